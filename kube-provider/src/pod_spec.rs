//! The proxy pod of an instance: a pure function of the configuration, the chosen node
//! and what the instance records.
//!
//! - **Host network**, so the proxy's traffic leaves from the node's own address, the
//!   one partners allow-list, and the instance's address is the node's.
//! - **Bound to its node** (`nodeName`): the provider chose it (see `placement`).
//! - **Resources** from the machine type; the proxy port as an environment variable of
//!   the image's choosing and as the container port with the same host port (TCP), so
//!   the port is declared as the node's; a TCP readiness probe on it, so RUNNING means
//!   the proxy accepts connections.
//! - **No service account token**: the proxy never talks to the apiserver.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, Pod, PodSpec, Probe, TCPSocketAction,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::config::{Config, Image, MachineType};
use crate::record::{MANAGED_BY, MANAGED_BY_LABEL, RECORD_ANNOTATION, Recorded, pod_name};

/// The proxy container's name.
pub const CONTAINER_NAME: &str = "proxy";

/// The pod for `recorded` on `node`.
pub fn proxy_pod(
    config: &Config,
    recorded: &Recorded,
    node: &str,
    image: &Image,
    machine_type: &MachineType,
) -> Pod {
    let record = serde_json::to_string(recorded).expect("a record always serializes");
    let port = i32::try_from(recorded.proxy_port).expect("validated: a port is at most 65535");
    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&recorded.key)),
            namespace: Some(config.namespace.clone()),
            labels: Some(BTreeMap::from([(
                MANAGED_BY_LABEL.to_owned(),
                MANAGED_BY.to_owned(),
            )])),
            annotations: Some(BTreeMap::from([(RECORD_ANNOTATION.to_owned(), record)])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_owned()),
            host_network: Some(true),
            dns_policy: Some("ClusterFirstWithHostNet".into()),
            automount_service_account_token: Some(false),
            tolerations: (!config.tolerations.is_empty()).then(|| config.tolerations.clone()),
            containers: vec![Container {
                name: CONTAINER_NAME.into(),
                image: Some(image.image.clone()),
                image_pull_policy: image.pull_policy.clone(),
                command: image.command.clone(),
                args: image.args.clone(),
                env: Some(vec![EnvVar {
                    name: image.port_env.clone(),
                    value: Some(recorded.proxy_port.to_string()),
                    ..EnvVar::default()
                }]),
                ports: Some(vec![ContainerPort {
                    name: Some("proxy".into()),
                    container_port: port,
                    // Host network makes the port the node's; declaring it so lets the
                    // kubelet refuse a second pod on it at admission, and other
                    // schedulers and tools see it taken.
                    host_port: Some(port),
                    protocol: Some("TCP".into()),
                    ..ContainerPort::default()
                }]),
                readiness_probe: Some(Probe {
                    tcp_socket: Some(TCPSocketAction {
                        port: IntOrString::Int(port),
                        ..TCPSocketAction::default()
                    }),
                    period_seconds: Some(5),
                    ..Probe::default()
                }),
                resources: Some(machine_type.resources()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RequestedPlacement;

    #[test]
    fn the_pod_runs_on_the_node_with_host_network_its_host_port_and_the_machine_type() {
        let config = Config::parse(
            "namespace: egress\nmachine_types: {small: {requests: {cpu: 100m}, limits: {memory: 64Mi}}}\n\
             images: {squid: {image: 'localhost/squid:6', port_env: SQUID_PORT}}\n",
        )
        .unwrap();
        let recorded = Recorded {
            key: "uid-0".into(),
            name: "ns/proxy".into(),
            tags: BTreeMap::new(),
            requested: RequestedPlacement {
                host: None,
                zone: None,
                machine_type: "small".into(),
                image: "squid".into(),
            },
            proxy_port: 3128,
        };
        let pod = proxy_pod(
            &config,
            &recorded,
            "node-a",
            &config.images["squid"],
            &config.machine_types["small"],
        );
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.host_network, Some(true));
        let container = &spec.containers[0];
        let env = &container.env.as_ref().unwrap()[0];
        assert_eq!(
            (env.name.as_str(), env.value.as_deref()),
            ("SQUID_PORT", Some("3128"))
        );
        let port = &container.ports.as_ref().unwrap()[0];
        assert_eq!(
            (
                port.container_port,
                port.host_port,
                port.protocol.as_deref()
            ),
            (3128, Some(3128), Some("TCP"))
        );
        let resources = container.resources.as_ref().unwrap();
        assert!(resources.requests.as_ref().unwrap().contains_key("cpu"));
        assert!(resources.limits.as_ref().unwrap().contains_key("memory"));
        assert_eq!(pod.metadata.name.unwrap(), pod_name("uid-0"));
    }
}
