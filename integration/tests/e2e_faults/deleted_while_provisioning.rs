//! The Proxy deleted while its VM provisions: nothing is left.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{delete, manifest, running_domains};

pub(crate) async fn proxy_deleted_while_provisioning(stack: &Stack) -> Duration {
    stack.kubectl_apply(&manifest(stack, "early")).unwrap();
    wait_for("the VM to start", Duration::from_secs(120), || {
        !running_domains(stack).is_empty()
    })
    .await;
    assert_ne!(
        stack.proxy_field("early", "{.status.phase}"),
        "Ready",
        "the VM is still provisioning when its Proxy is deleted"
    );
    let injected = Instant::now();
    delete(stack, "early").await;
    let converged = injected.elapsed();
    let left: Vec<String> = Stack::files_in(&stack.pool_dir())
        .into_iter()
        .filter(|f| !f.starts_with("egressproxy-base-"))
        .collect();
    assert_eq!(left, Vec::<String>::new(), "no overlay or seed is left");
    assert_eq!(
        Stack::files_in(&stack.nvram_dir()),
        Vec::<String>::new(),
        "no NVRAM is left"
    );
    converged
}
