//! Domain type detection and firmware discovery against a real private libvirtd, whose
//! `/dev/kvm` is masked (as on hosts without KVM): libvirt offers no KVM, so `auto`
//! chooses qemu without probing; a probe guest under TCG runs SeaBIOS and ends by itself.

mod common;

use std::time::Duration;

use common::*;
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::process::wait_until;
use kvm_agent::libvirt::host::capabilities::{
    ProbeOutcome, VirtTypes, detect_virt_type, domain_capabilities, probe, probe_domain_xml,
    start_probe_domain,
};
use kvm_agent::libvirt::xml::domain::VirtType;
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::Pool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_detection_and_a_probe_guest_on_tcg() {
    let libvirtd = Libvirtd::start().unwrap();
    let pool = Pool::new(&config(vec![local_host("here", &libvirtd.socket())])).unwrap();
    let host = pool.host("here").unwrap();
    let (kvm, qemu, choice, outcome) = host
        .call(
            LibvirtOp::new("virConnectGetDomainCapabilities"),
            deadline_in(Duration::from_secs(240)),
            |c| {
                let kvm = domain_capabilities(c, VirtType::Kvm)?;
                let qemu = domain_capabilities(c, VirtType::Qemu)?;
                let choice = detect_virt_type(c, "egressproxy-probe-test")?;
                let outcome = probe(
                    c,
                    VirtType::Qemu,
                    "egressproxy-probe-tcg",
                    Duration::from_secs(60),
                )?;
                Ok((kvm, qemu, choice, outcome))
            },
        )
        .await
        .unwrap();
    assert_eq!(kvm, None, "the fixture masks /dev/kvm");
    let qemu = qemu.expect("TCG is always offered");
    assert!(
        qemu.supports_uefi(),
        "OVMF (package ovmf) is installed: {qemu:?}"
    );
    assert_eq!(choice.virt_type, VirtType::Qemu);
    assert!(choice.reason.contains("no KVM"), "{}", choice.reason);
    assert!(
        matches!(outcome, ProbeOutcome::Ran(_)),
        "a TCG probe guest reboots and ends: {outcome:?}\n{}",
        std::fs::read_to_string(libvirtd.log()).unwrap_or_default()
    );
}

/// A probe guest dies with the connection that started it: a deadline that cuts the
/// connection mid-probe leaves no guest running. The guest is paused right away so that
/// it cannot end by itself.
#[test]
fn a_probe_guest_is_destroyed_when_its_connection_closes() {
    let libvirtd = Libvirtd::start().unwrap();
    virt::error::clear_error_callback();
    let observer = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
    let name = "egressproxy-probe-orphan";
    let xml = probe_domain_xml(name, VirtType::Qemu).unwrap();
    let mut paused = false;
    for _ in 0..5 {
        let prober = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
        let domain = start_probe_domain(&prober, &xml)
            .unwrap()
            .expect("the probe starts");
        // A TCG guest takes a while to reach its reboot; if it was faster, try again.
        paused = domain.suspend().is_ok();
        drop(domain);
        drop(prober);
        if paused {
            break;
        }
    }
    assert!(paused, "the probe guest could be paused");
    wait_until(
        "the paused probe guest to go with its connection",
        Duration::from_secs(10),
        || Ok(observer.lookup_domain_by_name(name).is_err()),
    )
    .unwrap();
}

/// `auto` detection runs under its own deadline, once per host: a caller whose deadline
/// passes first (the hypervisor is frozen) is told the probe is running, not that its
/// call timed out; a later caller gets the answer, which is then cached (even with the
/// hypervisor frozen again, the answer comes at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_detection_outlives_a_short_deadline_and_is_cached() {
    let mut libvirtd = Libvirtd::start().unwrap();
    let pool = Pool::new(&config(vec![local_host("here", &libvirtd.socket())])).unwrap();
    let host = pool.host("here").unwrap();
    let virt_types = VirtTypes::default();
    libvirtd.pause().unwrap();
    for _ in 0..2 {
        let err = kvm_agent::Error::from(
            virt_types
                .auto_choice(&host, deadline_in(Duration::from_millis(500)))
                .await
                .unwrap_err(),
        );
        assert_eq!(err.to_provider_error().reason, "KVM_PROBE_RUNNING", "{err}");
        assert!(err.to_provider_error().retry_after.is_some(), "{err}");
    }
    libvirtd.resume().unwrap();
    let choice = virt_types
        .auto_choice(&host, deadline_in(Duration::from_secs(120)))
        .await
        .unwrap();
    assert_eq!(choice.virt_type, VirtType::Qemu, "{}", choice.reason);
    libvirtd.pause().unwrap();
    let cached = virt_types
        .auto_choice(&host, deadline_in(Duration::from_millis(200)))
        .await;
    libvirtd.resume().unwrap();
    assert_eq!(cached.unwrap(), choice);
}
