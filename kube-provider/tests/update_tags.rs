//! UpdateInstanceTags against a real kube-apiserver: compare-and-set on the pod's record
//! annotation, guarded by its resourceVersion, seen at once by Get, List and
//! WatchInstances, kept across a provider restart; one winner among concurrent callers;
//! a terminating pod is INSTANCE_DELETING.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Harness, create, create_request, get};
use egressproxy_provider::client::Client;
use egressproxy_provider::{ErrorClass, ProviderError, pb};

fn tags(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn update(
    client: &mut Client,
    id: &str,
    expected: &HashMap<String, String>,
    new: &HashMap<String, String>,
) -> Result<pb::Instance, ProviderError> {
    client
        .update_instance_tags(pb::UpdateInstanceTagsRequest {
            id: id.to_owned(),
            expected_tags: expected.clone(),
            tags: new.clone(),
        })
        .await
        .map(|r| r.into_inner().instance.unwrap())
        .map_err(|status| ProviderError::from_status(&status))
}

async fn list_ids(client: &mut Client, selector: &HashMap<String, String>) -> Vec<String> {
    client
        .list_instances(pb::ListInstancesRequest {
            tag_selector: selector.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .instances
        .into_iter()
        .map(|i| i.id)
        .collect()
}

#[tokio::test]
async fn update_tags_is_compare_and_set_seen_at_once_and_kept_across_a_restart() {
    let harness = Harness::new("kube-provider-retag", &[("a", "z1")]).await;
    let first = harness.serve().await;
    let mut client = first.client.clone();
    let capabilities = client
        .get_capabilities(pb::GetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert!(capabilities.contains(&(pb::Capability::UpdateTags as i32)));

    let spare = tags(&[("pool", "spares")]);
    let adopted = tags(&[("proxy", "ns/p"), ("uid", "1234")]);
    let instance = create(
        &mut client,
        create_request("retag", None, &[("pool", "spares")]),
    )
    .await;
    let mut stream = client
        .watch_instances(pb::WatchInstancesRequest {
            id: instance.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    while stream.message().await.unwrap().unwrap().r#type() != pb::WatchEventType::Synced {}

    let answer = update(&mut client, &instance.id, &spare, &adopted)
        .await
        .unwrap();
    assert_eq!(answer.tags, adopted);
    // Only the tags change.
    assert_eq!(
        pb::Instance {
            tags: spare.clone(),
            ..answer.clone()
        },
        instance
    );
    assert_eq!(get(&mut client, &instance.id).await.unwrap(), answer);
    assert_eq!(
        list_ids(&mut client, &tags(&[("uid", "1234")])).await,
        [instance.id.as_str()]
    );
    assert!(list_ids(&mut client, &spare).await.is_empty());
    let event = tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("the watcher hears of the update")
        .unwrap()
        .unwrap();
    assert_eq!(event.r#type(), pb::WatchEventType::Updated);
    assert_eq!(event.instance.unwrap().tags, adopted);

    // A repeat is OK and changes nothing; a stale expectation is TAGS_CHANGED.
    assert_eq!(
        update(&mut client, &instance.id, &spare, &adopted)
            .await
            .unwrap(),
        answer
    );
    let stale = update(&mut client, &instance.id, &spare, &tags(&[("uid", "x")]))
        .await
        .unwrap_err();
    assert_eq!(
        (stale.class, stale.reason.as_str()),
        (ErrorClass::Permanent, "TAGS_CHANGED"),
        "{stale}"
    );
    assert_eq!(get(&mut client, &instance.id).await.unwrap().tags, adopted);

    // Unknown ids, an empty id, bad tags.
    for unknown in [
        kube_provider::record::pod_name("never-created"),
        "web".to_owned(),
    ] {
        let error = update(&mut client, &unknown, &spare, &adopted)
            .await
            .unwrap_err();
        assert_eq!(error.class, ErrorClass::NotFound, "{unknown}: {error}");
    }
    let error = update(&mut client, "", &spare, &adopted).await.unwrap_err();
    assert_eq!(error.field_violations[0].field, "id", "{error}");
    let error = update(&mut client, &instance.id, &adopted, &tags(&[("", "v")]))
        .await
        .unwrap_err();
    assert_eq!(error.field_violations[0].field, r#"tags[""]"#, "{error}");

    // A restarted provider reads the tags the cluster kept.
    drop((stream, client, first));
    let second = harness.serve().await;
    let mut client = second.client.clone();
    assert_eq!(get(&mut client, &instance.id).await.unwrap().tags, adopted);
}

#[tokio::test]
async fn of_concurrent_updates_one_wins_and_a_terminating_pod_is_deleting() {
    let harness = Harness::new("kube-provider-retag-race", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let spare = tags(&[("pool", "spares")]);
    let instance = create(
        &mut client,
        create_request("race", None, &[("pool", "spares")]),
    )
    .await;

    let callers = (0..6).map(|n| {
        let mut client = provider.client.clone();
        let (id, spare) = (instance.id.clone(), spare.clone());
        tokio::spawn(async move {
            let mine = tags(&[("owner", &format!("caller-{n}"))]);
            let result = update(&mut client, &id, &spare, &mine).await;
            (mine, result)
        })
    });
    let mut winners = Vec::new();
    for result in futures::future::join_all(callers).await {
        match result.unwrap() {
            (mine, Ok(answer)) => {
                assert_eq!(answer.tags, mine);
                winners.push(mine);
            }
            (_, Err(error)) => assert_eq!(error.reason, "TAGS_CHANGED", "{error}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one caller wins: {winners:?}");
    assert_eq!(
        get(&mut client, &instance.id).await.unwrap().tags,
        winners[0]
    );

    // While the pod terminates, its tags no longer change.
    client
        .delete_instance(pb::DeleteInstanceRequest {
            id: instance.id.clone(),
        })
        .await
        .unwrap();
    let error = update(&mut client, &instance.id, &winners[0], &spare)
        .await
        .unwrap_err();
    assert_eq!(
        (error.class, error.reason.as_str()),
        (ErrorClass::Permanent, "INSTANCE_DELETING"),
        "{error}"
    );
    harness.finish_termination(&instance.id).await;
    let error = update(&mut client, &instance.id, &winners[0], &spare)
        .await
        .unwrap_err();
    assert_eq!(error.class, ErrorClass::NotFound, "{error}");
}
