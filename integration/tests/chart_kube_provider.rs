//! kube-provider installed by the chart (`providers:` in values, no kvm-agent) into the
//! single-node cluster from real parts (`integration::cluster`), and used as users use
//! it:
//!
//! 1. `helm install` with one `type: kube` provider: the operator's and kube-provider's
//!    pods run from the project's images (`make images`) and become Ready.
//! 2. A Proxy with `provider: kube` becomes Ready: its instance is a pod of the project's
//!    squid image on the labelled egress node, at the node's address, and the operator's
//!    Http health check fetches a web pod through it.
//! 3. A pod of another namespace fetches the web pod through the proxy: it gets the page,
//!    and squid's access log (the proxy pod's output) has the request.
//! 4. Deleting the Proxy removes the proxy pod, and the Proxy goes.
//!
//! Needs root, the packages of `integration/tools/install-system-packages.sh`, and what
//! `make setup` and `make images` build (kube-harness, kube-node, the cluster's and the
//! project's images). One test: the process has one cluster.

use std::time::{Duration, Instant};

use egressproxy_integration::cluster::network::NODE_IP;
use egressproxy_integration::cluster::{Cluster, ClusterOptions, pods};
use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::KubeTestEnv;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::runtime::wait::{await_condition, conditions};

const RELEASE: &str = "kp";
const OPERATOR: &str = "kp-egressproxy-operator";
const PROVIDER: &str = "kp-egressproxy-kube-provider";
/// The label kube-provider puts on its proxy pods.
const PROXY_PODS: &str = "app.kubernetes.io/managed-by=kube.egressproxy.dev";
const PROXY_PORT: u16 = 3128;
/// The project's images (`make images`) the cluster imports.
const PROJECT_IMAGES: [&str; 3] = ["operator", "kube-provider", "squid-proxy"];
/// Images are local and the pods small; the Proxy needs a pod start and one check.
const WITHIN: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread")]
async fn a_kube_proxy_installed_by_the_chart_proxies_another_namespace() {
    let started = Instant::now();
    let options = ClusterOptions {
        images: PROJECT_IMAGES.iter().map(|s| (*s).to_owned()).collect(),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(&options).await.unwrap();
    let cluster_up = started.elapsed();
    let release = KubeTestEnv::new("kp-release").await.unwrap();
    let users = KubeTestEnv::new("kp-users").await.unwrap();
    let kubectl = Kubectl::new(cluster.kubeconfig());
    label_egress_node(&release.client, cluster.node_name()).await;

    // 1. The chart with kube-provider instead of the kvm-agent.
    let dir = tempfile::tempdir().unwrap();
    let values = dir.path().join("values.yaml");
    std::fs::write(
        &values,
        "operator:\n  clusterName: kube-provider-chart\n\
         providers:\n  - {name: kube, type: kube, verbosity: 1}\n",
    )
    .unwrap();
    let helm = Helm::new(cluster.kubeconfig()).unwrap();
    helm.install(RELEASE, &release.namespace, &[&values], &[])
        .unwrap();
    for deployment in [PROVIDER, OPERATOR] {
        let available =
            pods::deployment_available(&release.client, &release.namespace, deployment, WITHIN)
                .await
                .unwrap();
        assert!(
            available,
            "{deployment} had no available replica within {WITHIN:?}\n{}\n{}",
            cluster.deployment_logs(&release.namespace, deployment),
            cluster.log_tails()
        );
    }

    // 2. A web pod to fetch, and a Proxy whose health check fetches it through squid.
    kubectl
        .run(
            &["apply", "-n", &users.namespace, "-f", "-"],
            Some(&web_pod_manifest()),
        )
        .unwrap();
    let user_pods: Api<Pod> = users.namespaced();
    let web = tokio::time::timeout(WITHIN, await_condition(user_pods.clone(), "web", is_ready))
        .await
        .unwrap_or_else(|_| panic!("the web pod was not Ready\n{}", cluster.log_tails()))
        .unwrap()
        .unwrap();
    let web_ip = web.status.unwrap().pod_ip.unwrap();
    let url = format!("http://{web_ip}:8080/");
    let proxies = proxy_api(&users.client, &users.namespace);
    proxies
        .create(&PostParams::default(), &proxy(&url))
        .await
        .unwrap();
    let ready = tokio::time::timeout(
        WITHIN,
        await_condition(proxies.clone(), "egress", is_proxy_ready),
    )
    .await;
    let proxy_pods: Api<Pod> = release.namespaced();
    let listed = proxy_pods
        .list(&ListParams::default().labels(PROXY_PODS))
        .await
        .unwrap();
    let report = || {
        format!(
            "--- operator\n{}\n--- kube-provider\n{}\n{}",
            cluster.deployment_logs(&release.namespace, OPERATOR),
            cluster.deployment_logs(&release.namespace, PROVIDER),
            cluster.log_tails()
        )
    };
    let proxy = match ready {
        Ok(Ok(Some(proxy))) => proxy,
        other => panic!(
            "the Proxy was not Ready within {WITHIN:?}: {other:?}\n{:#?}\n{}",
            proxies.get("egress").await.map(|p| p.data),
            report()
        ),
    };
    assert_eq!(listed.items.len(), 1, "one proxy pod: {listed:?}");
    let proxy_pod = listed.items[0].metadata.name.clone().unwrap();
    let status = &proxy.data["status"];
    assert_eq!(
        status["addresses"][0]["address"].as_str(),
        Some(NODE_IP.to_string().as_str()),
        "the proxy's address is the egress node's: {status:#}"
    );

    // 3. A pod of another namespace than the proxy pod's, through the proxy.
    let proxy_url = format!("http://{NODE_IP}:{PROXY_PORT}");
    // A page the operator's health check never asks for, so squid's log line for it can
    // only be the client's.
    let page = format!("{url}client.html");
    let client = pods::toolbox_pod(
        "client",
        &[("http_proxy", proxy_url.as_str())],
        &format!("wget -qO- {page}"),
    )
    .unwrap();
    kubectl
        .run(&["apply", "-n", &users.namespace, "-f", "-"], Some(&client))
        .unwrap();
    let phase = pods::phase_when_finished(&users.client, &users.namespace, "client", WITHIN)
        .await
        .unwrap();
    let output = cluster.pod_logs(&users.namespace, "client");
    assert_eq!(
        phase,
        "Succeeded",
        "the client's output:\n{output}\n{}",
        report()
    );
    assert!(output.contains("client-page"), "the client got: {output}");
    let access_log = cluster.pod_logs(&release.namespace, &proxy_pod);
    assert!(
        access_log
            .lines()
            .any(|line| line.contains("TCP_MISS/200") && line.contains(&format!("GET {page}"))),
        "squid's access log has no GET {page}:\n{access_log}"
    );

    // 4. Deleting the Proxy removes its pod.
    proxies
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    pods::gone(&release.client, &release.namespace, PROXY_PODS, WITHIN)
        .await
        .unwrap_or_else(|err| panic!("{err:#}\n{}", report()));
    let uid = proxy.metadata.uid.clone().unwrap();
    tokio::time::timeout(
        WITHIN,
        await_condition(proxies, "egress", conditions::is_deleted(&uid)),
    )
    .await
    .unwrap_or_else(|_| panic!("the Proxy kept its finalizer\n{}", report()))
    .unwrap();
    eprintln!(
        "timing: cluster up in {cluster_up:?}, whole test {:?}",
        started.elapsed()
    );
}

/// Makes the kubelet's node an egress node (the chart's default node selector), in zone z1.
async fn label_egress_node(client: &kube::Client, node: &str) {
    let labels = serde_json::json!({"metadata": {"labels": {
        "egressproxy.dev/egress": "true",
        "topology.kubernetes.io/zone": "z1",
    }}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&labels))
        .await
        .unwrap();
}

fn proxy_api(client: &kube::Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("egressproxy.dev", "v1alpha1", "Proxy");
    Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk))
}

