//! Waiting for pods and Deployments, by watching them.

use std::time::Duration;

use anyhow::Context;
use futures::TryStreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::runtime::{WatchStreamExt, watcher};

/// Waits until pod `name` of `namespace` has ended (`Succeeded` or `Failed`), or `within`
/// has passed; returns its phase then (`Pending` or `Running` when it has not ended).
pub async fn phase_when_finished(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    within: Duration,
) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let _ = tokio::time::timeout(
        within,
        await_condition(pods.clone(), name, |pod: Option<&Pod>| {
            pod.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|phase| phase == "Succeeded" || phase == "Failed")
        }),
    )
    .await;
    let pod = pods
        .get(name)
        .await
        .with_context(|| format!("read pod {namespace}/{name}"))?;
    Ok(pod.status.and_then(|s| s.phase).unwrap_or_default())
}

/// Waits until Deployment `name` of `namespace` has an available replica (one whose
/// readiness probe passed); false when `within` passes first.
pub async fn deployment_available(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    within: Duration,
) -> anyhow::Result<bool> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let available = tokio::time::timeout(
        within,
        await_condition(deployments, name, |d: Option<&Deployment>| {
            d.and_then(|d| d.status.as_ref())
                .and_then(|s| s.available_replicas)
                .is_some_and(|n| n >= 1)
        }),
    )
    .await;
    match available {
        Ok(Ok(_)) => Ok(true),
        Ok(Err(err)) => Err(anyhow::Error::new(err).context(format!("watch Deployment {name}"))),
        Err(_) => Ok(false),
    }
}

/// Waits until an EndpointSlice of Service `service` lists `address` as ready: the
/// Service then routes to it once kube-proxy has applied the slice; false when `within`
/// passes first.
pub async fn service_lists_ready(
    client: &kube::Client,
    namespace: &str,
    service: &str,
    address: &str,
    within: Duration,
) -> anyhow::Result<bool> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), namespace);
    let selector = format!("kubernetes.io/service-name={service}");
    let lists = |slice: &EndpointSlice| {
        slice.endpoints.iter().flatten().any(|endpoint| {
            endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(true)
                && endpoint.addresses.iter().any(|a| a == address)
        })
    };
    let listing = watcher(slices, watcher::Config::default().labels(&selector))
        .default_backoff()
        .applied_objects()
        .try_filter(|slice| std::future::ready(lists(slice)));
    let found = tokio::time::timeout(within, std::pin::pin!(listing).try_next()).await;
    match found {
        Ok(Ok(Some(_))) => Ok(true),
        Ok(Ok(None)) => anyhow::bail!("the watch of {service}'s EndpointSlices ended"),
        Ok(Err(err)) => {
            Err(anyhow::Error::new(err).context(format!("watch {service}'s EndpointSlices")))
        }
        Err(_) => Ok(false),
    }
}

/// Waits until every pod of `namespace` matching `selector` (a label selector) is gone.
pub async fn gone(
    client: &kube::Client,
    namespace: &str,
    selector: &str,
    within: Duration,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let listed = pods
        .list(&ListParams::default().labels(selector))
        .await
        .with_context(|| format!("list the pods of {namespace} with {selector}"))?;
    for pod in listed.items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        tokio::time::timeout(
            within,
            await_condition(pods.clone(), &name, conditions::is_deleted(&uid)),
        )
        .await
        .with_context(|| format!("pod {namespace}/{name} was still there after {within:?}"))?
        .with_context(|| format!("watch pod {name}"))?;
    }
    Ok(())
}

/// A Pod named `name` that runs `script` once (`sh -c`) in the toolbox image as uid
/// 65532, with `env`: a JSON manifest for `kubectl apply -f -`.
pub fn toolbox_pod(name: &str, env: &[(&str, &str)], script: &str) -> anyhow::Result<String> {
    let image = crate::tools::image_archive(super::TOOLBOX_IMAGE)?.name;
    let env: Vec<serde_json::Value> = env
        .iter()
        .map(|(name, value)| serde_json::json!({"name": name, "value": value}))
        .collect();
    Ok(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
            "containers": [{
                "name": name,
                "image": image,
                "imagePullPolicy": "Never",
                "env": env,
                "command": ["sh", "-c", script],
            }],
        },
    })
    .to_string())
}
