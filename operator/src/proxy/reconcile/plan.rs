//! Deciding what to do: a pure function from the spec, the status and what was
//! observed to one [`Step`]. No I/O, no clock: every row of the table in
//! `docs/operator.md` is a unit test below.

use egressproxy_provider::pb;

use super::observe::{Health, Instance, Observation};
use crate::crd::{ProxySpec, ProxyStatus, condition};

/// The one thing the reconcile does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// No instance is recorded: check the placement and create one.
    Create,
    /// The recorded instance must go, and a new one take its place.
    Replace {
        /// The instance being replaced.
        id: String,
        /// Why.
        cause: Cause,
    },
    /// The instance is being created or booting: poll again.
    AwaitInstance {
        /// What the provider says it is doing.
        message: String,
    },
    /// The instance runs with an address and its proxy answered: Ready.
    MarkHealthy {
        /// Its addresses.
        addresses: Vec<pb::Address>,
    },
    /// The instance runs, but its proxy has never answered yet: still installing.
    AwaitProxy {
        /// Its addresses.
        addresses: Vec<pb::Address>,
        /// What the health check saw.
        problem: String,
    },
    /// The proxy failed its check, fewer times in a row than the threshold: keep the
    /// status, check again soon.
    ToleratePassingFailure {
        /// Its addresses.
        addresses: Vec<pb::Address>,
    },
    /// The proxy failed its check `failureThreshold` times in a row: Degraded.
    MarkUnhealthy {
        /// Its addresses.
        addresses: Vec<pb::Address>,
        /// Why, for the condition and the Event.
        message: String,
    },
}

/// Why an instance is replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// `spec.placement` changed (with `placementUpdatePolicy: Replace`); the old
    /// instance is deleted and the new one created in the same reconcile.
    PlacementChanged,
    /// The provider reports it stopped; it is deleted first.
    Stopped(String),
    /// The provider no longer knows it.
    Vanished,
    /// It has not become Ready within `spec.provisioningTimeoutSeconds` of its creation.
    ProvisioningTimedOut {
        /// The timeout, in seconds.
        timeout_seconds: u32,
        /// What it was still waiting for.
        waiting_for: String,
    },
}

impl Cause {
    /// The condition and Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Cause::PlacementChanged => "Replacing",
            Cause::Stopped(_) => "InstanceStopped",
            Cause::Vanished => "InstanceVanished",
            Cause::ProvisioningTimedOut { .. } => "ProvisioningTimedOut",
        }
    }

    /// Whether the old instance must be deleted (it may still exist).
    pub fn deletes_old(&self) -> bool {
        !matches!(self, Cause::Vanished)
    }

    /// A short description, for the `Replaced` Event.
    pub fn describe(&self) -> String {
        match self {
            Cause::PlacementChanged => "placement changed".into(),
            Cause::Stopped(message) if message.is_empty() => "stopped".into(),
            Cause::Stopped(message) => format!("stopped ({message})"),
            Cause::Vanished => "vanished at the provider".into(),
            Cause::ProvisioningTimedOut {
                timeout_seconds, ..
            } => format!("not ready within {timeout_seconds}s"),
        }
    }
}

/// The next step for a Proxy with `spec` and `status`, given `observed`.
pub fn plan(spec: &ProxySpec, status: &ProxyStatus, observed: &Observation) -> Step {
    let Some(id) = status.provider_id.clone() else {
        return Step::Create;
    };
    if status.placement.as_ref() != Some(&spec.placement) {
        return Step::Replace {
            id,
            cause: Cause::PlacementChanged,
        };
    }
    let instance = match &observed.instance {
        Instance::Found(instance) => instance,
        Instance::Vanished => {
            return Step::Replace {
                id,
                cause: Cause::Vanished,
            };
        }
        // The status names an instance that was not looked up (observe skips the
        // lookup only when no instance is recorded): the safe answer is to look again.
        Instance::NotLookedUp => {
            return Step::AwaitInstance {
                message: "looking up the instance".into(),
            };
        }
    };
    let step = match instance.state() {
        pb::InstanceState::Stopped => Step::Replace {
            id: id.clone(),
            cause: Cause::Stopped(instance.state_message.clone()),
        },
        pb::InstanceState::Running if !instance.addresses.is_empty() => health_step(
            spec,
            status,
            instance.addresses.clone(),
            observed.health.as_ref(),
        ),
        state => Step::AwaitInstance {
            message: match state {
                pb::InstanceState::Deleting => "the provider is deleting the instance".to_owned(),
                pb::InstanceState::Running => "running, waiting for an address".to_owned(),
                _ if instance.state_message.is_empty() => {
                    "the instance is being created".to_owned()
                }
                _ => instance.state_message.clone(),
            },
        },
    };
    match timed_out(spec, status, observed, &step) {
        Some(cause) => Step::Replace { id, cause },
        None => step,
    }
}

