//! `deploy/kube-provider/rbac.yaml` is enough: a provider that reaches the apiserver as
//! its ServiceAccount, with only those rules, watches, creates, reads, lists, retags and
//! deletes instances (a missing rule would answer FAILED_PRECONDITION, `KUBE_FORBIDDEN`, or for
//! the watch UNAVAILABLE).

mod common;

use std::time::Duration;

use common::{Harness, create, create_request, get};
use egressproxy_integration::helm::Kubectl;
use egressproxy_provider::{ErrorClass, pb};
use pb::InstanceState;

const RBAC: &str = include_str!("../../deploy/kube-provider/rbac.yaml");

#[tokio::test]
async fn the_documented_rbac_is_all_the_provider_needs() {
    let harness = Harness::new("kube-provider-rbac", &[("a", "z1")]).await;
    let namespace = &harness.env.namespace;
    // Cluster-scoped names made unique per test; the longer name first, as it holds
    // the shorter.
    let rbac = RBAC
        .replace(
            "egressproxy-kube-provider",
            &format!("{namespace}-kube-provider"),
        )
        .replace("egressproxy-kube", namespace);
    Kubectl::new(harness.env.apiserver().kubeconfig_path())
        .run(&["apply", "-f", "-"], Some(&rbac))
        .unwrap();
    let account = harness
        .env
        .service_account_client("kube-provider")
        .await
        .unwrap();
    let provider = harness.serve_as(account, harness.config()).await;
    let mut client = provider.client.clone();

    // WatchInstances: a new stream of no instances is just SYNCED.
    let mut stream = client
        .watch_instances(pb::WatchInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.r#type(), pb::WatchEventType::Synced);

    let instance = create(&mut client, create_request("rbac", None, &[("t", "1")])).await;
    // The watch follows the change (listing alone is not watching).
    let followed = tokio::time::timeout(Duration::from_secs(20), stream.message()).await;
    let event = followed
        .expect("the watch told no change within 20 s")
        .unwrap()
        .unwrap();
    assert_eq!(event.r#type(), pb::WatchEventType::Updated);
    assert_eq!(event.instance.unwrap().id, instance.id);
    let again = create(&mut client, create_request("rbac", None, &[])).await;
    assert_eq!(again.id, instance.id);
    assert_eq!(
        get(&mut client, &instance.id).await.unwrap().state(),
        InstanceState::Provisioning
    );
    let listed = client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.instances.len(), 1);
    let retagged = client
        .update_instance_tags(pb::UpdateInstanceTagsRequest {
            id: instance.id.clone(),
            expected_tags: [("t".to_owned(), "1".to_owned())].into(),
            tags: [("t".to_owned(), "2".to_owned())].into(),
        })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    assert_eq!(retagged.tags["t"], "2");
    client
        .delete_instance(pb::DeleteInstanceRequest {
            id: instance.id.clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        get(&mut client, &instance.id).await.unwrap().state(),
        InstanceState::Deleting
    );
    harness.finish_termination(&instance.id).await;
    assert_eq!(
        get(&mut client, &instance.id).await.unwrap_err().class,
        ErrorClass::NotFound
    );
}
