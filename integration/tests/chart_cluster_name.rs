//! No shared default cluster name: installed without `operator.clusterName`, the operator
//! tags its instances with the UID of the cluster's kube-system namespace (unique per
//! cluster, so two clusters on one provider never take each other's VMs for orphans),
//! may read that one namespace and nothing else of its kind, and NOTES says which value
//! it uses.

mod chart_support;

use chart_support::{create_proxy, wait_ready};
use egressproxy_integration::chart_pod::ChartPod;
use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;

const OPERATOR: &str = "cn-egressproxy-operator";

#[tokio::test]
async fn without_a_cluster_name_instances_carry_the_cluster_s_own_identity() {
    let env = KubeTestEnv::new("chart-cluster-name").await.unwrap();
    let ns = env.namespace.as_str();
    let kubeconfig = env.apiserver().kubeconfig_path();
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let endpoint = format!(
        "operator.providers.reference.endpoint={}",
        provider.endpoint()
    );
    // Its own namespace only, so the operator leaves other tests' Proxies alone.
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    let helm = Helm::new(kubeconfig).unwrap();
    let notes = helm.install_notes("cn", ns, &[]).unwrap();
    helm.install("cn", ns, &[], &[&endpoint, &watch]).unwrap();

    let uid = Api::<Namespace>::all(env.client.clone())
        .get("kube-system")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    assert!(
        notes.contains("egressproxy.dev/cluster=<UID of this cluster's kube-system")
            && notes.contains(&uid),
        "NOTES name the value:\n{notes}"
    );

    let kubectl = Kubectl::new(kubeconfig);
    let sa = format!("system:serviceaccount:{ns}:{OPERATOR}");
    let can = |question: &[&str]| kubectl.can_i(&sa, question).unwrap();
    assert!(can(&["get", "namespaces/kube-system"]));
    assert!(!can(&["get", "namespaces/default"]));
    assert!(!can(&["list", "namespaces"]));

    let _operator = ChartPod::start(&env, ns, OPERATOR, "egressproxy-operator", Some(OPERATOR))
        .await
        .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    create_proxy(&env, ns, "tagged", listener.local_addr().unwrap().port()).await;
    wait_ready(&env, ns, "tagged").await;

    let mut client = connect_lazy(&ClientOptions::new(provider.endpoint())).unwrap();
    let instances = client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .instances;
    assert_eq!(instances.len(), 1, "{instances:?}");
    assert_eq!(
        instances[0].tags.get("egressproxy.dev/cluster"),
        Some(&uid),
        "tagged with kube-system's UID: {:?}",
        instances[0].tags
    );
}
