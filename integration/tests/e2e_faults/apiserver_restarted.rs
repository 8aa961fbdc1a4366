//! The kube-apiserver crashed and started again (same port, same etcd data) while a
//! Proxy provisions: the operator's watches recover and the Proxy becomes Ready with one
//! VM. Its deletion then proves the watch works again: the operator learns of it only
//! through the watch.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{READY_WITHIN, assert_one_vm, delete, manifest};

/// The time to converge, the apiserver's downtime, and whether the operator kept running
/// (it exits, as a Deployment's pod would, when it cannot renew its Lease in time; it
/// is then started again as its Deployment would).
pub(crate) async fn apiserver_restarted_while_provisioning(
    stack: &mut Stack,
) -> (Duration, Duration, bool) {
    stack.kubectl_apply(&manifest(stack, "api")).unwrap();
    wait_for("the operator to create", Duration::from_secs(60), || {
        !stack.proxy_field("api", "{.status.providerId}").is_empty()
    })
    .await;
    assert_ne!(stack.proxy_field("api", "{.status.phase}"), "Ready");
    let injected = Instant::now();
    tokio::task::block_in_place(|| stack.restart_apiserver()).unwrap();
    let down_for = injected.elapsed();
    // Supervise the operator as its Deployment would while waiting for Ready.
    let mut kept_running = true;
    let until = Instant::now() + READY_WITHIN;
    while stack.proxy_field("api", "{.status.phase}") != "Ready" {
        assert!(
            Instant::now() < until,
            "api was not Ready after {READY_WITHIN:?}"
        );
        if !stack.operator_running() {
            kept_running = false;
            stack.kill_operator();
            stack.start_operator().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let converged = injected.elapsed();
    assert_one_vm(stack, "api");
    delete(stack, "api").await;
    (converged, down_for, kept_running)
}
