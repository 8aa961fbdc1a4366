//! The agent SIGKILLed while it uploads the base image, then restarted.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{assert_one_vm, base_files, delete, manifest, wait_ready};

pub(crate) async fn agent_killed_during_base_upload(stack: &mut Stack) -> Duration {
    assert!(
        base_files(stack).is_empty(),
        "the pool starts without a base"
    );
    stack.kubectl_apply(&manifest(stack, "upload")).unwrap();
    wait_for("the base upload to start", Duration::from_secs(120), || {
        !base_files(stack).is_empty()
    })
    .await;
    assert!(
        !base_files(stack).iter().any(|f| f.ends_with(".complete")),
        "the upload is still under way when the agent is killed: {:?}",
        base_files(stack)
    );
    let injected = Instant::now();
    stack.kill_agent();
    stack.start_agent().await.unwrap();
    wait_ready(stack, "upload").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "upload");
    let bases = base_files(stack);
    assert_eq!(
        bases.len(),
        2,
        "one complete base and its marker: {bases:?}"
    );
    assert!(bases.iter().any(|f| f.ends_with(".complete")), "{bases:?}");
    delete(stack, "upload").await;
    converged
}