/// Whether an instance that has never been Ready ran out of
/// `spec.provisioningTimeoutSeconds`, counted from its creation. Once its proxy has
/// answered, failures are the health check's business, not this timeout's.
fn timed_out(
    spec: &ProxySpec,
    status: &ProxyStatus,
    observed: &Observation,
    step: &Step,
) -> Option<Cause> {
    let waiting_for = match step {
        Step::AwaitInstance { message } => message.clone(),
        Step::AwaitProxy { problem, .. } => format!("the proxy to answer: {problem}"),
        _ => return None,
    };
    // The provider is already deleting it: replacing would only race that.
    let deleting = matches!(&observed.instance,
        Instance::Found(instance) if instance.state() == pb::InstanceState::Deleting);
    if deleting || ever_healthy(status) {
        return None;
    }
    let created = status.instance_create_time.as_ref()?.0;
    let timeout = jiff::SignedDuration::from_secs(i64::from(spec.provisioning_timeout_seconds));
    if observed.at.duration_since(created) < timeout {
        return None;
    }
    Some(Cause::ProvisioningTimedOut {
        timeout_seconds: spec.provisioning_timeout_seconds,
        waiting_for,
    })
}

/// The Healthy condition exists once the current instance's proxy has answered (a
/// replacement starts without it).
fn ever_healthy(status: &ProxyStatus) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == condition::HEALTHY)
}

