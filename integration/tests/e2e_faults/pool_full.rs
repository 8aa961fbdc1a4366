//! The storage pool's disk full: a second host of the agent (the same hypervisor) whose
//! pool is a 64 MiB tmpfs, too small for the base image. The Proxy's status names the
//! pool, the host and what to do (the agent's `POOL_FULL`), nothing half-written stays
//! in the pool; once the tmpfs is grown the Proxy converges to one Ready VM.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::{IMAGE, PROVIDER, Stack, TmpfsPool};
use egressproxy_integration::e2e::wait_for;

use crate::download_cut::assert_password_hidden;
use crate::support::{assert_one_vm, delete, events, manifest_placed, wait_ready};

/// The host whose pool is the small tmpfs.
const SMALL_HOST: &str = "hv-small";
/// Its pool.
const SMALL_POOL: &str = "small";
/// The tmpfs's size before and after it is grown (the image is about 210 MiB; the VM's
/// overlay grows while it boots).
const FULL_MIB: u64 = 64;
const GROWN_MIB: u64 = 1024;

/// The time from the tmpfs's growth to the Proxy's readiness.
pub(crate) async fn pool_full(stack: &mut Stack) -> Duration {
    let pool = stack.add_tmpfs_pool(SMALL_POOL, FULL_MIB).unwrap();
    stack.add_agent_host(SMALL_HOST, SMALL_POOL).await.unwrap();
    let manifest = manifest_placed(stack, "full", PROVIDER, SMALL_HOST, IMAGE);
    stack.kubectl_apply(&manifest).unwrap();
    wait_for(
        "the Proxy to report the full pool",
        Duration::from_secs(180),
        || !stack.proxy_field("full", "{.status.lastError}").is_empty(),
    )
    .await;
    let reported = stack.proxy_field("full", "{.status.lastError}");
    let condition = stack.proxy_field("full", "{.status.conditions[?(@.type==\"Ready\")]}");
    let events = events(stack, "full");
    eprintln!("pool-full: lastError: {reported}\n  Ready: {condition}\n  Events:\n{events}");
    let cause = format!("storage pool {SMALL_POOL} on host {SMALL_HOST} is full");
    for word in [
        cause.as_str(),
        "free space in the pool or grow its filesystem",
    ] {
        assert!(
            reported.contains(word),
            "the error names {word:?}: {reported}"
        );
    }
    wait_for(
        "the pool to hold nothing of the failed Create",
        Duration::from_secs(120),
        || Stack::files_in(&pool.dir()).is_empty(),
    )
    .await;
    pool.resize(GROWN_MIB).unwrap();
    let grown = Instant::now();
    wait_ready(stack, "full").await;
    let converged = grown.elapsed();
    assert_one_vm(stack, "full");
    assert_password_hidden(stack, "full", &[&reported, &condition]);
    delete(stack, "full").await;
    assert_only_the_base_left(&pool);
    converged
}

/// After the Proxy's deletion the pool holds the base and its marker, nothing else.
fn assert_only_the_base_left(pool: &TmpfsPool) {
    let files = Stack::files_in(&pool.dir());
    assert_eq!(files.len(), 2, "a base and its marker: {files:?}");
    assert!(
        files.iter().all(|f| f.starts_with("egressproxy-base-")),
        "{files:?}"
    );
}
