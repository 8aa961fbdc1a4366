//! `kvm-agent check-config` and `check-hosts` as an operator runs them.

use std::process::Command;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;

fn kvm_agent(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvm-agent"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_names_the_bad_field_and_check_hosts_reaches_libvirt() {
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = format!(
        "hosts:\n\
         - name: hv\n  \
           ssh:\n    address: \"{}\"\n    user: root\n    privateKey: {}\n    knownHosts: {}\n  \
           libvirtSocket: {}\n\
         - name: here\n  local: true\n  libvirtSocket: {}\n\
         machineTypes:\n  small: {{vcpus: 1, memoryMiB: 512, diskGiB: 4}}\n\
         images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
        sshd.address(),
        sshd.client_key().display(),
        sshd.known_hosts().display(),
        libvirtd.socket().display(),
        libvirtd.socket().display(),
    );
    let good_path = dir.path().join("good.yaml");
    std::fs::write(&good_path, &good).unwrap();
    let (ok, stdout, stderr) =
        kvm_agent(&["check-config", "--config", good_path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ok (2 hosts, 1 machine types, 1 images)"),
        "{stdout}"
    );

    let (ok, stdout, stderr) = kvm_agent(&["check-hosts", "--config", good_path.to_str().unwrap()]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("hv: ok, libvirt 11."), "{stdout}");
    assert!(stdout.contains("here: ok, libvirt 11."), "{stdout}");

    let bad = good.replace(
        &sshd.client_key().display().to_string(),
        "/nonexistent/id_ed25519",
    );
    let bad_path = dir.path().join("bad.yaml");
    std::fs::write(&bad_path, bad).unwrap();
    let (ok, _, stderr) = kvm_agent(&["check-config", "--config", bad_path.to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("hosts[0].ssh.privateKey"), "{stderr}");
    assert!(stderr.contains("/nonexistent/id_ed25519"), "{stderr}");
}
