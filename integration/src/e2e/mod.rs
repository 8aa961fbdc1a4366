//! The end-to-end stack: the real path from a Proxy to a VM that proxies, on one
//! machine, for the end-to-end tests and `make demo`.
//!
//! - [`guest_image`]: the guest image built from Debian's packages, cached by recipe.
//! - [`stack`]: everything a Proxy needs, started and torn down as one ([`stack::Stack`]).
//! - [`release`]: the operator and the agent installed through the Helm chart.
//! - [`http_servers`]: the image mirror and the target of proxied requests.
//! - [`otlp`]: a span receiver that keeps what the operator and the agent export.
//! - [`system_user`]: the agent's SSH account, under a name unique to the run.
//! - [`timeline`]: what a benchmark reads from watched objects, change by change, timed.
//! - [`pool_view`]: a ProxyPool, its members and its EndpointSlices as the pool
//!   benchmarks read them.

pub mod guest_image;
pub mod http_servers;
pub mod otlp;
pub mod pool_view;
pub mod release;
pub mod stack;
pub mod system_user;
pub mod timeline;

/// Polls `done` (a kubectl or virsh question: nothing to watch) every 250 ms until it
/// holds; panics naming `what` after `within`.
pub async fn wait_for(what: &str, within: std::time::Duration, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
