//! `kvm-agent evict-images` against a real private libvirtd (local mode): the base an
//! overlay uses stays with its marker; an old unused base, its marker and a stray marker
//! go; a base written a moment ago (another agent's upload) stays until `--min-age 0s`.

mod common;

use common::kvm_agent;

use std::path::Path;
use std::process::Command;

use egressproxy_integration::libvirtd::Libvirtd;
use kvm_agent::config::ImageFormat;
use kvm_agent::images::cache::marker_volume;
use kvm_agent::libvirt::naming::base_volume;
use kvm_agent::libvirt::xml::volume::{overlay_volume, raw_volume};
use virt::storage_vol::StorageVol;

/// The `evict-images` example of docs/kvm-agent.md: its arguments and output lines.
fn documented_eviction() -> (Vec<String>, Vec<String>) {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Image cache"))
        .expect("docs/kvm-agent.md has an \"Image cache\" section");
    let block = section
        .split("```console")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a console block");
    let mut lines = block
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty());
    let command = lines.next().unwrap().trim();
    let args = command
        .strip_prefix("$ kvm-agent ")
        .expect("the block starts with the command")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    // The block is indented like the list item it belongs to.
    let output = lines
        .map(|l| l.strip_prefix("  ").unwrap_or(l).to_owned())
        .collect();
    (args, output)
}

/// A report line with its variable parts (digests, numbers) blanked out.
fn shape(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(at) = rest.find("egressproxy-base-") {
        out.push_str(&rest[..at]);
        out.push_str("egressproxy-base-H");
        rest = &rest[at + "egressproxy-base-".len()..];
        let digest_end = rest
            .find(|c: char| !(c.is_ascii_hexdigit() || c == '…'))
            .unwrap_or(rest.len());
        rest = &rest[digest_end..];
    }
    out.push_str(rest);
    let mut shaped = String::new();
    for c in out.chars() {
        if !c.is_ascii_digit() {
            shaped.push(c);
        } else if !shaped.ends_with('#') {
            shaped.push('#');
        }
    }
    shaped
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn evict_images_deletes_only_bases_no_overlay_uses() {
    let libvirtd = Libvirtd::start().unwrap();
    let images = libvirtd.dir().join("images");
    std::fs::create_dir(&images).unwrap();
    let (used, unused) = (
        base_volume(&"aa".repeat(32)).unwrap(),
        base_volume(&"bb".repeat(32)).unwrap(),
    );
    let stray = marker_volume(&base_volume(&"cc".repeat(32)).unwrap());
    let uploading = base_volume(&"dd".repeat(32)).unwrap();
    let overlay = "egressproxy-uid-1.root.qcow2";
    {
        virt::error::clear_error_callback();
        let conn = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
        let xml = format!(
            "<pool type='dir'><name>vms</name><target><path>{}</path></target></pool>",
            images.display()
        );
        let pool = conn.create_storage_pool_xml(&xml, 0).unwrap();
        let create = |xml: String| StorageVol::create_xml(&pool, &xml, 0).unwrap();
        let base = create(raw_volume(&used, 1 << 20).unwrap());
        create(raw_volume(&marker_volume(&used), 0).unwrap());
        create(raw_volume(&unused, 1 << 20).unwrap());
        create(raw_volume(&marker_volume(&unused), 0).unwrap());
        create(raw_volume(&stray, 0).unwrap());
        create(raw_volume(&uploading, 1 << 20).unwrap());
        create(
            overlay_volume(
                overlay,
                1 << 30,
                Path::new(&base.path().unwrap()),
                ImageFormat::Raw,
            )
            .unwrap(),
        );
    }
    // Left an hour ago: old enough to evict.
    for name in [&unused, &marker_volume(&unused), &stray] {
        let status = Command::new("touch")
            .args(["-d", "1 hour ago"])
            .arg(images.join(name))
            .status()
            .unwrap();
        assert!(status.success());
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "hosts:\n- name: here\n  local: true\n  libvirtSocket: {}\n  storagePool: vms\n",
            libvirtd.socket().display(),
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();

    // The documented command, on this host and config.
    let (args, documented) = documented_eviction();
    let args: Vec<&str> = args
        .iter()
        .map(|a| match a.as_str() {
            "/etc/kvm-agent/config.yaml" => config,
            "hv1" => "here",
            other => other,
        })
        .collect();
    assert_eq!(args, ["evict-images", "--config", config, "here"]);
    let (ok, stdout, stderr) = kvm_agent(&args);
    assert!(ok, "{stdout}{stderr}");
    let printed: Vec<String> = stdout.lines().map(shape).collect();
    for line in &documented {
        let line = shape(&line.replace("hv1", "here"));
        assert!(
            printed.contains(&line),
            "documented {line:?} not in\n{stdout}"
        );
    }
    for line in [
        "here: deleted 3 volume(s), kept 2 base(s)".to_owned(),
        format!("  deleted {}\n  deleted {unused}\n", marker_volume(&unused)),
        format!("  deleted {stray}"),
        format!("  kept    {used} (used by {overlay})"),
        format!("  kept    {uploading} (written "),
    ] {
        assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
    }
    let mut expected = vec![
        overlay.to_owned(),
        used.clone(),
        marker_volume(&used),
        uploading.clone(),
    ];
    expected.sort();
    assert_eq!(files(&images), expected);

    // Without a minimum age, the young base without marker goes too; on every host.
    let (ok, stdout, _) = kvm_agent(&["evict-images", "--config", config, "--min-age", "0s"]);
    assert!(ok);
    assert!(
        stdout.contains(&format!(
            "here: deleted 1 volume(s), kept 1 base(s)\n  deleted {uploading}\n"
        )),
        "{stdout}"
    );
    expected.retain(|name| *name != uploading);
    assert_eq!(files(&images), expected);

    let (ok, _, stderr) = kvm_agent(&["evict-images", "--config", config, "elsewhere"]);
    assert!(!ok);
    assert!(
        stderr.contains("\"elsewhere\" is not in the configuration"),
        "{stderr}"
    );
}
