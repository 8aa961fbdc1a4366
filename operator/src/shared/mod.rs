//! Leaves every layer may use: they name no resource's logic.
//!
//! - [`error`]: the operator's error type and what each error means for retrying.
//! - [`backoff`]: per-object exponential backoff with jitter.
//! - [`limits`]: the bounds of every duration setting.
//! - [`metrics`]: Prometheus metrics; [`http`]: `/metrics`, `/healthz`, `/readyz`;
//!   [`liveness`]: whether the control loop still processes requests (`/healthz`).
//! - [`memory`]: gives the system back what the allocator keeps after a burst of work;
//!   [`tables`]: shrinks a map whose entries went.

pub mod backoff;
pub mod error;
pub mod http;
pub mod limits;
pub mod liveness;
pub mod memory;
pub mod metrics;
pub mod tables;
