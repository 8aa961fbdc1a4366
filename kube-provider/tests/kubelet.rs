//! kube-provider on the single-node cluster with a real kubelet (`integration::cluster`):
//! a Create becomes a host-network pod that the kubelet runs on the labelled egress
//! node, the instance is RUNNING at the node's address once the pod's readiness probe
//! reaches the listener, and a Delete is DELETING until the kubelet has stopped it,
//! then NOT_FOUND.
//!
//! The "proxy" is busybox's httpd from the toolbox image, started on the port the
//! provider passes in `PROXY_PORT`: the test is about the provider and the pod, not
//! about a proxy image (the project's squid image, installed by the chart, is
//! `integration/tests/chart_kube_provider.rs`'s).
//!
//! The second test runs the whole conformance suite (`--without-cloud-init`) against
//! kube-provider on this cluster: unlike `tests/conformance.rs`, whose stand-in kubelet
//! reports every pod Running at once, here RUNNING and the end of a Delete are what a
//! real kubelet did with real pods on one node.
//!
//! Needs root, the packages of `integration/tools/install-system-packages.sh`, and what
//! `make setup` builds (kube-harness, kube-node, the cluster's images). A process may run
//! one cluster (it registers the Node `localhost`), so the tests share it: see
//! [`shared_cluster`]. Each test selects the node by a label of its own, so neither
//! test's provider places on the other's behalf or loses the node when the other
//! relabels it.

mod common;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use common::{Harness, create, create_request, get};
use egressproxy_integration::cluster::network::NODE_IP;
use egressproxy_integration::cluster::{Cluster, ClusterOptions, TOOLBOX_IMAGE, pods};
use egressproxy_integration::tools;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::conformance::{self, Ledger, Selection, Target};
use egressproxy_provider::{ErrorClass, pb};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube_provider::config::{Image, MachineType};
use pb::InstanceState;
use pb::placement::Location;

const WITHIN: Duration = Duration::from_secs(120);
/// A high port: the pod shares the node's network namespace, and runs as uid 65532.
const PORT: u32 = 18_080;

/// The cluster of this process, started by the first test that asks and stopped when
/// the last test holding it ends. The tests run in parallel by default, so both get the
/// same cluster; run one at a time, each starts its own in turn.
async fn shared_cluster() -> Arc<Cluster> {
    static SHARED: tokio::sync::Mutex<Weak<Cluster>> = tokio::sync::Mutex::const_new(Weak::new());
    let mut shared = SHARED.lock().await;
    if let Some(cluster) = shared.upgrade() {
        return cluster;
    }
    let cluster = Arc::new(Cluster::start(&ClusterOptions::default()).await.unwrap());
    *shared = Arc::downgrade(&cluster);
    cluster
}

