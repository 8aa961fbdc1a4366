//! sshd restarted as soon as the operator records the instance key (during Create, or
//! just after it while the VM boots): every SSH session, and with it the agent's
//! libvirt connection, drops.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{assert_one_vm, delete, manifest, wait_ready};

pub(crate) async fn ssh_dropped_during_create(stack: &mut Stack) -> Duration {
    stack.kubectl_apply(&manifest(stack, "ssh")).unwrap();
    // The base is cached: right after the apply the operator is checking the placement
    // or creating the VM, over the agent's SSH connection.
    wait_for("the operator to act", Duration::from_secs(60), || {
        !stack.proxy_field("ssh", "{.status.instanceKey}").is_empty()
    })
    .await;
    let injected = Instant::now();
    stack.restart_sshd().unwrap();
    wait_ready(stack, "ssh").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "ssh");
    delete(stack, "ssh").await;
    converged
}
