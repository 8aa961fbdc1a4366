//! A proxy pod read back as the contract's instance: a pure function, so Create, Get
//! and List tell the same story about the same pod.
//!
//! | pod | state | addresses |
//! |---|---|---|
//! | has a deletion timestamp | DELETING | none |
//! | phase Running, Ready | RUNNING | the node's IPv4 addresses (host network) |
//! | phase Running, not Ready | PROVISIONING | none |
//! | phase Pending, Unknown or none | PROVISIONING (a node out of touch is not a stopped proxy) | none |
//! | phase Succeeded or Failed | STOPPED (the operator replaces it) | none |
//! | phase Failed, reason `NodePorts` | STOPPED, the message naming the port in use on the node | none |
//!
//! The kubelet fails a pod with reason `NodePorts` when its port is taken on the node
//! by the time it admits it (the placement keeps the provider's own pods and every
//! declared host port apart, but not a second provider replica racing this one):
//! the message says so, as a port in use, not only that the pod failed.
//!
//! RUNNING needs an address: a Ready pod whose status holds no IPv4 host address stays
//! PROVISIONING. IPv6 host addresses are left out, since the provider does not declare
//! `CAPABILITY_IPV6`.

use std::net::IpAddr;

use egressproxy_provider::pb::{self, InstanceState};
use k8s_openapi::api::core::v1::Pod;

use crate::record::{RECORD_ANNOTATION, Recorded};

/// Why a pod could not be read as an instance.
#[derive(Debug, thiserror::Error)]
#[error("pod {pod} has no readable {RECORD_ANNOTATION} annotation: {problem}")]
pub struct Unreadable {
    /// The pod's name.
    pub pod: String,
    /// What is wrong with it.
    pub problem: String,
}

/// The instance recorded on `pod`.
pub fn recorded(pod: &Pod) -> Result<Recorded, Unreadable> {
    let pod_name = || pod.metadata.name.clone().unwrap_or_default();
    let text = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RECORD_ANNOTATION))
        .ok_or_else(|| Unreadable {
            pod: pod_name(),
            problem: "missing".into(),
        })?;
    serde_json::from_str(text).map_err(|error| Unreadable {
        pod: pod_name(),
        problem: error.to_string(),
    })
}

/// `pod` as GetInstance answers it.
pub fn instance(pod: &Pod) -> Result<pb::Instance, Unreadable> {
    let recorded = recorded(pod)?;
    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    let (state, state_message, addresses) = state(pod, recorded.proxy_port);
    let mut instance =
        pb::Instance {
            id: pod.metadata.name.clone().unwrap_or_default(),
            key: recorded.key,
            name: recorded.name,
            state_message,
            addresses,
            create_time: pod.metadata.creation_timestamp.as_ref().map(|time| {
                prost_types::Timestamp {
                    seconds: time.0.as_second(),
                    nanos: time.0.subsec_nanosecond(),
                }
            }),
            tags: recorded.tags.into_iter().collect(),
            placement: Some(recorded.requested.echo(node)),
            proxy_port: recorded.proxy_port,
            ..pb::Instance::default()
        };
    instance.set_state(state);
    Ok(instance)
}

fn state(pod: &Pod, proxy_port: u32) -> (InstanceState, String, Vec<pb::Address>) {
    if pod.metadata.deletion_timestamp.is_some() {
        return (
            InstanceState::Deleting,
            "the pod is terminating".into(),
            Vec::new(),
        );
    }
    let status = pod.status.clone().unwrap_or_default();
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let why = status
        .reason
        .iter()
        .chain(status.message.iter())
        .cloned()
        .collect::<Vec<_>>()
        .join(": ");
    match status.phase.as_deref() {
        Some("Running") => {
            let ready = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let addresses = node_addresses(&status);
            if !ready {
                (
                    InstanceState::Provisioning,
                    "waiting for the proxy to accept connections".into(),
                    Vec::new(),
                )
            } else if addresses.is_empty() {
                (
                    InstanceState::Provisioning,
                    "waiting for the node's IPv4 address".into(),
                    Vec::new(),
                )
            } else {
                (InstanceState::Running, String::new(), addresses)
            }
        }
        Some("Failed") if status.reason.as_deref() == Some("NodePorts") => {
            let message = format!(
                "the kubelet of node {node} rejected the pod: proxy port {proxy_port} is \
                 already in use there: use another proxy port or node ({why})"
            );
            (InstanceState::Stopped, bounded(message), Vec::new())
        }
        Some(phase @ ("Succeeded" | "Failed")) => {
            let message = format!("the pod is {phase} on node {node}");
            let message = if why.is_empty() {
                message
            } else {
                format!("{message}: {why}")
            };
            (InstanceState::Stopped, bounded(message), Vec::new())
        }
        _ => {
            let waiting = status
                .container_statuses
                .iter()
                .flatten()
                .filter_map(|c| c.state.as_ref()?.waiting.as_ref()?.reason.clone())
                .next();
            let message = match waiting {
                Some(reason) => format!("the proxy container on node {node} is waiting: {reason}"),
                None => format!("waiting for node {node} to start the pod"),
            };
            (InstanceState::Provisioning, bounded(message), Vec::new())
        }
    }
}

