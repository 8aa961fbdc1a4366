//! Which node a new proxy pod goes to: a pure decision over the egress nodes.
//!
//! The provider picks the node itself and binds the pod to it (`spec.nodeName`), because
//! the contract echoes the chosen location in Create's answer, before any scheduler
//! would have run. The choice, as a table:
//!
//! | placement | eligible nodes | answer |
//! |---|---|---|
//! | host H | H is not an egress node | INVALID_ARGUMENT on `placement.host` |
//! | host H | H is cordoned or not Ready | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | host H | H is schedulable | H |
//! | zone Z | no egress node carries Z | INVALID_ARGUMENT on `placement.zone` |
//! | zone Z | every node in Z is cordoned or not Ready | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | zone Z or none | some schedulable and Ready | the one with fewest of our pods, then by name |
//! | none | no schedulable, Ready egress node | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//!
//! A node that is not Ready (its kubelet is down or unreachable) would leave the pod
//! PROVISIONING until the caller gives up; the caller retries instead, and a node that
//! comes back is chosen again.
//!
//! Resource fit is the kubelet's: a pod that does not fit fails admission, its instance
//! is STOPPED, and the operator replaces it.

use std::time::Duration;

use egressproxy_provider::ProviderError;
use k8s_openapi::api::core::v1::Node;

use crate::record::RequestedPlacement;

/// How long a caller waits before retrying a Create that found no room.
const NO_ROOM_RETRY: Duration = Duration::from_secs(30);

/// An egress node as the choice sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The node's name.
    pub name: String,
    /// Its zone label's value.
    pub zone: Option<String>,
    /// False when cordoned, or when its Ready condition is not True.
    pub schedulable: bool,
    /// This provider's pods on it now.
    pub instances: usize,
}

impl Candidate {
    /// A node, its zone read from `zone_label`, with `instances` of our pods on it.
    pub fn from_node(node: &Node, zone_label: &str, instances: usize) -> Self {
        Candidate {
            name: node.metadata.name.clone().unwrap_or_default(),
            zone: node
                .metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get(zone_label).cloned()),
            schedulable: is_ready(node)
                && !node
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.unschedulable)
                    .unwrap_or(false),
            instances,
        }
    }
}

/// Whether the node's Ready condition is True (none: its kubelet never reported).
fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// The node for `requested` among the egress nodes, as the module's table says.
pub fn choose(
    requested: &RequestedPlacement,
    nodes: &[Candidate],
) -> Result<String, ProviderError> {
    let names = || {
        let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    };
    let in_scope: Vec<&Candidate> = match (&requested.host, &requested.zone) {
        (Some(host), _) => {
            let found: Vec<_> = nodes.iter().filter(|n| &n.name == host).collect();
            if found.is_empty() {
                return Err(ProviderError::invalid_argument(
                    "placement.host",
                    format!(
                        "no egress node is named {host:?}: the egress nodes are {}",
                        names()
                    ),
                ));
            }
            found
        }
        (None, Some(zone)) => {
            let found: Vec<_> = nodes
                .iter()
                .filter(|n| n.zone.as_ref() == Some(zone))
                .collect();
            if found.is_empty() {
                return Err(ProviderError::invalid_argument(
                    "placement.zone",
                    format!("no egress node is in zone {zone:?}"),
                ));
            }
            found
        }
        (None, None) => nodes.iter().collect(),
    };
    in_scope
        .into_iter()
        .filter(|n| n.schedulable)
        .min_by(|a, b| a.instances.cmp(&b.instances).then(a.name.cmp(&b.name)))
        .map(|n| n.name.clone())
        .ok_or_else(|| {
            ProviderError::quota_exhausted(
                format!(
                    "no schedulable egress node for this placement (egress nodes: {})",
                    names()
                ),
                Some(NO_ROOM_RETRY),
            )
            .with_reason("CAPACITY_EXHAUSTED")
        })
}

#[cfg(test)]
mod tests {
    use egressproxy_provider::ErrorClass;

    use super::*;

    fn node(name: &str, zone: &str, schedulable: bool, instances: usize) -> Candidate {
        Candidate {
            name: name.into(),
            zone: Some(zone.into()),
            schedulable,
            instances,
        }
    }

    fn placement(host: Option<&str>, zone: Option<&str>) -> RequestedPlacement {
        RequestedPlacement {
            host: host.map(Into::into),
            zone: zone.map(Into::into),
            machine_type: "small".into(),
            image: "squid".into(),
        }
    }

    /// The node chosen, or the error's class and its field (or reason).
    type Outcome<'a> = Result<&'a str, (ErrorClass, String)>;

    /// The module doc's table, row for row.
    #[test]
    fn the_choice_follows_the_table() {
        let nodes = [
            node("a", "z1", true, 2),
            node("b", "z1", true, 1),
            node("c", "z2", false, 0),
            node("d", "z3", true, 1),
        ];
        let invalid = |field: &str| Err((ErrorClass::InvalidArgument, field.to_owned()));
        let full = Err((ErrorClass::QuotaExhausted, "CAPACITY_EXHAUSTED".to_owned()));
        let rows: [(RequestedPlacement, Outcome); 7] = [
            (placement(Some("x"), None), invalid("placement.host")),
            (placement(Some("c"), None), full.clone()),
            (placement(Some("a"), None), Ok("a")),
            (placement(None, Some("z9")), invalid("placement.zone")),
            (placement(None, Some("z2")), full),
            (placement(None, Some("z1")), Ok("b")),
            (placement(None, None), Ok("b")),
        ];
        for (requested, expected) in rows {
            let got = choose(&requested, &nodes).map_err(|e| {
                let detail = e
                    .field_violations
                    .first()
                    .map_or(e.reason.clone(), |v| v.field.clone());
                (e.class, detail)
            });
            assert_eq!(got, expected.map(str::to_owned), "{requested:?}");
        }
    }

    #[test]
    fn a_node_is_schedulable_only_ready_and_uncordoned() {
        use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus};
        let node = |ready: Option<&str>, cordoned: bool| Node {
            spec: Some(NodeSpec {
                unschedulable: Some(cordoned),
                ..NodeSpec::default()
            }),
            status: Some(NodeStatus {
                conditions: ready.map(|status| {
                    vec![NodeCondition {
                        type_: "Ready".into(),
                        status: status.into(),
                        ..NodeCondition::default()
                    }]
                }),
                ..NodeStatus::default()
            }),
            ..Node::default()
        };
        let schedulable = |n: &Node| Candidate::from_node(n, "zone", 0).schedulable;
        assert!(schedulable(&node(Some("True"), false)));
        assert!(!schedulable(&node(Some("True"), true)));
        assert!(!schedulable(&node(Some("Unknown"), false)));
        assert!(!schedulable(&node(None, false)));
    }

    #[test]
    fn no_schedulable_node_at_all_is_no_room() {
        let error = choose(&placement(None, None), &[]).unwrap_err();
        assert_eq!(error.class, ErrorClass::QuotaExhausted);
        assert!(error.retry_after.is_some());
    }
}
