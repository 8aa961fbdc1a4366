//! libvirtd restarted alone while the VM starts (booting, before the Proxy is Ready), as
//! `systemctl restart libvirtd` does on a hypervisor: the guest keeps running, the new
//! daemon reconnects to it, and the Proxy ends Ready with that one VM (the same QEMU
//! process); its deletion then goes through the new daemon.
//!
//! The restart waits until libvirt has resumed the guest (state `running`): a domain
//! still paused while libvirt starts it is killed by the new daemon on reconnect ("wasn't
//! fully started yet"), and the Proxy is then rightly Ready on a replacement instead.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{assert_one_vm, delete, manifest, wait_ready};

/// The time to converge.
pub(crate) async fn libvirtd_restarted_while_the_vm_starts(stack: &mut Stack) -> Duration {
    stack.kubectl_apply(&manifest(stack, "restart")).unwrap();
    wait_for("the VM to run", Duration::from_secs(120), || {
        !resumed_domains(stack).is_empty()
    })
    .await;
    assert_ne!(stack.proxy_field("restart", "{.status.phase}"), "Ready");
    let domain = resumed_domains(stack).remove(0);
    let guest = stack.guest_pid(&domain).expect("the running guest's pid");
    let injected = Instant::now();
    tokio::task::block_in_place(|| stack.restart_libvirtd()).unwrap();
    assert!(
        stack.libvirtd_adopted().contains(&guest),
        "the guest's QEMU {guest} outlived the old libvirtd"
    );
    wait_ready(stack, "restart").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "restart");
    assert_eq!(
        stack.guest_pid(&domain),
        Some(guest),
        "the guest {domain} that ran before the restart is the one that runs now"
    );
    delete(stack, "restart").await;
    converged
}

/// The domains in libvirt's `running` state: started and resumed, not paused.
fn resumed_domains(stack: &Stack) -> Vec<String> {
    stack
        .virsh(&["list", "--name", "--state-running"])
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}