/// The node's IPv4 addresses a host-network pod reports.
fn node_addresses(status: &k8s_openapi::api::core::v1::PodStatus) -> Vec<pb::Address> {
    let mut texts: Vec<&str> = status
        .host_ips
        .iter()
        .flatten()
        .map(|h| h.ip.as_str())
        .collect();
    if texts.is_empty() {
        texts.extend(status.host_ip.as_deref());
    }
    let mut addresses: Vec<pb::Address> = texts
        .into_iter()
        .filter_map(|text| match text.parse::<IpAddr>() {
            Ok(IpAddr::V4(ip)) if !ip.is_unspecified() => Some(pb::Address {
                address: ip.to_string(),
                scope: pb::AddressScope::Internal.into(),
                family: pb::IpFamily::V4.into(),
            }),
            _ => None,
        })
        .collect();
    addresses.dedup();
    addresses.truncate(16);
    addresses
}

/// The contract bounds `state_message` to 1 KiB.
fn bounded(mut message: String) -> String {
    const MAX: usize = 1024;
    if message.len() > MAX {
        let mut end = MAX - 3;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{HostIP, PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::*;
    use crate::record::RequestedPlacement;

    fn pod(status: PodStatus, deleting: bool) -> Pod {
        let recorded = Recorded {
            key: "k".into(),
            name: "n".into(),
            tags: BTreeMap::from([("a".into(), "b".into())]),
            requested: RequestedPlacement {
                host: None,
                zone: None,
                machine_type: "small".into(),
                image: "squid".into(),
            },
            proxy_port: 3128,
        };
        Pod {
            metadata: ObjectMeta {
                name: Some("egress-proxy-x".into()),
                annotations: Some(BTreeMap::from([(
                    RECORD_ANNOTATION.into(),
                    serde_json::to_string(&recorded).unwrap(),
                )])),
                deletion_timestamp: deleting.then(|| Time(Default::default())),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                ..PodSpec::default()
            }),
            status: Some(status),
        }
    }

    fn running(ready: &str, ips: &[&str]) -> PodStatus {
        PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: ready.into(),
                ..PodCondition::default()
            }]),
            host_ips: Some(ips.iter().map(|ip| HostIP { ip: (*ip).into() }).collect()),
            ..PodStatus::default()
        }
    }

    /// As the kubelet fails a pod whose host port another pod on the node holds.
    fn rejected_for_its_port() -> PodStatus {
        PodStatus {
            phase: Some("Failed".into()),
            reason: Some("NodePorts".into()),
            message: Some("Pod was rejected: Predicate NodePorts failed".into()),
            ..PodStatus::default()
        }
    }

    #[test]
    fn a_pod_rejected_for_its_port_says_which_port_on_which_node() {
        let stopped = instance(&pod(rejected_for_its_port(), false)).unwrap();
        assert_eq!(stopped.state(), InstanceState::Stopped);
        for part in [
            "node node-a",
            "proxy port 3128",
            "already in use",
            "another proxy port",
        ] {
            assert!(
                stopped.state_message.contains(part),
                "{part:?} missing: {}",
                stopped.state_message
            );
        }
        let failed = instance(&pod(phase("Failed"), false)).unwrap();
        assert!(
            !failed.state_message.contains("in use"),
            "{}",
            failed.state_message
        );
    }

    fn phase(phase: &str) -> PodStatus {
        PodStatus {
            phase: Some(phase.into()),
            ..PodStatus::default()
        }
    }

    /// The module doc's table, row for row.
    #[test]
    fn states_follow_the_table() {
        let rows = [
            (
                pod(running("True", &["192.0.2.7"]), true),
                InstanceState::Deleting,
                0,
            ),
            (
                pod(running("True", &["192.0.2.7", "2001:db8::7"]), false),
                InstanceState::Running,
                1,
            ),
            (
                pod(running("False", &["192.0.2.7"]), false),
                InstanceState::Provisioning,
                0,
            ),
            (
                pod(running("True", &["2001:db8::7"]), false),
                InstanceState::Provisioning,
                0,
            ),
            (pod(phase("Pending"), false), InstanceState::Provisioning, 0),
            (pod(phase("Unknown"), false), InstanceState::Provisioning, 0),
            (
                pod(PodStatus::default(), false),
                InstanceState::Provisioning,
                0,
            ),
            (pod(phase("Succeeded"), false), InstanceState::Stopped, 0),
            (pod(phase("Failed"), false), InstanceState::Stopped, 0),
            (
                pod(rejected_for_its_port(), false),
                InstanceState::Stopped,
                0,
            ),
        ];
        for (pod, state, addresses) in rows {
            let instance = instance(&pod).unwrap();
            assert_eq!(instance.state(), state, "{:?}", pod.status);
            assert_eq!(instance.addresses.len(), addresses, "{:?}", pod.status);
        }
    }

    #[test]
    fn the_record_and_the_chosen_node_are_echoed() {
        let instance = instance(&pod(phase("Pending"), false)).unwrap();
        assert_eq!(instance.key, "k");
        assert_eq!(instance.tags["a"], "b");
        assert_eq!(instance.proxy_port, 3128);
        assert_eq!(
            instance.placement.unwrap().location,
            Some(pb::placement::Location::Host("node-a".into()))
        );
    }

    #[test]
    fn a_pod_without_a_record_is_unreadable() {
        let mut pod = pod(phase("Pending"), false);
        pod.metadata.annotations = None;
        assert!(instance(&pod).is_err());
    }
}