/// The toolbox image running busybox's httpd on the port the provider passes: a
/// listener for the readiness probe, standing in for a proxy.
fn toolbox_image() -> Image {
    Image {
        image: tools::image_archive(TOOLBOX_IMAGE).unwrap().name,
        pull_policy: Some("Never".into()),
        // httpd as PID 1 would ignore the kubelet's SIGTERM and hold the port for the
        // whole grace period; the shell stops it at once.
        command: Some(
            [
                "sh",
                "-c",
                "httpd -f -p \"$PROXY_PORT\" & trap 'kill $!; exit 0' TERM; wait",
            ]
            .map(String::from)
            .to_vec(),
        ),
        args: None,
        port_env: "PROXY_PORT".into(),
    }
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

#[tokio::test(flavor = "multi_thread")]
async fn a_proxy_pod_runs_on_the_egress_node_and_goes_when_deleted() {
    let cluster = shared_cluster().await;
    let harness = Harness::new("kube-provider-kubelet", &[]).await;
    harness.label_egress_node(cluster.node_name(), "z1").await;
    let mut config = harness.config();
    config.images.insert("toolbox".into(), toolbox_image());
    let provider = harness.serve_with(config).await;
    let mut client = provider.client.clone();

    let mut request = create_request("runs", Some(Location::Zone("z1".into())), &[]);
    request.placement.as_mut().unwrap().image = "toolbox".into();
    request.proxy_port = PORT;
    let instance = create(&mut client, request).await;
    let pods = harness.pods();
    let ready = tokio::time::timeout(
        WITHIN,
        await_condition(pods.clone(), &instance.id, is_ready),
    )
    .await;
    assert!(
        matches!(ready, Ok(Ok(Some(_)))),
        "the pod was not Ready within {WITHIN:?}: {ready:?}\n{}",
        cluster.log_tails()
    );
    let running = get(&mut client, &instance.id).await.unwrap();
    assert_eq!(running.state(), InstanceState::Running, "{running:?}");
    assert_eq!(running.addresses[0].address, NODE_IP.to_string());
    let uid = pods.get(&instance.id).await.unwrap().metadata.uid.unwrap();

    client
        .delete_instance(pb::DeleteInstanceRequest {
            id: instance.id.clone(),
        })
        .await
        .unwrap();
    match get(&mut client, &instance.id).await {
        Ok(deleting) => assert_eq!(deleting.state(), InstanceState::Deleting),
        Err(gone) => assert_eq!(gone.class, ErrorClass::NotFound),
    }
    let deleted = tokio::time::timeout(
        WITHIN,
        await_condition(pods, &instance.id, conditions::is_deleted(&uid)),
    )
    .await;
    assert!(
        matches!(deleted, Ok(Ok(_))),
        "the kubelet did not stop the pod within {WITHIN:?}: {deleted:?}\n{}",
        cluster.log_tails()
    );
    let gone = get(&mut client, &instance.id).await.unwrap_err();
    assert_eq!(gone.class, ErrorClass::NotFound);
}

/// The label kube-provider puts on its proxy pods.
const PROXY_PODS: &str = "app.kubernetes.io/managed-by=kube.egressproxy.dev";
/// The node label the conformance test's provider selects the node by (the other test
/// sets `common::EGRESS_LABEL` on the same node to its own namespace).
const CONFORMANCE_EGRESS_LABEL: &str = "egressproxy.dev/test-conformance-egress";

#[tokio::test(flavor = "multi_thread")]
async fn the_conformance_suite_passes_with_real_pods() {
    let cluster = shared_cluster().await;
    let started = Instant::now();
    let harness = Harness::new("kube-provider-kubelet-conformance", &[]).await;
    let labels = serde_json::json!({"metadata": {"labels": {
        CONFORMANCE_EGRESS_LABEL: "true",
        common::ZONE_LABEL: "z1",
    }}});
    Api::<Node>::all(harness.env.client.clone())
        .patch(
            cluster.node_name(),
            &PatchParams::default(),
            &Patch::Merge(&labels),
        )
        .await
        .unwrap();
    let mut config = harness.config();
    config.node_selector = [(CONFORMANCE_EGRESS_LABEL.to_owned(), "true".to_owned())].into();
    config.images.insert("toolbox".into(), toolbox_image());
    // A run holds a few dozen pods at once on this one two-core node: sized as a user
    // sizes a machine type to the nodes, they fit (at 100m, the provider would refuse
    // the twentieth Create for want of cpu).
    config.machine_types.insert(
        "small".into(),
        MachineType {
            requests: [("cpu", "10m"), ("memory", "16Mi")]
                .map(|(name, amount)| (name.to_owned(), Quantity(amount.to_owned())))
                .into(),
            limits: [("memory".to_owned(), Quantity("64Mi".to_owned()))].into(),
        },
    );
    let provider = harness.serve_with(config).await;
    let rejected = failed_pods(harness.pods());

    let options = ClientOptions::new(provider.endpoint.clone());
    let mut target = Target::new(pb::Placement {
        location: None,
        machine_type: "small".into(),
        image: "toolbox".into(),
    });
    // As `provider-conformance --without-cloud-init`: pods have no cloud-init.
    target.user_data.clear();
    target.cloud_init = false;
    target.running_timeout = WITHIN;
    target.check_timeout = Duration::from_secs(180);
    // A host-network pod's port is the node's, and the provider places one pod per port
    // on a node: the whole run fits on this one node because the suite gives each key of
    // a run its own port.
    let ledger = Ledger::new(connect_lazy(&options).unwrap());
    let report = conformance::run_with(&options, &target, &Selection::default(), &ledger).await;
    eprintln!("{report}");
    let ran = report.checks.len();
    let failures = report.failures();
    pods::gone(
        &harness.env.client,
        &harness.env.namespace,
        PROXY_PODS,
        WITHIN,
    )
    .await
    .unwrap_or_else(|err| panic!("after the run: {err:#}\n{}", cluster.log_tails()));
    let rejected = rejected.take();
    eprintln!("timing: {ran} checks in one run, {:?}", started.elapsed());
    assert_eq!(ran, conformance::CHECKS.len(), "every check ran once");
    assert!(
        failures.is_empty(),
        "{}\npods the kubelet failed: {rejected:#?}\n{}",
        failures.join("\n"),
        cluster.log_tails()
    );
}

/// Why the kubelet failed pods (their status's reason and message), as
/// `pod: reason: message`, collected from a watch until [`FailedPods::take`].
struct FailedPods {
    watch: tokio::task::JoinHandle<()>,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl FailedPods {
    /// Stops watching and returns each failure once.
    fn take(mut self) -> Vec<String> {
        self.watch.abort();
        let mut failed = Vec::new();
        while let Ok(line) = self.lines.try_recv() {
            if !failed.contains(&line) {
                failed.push(line);
            }
        }
        failed
    }
}

fn failed_pods(pods: Api<Pod>) -> FailedPods {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let (sender, lines) = tokio::sync::mpsc::unbounded_channel();
    let watch = tokio::spawn(async move {
        let events = watcher(pods, watcher::Config::default())
            .default_backoff()
            .applied_objects();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            let Ok(pod) = event else { continue };
            let Some(status) = pod.status else { continue };
            if status.phase.as_deref() == Some("Failed") {
                let _ = sender.send(format!(
                    "{}: {}: {}",
                    pod.metadata.name.unwrap_or_default(),
                    status.reason.unwrap_or_default(),
                    status.message.unwrap_or_default()
                ));
            }
        }
    });
    FailedPods { watch, lines }
}
