//! `crds.enabled` and `crds.keep` against the real kube-apiserver: with `keep: false` the
//! CRD goes with the release; with `enabled: false` the release does not touch it. In a
//! process (so an apiserver) of its own, because the CRD is cluster-wide and
//! `chart_install.rs` installs it with its release.

use std::time::Duration;

use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::KubeTestEnv;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use kube::runtime::wait::{await_condition, conditions};

const CRD: &str = "proxies.egressproxy.dev";

#[tokio::test]
async fn the_crd_follows_crds_enabled_and_crds_keep() {
    let env = KubeTestEnv::new("chart-crds").await.unwrap();
    let ns = env.namespace.as_str();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(env.client.clone());

    helm.install("temporary", ns, &[], &["crds.keep=false"])
        .unwrap();
    let crd = crds.get(CRD).await.unwrap();
    let labels = crd.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("app.kubernetes.io/instance").map(String::as_str),
        Some("temporary")
    );
    assert!(
        !crd.metadata
            .annotations
            .clone()
            .unwrap_or_default()
            .contains_key("helm.sh/resource-policy"),
        "keep=false must not ask Helm to keep the CRD"
    );
    let uid = crd.metadata.uid.clone().unwrap();
    helm.uninstall_without_hooks("temporary", ns).unwrap();
    // The apiserver removes the CRD once its finalizer has cleaned up the instances (none
    // here). That finalizer retries with a growing backoff when the CRD's storage is not
    // ready yet, which a loaded machine has been seen to stretch past a minute; the
    // failure names the CRD's state so that a CRD that really stays is told apart.
    let deleted = tokio::time::timeout(
        Duration::from_secs(180),
        await_condition(crds.clone(), CRD, conditions::is_deleted(&uid)),
    )
    .await;
    if deleted.is_err() {
        let left = crds.get_opt(CRD).await.unwrap().map(|crd| {
            let conditions = crd.status.map(|s| s.conditions.unwrap_or_default());
            (
                crd.metadata.deletion_timestamp,
                crd.metadata.finalizers,
                conditions,
            )
        });
        panic!(
            "the CRD outlived a release with crds.keep=false: (deletion, finalizers, conditions) = {left:?}"
        );
    }
    deleted.unwrap().unwrap();

    helm.install("without-crd", ns, &[], &["crds.enabled=false"])
        .unwrap();
    assert!(
        crds.get_opt(CRD).await.unwrap().is_none(),
        "crds.enabled=false installed the CRD"
    );
    helm.uninstall_without_hooks("without-crd", ns).unwrap();
}
