//! kube-provider places a proxy pod only where its requests fit, against a real
//! kube-apiserver (no kubelet): it binds its pods itself, so no scheduler checks the fit,
//! and a pod that does not fit would be made only for the kubelet to reject it
//! (`OutOfcpu`), its instance STOPPED. A node whose allocatable cpu is taken by our pods
//! and by someone else's is refused with RESOURCE_EXHAUSTED `CAPACITY_EXHAUSTED` naming
//! what it lacks; a terminated pod's requests no longer count; with a second node the
//! pod goes there.
//!
//! Needs the kube-harness of `make setup` (`integration/tools/install-go-tools.sh`).

mod common;

use common::{Harness, create, create_request};
use egressproxy_provider::{ErrorClass, ProviderError, pb};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use pb::placement::Location;

fn assert_no_room(error: &ProviderError, node: &str) {
    assert_eq!(
        (error.class, error.reason.as_str()),
        (ErrorClass::QuotaExhausted, "CAPACITY_EXHAUSTED"),
        "{error}"
    );
    assert!(error.retry_after.is_some(), "{error}");
    // Our pod (100m) and someone else's (100m) of the node's 250m.
    let lacks = format!("{node} (cpu: 200m of 250m allocatable requested already");
    assert!(error.message.contains(&lacks), "{lacks:?} missing: {error}");
}

#[tokio::test]
async fn a_node_without_room_for_the_requests_is_refused_until_room_is_freed() {
    let harness = Harness::new("kube-provider-node-room", &[("a", "z1"), ("b", "z2")]).await;
    harness
        .set_allocatable(
            "a",
            serde_json::json!({"cpu": "250m", "memory": "8Gi", "pods": "110"}),
        )
        .await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let a = harness.nodes["a"].clone();

    // Someone else's pod on node a requests 100m.
    let (namespace, foreign) = harness.other_namespace("other").await;
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "batch"},
        "spec": {"nodeName": a, "containers": [{"name": "batch", "image": "x",
            "resources": {"requests": {"cpu": "100m"}}}]},
    }))
    .unwrap();
    foreign.create(&PostParams::default(), &pod).await.unwrap();

    // Each request takes its own port, so only room can refuse it.
    let on_a = |key: &str, port: u32| {
        let mut request = create_request(key, Some(Location::Host(a.clone())), &[]);
        request.proxy_port = port;
        request
    };
    create(&mut client, on_a("first", 3128)).await;
    let status = client
        .create_instance(on_a("second", 3129))
        .await
        .unwrap_err();
    assert_no_room(&ProviderError::from_status(&status), &a);
    let mut in_zone = on_a("in-zone", 3130);
    in_zone.placement.as_mut().unwrap().location = Some(Location::Zone("z1".into()));
    let status = client.create_instance(in_zone).await.unwrap_err();
    assert_no_room(&ProviderError::from_status(&status), &a);
    let pods = harness.pods().list(&Default::default()).await.unwrap();
    assert_eq!(pods.items.len(), 1, "no pod made for a refused Create");

    // Left to the provider, the pod goes to the node with room.
    let anywhere = create(&mut client, create_request("anywhere", None, &[])).await;
    let bound = harness.pods().get(&anywhere.id).await.unwrap();
    assert_eq!(
        bound.spec.unwrap().node_name,
        Some(harness.nodes["b"].clone())
    );

    // Once the other pod has terminated, its requests no longer count.
    let succeeded = serde_json::json!({"status": {"phase": "Succeeded"}});
    foreign
        .patch_status("batch", &PatchParams::default(), &Patch::Merge(&succeeded))
        .await
        .unwrap();
    create(&mut client, on_a("second", 3129)).await;
    harness.delete_namespace(&namespace).await;
}
