//! The operator SIGKILLed while the VM provisions, then restarted; then that VM
//! destroyed behind the operator's back (`virsh destroy`): the Proxy gets a new
//! instance, and its Events name the old and the new id.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{
    READY_WITHIN, assert_one_vm, delete, events, manifest, replaced_chain, wait_ready,
};

/// Leaves the Proxy `crash` Ready; returns the time to converge and its instance id.
pub(crate) async fn operator_killed_during_provisioning(stack: &mut Stack) -> (Duration, String) {
    stack.kubectl_apply(&manifest(stack, "crash")).unwrap();
    wait_for("the VM to be created", Duration::from_secs(120), || {
        !stack
            .proxy_field("crash", "{.status.providerId}")
            .is_empty()
    })
    .await;
    assert_eq!(
        stack.proxy_field("crash", "{.status.phase}"),
        "Provisioning"
    );
    let injected = Instant::now();
    stack.kill_operator();
    stack.start_operator().await.unwrap();
    wait_ready(stack, "crash").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "crash");
    (
        converged,
        stack.proxy_field("crash", "{.status.providerId}"),
    )
}

/// Destroys the VM of the Ready Proxy `crash` (instance `old`), then deletes the Proxy.
pub(crate) async fn vm_destroyed_behind_the_operators_back(stack: &Stack, old: &str) -> Duration {
    let domain = stack.domains().unwrap().remove(0);
    let injected = Instant::now();
    stack.virsh(&["destroy", &domain]).unwrap();
    wait_for("a new instance", READY_WITHIN, || {
        let now = stack.proxy_field("crash", "{.status.providerId}");
        !now.is_empty() && now != old
    })
    .await;
    wait_ready(stack, "crash").await;
    let converged = injected.elapsed();
    let new = stack.proxy_field("crash", "{.status.providerId}");
    assert_one_vm(stack, "crash");
    let events = events(stack, "crash");
    assert!(
        events.contains(old),
        "the Events name the old instance {old}:\n{events}"
    );
    assert!(
        replaced_chain(&events, old, &new),
        "Replaced events lead from the old instance {old} to the new one {new}:\n{events}"
    );
    delete(stack, "crash").await;
    converged
}
