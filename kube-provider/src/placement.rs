//! Which node a new proxy pod goes to: a pure decision over the egress nodes.
//!
//! The provider picks the node itself and binds the pod to it (`spec.nodeName`), because
//! the contract echoes the chosen location in Create's answer, before any scheduler
//! would have run. Binding bypasses the scheduler, so the choice does the scheduler's
//! port check itself: a proxy pod has host network, so its proxy port is a port of the
//! node, and a node where any pod that has not terminated (ours or anyone's) already
//! holds that TCP host port is no candidate ([`Candidate::ports_in_use`]). The choice,
//! as a table:
//!
//! | placement | eligible nodes | answer |
//! |---|---|---|
//! | host H | H is not an egress node | INVALID_ARGUMENT on `placement.host` |
//! | host H | H is cordoned or not Ready | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | host H | a pod on H holds the proxy port | RESOURCE_EXHAUSTED, `PORT_IN_USE` |
//! | host H | H is schedulable, the port free | H |
//! | zone Z | no egress node carries Z | INVALID_ARGUMENT on `placement.zone` |
//! | zone Z | every node in Z is cordoned or not Ready | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | zone Z | every schedulable node in Z holds the port | RESOURCE_EXHAUSTED, `PORT_IN_USE` |
//! | host H | H has the port free but no room for the pod | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | zone Z or none | every schedulable node with the port free has no room | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | zone Z or none | some schedulable and Ready with the port free and room | of those, the one with fewest of our pods, then by name |
//! | none | no schedulable, Ready egress node | RESOURCE_EXHAUSTED, `CAPACITY_EXHAUSTED` |
//! | none | every schedulable egress node holds the port | RESOURCE_EXHAUSTED, `PORT_IN_USE` |
//!
//! A node that is not Ready (its kubelet is down or unreachable) would leave the pod
//! PROVISIONING until the caller gives up; the caller retries instead, and a node that
//! comes back is chosen again. A port is busy as long as its holder has not terminated:
//! a terminating pod's process may still listen, and its kubelet still counts it.
//!
//! Binding bypasses the scheduler's resource fit too, so the choice also asks whether
//! the node has room for the pod's requests ([`crate::node_room`]): a node where the
//! kubelet would reject the pod (`OutOfcpu`) is no candidate either.
//!
//! The kubelet stays the backstop for what the choice could not see: a port taken
//! between the choice and the pod's admission by a process outside any pod or by a
//! second provider replica, or room taken by a Create of another port at the same
//! moment. Such a pod fails admission and its instance is STOPPED with the kubelet's
//! message (see `instance`), and the operator replaces it.

use std::collections::BTreeSet;
use std::time::Duration;

use egressproxy_provider::ProviderError;
use k8s_openapi::api::core::v1::{Node, Pod};

use crate::node_room::{Amounts, NodeRoom};
use crate::record::RequestedPlacement;

/// How long a caller waits before retrying a Create that found no room.
const NO_ROOM_RETRY: Duration = Duration::from_secs(30);

/// The reason of a Create refused because every node it may go to has its proxy port
/// held already.
pub const PORT_IN_USE: &str = "PORT_IN_USE";

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
    /// The TCP host ports that pods on it (any namespace, not terminated) hold.
    pub ports_in_use: BTreeSet<u32>,
    /// Its allocatable resources and its pods' requests; `None` when not inspected,
    /// which the choice takes as room enough.
    pub room: Option<NodeRoom>,
}

impl Candidate {
    /// A node, its zone read from `zone_label`, with `instances` of our pods on it and
    /// no port known to be in use (see [`Candidate::ports_in_use`]).
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
            ports_in_use: BTreeSet::new(),
            room: None,
        }
    }

    /// What it lacks for a pod requesting `wanted`, in words; `None` when it fits.
    fn shortfall(&self, wanted: &Amounts) -> Option<String> {
        self.room.as_ref().and_then(|room| room.shortfall(wanted))
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

/// The TCP host ports `pod` holds on its node: none once it has terminated (Succeeded or
/// Failed), else every TCP `hostPort` of its containers and init containers, as the
/// kubelet's port check counts them. (The apiserver fills in `hostPort` of a
/// host-network pod's declared ports, so a proxy pod's port is among them.)
pub fn host_ports(pod: &Pod) -> BTreeSet<u32> {
    let terminated = pod
        .status
        .as_ref()
        .and_then(|status| status.phase.as_deref())
        .is_some_and(|phase| matches!(phase, "Succeeded" | "Failed"));
    let Some(spec) = pod.spec.as_ref().filter(|_| !terminated) else {
        return BTreeSet::new();
    };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|container| container.ports.iter().flatten())
        .filter(|port| port.protocol.as_deref().unwrap_or("TCP") == "TCP")
        .filter_map(|port| port.host_port.and_then(|p| u32::try_from(p).ok()))
        .filter(|port| *port != 0)
        .collect()
}

