//! Fault injection for the reference provider: fail, slow down or hang the next calls,
//! so callers can be tested against the failures real infrastructure produces only
//! now and then.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{ErrorClass, ProviderError};

/// What a call that meets a fault experiences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultEffect {
    /// The call fails with this class.
    Fail(ErrorClass),
    /// The call answers normally after this extra delay.
    Latency(Duration),
    /// The call never answers (until the caller gives up).
    Hang,
    /// The call does its work, then holds its answer back this long.
    DelayResponse(Duration),
}

/// One injected fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The Provider method it applies to (`"CreateInstance"`); `None` for all.
    pub method: Option<String>,
    /// Calls left to meet it; `None` for every call until cleared.
    pub remaining: Option<u32>,
    /// What those calls experience.
    pub effect: FaultEffect,
    /// Message of the injected error.
    pub message: String,
    /// RetryInfo's delay on the injected error (with [`FaultEffect::Fail`]).
    pub retry_after: Option<Duration>,
}

/// The injected faults, shared by the provider and its control service.
#[derive(Debug, Clone, Default)]
pub struct Faults(Arc<Mutex<Vec<Fault>>>);

impl Faults {
    /// Adds a fault after those already injected.
    pub fn inject(&self, fault: Fault) {
        self.lock().push(fault);
    }

    /// Removes every fault.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Applies the first fault matching `method`, using up one of its calls. Returns
    /// the delay to hold the answer back by, after the call's work is done.
    pub(crate) async fn apply(&self, method: &str) -> Result<Option<Duration>, ProviderError> {
        let Some(effect) = self.take(method) else {
            return Ok(None);
        };
        match effect {
            (FaultEffect::Fail(class), message, retry_after) => {
                Err(ProviderError::new(class, message)
                    .with_reason("INJECTED_FAULT")
                    .with_retry_after(retry_after))
            }
            (FaultEffect::Latency(delay), _, _) => {
                tokio::time::sleep(delay).await;
                Ok(None)
            }
            (FaultEffect::Hang, _, _) => std::future::pending().await,
            (FaultEffect::DelayResponse(delay), _, _) => Ok(Some(delay)),
        }
    }

    fn take(&self, method: &str) -> Option<(FaultEffect, String, Option<Duration>)> {
        let mut faults = self.lock();
        let index = faults
            .iter()
            .position(|fault| fault.method.as_deref().is_none_or(|m| m == method))?;
        let fault = &mut faults[index];
        let taken = (
            fault.effect.clone(),
            fault.message.clone(),
            fault.retry_after,
        );
        if let Some(remaining) = &mut fault.remaining {
            *remaining = remaining.saturating_sub(1);
            if *remaining == 0 {
                faults.remove(index);
            }
        }
        Some(taken)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Fault>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(method: Option<&str>, remaining: Option<u32>, class: ErrorClass) -> Fault {
        Fault {
            method: method.map(str::to_owned),
            remaining,
            effect: FaultEffect::Fail(class),
            message: "injected".into(),
            retry_after: None,
        }
    }

    #[tokio::test]
    async fn a_counted_fault_is_used_up_then_calls_succeed() {
        let faults = Faults::default();
        faults.inject(fail(Some("CreateInstance"), Some(2), ErrorClass::Transient));
        assert!(faults.apply("GetInstance").await.is_ok());
        for _ in 0..2 {
            let error = faults.apply("CreateInstance").await.unwrap_err();
            assert_eq!(error.class, ErrorClass::Transient);
        }
        assert!(faults.apply("CreateInstance").await.is_ok());
    }

    #[tokio::test]
    async fn an_uncounted_fault_lasts_until_cleared() {
        let faults = Faults::default();
        faults.inject(fail(None, None, ErrorClass::Permanent));
        for method in ["GetInstance", "DeleteInstance", "GetInstance"] {
            assert_eq!(
                faults.apply(method).await.unwrap_err().class,
                ErrorClass::Permanent
            );
        }
        faults.clear();
        assert!(faults.apply("GetInstance").await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn hang_never_answers() {
        let faults = Faults::default();
        faults.inject(Fault {
            method: None,
            remaining: Some(1),
            effect: FaultEffect::Hang,
            message: String::new(),
            retry_after: None,
        });
        let hung = tokio::time::timeout(Duration::from_secs(3600), faults.apply("GetInstance"));
        assert!(hung.await.is_err(), "a hung call must not answer");
    }
}
