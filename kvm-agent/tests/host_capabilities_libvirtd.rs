//! Domain type detection and firmware discovery against a real private libvirtd, whose
//! `/dev/kvm` is masked (as on hosts without KVM): libvirt offers no KVM, so `auto`
//! chooses qemu without probing; a probe guest under TCG runs SeaBIOS and ends by itself.

mod common;

use std::time::Duration;

use common::*;
use egressproxy_integration::libvirtd::Libvirtd;
use kvm_agent::domain_xml::VirtType;
use kvm_agent::host_capabilities::{ProbeOutcome, detect_virt_type, domain_capabilities, probe};
use kvm_agent::libvirt_call::LibvirtOp;
use kvm_agent::pool::Pool;

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