/// The egress nodes `requested` may go to, whatever their state; INVALID_ARGUMENT when
/// it names a host or zone that has none.
pub fn in_scope<'a>(
    requested: &RequestedPlacement,
    nodes: &'a [Candidate],
) -> Result<Vec<&'a Candidate>, ProviderError> {
    match (&requested.host, &requested.zone) {
        (Some(host), _) => {
            let found: Vec<_> = nodes.iter().filter(|n| &n.name == host).collect();
            if found.is_empty() {
                return Err(ProviderError::invalid_argument(
                    "placement.host",
                    format!(
                        "no egress node is named {host:?}: the egress nodes are {}",
                        names(nodes.iter())
                    ),
                ));
            }
            Ok(found)
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
            Ok(found)
        }
        (None, None) => Ok(nodes.iter().collect()),
    }
}

/// The node for `requested` with `proxy_port` and a pod requesting `wanted` among the
/// egress nodes, as the module's table says.
pub fn choose(
    requested: &RequestedPlacement,
    proxy_port: u32,
    wanted: &Amounts,
    nodes: &[Candidate],
) -> Result<String, ProviderError> {
    let schedulable: Vec<&Candidate> = in_scope(requested, nodes)?
        .into_iter()
        .filter(|n| n.schedulable)
        .collect();
    if schedulable.is_empty() {
        return Err(ProviderError::quota_exhausted(
            format!(
                "no schedulable egress node for this placement (egress nodes: {})",
                names(nodes.iter())
            ),
            Some(NO_ROOM_RETRY),
        )
        .with_reason("CAPACITY_EXHAUSTED"));
    }
    let (busy, free): (Vec<&Candidate>, Vec<&Candidate>) = schedulable
        .into_iter()
        .partition(|n| n.ports_in_use.contains(&proxy_port));
    if free.is_empty() {
        return Err(port_in_use(requested, proxy_port, &busy));
    }
    let (fitting, full): (Vec<&Candidate>, Vec<&Candidate>) = free
        .into_iter()
        .partition(|n| n.shortfall(wanted).is_none());
    fitting
        .into_iter()
        .min_by(|a, b| a.instances.cmp(&b.instances).then(a.name.cmp(&b.name)))
        .map(|n| n.name.clone())
        .ok_or_else(|| no_room(requested, wanted, &full))
}

/// Every node the placement allows with the port free lacks room for the pod: say what
/// each lacks, and what to change.
fn no_room(requested: &RequestedPlacement, wanted: &Amounts, full: &[&Candidate]) -> ProviderError {
    let lacks: Vec<String> = full
        .iter()
        .map(|n| format!("{} ({})", n.name, n.shortfall(wanted).unwrap_or_default()))
        .collect();
    ProviderError::quota_exhausted(
        format!(
            "no egress node this placement allows has room for a pod of machine type {:?}: {}; \
             choose a smaller machine type, free room on these nodes or label more egress \
             nodes, or retry once other pods are gone",
            requested.machine_type,
            lacks.join("; ")
        ),
        Some(NO_ROOM_RETRY),
    )
    .with_reason("CAPACITY_EXHAUSTED")
}

/// Every node the placement allows holds `proxy_port`: say where, and what to change.
fn port_in_use(
    requested: &RequestedPlacement,
    proxy_port: u32,
    busy: &[&Candidate],
) -> ProviderError {
    let nodes = names(busy.iter().copied());
    let what_to_do = match (&requested.host, &requested.zone) {
        (Some(_), _) => "ask for another proxy port, or another node or zone",
        (None, Some(_)) => {
            "ask for another proxy port or another zone, or label more egress nodes into the zone"
        }
        (None, None) => "ask for another proxy port, or label more egress nodes",
    };
    ProviderError::quota_exhausted(
        format!(
            "proxy port {proxy_port} is already in use on every schedulable egress node this \
             placement allows ({nodes}): a proxy pod uses host network, so its port is the \
             node's; {what_to_do}, or retry once the pod holding it is gone"
        ),
        Some(NO_ROOM_RETRY),
    )
    .with_reason(PORT_IN_USE)
}

