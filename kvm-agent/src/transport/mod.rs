//! The bottom layer: reaching a hypervisor's libvirt and calling it safely.
//!
//! A libvirt call travels down this stack:
//! 1. [`pool`] finds the host's shared `connection` (dialling it when there is none,
//!    one dial at a time, with backoff after failures);
//! 2. the connection speaks libvirt's RPC over a [`relay`]: a local unix socket whose
//!    streams are pumped into `ssh` channels (or into the hypervisor's own socket when
//!    the agent runs on it);
//! 3. [`call`] runs the blocking libvirt function on a blocking thread, inside a span,
//!    bounded by the caller's deadline: on expiry it cuts the relay under the connection,
//!    which makes the call return;
//!    [`libvirt_error`] classifies what libvirt answers: reported (the connection stays)
//!    or a transport failure (the connection is dropped);
//! 4. [`event_loop`] runs libvirt's event loop, which libvirt keepalive needs;
//! 5. [`bulk`] streams volume uploads on a connection of their own, on the low-priority
//!    runtime of [`bulk_runtime`].
//!
//! Nothing here knows about instances, images or the contract.

pub mod bulk;
pub mod bulk_runtime;
pub mod call;
pub(crate) mod connection;
pub mod error;
pub mod event_loop;
pub mod libvirt_error;
pub mod pool;
pub mod relay;
pub(crate) mod ssh;
