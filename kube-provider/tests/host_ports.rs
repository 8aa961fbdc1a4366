//! kube-provider keeps proxies apart by port against a real kube-apiserver (no kubelet):
//! a proxy pod has host network, so two pods with one proxy port on one node would be
//! one too many for the kubelet. Two Creates of one port at once with a single egress
//! node give one instance and one RESOURCE_EXHAUSTED `PORT_IN_USE` naming the port and
//! the node; with two nodes they land on different nodes. A port held by another
//! namespace's pod, or by a pod of ours that is still terminating, counts too; a
//! terminated pod's does not.
//!
//! Needs the kube-harness of `make setup` (`integration/tools/install-go-tools.sh`).

mod common;

use std::collections::BTreeSet;

use common::{Harness, create, create_request};
use egressproxy_provider::{ErrorClass, ProviderError, pb};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube_provider::placement::PORT_IN_USE;
use pb::placement::Location;

/// Sends the Creates at once and returns each answer, in order.
async fn create_at_once(
    client: &egressproxy_provider::client::Client,
    requests: Vec<pb::CreateInstanceRequest>,
) -> Vec<Result<pb::Instance, ProviderError>> {
    let calls: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .create_instance(request)
                    .await
                    .map(|answer| answer.into_inner().instance.unwrap())
                    .map_err(|status| ProviderError::from_status(&status))
            })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    answers
}

/// The node the instance's pod is bound to.
async fn node_of(harness: &Harness, instance: &pb::Instance) -> String {
    let pod = harness.pods().get(&instance.id).await.unwrap();
    pod.spec.unwrap().node_name.unwrap()
}

fn assert_port_in_use(error: &ProviderError, port: u32, node: &str) {
    assert_eq!(
        (error.class, error.reason.as_str()),
        (ErrorClass::QuotaExhausted, PORT_IN_USE),
        "{error}"
    );
    assert!(error.retry_after.is_some(), "{error}");
    for part in [format!("proxy port {port}"), node.to_owned()] {
        assert!(error.message.contains(&part), "{part:?} missing: {error}");
    }
}

#[tokio::test]
async fn two_creates_of_one_port_on_one_node_give_one_instance_and_port_in_use() {
    let harness = Harness::new("kube-provider-port-one-node", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let node = &harness.nodes["a"];

    let answers = create_at_once(
        &provider.client,
        vec![
            create_request("first", Some(Location::Zone("z1".into())), &[]),
            create_request("second", Some(Location::Zone("z1".into())), &[]),
        ],
    )
    .await;
    let (created, refused): (Vec<_>, Vec<_>) = answers.iter().partition(|a| a.is_ok());
    assert_eq!((created.len(), refused.len()), (1, 1), "{answers:?}");
    assert_port_in_use(refused[0].as_ref().unwrap_err(), 3128, node);
    let pods = harness.pods().list(&Default::default()).await.unwrap();
    assert_eq!(pods.items.len(), 1, "one pod, on port 3128 of {node}");

    // The node by name is refused the same way; another port on it is free.
    let mut client = provider.client.clone();
    let pinned = create_request("pinned", Some(Location::Host(node.clone())), &[]);
    let status = client.create_instance(pinned).await.unwrap_err();
    assert_port_in_use(&ProviderError::from_status(&status), 3128, node);
    let mut other_port = create_request("other-port", Some(Location::Host(node.clone())), &[]);
    other_port.proxy_port = 3129;
    let on_3129 = create(&mut client, other_port).await;
    assert_eq!(node_of(&harness, &on_3129).await, *node);
}

#[tokio::test]
async fn two_creates_of_one_port_with_two_nodes_land_on_different_nodes() {
    let harness = Harness::new("kube-provider-port-two-nodes", &[("a", "z1"), ("b", "z1")]).await;
    let provider = harness.serve().await;

    for location in [Some(Location::Zone("z1".into())), None] {
        let tag = if location.is_some() { "zone" } else { "none" };
        let answers = create_at_once(
            &provider.client,
            vec![
                create_request(&format!("{tag}-1"), location.clone(), &[]),
                create_request(&format!("{tag}-2"), location.clone(), &[]),
            ],
        )
        .await;
        let instances: Vec<&pb::Instance> = answers
            .iter()
            .map(|a| a.as_ref().unwrap_or_else(|e| panic!("{tag}: {e}")))
            .collect();
        let mut nodes = BTreeSet::new();
        for instance in &instances {
            nodes.insert(node_of(&harness, instance).await);
        }
        assert_eq!(nodes.len(), 2, "{tag}: both on one node: {nodes:?}");
        // Until they go, port 3128 is in use on both nodes; 3129 is not.
        let mut client = provider.client.clone();
        let third = create_request(&format!("{tag}-3"), location.clone(), &[]);
        let status = client.create_instance(third).await.unwrap_err();
        let error = ProviderError::from_status(&status);
        for node in harness.nodes.values() {
            assert_port_in_use(&error, 3128, node);
        }
        for instance in instances {
            client
                .delete_instance(pb::DeleteInstanceRequest {
                    id: instance.id.clone(),
                })
                .await
                .unwrap();
            harness.finish_termination(&instance.id).await;
        }
    }
}

#[tokio::test]
async fn another_namespaces_pod_and_a_terminating_pod_hold_the_port() {
    let harness = Harness::new("kube-provider-port-others", &[("a", "z1"), ("b", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let (a, b) = (&harness.nodes["a"], &harness.nodes["b"]);

    // Someone else's pod on node a declares host port 3128.
    let (namespace, foreign) = harness.other_namespace("other").await;
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"nodeName": a, "containers": [{"name": "web", "image": "x",
            "ports": [{"containerPort": 80, "hostPort": 3128}]}]},
    }))
    .unwrap();
    foreign.create(&PostParams::default(), &pod).await.unwrap();

    let on_a = create_request("on-a", Some(Location::Host(a.clone())), &[]);
    let status = client.create_instance(on_a.clone()).await.unwrap_err();
    assert_port_in_use(&ProviderError::from_status(&status), 3128, a);
    let placed = create(&mut client, create_request("anywhere", None, &[])).await;
    assert_eq!(node_of(&harness, &placed).await, *b);

    // Once that pod has terminated, its port is free.
    let succeeded = serde_json::json!({"status": {"phase": "Succeeded"}});
    foreign
        .patch_status("web", &PatchParams::default(), &Patch::Merge(&succeeded))
        .await
        .unwrap();
    let instance = create(&mut client, on_a).await;
    assert_eq!(node_of(&harness, &instance).await, *a);

    // Our pod on b holds the port while it terminates, and frees it once gone.
    client
        .delete_instance(pb::DeleteInstanceRequest {
            id: placed.id.clone(),
        })
        .await
        .unwrap();
    let on_b = create_request("on-b", Some(Location::Host(b.clone())), &[]);
    let status = client.create_instance(on_b.clone()).await.unwrap_err();
    assert_port_in_use(&ProviderError::from_status(&status), 3128, b);
    harness.finish_termination(&placed.id).await;
    let instance = create(&mut client, on_b).await;
    assert_eq!(node_of(&harness, &instance).await, *b);
    harness.delete_namespace(&namespace).await;
}
