//! `kvm-agent check-host` against a real private libvirtd (local mode): a ready pool, a
//! missing network with the command that fixes it, UEFI found, and `auto` falling back
//! to TCG because the fixture has no usable KVM.

use std::process::Command;

use egressproxy_integration::libvirtd::Libvirtd;

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
fn check_host_reports_each_requirement_with_its_fix() {
    let libvirtd = Libvirtd::start().unwrap();
    let images = libvirtd.dir().join("images");
    std::fs::create_dir(&images).unwrap();
    {
        virt::error::clear_error_callback();
        let conn = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
        let xml = format!(
            "<pool type='dir'><name>vms</name><target><path>{}</path></target></pool>",
            images.display()
        );
        conn.create_storage_pool_xml(&xml, 0).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "hosts:\n\
             - name: here\n  local: true\n  libvirtSocket: {}\n  storagePool: vms\n  network: egress\n\
             - name: nopool\n  local: true\n  libvirtSocket: {}\n  storagePool: missing\n  domainType: qemu\n\
             images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
            libvirtd.socket().display(),
            libvirtd.socket().display(),
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();

    let (ok, stdout, stderr) = kvm_agent(&["check-host", "--config", config, "here"]);
    assert!(!ok, "a missing network is not ready\n{stdout}{stderr}");
    for line in [
        "here: NOT READY",
        "[ok  ] libvirt: reachable, version 11.",
        "[ok  ] storage pool: \"vms\" active and writable",
        "[FAIL] network: libvirt network \"egress\" does not exist",
        "fix: define it (`virsh net-define`)",
        "[ok  ] firmware: UEFI available",
        "[WARN] domain type: auto: qemu (libvirt offers no KVM",
        "confinement:",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
    assert!(!stdout.contains("nopool"), "only the named host: {stdout}");

    let (ok, stdout, _) = kvm_agent(&["check-host", "--config", config]);
    assert!(!ok);
    assert!(
        stdout.contains("[FAIL] storage pool: \"missing\" does not exist"),
        "{stdout}"
    );
    assert!(
        stdout.contains("virsh pool-define-as missing dir"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[ok  ] domain type: qemu (software emulation), as configured"),
        "{stdout}"
    );

    let (ok, _, stderr) = kvm_agent(&["check-host", "--config", config, "elsewhere"]);
    assert!(!ok);
    assert!(
        stderr.contains("\"elsewhere\" is not in the configuration"),
        "{stderr}"
    );
}
