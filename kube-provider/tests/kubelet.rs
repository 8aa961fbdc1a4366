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
//! Needs root, the packages of `integration/tools/install-system-packages.sh`, and what
//! `make setup` builds (kube-harness, kube-node, the cluster's images). One test: the
//! process has one cluster.

mod common;

use std::time::Duration;

use common::{Harness, create, create_request, get};
use egressproxy_integration::cluster::network::NODE_IP;
use egressproxy_integration::cluster::{Cluster, ClusterOptions, TOOLBOX_IMAGE};
use egressproxy_integration::tools;
use egressproxy_provider::{ErrorClass, pb};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::wait::{await_condition, conditions};
use kube_provider::config::Image;
use pb::InstanceState;
use pb::placement::Location;

const WITHIN: Duration = Duration::from_secs(120);
/// A high port: the pod shares the node's network namespace, and runs as uid 65532.
const PORT: u32 = 18_080;

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
    let cluster = Cluster::start(&ClusterOptions::default()).await.unwrap();
    let harness = Harness::new("kube-provider-kubelet", &[]).await;
    harness.label_egress_node(cluster.node_name(), "z1").await;
    let mut config = harness.config();
    config.images.insert(
        "toolbox".into(),
        Image {
            image: tools::image_archive(TOOLBOX_IMAGE).unwrap().name,
            pull_policy: Some("Never".into()),
            command: Some(
                ["httpd", "-f", "-p", "$(PROXY_PORT)"]
                    .map(String::from)
                    .to_vec(),
            ),
            args: None,
            port_env: "PROXY_PORT".into(),
        },
    );
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
