//! The documented way to run kvm-agent on a hypervisor (`deploy/systemd/`): the example
//! config passes `kvm-agent check-config`, and the unit passes `systemd-analyze verify`
//! without a single warning and `systemd-analyze security` with a low exposure score.

use std::path::{Path, PathBuf};
use std::process::Command;

use egressproxy_integration::reference_provider::workspace_binary;

/// The highest `systemd-analyze security` exposure the unit may have, in tenths (the
/// tool's `--threshold` unit): 2.0 of 10, "OK". The unit scores 1.2 today.
const MAX_EXPOSURE_TENTHS: u32 = 20;

fn deploy_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/systemd")
        .join(name)
}

#[test]
fn the_hypervisor_config_example_passes_check_config() {
    // The unit points TMPDIR (the spool) at its CacheDirectory; here a temporary one.
    let spool = tempfile::tempdir().unwrap();
    let output = Command::new(workspace_binary("kvm-agent").unwrap())
        .arg("check-config")
        .arg("--config")
        .arg(deploy_file("config.yaml"))
        .env("TMPDIR", spool.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("ok (1 hosts, 2 machine types, 1 images)"),
        "{stdout}"
    );
}

/// The unit with its `/usr/local/bin/kvm-agent` pointing at the workspace's binary
/// (systemd-analyze checks that every command exists), in a directory of its own.
fn unit_with_built_binary() -> (tempfile::TempDir, PathBuf) {
    let unit = std::fs::read_to_string(deploy_file("kvm-agent.service")).unwrap();
    assert!(unit.contains("/usr/local/bin/kvm-agent"));
    let binary = workspace_binary("kvm-agent").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvm-agent.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/kvm-agent", &binary.display().to_string()),
    )
    .unwrap();
    (dir, path)
}

fn systemd_analyze(args: &[&str], unit: &Path) -> std::process::Output {
    Command::new("systemd-analyze")
        .args(args)
        .arg(unit)
        .output()
        .expect("systemd-analyze (Debian package systemd, see integration/tools/install-system-packages.sh)")
}

#[test]
fn the_systemd_unit_verifies_without_warnings() {
    let (_dir, unit) = unit_with_built_binary();
    let output = systemd_analyze(&["verify"], &unit);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // verify exits 0 on an unparsable setting and only warns: any output is a defect.
    assert!(output.status.success() && said.trim().is_empty(), "{said}");
}

#[test]
fn the_systemd_unit_is_hardened() {
    let (_dir, unit) = unit_with_built_binary();
    let threshold = format!("--threshold={MAX_EXPOSURE_TENTHS}");
    let output = systemd_analyze(&["security", "--offline=true", &threshold], &unit);
    let report = String::from_utf8_lossy(&output.stdout);
    let score = report
        .lines()
        .find(|line| line.contains("Overall exposure level"))
        .unwrap_or("(no score)");
    println!("{} (limit {MAX_EXPOSURE_TENTHS} tenths)", score.trim());
    assert!(
        output.status.success(),
        "exposure above {MAX_EXPOSURE_TENTHS} tenths:\n{report}{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
