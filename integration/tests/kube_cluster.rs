//! The single-node cluster from real parts (`integration::cluster`): a pod from a locally
//! built image runs under the kubelet and gets an address from the pod range; another pod
//! reaches it through its Service's ClusterIP (kube-proxy's rules) and finds that
//! Service by name (CoreDNS), and `kubectl logs` shows its output (the apiserver reaches
//! the kubelet); the project's images, built from `deploy/docker/`, run
//! as their Dockerfiles say (uid 65532, under a read-only root filesystem); the chart
//! with the operator alone installs (its pod Ready) and uninstalls without leaving
//! anything of the release; and the node leaves nothing behind when it goes. One test:
//! the process has one cluster.
//!
//! Needs root, the packages of `integration/tools/install-system-packages.sh`, and what
//! `make setup` and `make images` build (kube-harness, kube-node, the images).

use std::net::Ipv4Addr;
use std::time::Duration;

use egressproxy_integration::cluster::network::POD_CIDR;
use egressproxy_integration::cluster::{Cluster, ClusterOptions, TOOLBOX_IMAGE, pods};
use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::tools;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::Api;
use kube::runtime::wait::{await_condition, conditions};

const WITHIN: Duration = Duration::from_secs(120);
const CRD: &str = include_str!("../../charts/egressproxy/files/crds.yaml");

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
/// The Service's EndpointSlice already lists the web pod, but kube-proxy applies it to
/// the node's rules on its own schedule, which nothing in the API reports: the first
/// fetch retries, a bounded number of times, until the ClusterIP answers.
fn client_manifest(namespace: &str, cluster_ip: &str) -> String {
    let script = format!(
        "set -e\n\
         nslookup web.{namespace}.svc.cluster.local\n\
         tries=0\n\
         until wget -qO /tmp/page http://{cluster_ip}/; do\n\
           tries=$((tries + 1)); [ $tries -lt 30 ] || exit 1; sleep 1\n\
         done\n\
         echo \"by-ip: $(cat /tmp/page) after $tries retries\"\n\
         echo \"by-name: $(wget -qO- http://web/)\"\n"
    );
    pods::toolbox_pod("client", &[], &script).unwrap()
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

/// The project's images as `make images` writes them, with the binary each runs.
const PROJECT_IMAGES: [(&str, &str); 2] = [
    ("operator", "egressproxy-operator"),
    ("kvm-agent", "kvm-agent"),
];

/// A pod that runs `image` with `--version` as the chart runs the project's containers:
/// no user set (the image's must be non-root), a read-only root filesystem, no
/// capabilities.
fn version_pod_manifest(name: &str, image: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  restartPolicy: Never
  securityContext: {{runAsNonRoot: true}}
  containers:
  - name: main
    image: {image}
    args: [--version]
    securityContext:
      readOnlyRootFilesystem: true
      allowPrivilegeEscalation: false
      capabilities: {{drop: [ALL]}}
"#
    )
}

