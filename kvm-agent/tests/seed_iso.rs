//! The seed image read back by independent tools: blkid (what cloud-init uses to find
//! the `cidata` label), isoinfo (genisoimage) through the primary and the Joliet tree,
//! and xorriso. Mounting it with the kernel's iso9660 driver would be closer still to a
//! guest, but containers like CI's have no isofs module.
//!
//! Needs `blkid`, `isoinfo` (Debian package genisoimage) and `xorriso`.

use std::process::Command;

use kvm_agent::guest::cloud_init::{GuestAgent, seed_documents};
use kvm_agent::guest::seed::build_seed;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_bytes(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn the_kernel_and_blkid_read_the_seed_as_cloud_init_expects() {
    let mut user = b"#cloud-config\npackages: [squid]\n".to_vec();
    user.extend(b"# a long comment to span several sectors\n".repeat(200));
    let vendor = b"#!/bin/sh\necho vendor\n";
    let docs = seed_documents(&user, Some(vendor), GuestAgent::Install).unwrap();
    let network = "version: 2\nethernets: {}\n";
    let image = build_seed(&docs, "uid-1", "egressproxy-uid-1", Some(network));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seed.iso");
    std::fs::write(&path, &image).unwrap();
    let label = run(Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "LABEL"])
        .arg(&path));
    assert_eq!(label.trim(), "cidata");
    let fs_type = run(Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(&path));
    assert_eq!(fs_type.trim(), "iso9660");

    let meta = b"instance-id: uid-1\nlocal-hostname: egressproxy-uid-1\n".to_vec();
    let mut want = vec![
        ("meta-data".to_owned(), meta),
        ("user-data".to_owned(), docs.user_data.clone()),
        ("vendor-data".to_owned(), docs.vendor_data.clone().unwrap()),
        ("network-config".to_owned(), network.as_bytes().to_vec()),
    ];
    want.sort();
    // isoinfo (genisoimage): the Joliet tree has the exact names, the primary tree the
    // upper-case ones the kernel shows lower-cased.
    for (name, content) in &want {
        let joliet = run_bytes(
            Command::new("isoinfo")
                .args(["-J", "-x", &format!("/{name}"), "-i"])
                .arg(&path),
        );
        assert_eq!(&joliet, content, "Joliet {name}");
        let primary = run_bytes(
            Command::new("isoinfo")
                .args(["-x", &format!("/{}.;1", name.to_uppercase()), "-i"])
                .arg(&path),
        );
        assert_eq!(&primary, content, "primary {name}");
    }
    // xorriso, an independent reader, extracts the same files.
    let out = dir.path().join("extracted");
    run(Command::new("xorriso")
        .args(["-osirrox", "on", "-indev"])
        .arg(&path)
        .args(["-extract", "/"])
        .arg(&out));
    let mut extracted: Vec<(String, Vec<u8>)> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    extracted.sort();
    assert_eq!(extracted, want);
}
