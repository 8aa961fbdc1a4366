//! Whether the operator's control loop is alive, for `/healthz` (the liveness probe).
//!
//! A process whose HTTP server answers can still have a controller that no longer
//! processes anything (a reconcile stuck on a lock, a scheduler that stopped being
//! polled); a constant "ok" would keep such a pod running for ever. So:
//!
//! 1. A candidate (no lease yet) runs no control loop: it is alive while it serves.
//! 2. Once leader, the controller is sent a liveness probe every [`PROBE_EVERY`]: a
//!    request for an object that cannot exist (its name is not a valid object name),
//!    which goes through the controller's queue and scheduler like any Proxy and comes
//!    out as "object not found" ([`Liveness::probes`]). Every result the controller
//!    yields (a reconcile or a probe) is a beat ([`Liveness::beat`]).
//! 3. `/healthz` fails, naming the silence, when the leader's controller has yielded
//!    nothing for [`SILENCE_LIMIT`]: longer than a probe takes to pass through even when
//!    every worker is busy with slow provider calls, short enough that the kubelet
//!    restarts a wedged operator within minutes.

use std::sync::Mutex;
use std::time::Duration;

use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

use crate::crd::Proxy;

/// How often the leader's controller is sent a liveness probe.
pub const PROBE_EVERY: Duration = Duration::from_secs(15);
/// How long the leader's controller may yield nothing before `/healthz` fails.
pub const SILENCE_LIMIT: Duration = Duration::from_secs(300);
/// The probe's object name: not a valid Kubernetes name, so no Proxy can have it.
const PROBE_NAME: &str = "<liveness probe>";

#[derive(Debug, Clone, Copy)]
enum State {
    Candidate,
    Controlling { last_beat: Instant },
}

/// The control loop's liveness; see the module docs.
#[derive(Debug)]
pub struct Liveness {
    state: Mutex<State>,
    limit: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Self::with_limit(SILENCE_LIMIT)
    }
}

impl Liveness {
    /// A candidate whose controller, once it leads, may be silent for `limit`.
    pub fn with_limit(limit: Duration) -> Self {
        Liveness {
            state: Mutex::new(State::Candidate),
            limit,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This replica leads: from now on its controller must keep yielding.
    pub fn start_controlling(&self) {
        *self.state() = State::Controlling {
            last_beat: Instant::now(),
        };
    }

    /// The controller yielded a result.
    pub fn beat(&self) {
        if let State::Controlling { last_beat } = &mut *self.state() {
            *last_beat = Instant::now();
        }
    }

    /// `Ok` with what is alive, or `Err` with what has stopped.
    pub fn check(&self) -> Result<String, String> {
        match *self.state() {
            State::Candidate => Ok("ok: candidate, waiting for the leader lease".to_owned()),
            State::Controlling { last_beat } => {
                let silence = last_beat.elapsed();
                if silence > self.limit {
                    Err(format!(
                        "the controller has processed nothing for {}s (a liveness probe goes \
                         through it every {}s; the limit is {}s)",
                        silence.as_secs(),
                        PROBE_EVERY.as_secs(),
                        self.limit.as_secs()
                    ))
                } else {
                    Ok(format!(
                        "ok: the controller processed its last request {}s ago",
                        silence.as_secs()
                    ))
                }
            }
        }
    }

    /// Whether a controller error is a probe's "not found" (expected: not worth a log).
    pub fn is_probe(
        error: &kube::runtime::controller::Error<impl std::error::Error, impl std::error::Error>,
    ) -> bool {
        matches!(error, kube::runtime::controller::Error::ObjectNotFound(object) if object.name == PROBE_NAME)
    }

    /// The probes to feed the controller (`Controller::reconcile_on`): one at once,
    /// then one every [`PROBE_EVERY`].
    pub fn probes() -> impl futures::Stream<Item = ObjectRef<Proxy>> + Send + 'static {
        let ticks = tokio::time::interval(PROBE_EVERY);
        futures::stream::unfold(ticks, |mut ticks| async move {
            ticks.tick().await;
            Some((ObjectRef::new(PROBE_NAME).within(PROBE_NAME), ticks))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_silent_controller_fails_the_check_and_a_beat_revives_it() {
        let liveness = Liveness::with_limit(Duration::from_secs(60));
        assert!(liveness.check().unwrap().contains("candidate"));
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(liveness.check().is_ok(), "a candidate runs no control loop");

        liveness.start_controlling();
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(liveness.check().unwrap().contains("59s ago"));
        tokio::time::advance(Duration::from_secs(2)).await;
        let silent = liveness.check().unwrap_err();
        assert!(
            silent.contains("processed nothing for 61s") && silent.contains("limit is 60s"),
            "{silent}"
        );
        liveness.beat();
        assert!(liveness.check().unwrap().contains("0s ago"));
    }

    #[tokio::test(start_paused = true)]
    async fn probes_come_at_once_then_every_period_and_name_no_possible_proxy() {
        use futures::StreamExt;
        let mut probes = Box::pin(Liveness::probes());
        let first = probes.next().await.unwrap();
        assert_eq!(first.name, PROBE_NAME);
        let started = Instant::now();
        probes.next().await.unwrap();
        assert_eq!(started.elapsed(), PROBE_EVERY);
        // Kubernetes names are lowercase alphanumerics, '-' and '.': never this one.
        assert!(PROBE_NAME.contains(['<', ' ', '>']));
    }
}