/// The `User` of the image config inside a docker-archive.
fn archive_user(archive: &std::path::Path) -> String {
    let list = std::process::Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg("manifest.json")
        .output()
        .unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    let config_file = manifest[0]["Config"].as_str().unwrap().to_owned();
    let config = std::process::Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg(&config_file)
        .output()
        .unwrap();
    let config: serde_json::Value = serde_json::from_slice(&config.stdout).unwrap();
    config["config"]["User"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Waits until pod `name` has ended; its phase.
async fn finished_phase(pods: &Api<Pod>, name: &str) -> String {
    let namespace = pods.namespace().unwrap_or_default().to_owned();
    pods::phase_when_finished(&pods.clone().into_client(), &namespace, name, WITHIN)
        .await
        .unwrap()
}

/// Each project image is non-root (uid 65532) and its binary runs in a pod as the chart
/// runs it, with every library it links present.
async fn project_images_run_as_their_dockerfiles_say(
    cluster: &Cluster,
    kubectl: &Kubectl,
    pods: &Api<Pod>,
    namespace: &str,
) {
    for (short, binary) in PROJECT_IMAGES {
        let image = cluster.import_image(short).unwrap();
        assert_eq!(
            archive_user(&image.path),
            "65532:65532",
            "the {short} image's user"
        );
        let pod = format!("{short}-version");
        kubectl
            .run(
                &["apply", "-n", namespace, "-f", "-"],
                Some(&version_pod_manifest(&pod, &image.name)),
            )
            .unwrap();
        let phase = finished_phase(pods, &pod).await;
        let output = cluster.pod_logs(namespace, &pod);
        assert_eq!(
            phase,
            "Succeeded",
            "{} ended {phase:?}; its output:\n{output}\n{}",
            image.name,
            cluster.log_tails()
        );
        assert!(
            output.contains(&format!("{binary} {}", env!("CARGO_PKG_VERSION"))),
            "{} printed no version:\n{output}",
            image.name
        );
    }
}

/// The chart as users install it with only the operator (the CRD applied first, as with
/// `crds.enabled: false`): the operator's pod, from the project's image and under the
/// chart's security context, becomes Ready, and `helm uninstall` then leaves nothing of
/// the release, its leader Lease included.
async fn the_chart_installs_and_uninstalls_without_leftovers(
    cluster: &Cluster,
    kube: &KubeTestEnv,
) {
    const RELEASE: &str = "kc";
    let namespace = &kube.namespace;
    apply_crds_yaml(&kube.client, CRD).await.unwrap();
    let helm = Helm::new(cluster.kubeconfig()).unwrap();
    let watch = format!("operator.watchNamespaces={{{namespace}}}");
    helm.install(
        RELEASE,
        namespace,
        &[],
        &[
            "crds.enabled=false",
            "operator.clusterName=kube-cluster-test",
            &watch,
        ],
    )
    .unwrap();
    let operator = format!("{RELEASE}-egressproxy-operator");
    let available = pods::deployment_available(&kube.client, namespace, &operator, WITHIN)
        .await
        .unwrap();
    assert!(
        available,
        "the operator's Deployment had no available replica within {WITHIN:?}:\n{}\n{}",
        cluster.deployment_logs(namespace, &operator),
        cluster.log_tails()
    );
    helm.uninstall(RELEASE, namespace).unwrap();
    let selector = format!("app.kubernetes.io/instance={RELEASE}");
    pods::gone(&kube.client, namespace, &selector, WITHIN)
        .await
        .unwrap();
    let left = cluster.kubectl().release_leftovers(namespace, RELEASE);
    assert!(left.is_empty(), "helm uninstall left: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn pods_services_dns_and_the_project_images_run_on_the_node() {
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
    // Its readiness probe passes and the Service lists it: only then does the
    // ClusterIP route to it.
    let listed = pods::service_lists_ready(&kube.client, &namespace, "web", &pod_ip, WITHIN)
        .await
        .unwrap();
    assert!(
        listed,
        "the web Service's EndpointSlice did not list {pod_ip} as ready within {WITHIN:?}\n{}",
        cluster.log_tails()
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
            Some(&client_manifest(&namespace, &cluster_ip)),
        )
        .unwrap();
    let phase = finished_phase(&pods, "client").await;
    let output = cluster.pod_logs(&namespace, "client");
    assert_eq!(
        phase,
        "Succeeded",
        "the client pod ended {phase:?}; its output:\n{output}\n{}",
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
    // The apiserver reaches the kubelet: `kubectl logs` shows the same output.
    let logs = kubectl
        .run(&["logs", "-n", &namespace, "client"], None)
        .unwrap();
    assert!(
        logs.contains(&format!("by-ip: {body}")),
        "kubectl logs client:\n{logs}"
    );

    // 3. The project's images run as their Dockerfiles say.
    project_images_run_as_their_dockerfiles_say(&cluster, &kubectl, &pods, &namespace).await;

    // 4. The chart with the operator alone installs and uninstalls cleanly.
    the_chart_installs_and_uninstalls_without_leftovers(&cluster, &kube).await;

    // 5. Nothing of the node outlives it: no process, cgroup, mount or network namespace.
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