/// The nodes' names, comma-separated, or "none".
fn names<'a>(nodes: impl Iterator<Item = &'a Candidate>) -> String {
    let names: Vec<&str> = nodes.map(|n| n.name.as_str()).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use egressproxy_provider::ErrorClass;

    use super::*;

    const PORT: u32 = 3128;

    fn node(name: &str, zone: &str, schedulable: bool, instances: usize) -> Candidate {
        Candidate {
            name: name.into(),
            zone: Some(zone.into()),
            schedulable,
            instances,
            ports_in_use: BTreeSet::new(),
            room: None,
        }
    }

    fn holding(mut candidate: Candidate, port: u32) -> Candidate {
        candidate.ports_in_use.insert(port);
        candidate
    }

    /// What a pod of machine type `small` requests: 100m cpu, and one pod.
    fn small() -> Amounts {
        Amounts::from([("cpu".to_owned(), 100), ("pods".to_owned(), 1000)])
    }

    /// `candidate` with `cpu_left` millicores of 1000 left, and room for pods.
    fn with_cpu_left(mut candidate: Candidate, cpu_left: i128) -> Candidate {
        candidate.room = Some(NodeRoom {
            allocatable: Amounts::from([("cpu".to_owned(), 1000), ("pods".to_owned(), 110_000)]),
            requested: Amounts::from([("cpu".to_owned(), 1000 - cpu_left)]),
        });
        candidate
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

    fn outcome(result: Result<String, ProviderError>) -> Result<String, (ErrorClass, String)> {
        result.map_err(|e| {
            let detail = e
                .field_violations
                .first()
                .map_or(e.reason.clone(), |v| v.field.clone());
            (e.class, detail)
        })
    }

    /// The module doc's table, row for row. Node `a` (z1) holds the port, so zone z1
    /// has only `b` left, though `a` has more room by our count; z4's only schedulable
    /// node holds it; z5's only node lacks cpu for the pod; in z6 the node with cpu left
    /// wins, though it has more of our pods.
    #[test]
    fn the_choice_follows_the_table() {
        let nodes = [
            holding(node("a", "z1", true, 0), PORT),
            node("b", "z1", true, 1),
            node("c", "z2", false, 0),
            node("d", "z3", true, 1),
            holding(node("e", "z4", true, 0), PORT),
            node("f", "z4", false, 0),
            with_cpu_left(node("g", "z5", true, 0), 99),
            with_cpu_left(node("h", "z6", true, 0), 50),
            with_cpu_left(node("i", "z6", true, 3), 100),
        ];
        let invalid = |field: &str| Err((ErrorClass::InvalidArgument, field.to_owned()));
        let full = Err((ErrorClass::QuotaExhausted, "CAPACITY_EXHAUSTED".to_owned()));
        let port_in_use = Err((ErrorClass::QuotaExhausted, PORT_IN_USE.to_owned()));
        let rows: [(RequestedPlacement, Outcome); 14] = [
            (placement(Some("x"), None), invalid("placement.host")),
            (placement(Some("c"), None), full.clone()),
            (placement(Some("g"), None), full.clone()),
            (placement(None, Some("z5")), full.clone()),
            (placement(None, Some("z6")), Ok("i")),
            (placement(Some("i"), None), Ok("i")),
            (placement(Some("a"), None), port_in_use.clone()),
            (placement(Some("b"), None), Ok("b")),
            (placement(None, Some("z9")), invalid("placement.zone")),
            (placement(None, Some("z2")), full),
            (placement(None, Some("z4")), port_in_use),
            (placement(None, Some("z1")), Ok("b")),
            (placement(None, Some("z3")), Ok("d")),
            (placement(None, None), Ok("b")),
        ];
        for (requested, expected) in rows {
            let got = outcome(choose(&requested, PORT, &small(), &nodes));
            assert_eq!(got, expected.map(str::to_owned), "{requested:?}");
        }
    }

    #[test]
    fn no_room_names_each_node_what_it_lacks_and_what_to_do() {
        let nodes = [
            with_cpu_left(node("a", "z1", true, 0), 40),
            with_cpu_left(node("b", "z1", true, 0), 0),
        ];
        let error = choose(&placement(None, Some("z1")), PORT, &small(), &nodes).unwrap_err();
        assert_eq!(error.class, ErrorClass::QuotaExhausted);
        assert_eq!(error.reason, "CAPACITY_EXHAUSTED");
        assert_eq!(error.retry_after, Some(NO_ROOM_RETRY));
        for part in [
            "machine type \"small\"",
            "a (cpu: 960m of 1000m allocatable requested already, one more pod asks 100m)",
            "b (cpu: 1000m of 1000m",
            "choose a smaller machine type",
        ] {
            assert!(
                error.message.contains(part),
                "{part:?} in {}",
                error.message
            );
        }
    }

    #[test]
    fn without_a_port_in_use_the_fewest_of_our_pods_win_then_the_name() {
        let nodes = [
            node("a", "z1", true, 2),
            node("b", "z1", true, 1),
            node("c", "z1", true, 1),
        ];
        assert_eq!(
            choose(&placement(None, None), PORT, &small(), &nodes).unwrap(),
            "b"
        );
        assert_eq!(
            choose(&placement(Some("a"), None), PORT, &small(), &nodes).unwrap(),
            "a"
        );
    }

    #[test]
    fn only_the_requested_port_makes_a_node_busy() {
        let nodes = [holding(node("a", "z1", true, 0), 8080)];
        assert_eq!(
            choose(&placement(Some("a"), None), PORT, &small(), &nodes).unwrap(),
            "a"
        );
        let error = choose(&placement(Some("a"), None), 8080, &small(), &nodes).unwrap_err();
        assert_eq!(error.reason, PORT_IN_USE);
    }

    #[test]
    fn port_in_use_names_the_port_the_nodes_and_what_to_do() {
        let nodes = [
            holding(node("a", "z1", true, 0), PORT),
            holding(node("b", "z1", true, 0), PORT),
            node("c", "z1", false, 0),
        ];
        let error = choose(&placement(None, Some("z1")), PORT, &small(), &nodes).unwrap_err();
        assert_eq!(error.class, ErrorClass::QuotaExhausted);
        assert!(error.retry_after.is_some());
        for part in [
            "proxy port 3128",
            "(a, b)",
            "another proxy port",
            "another zone",
        ] {
            assert!(
                error.message.contains(part),
                "{part:?} missing: {}",
                error.message
            );
        }
        assert!(!error.message.contains(" c"), "{}", error.message);
        let pinned = choose(&placement(Some("a"), None), PORT, &small(), &nodes).unwrap_err();
        assert!(
            pinned.message.contains("another node"),
            "{}",
            pinned.message
        );
    }

    #[test]
    fn a_pod_holds_its_tcp_host_ports_until_it_terminates() {
        use k8s_openapi::api::core::v1::{Container, ContainerPort, PodSpec, PodStatus};
        let port = |number: i32, protocol: Option<&str>, host: Option<i32>| ContainerPort {
            container_port: number,
            host_port: host,
            protocol: protocol.map(Into::into),
            ..ContainerPort::default()
        };
        let pod = |phase: Option<&str>| Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    ports: Some(vec![
                        port(3128, Some("TCP"), Some(3128)),
                        port(53, Some("UDP"), Some(53)),
                        port(8080, None, None),
                        port(9000, None, Some(9001)),
                    ]),
                    ..Container::default()
                }],
                init_containers: Some(vec![Container {
                    ports: Some(vec![port(7000, None, Some(7000))]),
                    ..Container::default()
                }]),
                ..PodSpec::default()
            }),
            status: phase.map(|phase| PodStatus {
                phase: Some(phase.into()),
                ..PodStatus::default()
            }),
            ..Pod::default()
        };
        let held = BTreeSet::from([3128, 7000, 9001]);
        assert_eq!(host_ports(&pod(None)), held);
        assert_eq!(host_ports(&pod(Some("Pending"))), held);
        assert_eq!(host_ports(&pod(Some("Running"))), held);
        assert!(host_ports(&pod(Some("Succeeded"))).is_empty());
        assert!(host_ports(&pod(Some("Failed"))).is_empty());
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
        let error = choose(&placement(None, None), PORT, &small(), &[]).unwrap_err();
        assert_eq!(error.class, ErrorClass::QuotaExhausted);
        assert_eq!(error.reason, "CAPACITY_EXHAUSTED");
        assert!(error.retry_after.is_some());
    }
}
