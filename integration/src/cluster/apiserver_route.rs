//! How the node and its pods reach the apiserver, which listens on the host's loopback.
//!
//! 1. A relay listens on the apiserver's port on every address of the node's network
//!    namespace and forwards to the host's loopback: the kubelet and kube-proxy dial
//!    `127.0.0.1:<port>` from the admin kubeconfig as they would on a control-plane node,
//!    and the address and certificate are the ones the host's clients use.
//! 2. The `kubernetes` Service (ClusterIP 10.96.0.1, which the apiserver's certificate
//!    names and every pod is told through `KUBERNETES_SERVICE_HOST`) gets an
//!    EndpointSlice with the node's address and that port, as the apiserver's endpoint
//!    reconciler publishes its own address in a real cluster (the harness turns it off:
//!    its address is loopback). kube-proxy turns it into a DNAT rule, so a pod's
//!    request to the Service reaches the relay.

use anyhow::Context;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams};

use super::network::NODE_IP;
use crate::relay::LoopbackRelay;

/// The field manager of the EndpointSlice.
const MANAGER: &str = "egressproxy-test-cluster";

/// Relays the apiserver's `port` into `netns` (all addresses) on `runtime`.
pub(crate) fn relay(
    runtime: &tokio::runtime::Handle,
    netns: &str,
    port: u16,
) -> anyhow::Result<LoopbackRelay> {
    LoopbackRelay::start_on(
        runtime,
        netns,
        std::net::SocketAddr::from(([0, 0, 0, 0], port)),
    )
    .context("relay the apiserver into the node's network namespace")
}

/// Publishes the node's address and `port` as the `kubernetes` Service's endpoint.
pub(crate) async fn publish_endpoint(client: &kube::Client, port: u16) -> anyhow::Result<()> {
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": MANAGER,
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [NODE_IP.to_string()], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
    }))?;
    Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .patch(
            "kubernetes",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&slice),
        )
        .await
        .context("publish the kubernetes Service's EndpointSlice")?;
    Ok(())
}
