//! libvirtd hung (SIGSTOPped with its guests) while the VM provisions, for longer than
//! the deadline of the calls that reach it, then continued: every call ends with a
//! deadline error instead of hanging, and the Proxy then becomes Ready with one VM.

use std::time::{Duration, Instant};

use futures::FutureExt;

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{assert_one_vm, delete, manifest, running_domains, wait_ready};

/// The time from the pause until the Proxy is Ready, and how long the hang lasted (at
/// least one call deadline).
pub(crate) async fn libvirtd_hung_while_provisioning(stack: &mut Stack) -> (Duration, Duration) {
    stack.kubectl_apply(&manifest(stack, "hung")).unwrap();
    wait_for("the VM to start", Duration::from_secs(120), || {
        !running_domains(stack).is_empty()
    })
    .await;
    assert_ne!(stack.proxy_field("hung", "{.status.phase}"), "Ready");
    let paused = Instant::now();
    stack.pause_libvirtd().unwrap();
    let deadline = stack.call_timeout();
    // A call started just before the pause ends one deadline later; one started after it
    // (GetInstance again, on a new connection) another deadline later. Anything slower
    // hangs.
    // The error is kept as it was seen during the hang: once libvirtd continues, the
    // next reconcile may succeed and clear it before it could be read again.
    let mut error = String::new();
    let hang = wait_for(
        "a deadline error while libvirtd hangs",
        3 * deadline + Duration::from_secs(30),
        || {
            let now = stack.proxy_field("hung", "{.status.lastError}");
            let seen = now.contains("deadline exceeded") && paused.elapsed() > deadline;
            if seen {
                error = now;
            }
            seen
        },
    );
    let outcome = std::panic::AssertUnwindSafe(hang).catch_unwind().await;
    let hung_for = paused.elapsed();
    stack.resume_libvirtd().unwrap();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    eprintln!("libvirtd-hung: paused {hung_for:.1?}; the Proxy's last error: {error}");
    assert!(
        error.contains("host hv1") && error.contains("did not finish within"),
        "the error names the host and the call that did not finish in time: {error}"
    );
    wait_ready(stack, "hung").await;
    let converged = paused.elapsed();
    assert_one_vm(stack, "hung");
    delete(stack, "hung").await;
    (converged, hung_for)
}