/// A Proxy of the kube provider, no cloud-init (pods have none), checked by fetching
/// `url` through it.
fn proxy(url: &str) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "egress"},
        "spec": {
            "provider": "kube",
            "placement": {"zone": "z1", "machineType": "small", "image": "squid"},
            "proxyPort": PROXY_PORT,
            "healthCheck": {"type": "Http", "url": url, "periodSeconds": 2, "timeoutSeconds": 1},
        },
    }))
    .unwrap()
}

fn is_proxy_ready(proxy: Option<&DynamicObject>) -> bool {
    proxy.is_some_and(|proxy| proxy.data["status"]["phase"].as_str() == Some("Ready"))
}

fn is_ready(pod: Option<&Pod>) -> bool {
    pod.and_then(|pod| pod.status.as_ref())
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// busybox's httpd serving `index.html` (for the health check) and `client.html`.
fn web_pod_manifest() -> String {
    let image = egressproxy_integration::tools::image_archive(
        egressproxy_integration::cluster::TOOLBOX_IMAGE,
    )
    .unwrap()
    .name;
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: web}}
spec:
  securityContext: {{runAsNonRoot: true, runAsUser: 65532}}
  containers:
  - name: web
    image: {image}
    imagePullPolicy: Never
    command: [sh, -c, 'echo index > /www/index.html && echo client-page > /www/client.html && exec httpd -f -v -p 8080 -h /www']
    readinessProbe: {{tcpSocket: {{port: 8080}}, periodSeconds: 1}}
    volumeMounts: [{{name: www, mountPath: /www}}]
  volumes: [{{name: www, emptyDir: {{}}}}]
"#
    )
}
