//! The chart installed by the real `helm` into the real kube-apiserver, then used the way
//! a cluster would use it. The apiserver runs no pods, so the operator binary runs here,
//! out of cluster, as the chart's ServiceAccount (a token the apiserver issued) with the
//! args of the chart's Deployment and the providers config of the chart's ConfigMap:
//!
//! 1. `helm install` (all namespaces: a ClusterRole); `kubectl auth can-i --as` the
//!    operator's ServiceAccount for what it needs and what it must not do.
//! 2. The operator reconciles a Proxy whose cloud-init is in a Secret against the
//!    reference provider to Ready.
//! 3. `helm upgrade` to two watched namespaces and two replicas: the permissions shrink to
//!    a Role in each (no Secrets elsewhere, no cluster-wide Proxies), a PDB appears, and the
//!    operator brings a Proxy in each watched namespace to Ready with them and leaves one
//!    in a third namespace alone.
//! 4. `helm uninstall --no-hooks` (uninstalling anyway, past the hook that refuses while
//!    Proxies exist: `chart_lifecycle.rs`): the chart's objects go, the CRD (`crds.keep`)
//!    and the Proxies stay; installing the release again adopts the kept CRD.
//!
//! One test function: the release owns the cluster-wide CRD, which only one release in
//! this apiserver can own. `chart_crds.rs` covers `crds.keep=false` in its own process.

mod chart_support;

use chart_support::{create_proxy, proxy_api, wait_ready};
use egressproxy_integration::chart_pod::ChartPod;
use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};

const RELEASE: &str = "ep";
const OPERATOR: &str = "ep-egressproxy-operator";

