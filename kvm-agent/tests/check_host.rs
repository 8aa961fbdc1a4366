//! `kvm-agent check-host` against a real private libvirtd (local mode): a ready pool, a
//! missing network with the command that fixes it, UEFI found, and `auto` falling back
//! to TCG because the fixture has no usable KVM; an unwritable pool reported as a failed
//! check with its fix; concurrent checks of one pool not colliding on a probe volume.

mod common;

use std::process::Command;
use std::sync::{Arc, Barrier};

use common::{kvm_agent, local_host};
use kvm_agent::libvirt::host::check::{Status, check_host};

use egressproxy_integration::libvirtd::Libvirtd;

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
        // The fixture's libvirtd runs with `security_driver = "none"`: nothing confines
        // its guests, and the report must not claim otherwise.
        "[ok  ] confinement: no AppArmor or SELinux confinement of guests",
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

/// A pool libvirtd cannot write to (its directory is a read-only mount, made inside
/// libvirtd's own mount namespace: root ignores mode bits but not `ro`) is a FAIL line
/// with what to fix, not a bare libvirt error: libvirtd reports EROFS as a system error
/// on a healthy connection.
#[test]
fn an_unwritable_pool_is_a_failed_check_with_its_fix() {
    let libvirtd = Libvirtd::start().unwrap();
    let images = libvirtd.dir().join("ro-images");
    std::fs::create_dir(&images).unwrap();
    {
        virt::error::clear_error_callback();
        let conn = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
        let xml = format!(
            "<pool type='dir'><name>ro</name><target><path>{}</path></target></pool>",
            images.display()
        );
        conn.create_storage_pool_xml(&xml, 0).unwrap();
    }
    let pid = libvirtd.libvirtd_pid().unwrap().to_string();
    let mounted = Command::new("nsenter")
        .args([
            "-t",
            &pid,
            "-m",
            "mount",
            "-t",
            "tmpfs",
            "-o",
            "ro,size=1m",
            "tmpfs",
        ])
        .arg(&images)
        .output()
        .unwrap();
    assert!(
        mounted.status.success(),
        "{}",
        String::from_utf8_lossy(&mounted.stderr)
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "hosts:\n\
             - name: here\n  local: true\n  libvirtSocket: {}\n  storagePool: ro\n  domainType: qemu\n\
             images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
            libvirtd.socket().display(),
        ),
    )
    .unwrap();
    let (ok, stdout, stderr) = kvm_agent(&["check-host", "--config", config.to_str().unwrap()]);
    assert!(!ok, "{stdout}{stderr}");
    for line in [
        "here: NOT READY",
        "[FAIL] storage pool: \"ro\" is not writable: ",
        "Read-only file system",
        "fix: give libvirt write access to the pool's directory",
        // The connection stayed usable: the checks after the pool ran.
        "[ok  ] firmware: UEFI available",
    ] {
        assert!(
            stdout.contains(line),
            "missing {line:?} in\n{stdout}\n{stderr}"
        );
    }
}

/// Two checks of one pool at the same time each create and delete their own probe
/// volume: both find the pool writable, and no probe volume is left.
#[test]
fn concurrent_checks_of_one_pool_both_find_it_writable() {
    let libvirtd = Libvirtd::start().unwrap();
    let images = libvirtd.dir().join("images");
    std::fs::create_dir(&images).unwrap();
    virt::error::clear_error_callback();
    let conn = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
    let xml = format!(
        "<pool type='dir'><name>vms</name><target><path>{}</path></target></pool>",
        images.display()
    );
    let pool = conn.create_storage_pool_xml(&xml, 0).unwrap();
    let mut host = local_host("here", &libvirtd.socket());
    host.storage_pool = "vms".into();
    const ROUNDS: usize = 20;
    let barrier = Arc::new(Barrier::new(2));
    let checks: Vec<_> = (0..2)
        .map(|_| {
            let (uri, host, barrier) = (libvirtd.uri(), host.clone(), barrier.clone());
            std::thread::spawn(move || {
                let conn = virt::connect::Connect::open(Some(&uri)).unwrap();
                (0..ROUNDS)
                    .map(|_| {
                        barrier.wait();
                        // Errors are collected, not unwrapped: the other thread must not
                        // wait at the barrier for a thread that panicked.
                        check_host(&conn, &host, false)
                            .map_err(|e| format!("{e:?}"))
                            .map(|report| {
                                report.checks.into_iter().find(|c| c.name == "storage pool")
                            })
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for check in checks.into_iter().flat_map(|t| t.join().unwrap()) {
        let check = check.expect("the check runs").expect("a storage pool line");
        assert_eq!(check.status, Status::Ok, "{check:?}");
        assert_eq!(check.detail, "\"vms\" active and writable");
    }
    pool.refresh(0).unwrap();
    assert_eq!(pool.list_volumes().unwrap(), Vec::<String>::new());
}
