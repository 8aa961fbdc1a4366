//! CoreDNS as the cluster's DNS add-on: a Deployment in `kube-system` behind the
//! `kube-dns` Service at [`DNS_SERVICE_IP`], the address the kubelet gives every pod as
//! its resolver (`coredns.yaml`). It reaches the apiserver as any pod does, through the
//! `kubernetes` Service, so its readiness also proves that path.

use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::Api;
use kube::runtime::wait::await_condition;

use super::network::DNS_SERVICE_IP;
use crate::helm::Kubectl;

const MANIFEST: &str = include_str!("coredns.yaml");
/// A cold start schedules, starts and probes one pod.
const AVAILABLE_WITHIN: Duration = Duration::from_secs(120);

/// Applies the add-on with `image` and waits until its Deployment is available.
pub(crate) async fn deploy(
    kubectl: &Kubectl,
    client: &kube::Client,
    image: &str,
) -> anyhow::Result<()> {
    let manifest = MANIFEST
        .replace("IMAGE", image)
        .replace("DNS_SERVICE_IP", &DNS_SERVICE_IP.to_string());
    kubectl
        .run(
            &[
                "apply",
                "--server-side",
                "--field-manager=egressproxy-test-cluster",
                "-f",
                "-",
            ],
            Some(&manifest),
        )
        .context("apply CoreDNS")?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "kube-system");
    tokio::time::timeout(
        AVAILABLE_WITHIN,
        await_condition(deployments, "coredns", |deployment: Option<&Deployment>| {
            deployment
                .and_then(|d| d.status.as_ref())
                .and_then(|s| s.available_replicas)
                .is_some_and(|n| n >= 1)
        }),
    )
    .await
    .with_context(|| format!("CoreDNS was not available within {AVAILABLE_WITHIN:?}"))?
    .context("watch the CoreDNS Deployment")?;
    Ok(())
}