#[tokio::test]
async fn install_reconcile_upgrade_and_uninstall() {
    let env = KubeTestEnv::new("chart-release").await.unwrap();
    let proxies_env = KubeTestEnv::new("chart-proxies").await.unwrap();
    let more_proxies_env = KubeTestEnv::new("chart-more-proxies").await.unwrap();
    let other_env = KubeTestEnv::new("chart-other").await.unwrap();
    let (release_ns, proxies_ns, more_proxies_ns, other_ns) = (
        env.namespace.as_str(),
        proxies_env.namespace.as_str(),
        more_proxies_env.namespace.as_str(),
        other_env.namespace.as_str(),
    );
    let kubeconfig = env.apiserver().kubeconfig_path();
    let helm = Helm::new(kubeconfig).unwrap();
    let kubectl = Kubectl::new(kubeconfig);
    let provider = ReferenceProvider::start(&["--provisioning-delay", "200ms"]).unwrap();
    let sa = format!("system:serviceaccount:{release_ns}:{OPERATOR}");
    let can = |question: &[&str]| kubectl.can_i(&sa, question).unwrap();

    // 1. Install for all namespaces.
    let endpoint = format!(
        "operator.providers.reference.endpoint={}",
        provider.endpoint()
    );
    let cluster = format!("operator.clusterName=chart-{release_ns}");
    helm.install(RELEASE, release_ns, &[], &[&endpoint, &cluster])
        .unwrap();
    let proxies = "proxies.egressproxy.dev";
    assert!(can(&["list", proxies, "-A"]));
    assert!(can(&["watch", proxies, "-A"]));
    assert!(can(&["patch", proxies, "-n", proxies_ns]));
    assert!(can(&[
        "patch",
        proxies,
        "--subresource=status",
        "-n",
        proxies_ns
    ]));
    assert!(can(&["get", "secrets", "-n", proxies_ns]));
    assert!(can(&["create", "events.events.k8s.io", "-n", proxies_ns]));
    assert_service_verbs(&can, proxies_ns);
    assert!(can(&[
        "update",
        "leases.coordination.k8s.io/ep-egressproxy-operator",
        "-n",
        release_ns
    ]));
    assert!(!can(&[
        "update",
        "leases.coordination.k8s.io/someone-elses",
        "-n",
        release_ns
    ]));
    // It creates and deletes the members of ProxyPools; it never updates a Proxy.
    assert!(can(&["create", proxies, "-n", proxies_ns]));
    assert!(can(&["delete", proxies, "-n", proxies_ns]));
    assert!(!can(&["update", proxies, "-n", proxies_ns]));
    let pools = "proxypools.egressproxy.dev";
    assert!(can(&["watch", pools, "-A"]));
    assert!(can(&[
        "patch",
        pools,
        "--subresource=status",
        "-n",
        proxies_ns
    ]));
    // It patches a pool only for the finalizer that guards its spares.
    assert!(can(&["patch", pools, "-n", proxies_ns]));
    assert!(
        !can(&["update", pools, "-n", proxies_ns]),
        "pools belong to their users"
    );
    assert!(!can(&["delete", pools, "-n", proxies_ns]));
    // It watches Secrets' metadata, so that a cloud-init Secret created later is used
    // at once: RBAC cannot grant metadata alone.
    assert!(can(&["watch", "secrets", "-n", proxies_ns]));
    assert!(!can(&["create", "secrets", "-n", proxies_ns]));
    assert!(!can(&[
        "create",
        "leases.coordination.k8s.io",
        "-n",
        proxies_ns
    ]));

    // 2. The operator, as the chart runs it, brings a Proxy to Ready.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    {
        let _operator = ChartPod::start(
            &env,
            release_ns,
            OPERATOR,
            "egressproxy-operator",
            Some(OPERATOR),
        )
        .await
        .unwrap();
        create_proxy(&env, proxies_ns, "first", port).await;
        wait_ready(&env, proxies_ns, "first").await;
    }
    // It could write its Proxy's Service with the chart's account (the Service is
    // written from the first reconcile on, before the Proxy is Ready).
    let services: Api<k8s_openapi::api::core::v1::Service> =
        Api::namespaced(env.client.clone(), proxies_ns);
    assert!(services.get_opt("first").await.unwrap().is_some());
    // Its Events were allowed too (a refused Event is only a log line in the operator).
    let events: Api<Event> = Api::namespaced(env.client.clone(), proxies_ns);
    let reasons: Vec<String> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|event| event.reason)
        .collect();
    assert!(
        reasons.iter().any(|reason| reason == "Created"),
        "{reasons:?}"
    );

    // 3. Upgrade to two watched namespaces and two replicas.
    let watch = format!("operator.watchNamespaces={{{proxies_ns},{more_proxies_ns}}}");
    helm.upgrade(
        RELEASE,
        release_ns,
        &[],
        &[&endpoint, &cluster, &watch, "operator.replicas=2"],
    )
    .unwrap();
    for watched in [proxies_ns, more_proxies_ns] {
        assert!(can(&["list", proxies, "-n", watched]));
        assert!(can(&["watch", proxies, "-n", watched]));
        assert!(can(&[
            "patch",
            proxies,
            "--subresource=status",
            "-n",
            watched
        ]));
        assert!(can(&["get", "secrets", "-n", watched]));
        assert!(can(&["create", "events.events.k8s.io", "-n", watched]));
        assert!(can(&["delete", proxies, "-n", watched]), "a pool's members");
        assert!(can(&["watch", "proxypools.egressproxy.dev", "-n", watched]));
        assert_service_verbs(&can, watched);
    }
    assert!(!can(&["delete", proxies, "-n", other_ns]));
    assert!(!can(&["list", "services", "-n", other_ns]));
    assert!(!can(&[
        "patch",
        "endpointslices.discovery.k8s.io",
        "-n",
        other_ns
    ]));
    assert!(!can(&["list", proxies, "-n", other_ns]));
    assert!(
        !can(&["list", proxies, "-A"]),
        "a Role now, not a ClusterRole"
    );
    assert!(
        !can(&["get", "secrets", "-n", other_ns]),
        "no Secrets outside the watched namespace"
    );
    assert!(!can(&["get", "secrets", "-n", release_ns]));
    let cluster_roles: Api<ClusterRole> = Api::all(env.client.clone());
    assert!(cluster_roles.get_opt(OPERATOR).await.unwrap().is_none());
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(env.client.clone(), release_ns);
    let budget = budgets.get(OPERATOR).await.unwrap();
    assert_eq!(
        budget.spec.unwrap().min_available,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), release_ns);
    assert_eq!(
        deployments.get(OPERATOR).await.unwrap().spec.replicas,
        Some(2)
    );
    {
        let _operator = ChartPod::start(
            &env,
            release_ns,
            OPERATOR,
            "egressproxy-operator",
            Some(OPERATOR),
        )
        .await
        .unwrap();
        create_proxy(&env, other_ns, "unwatched", port).await;
        create_proxy(&env, proxies_ns, "second", port).await;
        create_proxy(&env, more_proxies_ns, "third", port).await;
        wait_ready(&env, proxies_ns, "second").await;
        wait_ready(&env, more_proxies_ns, "third").await;
    }
    let unwatched = proxy_api(&env.client, other_ns)
        .get("unwatched")
        .await
        .unwrap();
    assert!(
        unwatched.metadata.finalizers.is_none(),
        "a Proxy outside the watched namespaces is not the operator's"
    );

    // 4. Uninstall: the CRD and the Proxies stay (crds.keep defaults to true).
    helm.uninstall_without_hooks(RELEASE, release_ns).unwrap();
    assert!(deployments.get_opt(OPERATOR).await.unwrap().is_none());
    let crds: Api<CustomResourceDefinition> = Api::all(env.client.clone());
    assert!(
        crds.get_opt("proxies.egressproxy.dev")
            .await
            .unwrap()
            .is_some(),
        "crds.keep: the CRD outlives the release"
    );
    let left = proxy_api(&env.client, proxies_ns)
        .get("first")
        .await
        .unwrap();
    assert!(left.metadata.deletion_timestamp.is_none());
    // The kept CRD still carries the release's ownership: the same release adopts it.
    helm.install(RELEASE, release_ns, &[], &[&endpoint, &cluster])
        .unwrap();
    drop(listener);
}

/// The operator may do with Services and EndpointSlices in `namespace` exactly what it
/// does with its Proxies' own: read, watch, apply (create and patch) and delete, never
/// update.
fn assert_service_verbs(can: &impl Fn(&[&str]) -> bool, namespace: &str) {
    for resource in ["services", "endpointslices.discovery.k8s.io"] {
        for verb in ["list", "watch", "create", "patch", "delete"] {
            assert!(
                can(&[verb, resource, "-n", namespace]),
                "{verb} {resource} in {namespace}"
            );
        }
        assert!(
            !can(&["update", resource, "-n", namespace]),
            "update {resource} in {namespace}"
        );
    }
    assert!(can(&["get", "services", "-n", namespace]));
    assert!(!can(&[
        "get",
        "endpointslices.discovery.k8s.io",
        "-n",
        namespace
    ]));
}
