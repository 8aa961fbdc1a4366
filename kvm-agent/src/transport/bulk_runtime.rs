//! The bulk runtime: where everything of a bulk stream runs on the agent's side, so that
//! it yields the CPU to cheap calls.
//!
//! A volume upload keeps several threads busy (the libvirt stream writer, the relay, SSH
//! encryption). On the same threads as cheap calls, or at the same OS priority, it delays
//! them by whole scheduler slices on a small machine. Everything of a bulk stream on the
//! agent's side therefore runs on this runtime: its SSH session task, its relay, and its
//! blocking libvirt thread. Every thread of the runtime lowers its own scheduling priority
//! (Linux `nice` is per thread) to [`BULK_NICE`] when it starts.
//!
//! The runtime lives for the process; it is created on the first bulk stream.

use std::sync::OnceLock;

/// The nice value of bulk-stream threads (0 is normal, 19 the lowest priority).
pub const BULK_NICE: i32 = 10;

static RUNTIME: OnceLock<std::io::Result<tokio::runtime::Runtime>> = OnceLock::new();

/// The bulk runtime's handle, or `None` if it could not be built (then the caller's own
/// runtime is used).
pub(crate) fn handle() -> Option<tokio::runtime::Handle> {
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("kvm-agent-bulk")
                .on_thread_start(lower_priority)
                .enable_all()
                .build()
        })
        .as_ref()
        .map(|runtime| runtime.handle().clone())
        .inspect_err(|e| tracing::warn!(error = %e, "cannot start the bulk runtime; bulk streams run at normal priority"))
        .ok()
}

fn lower_priority() {
    // `None`: the calling thread (Linux applies PRIO_PROCESS with who=0 per thread).
    if let Err(e) = rustix::process::setpriority_process(None, BULK_NICE) {
        tracing::debug!(error = %e, "cannot lower a bulk thread's priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_threads_run_at_lower_priority() {
        let runtime = handle().expect("bulk runtime");
        let (worker, blocking) = runtime.block_on(async {
            let worker =
                tokio::spawn(async { rustix::process::getpriority_process(None).unwrap() });
            let blocking =
                tokio::task::spawn_blocking(|| rustix::process::getpriority_process(None).unwrap());
            (worker.await.unwrap(), blocking.await.unwrap())
        });
        let own = rustix::process::getpriority_process(None).unwrap();
        assert_eq!(worker, BULK_NICE);
        assert_eq!(blocking, BULK_NICE);
        assert_ne!(own, BULK_NICE, "the caller's thread keeps its priority");
    }
}
