//! libvirt's client event loop, which libvirt keepalive needs.
//!
//! libvirt sends keepalive probes and closes a connection whose peer stopped answering
//! only if an event loop implementation is registered *before the first connection is
//! opened* and something runs it. Registered but not running is worse than neither: the
//! daemon then drops idle clients after ~30 s. [`ensure_started`] does both, once per
//! process, on a dedicated thread that runs for the life of the process.

use std::sync::OnceLock;

static STARTED: OnceLock<Result<(), String>> = OnceLock::new();

/// Registers libvirt's default event loop and runs it on its own thread; idempotent.
/// Also silences libvirt's default error printer (errors are reported through `TransportError`).
pub fn ensure_started() -> Result<(), String> {
    STARTED
        .get_or_init(|| {
            virt::error::clear_error_callback();
            virt::event::event_register_default_impl()
                .map_err(|e| format!("register libvirt event loop: {e}"))?;
            std::thread::Builder::new()
                .name("libvirt-events".into())
                .spawn(|| {
                    loop {
                        if let Err(e) = virt::event::event_run_default_impl() {
                            tracing::warn!(error = %e, "libvirt event loop iteration failed");
                            std::thread::sleep(std::time::Duration::from_millis(100));
                        }
                    }
                })
                .map_err(|e| format!("start libvirt event loop thread: {e}"))?;
            Ok(())
        })
        .clone()
}
