//! What each layer says about one of its errors, in the contract's terms.
//!
//! A leaf: every layer imports it to classify its own errors, and it imports no layer.

use std::time::Duration;

pub use egressproxy_provider::ErrorClass;

/// A layer's verdict on one of its errors: the contract's class, the stable reason code
/// (listed in the error table of `docs/kvm-agent.md`) and, when the layer knows one, when
/// a retry may succeed. Each layer computes it once, for its own errors;
/// `Error::to_provider_error` (in the top-level `error` module) turns it into the
/// contract's error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    /// What a caller should do. `NotFound` here means the object the error is about is
    /// missing (a domain, a pool); only an instance that is gone is `NotFound` on the
    /// wire, so the one mapping turns every other `NotFound` into `Permanent`.
    pub class: ErrorClass,
    /// The `ErrorInfo.reason` on the wire.
    pub reason: &'static str,
    /// When a retry may succeed (`RetryInfo`).
    pub retry_after: Option<Duration>,
}

impl Classification {
    /// `class` with `reason`, no retry hint.
    pub const fn new(class: ErrorClass, reason: &'static str) -> Self {
        Self {
            class,
            reason,
            retry_after: None,
        }
    }

    /// The same, with a retry hint.
    pub const fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }
}
