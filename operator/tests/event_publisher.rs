//! The Event publisher against a real kube-apiserver, when its API calls fail: an Event
//! whose creation failed is created by the next identical publish (not patched as if it
//! existed), and a series whose Event is gone starts a new Event.

use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_operator::k8s::events::{EventPublisher, EventType};
use k8s_openapi::api::core::v1::{Namespace, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};

/// A reference to a Proxy (it need not exist: Events only name it).
fn regarding(namespace: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("egressproxy.dev/v1alpha1".into()),
        kind: Some("Proxy".into()),
        name: Some("egress".into()),
        namespace: Some(namespace.into()),
        uid: Some(format!("uid-{namespace}")),
        ..ObjectReference::default()
    }
}

/// The Events of `reason` in `namespace`, with their series counts (1 without a series).
async fn events(client: &kube::Client, namespace: &str, reason: &str) -> Vec<(String, i32)> {
    let events: Api<Event> = Api::namespaced(client.clone(), namespace);
    events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|event| event.reason.as_deref() == Some(reason))
        .map(|event| {
            let count = event.series.as_ref().map_or(1, |series| series.count);
            (event.note.unwrap_or_default(), count)
        })
        .collect()
}

#[tokio::test]
async fn an_event_whose_creation_failed_is_created_by_the_next_publish() {
    let env = KubeTestEnv::new("events-failed-create").await.unwrap();
    let publisher = EventPublisher::new(env.client.clone(), None);
    // Events cannot be created in a namespace that does not exist yet.
    let namespace = format!("{}-later", env.namespace);
    let about = regarding(&namespace);
    publisher
        .publish(&about, EventType::Warning, "DeleteFailed", "provider down")
        .await;
    let created = Namespace {
        metadata: ObjectMeta {
            name: Some(namespace.clone()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(env.client.clone())
        .create(&PostParams::default(), &created)
        .await
        .unwrap();
    publisher
        .publish(&about, EventType::Warning, "DeleteFailed", "provider down")
        .await;
    assert_eq!(
        events(&env.client, &namespace, "DeleteFailed").await,
        vec![("provider down".to_owned(), 1)],
        "the failed first publish must not count as a sent Event"
    );
}

#[tokio::test]
async fn a_repeat_of_an_event_that_is_gone_creates_it_again() {
    let env = KubeTestEnv::new("events-gone").await.unwrap();
    let publisher = EventPublisher::new(env.client.clone(), None);
    let about = regarding(&env.namespace);
    publisher
        .publish(&about, EventType::Normal, "Created", "instance i-1")
        .await;
    publisher
        .publish(&about, EventType::Normal, "Created", "instance i-1")
        .await;
    assert_eq!(
        events(&env.client, &env.namespace, "Created").await,
        vec![("instance i-1".to_owned(), 2)]
    );
    // The Event expires (or someone deletes it) while the series window is open.
    let api: Api<Event> = env.namespaced();
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    publisher
        .publish(&about, EventType::Normal, "Created", "instance i-1")
        .await;
    assert_eq!(
        events(&env.client, &env.namespace, "Created").await,
        vec![("instance i-1".to_owned(), 1)],
        "the repeat must not be lost on a patch of a missing Event"
    );
}
