//! The hypervisor presents another SSH host key (reinstalled, or a man in the middle):
//! the agent refuses it, and a Proxy applied meanwhile says which host and what to do
//! in its `Ready` condition and an Event, with no VM and no login on the hypervisor.
//! With the known key back (and the retry annotation set, as the condition says), the
//! same Proxy becomes Ready with one VM.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{assert_one_vm, delete, events, manifest, wait_ready};

/// The time from the injection until the refusal is reported, and from the restored
/// key until the Proxy is Ready.
pub(crate) async fn host_key_changed(stack: &mut Stack) -> (Duration, Duration) {
    let log_before = std::fs::read_to_string(stack.sshd_log())
        .unwrap_or_default()
        .len();
    let injected = Instant::now();
    stack.restart_sshd_with_other_host_key().unwrap();
    stack.kubectl_apply(&manifest(stack, "hostkey")).unwrap();
    let condition = "{.status.conditions[?(@.type==\"Ready\")].message}";
    wait_for("the host key refusal", Duration::from_secs(120), || {
        stack.proxy_field("hostkey", condition).contains("host key")
    })
    .await;
    let refused = injected.elapsed();
    let message = stack.proxy_field("hostkey", condition);
    eprintln!("host-key-changed: Ready condition: {message}");
    for part in [
        "host hv1",
        "SSH host key CHANGED",
        "known_hosts",
        "replace that line",
    ] {
        assert!(
            message.contains(part),
            "the condition names the host, the cause and the fix ({part:?}): {message}"
        );
    }
    assert_eq!(stack.proxy_field("hostkey", "{.status.phase}"), "Failed");
    let events = events(stack, "hostkey");
    assert!(
        events.contains("SSH host key CHANGED"),
        "an Event says it too:\n{events}"
    );
    assert_eq!(stack.domains().unwrap(), Vec::<String>::new(), "no VM");
    let log = std::fs::read_to_string(stack.sshd_log()).unwrap_or_default();
    let since = &log[log_before.min(log.len())..];
    assert!(
        since.contains("Connection from"),
        "the agent tried the hypervisor:\n{since}"
    );
    assert!(
        !since.contains("Accepted publickey"),
        "the agent did not log in to a host with another key:\n{since}"
    );

    let restored = Instant::now();
    stack.restart_sshd_with_own_host_key().unwrap();
    stack
        .kubectl(&[
            "annotate",
            "proxy",
            "hostkey",
            "--overwrite",
            &format!(
                "egressproxy.dev/reconcile-requested-at={}",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs()
            ),
        ])
        .unwrap();
    wait_ready(stack, "hostkey").await;
    let converged = restored.elapsed();
    assert_one_vm(stack, "hostkey");
    delete(stack, "hostkey").await;
    (refused, converged)
}