fn health_step(
    spec: &ProxySpec,
    status: &ProxyStatus,
    addresses: Vec<pb::Address>,
    health: Option<&Health>,
) -> Step {
    let Some(health) = health else {
        return Step::AwaitProxy {
            addresses,
            problem: "the health check has not run".into(),
        };
    };
    let problem = match &health.result {
        Ok(()) => return Step::MarkHealthy { addresses },
        Err(problem) => problem.clone(),
    };
    // Until this instance's proxy has answered once, it is still being installed, not
    // broken.
    if !ever_healthy(status) {
        return Step::AwaitProxy { addresses, problem };
    }
    let threshold = spec
        .health_check
        .clone()
        .unwrap_or_default()
        .failure_threshold;
    if health.consecutive_failures < threshold {
        return Step::ToleratePassingFailure { addresses };
    }
    Step::MarkUnhealthy {
        addresses,
        message: format!("health check failed {threshold} times in a row: {problem}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{HealthCheck, Placement};
    use crate::k8s::status::set_condition;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn spec() -> ProxySpec {
        serde_json::from_value(serde_json::json!({
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "healthCheck": {"failureThreshold": 3},
        }))
        .unwrap()
    }

    fn placement(machine_type: &str) -> Placement {
        Placement {
            machine_type: machine_type.into(),
            ..spec().placement
        }
    }

    /// A status with instance `i-1` created with `machine_type`, optionally healthy
    /// once (the Healthy condition exists).
    fn recorded(machine_type: &str, healthy_once: Option<bool>) -> ProxyStatus {
        let mut status = ProxyStatus {
            provider_id: Some("i-1".into()),
            placement: Some(placement(machine_type)),
            instance_create_time: Some(Time(created())),
            ..ProxyStatus::default()
        };
        if let Some(healthy) = healthy_once {
            set_condition(
                &mut status.conditions,
                condition::HEALTHY,
                healthy,
                "x",
                "",
                None,
            );
        }
        status
    }

    fn instance(state: pb::InstanceState, message: &str, addressed: bool) -> Instance {
        let mut instance = pb::Instance {
            id: "i-1".into(),
            state_message: message.into(),
            ..pb::Instance::default()
        };
        instance.set_state(state);
        if addressed {
            instance.addresses.push(pb::Address {
                address: "192.0.2.7".into(),
                ..pb::Address::default()
            });
        }
        Instance::Found(Box::new(instance))
    }

    /// When the recorded instance was created.
    fn created() -> jiff::Timestamp {
        "2026-01-01T00:00:00Z".parse().unwrap()
    }

    /// An observation one minute after the instance's creation.
    fn observed(instance: Instance, health: Option<(Result<(), &str>, u32)>) -> Observation {
        observed_after(60, instance, health)
    }

    fn observed_after(
        seconds: i64,
        instance: Instance,
        health: Option<(Result<(), &str>, u32)>,
    ) -> Observation {
        Observation {
            instance,
            health: health.map(|(result, consecutive_failures)| Health {
                result: result.map_err(str::to_owned),
                consecutive_failures,
            }),
            at: created() + jiff::SignedDuration::from_secs(seconds),
        }
    }

    fn timed_out(waiting_for: &str) -> Step {
        Step::Replace {
            id: "i-1".into(),
            cause: Cause::ProvisioningTimedOut {
                timeout_seconds: 600,
                waiting_for: waiting_for.into(),
            },
        }
    }

    fn addresses() -> Vec<pb::Address> {
        vec![pb::Address {
            address: "192.0.2.7".into(),
            ..pb::Address::default()
        }]
    }

    /// The table of `docs/operator.md`, row by row.
    #[test]
    fn every_row_of_the_table() {
        use pb::InstanceState::{Deleting, Provisioning, Running, Stopped};
        let running = || instance(Running, "", true);
        let rows: Vec<(&str, ProxyStatus, Observation, Step)> = vec![
            (
                "1 no instance recorded",
                ProxyStatus::default(),
                observed(Instance::NotLookedUp, None),
                Step::Create,
            ),
            (
                "2 placement changed",
                recorded("medium", Some(true)),
                observed(running(), Some((Ok(()), 0))),
                Step::Replace {
                    id: "i-1".into(),
                    cause: Cause::PlacementChanged,
                },
            ),
            (
                "3 instance vanished",
                recorded("small", Some(true)),
                observed(Instance::Vanished, None),
                Step::Replace {
                    id: "i-1".into(),
                    cause: Cause::Vanished,
                },
            ),
            (
                "4 instance stopped",
                recorded("small", Some(true)),
                observed(instance(Stopped, "shut off", false), None),
                Step::Replace {
                    id: "i-1".into(),
                    cause: Cause::Stopped("shut off".into()),
                },
            ),
            (
                "5 provisioning",
                recorded("small", None),
                observed(instance(Provisioning, "", false), None),
                Step::AwaitInstance {
                    message: "the instance is being created".into(),
                },
            ),
            (
                "6 provisioning, with the provider's message",
                recorded("small", None),
                observed(instance(Provisioning, "downloading image", false), None),
                Step::AwaitInstance {
                    message: "downloading image".into(),
                },
            ),
            (
                "7 running without an address",
                recorded("small", None),
                observed(instance(Running, "", false), None),
                Step::AwaitInstance {
                    message: "running, waiting for an address".into(),
                },
            ),
            (
                "8 deleting at the provider",
                recorded("small", None),
                observed(instance(Deleting, "", false), None),
                Step::AwaitInstance {
                    message: "the provider is deleting the instance".into(),
                },
            ),
            (
                "9 running, proxy answers",
                recorded("small", None),
                observed(running(), Some((Ok(()), 0))),
                Step::MarkHealthy {
                    addresses: addresses(),
                },
            ),
            (
                "10 running, proxy never answered yet",
                recorded("small", None),
                observed(running(), Some((Err("refused"), 5))),
                Step::AwaitProxy {
                    addresses: addresses(),
                    problem: "refused".into(),
                },
            ),
            (
                "11 running, answered before, fails below the threshold",
                recorded("small", Some(true)),
                observed(running(), Some((Err("refused"), 2))),
                Step::ToleratePassingFailure {
                    addresses: addresses(),
                },
            ),
            (
                "12 running, answered before, fails at the threshold",
                recorded("small", Some(true)),
                observed(running(), Some((Err("refused"), 3))),
                Step::MarkUnhealthy {
                    addresses: addresses(),
                    message: "health check failed 3 times in a row: refused".into(),
                },
            ),
            (
                "13 degraded, proxy answers again",
                recorded("small", Some(false)),
                observed(running(), Some((Ok(()), 0))),
                Step::MarkHealthy {
                    addresses: addresses(),
                },
            ),
            (
                "14 provisioning past the timeout",
                recorded("small", None),
                observed_after(600, instance(Provisioning, "", false), None),
                timed_out("the instance is being created"),
            ),
            (
                "15 running without an address past the timeout",
                recorded("small", None),
                observed_after(601, instance(Running, "", false), None),
                timed_out("running, waiting for an address"),
            ),
            (
                "16 running, proxy never answered, past the timeout",
                recorded("small", None),
                observed_after(900, running(), Some((Err("refused"), 90))),
                timed_out("the proxy to answer: refused"),
            ),
            (
                "17 running, answered before, fails below the threshold, past the timeout",
                recorded("small", Some(true)),
                observed_after(900, running(), Some((Err("refused"), 2))),
                Step::ToleratePassingFailure {
                    addresses: addresses(),
                },
            ),
            (
                "18 provisioning, no creation time recorded (an older operator's)",
                ProxyStatus {
                    instance_create_time: None,
                    ..recorded("small", None)
                },
                observed_after(900, instance(Provisioning, "", false), None),
                Step::AwaitInstance {
                    message: "the instance is being created".into(),
                },
            ),
            (
                "19 deleting at the provider, past the timeout",
                recorded("small", None),
                observed_after(900, instance(Deleting, "", false), None),
                Step::AwaitInstance {
                    message: "the provider is deleting the instance".into(),
                },
            ),
        ];
        for (row, status, observation, expected) in rows {
            assert_eq!(plan(&spec(), &status, &observation), expected, "row {row}");
        }
    }

    /// A state this operator does not know (from a newer provider) is read as the
    /// contract says: not usable yet, not an error, never a reason to replace.
    #[test]
    fn an_unknown_state_is_read_as_provisioning() {
        let Instance::Found(mut unknown) = instance(pb::InstanceState::Running, "warming up", true)
        else {
            unreachable!()
        };
        unknown.state = 99;
        let step = plan(
            &spec(),
            &recorded("small", None),
            &observed(Instance::Found(unknown), None),
        );
        assert_eq!(
            step,
            Step::AwaitInstance {
                message: "warming up".into()
            }
        );
    }

    #[test]
    fn the_threshold_comes_from_the_spec() {
        let mut spec = spec();
        spec.health_check = Some(HealthCheck {
            failure_threshold: 1,
            ..HealthCheck::default()
        });
        let step = plan(
            &spec,
            &recorded("small", Some(true)),
            &observed(
                instance(pb::InstanceState::Running, "", true),
                Some((Err("refused"), 1)),
            ),
        );
        assert!(matches!(step, Step::MarkUnhealthy { .. }), "{step:?}");
    }

    #[test]
    fn the_provisioning_timeout_comes_from_the_spec() {
        let mut spec = spec();
        spec.provisioning_timeout_seconds = 30;
        let provisioning = || instance(pb::InstanceState::Provisioning, "", false);
        let status = recorded("small", None);
        assert!(matches!(
            plan(&spec, &status, &observed_after(29, provisioning(), None)),
            Step::AwaitInstance { .. }
        ));
        let step = plan(&spec, &status, &observed_after(30, provisioning(), None));
        assert!(
            matches!(
                &step,
                Step::Replace {
                    cause: Cause::ProvisioningTimedOut {
                        timeout_seconds: 30,
                        ..
                    },
                    ..
                }
            ),
            "{step:?}"
        );
    }

    #[test]
    fn only_a_vanished_instance_is_not_deleted_before_its_replacement() {
        assert!(
            Cause::ProvisioningTimedOut {
                timeout_seconds: 1,
                waiting_for: String::new()
            }
            .deletes_old()
        );
        assert!(Cause::PlacementChanged.deletes_old());
        assert!(Cause::Stopped(String::new()).deletes_old());
        assert!(!Cause::Vanished.deletes_old());
    }
}
