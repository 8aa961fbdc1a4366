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
}

impl Cause {
    /// The condition and Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Cause::PlacementChanged => "Replacing",
            Cause::Stopped(_) => "InstanceStopped",
            Cause::Vanished => "InstanceVanished",
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
    match instance.state() {
        pb::InstanceState::Stopped => Step::Replace {
            id,
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
    }
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
    // The Healthy condition exists once this instance's proxy has answered (a
    // replacement starts without it): until then the proxy is still being
    // installed, not broken.
    let ever_healthy = status
        .conditions
        .iter()
        .any(|c| c.type_ == condition::HEALTHY);
    if !ever_healthy {
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
    use crate::status::set_condition;

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

    fn observed(instance: Instance, health: Option<(Result<(), &str>, u32)>) -> Observation {
        Observation {
            instance,
            health: health.map(|(result, consecutive_failures)| Health {
                result: result.map_err(str::to_owned),
                consecutive_failures,
            }),
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
        ];
        for (row, status, observation, expected) in rows {
            assert_eq!(plan(&spec(), &status, &observation), expected, "row {row}");
        }
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
    fn only_a_vanished_instance_is_not_deleted_before_its_replacement() {
        assert!(Cause::PlacementChanged.deletes_old());
        assert!(Cause::Stopped(String::new()).deletes_old());
        assert!(!Cause::Vanished.deletes_old());
    }
}
