//! The single-node cluster from real parts (`integration::cluster`): a pod from a locally
//! built image runs under the kubelet and gets an address from the pod range; another pod
//! reaches it through its Service's ClusterIP (kube-proxy's rules) and finds that
//! Service by name (CoreDNS); and the node leaves nothing behind when it goes.
//!
//! Needs root, the packages of `integration/tools/install-system-packages.sh`, and what
//! `make setup` builds (kube-harness, kube-node, and the cluster's images).

use std::net::Ipv4Addr;
use std::time::Duration;

use egressproxy_integration::cluster::network::POD_CIDR;
use egressproxy_integration::cluster::{Cluster, ClusterOptions, TOOLBOX_IMAGE};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::tools;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::Api;
use kube::runtime::wait::{await_condition, conditions};

const WITHIN: Duration = Duration::from_secs(120);

/// A web server pod and its Service; `body` is what it serves.
fn web_manifest(image: &str, body: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: web, labels: {{app: web}}}}
spec:
  securityContext: {{runAsNonRoot: true, runAsUser: 65532}}
  containers:
  - name: web
    image: {image}
    imagePullPolicy: Never
    command: [sh, -c, 'echo {body} > /www/index.html && exec httpd -f -v -p 8080 -h /www']
    readinessProbe: {{tcpSocket: {{port: 8080}}, periodSeconds: 1}}
    securityContext: {{readOnlyRootFilesystem: true, allowPrivilegeEscalation: false}}
    volumeMounts: [{{name: www, mountPath: /www}}]
  volumes: [{{name: www, emptyDir: {{}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: 8080}}]
"#
    )
}

/// A pod that asks CoreDNS for the Service, then fetches it by ClusterIP and by name.
fn client_manifest(image: &str, namespace: &str, cluster_ip: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: client}}
spec:
  restartPolicy: Never
  securityContext: {{runAsNonRoot: true, runAsUser: 65532}}
  containers:
  - name: client
    image: {image}
    imagePullPolicy: Never
    command:
    - sh
    - -c
    - |
      set -e
      nslookup web.{namespace}.svc.cluster.local
      echo "by-ip: $(wget -qO- http://{cluster_ip}/)"
      echo "by-name: $(wget -qO- http://web/)"
"#
    )
}

fn in_pod_range(ip: &str) -> bool {
    let (network, bits) = POD_CIDR.split_once('/').unwrap();
    let network: Ipv4Addr = network.parse().unwrap();
    let bits: u32 = bits.parse().unwrap();
    let Ok(ip) = ip.parse::<Ipv4Addr>() else {
        return false;
    };
    let mask = u32::MAX << (32 - bits);
    u32::from(ip) & mask == u32::from(network) & mask
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_reaches_another_through_its_service_address_and_name() {
    let cluster = Cluster::start(&ClusterOptions::default()).await.unwrap();
    let kube = KubeTestEnv::new("kube-cluster").await.unwrap();
    let namespace = kube.namespace.clone();
    let kubectl = cluster.kubectl();
    let image = tools::image_archive(TOOLBOX_IMAGE).unwrap().name;
    let body = format!("served-{}", uuid::Uuid::new_v4().simple());

    // 1. A pod from the locally built image runs and gets an address from the pod range.
    kubectl
        .run(
            &["apply", "-n", &namespace, "-f", "-"],
            Some(&web_manifest(&image, &body)),
        )
        .unwrap();
    let pods: Api<Pod> = kube.namespaced();
    let ready = tokio::time::timeout(
        WITHIN,
        await_condition(pods.clone(), "web", conditions::is_pod_running()),
    )
    .await;
    assert!(
        matches!(ready, Ok(Ok(_))),
        "the web pod did not run within {WITHIN:?}: {ready:?}\n{}\n{}",
        cluster.pod_logs(&namespace, "web"),
        cluster.log_tails()
    );
    let web = pods.get("web").await.unwrap();
    let pod_ip = web.status.and_then(|s| s.pod_ip).unwrap_or_default();
    assert!(
        in_pod_range(&pod_ip),
        "the web pod's address {pod_ip:?} is not in {POD_CIDR}"
    );

    // 2. Another pod reaches it through the Service's ClusterIP and by the Service's name.
    let services: Api<Service> = kube.namespaced();
    let cluster_ip = services
        .get("web")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.cluster_ip)
        .unwrap();
    kubectl
        .run(
            &["apply", "-n", &namespace, "-f", "-"],
            Some(&client_manifest(&image, &namespace, &cluster_ip)),
        )
        .unwrap();
    let finished = tokio::time::timeout(
        WITHIN,
        await_condition(pods.clone(), "client", |pod: Option<&Pod>| {
            pod.and_then(|p| p.status.as_ref())
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|phase| phase == "Succeeded" || phase == "Failed")
        }),
    )
    .await;
    let output = cluster.pod_logs(&namespace, "client");
    let phase = pods
        .get("client")
        .await
        .unwrap()
        .status
        .and_then(|s| s.phase)
        .unwrap_or_default();
    assert!(
        matches!(finished, Ok(Ok(_))) && phase == "Succeeded",
        "the client pod ended {phase:?} ({finished:?}); its output:\n{output}\n{}",
        cluster.log_tails()
    );
    assert!(
        output.contains(&cluster_ip),
        "CoreDNS did not answer web.{namespace}.svc.cluster.local with {cluster_ip}:\n{output}"
    );
    assert!(
        output.contains(&format!("by-ip: {body}")),
        "the ClusterIP did not reach the web pod:\n{output}"
    );
    assert!(
        output.contains(&format!("by-name: {body}")),
        "the Service's short name did not reach the web pod:\n{output}"
    );

    // 3. Nothing of the node outlives it: no process, cgroup, mount or network namespace.
    let mut containers = Vec::new();
    for pod in ["web", "client"] {
        let status = pods.get(pod).await.unwrap().status.unwrap_or_default();
        for container in status.container_statuses.unwrap_or_default() {
            let id = container.container_id.unwrap_or_default();
            containers.push(id.trim_start_matches("containerd://").to_owned());
        }
    }
    assert_eq!(containers.len(), 2, "container ids: {containers:?}");
    let netns = cluster.netns().to_owned();
    let dir = cluster.dir().to_owned();
    drop(cluster);
    let namespaces = std::fs::read_dir("/run/netns")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    assert!(
        !namespaces.contains(&netns),
        "the node's network namespace {netns} is left"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&dir.display().to_string()),
        "mounts under {} are left",
        dir.display()
    );
    assert!(!dir.exists(), "{} is left", dir.display());
    for id in &containers {
        let cgroup = std::path::Path::new("/sys/fs/cgroup/pids/k8s.io").join(id);
        assert!(
            !cgroup.exists(),
            "the container's cgroup {} is left",
            cgroup.display()
        );
    }
    let leftover = egressproxy_integration::process::processes_mentioning(&dir);
    assert!(
        leftover.is_empty(),
        "processes of the node are left: {leftover:?}"
    );
}
