//! Proxies, a stand-in for their VMs' proxy, and waits for Events, for the tests that
//! drive the controller against the reference provider.

use egressproxy_operator::crd::Proxy;
use egressproxy_provider::pb;
use futures::TryStreamExt;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};

/// A stand-in for the VM's proxy: the reference provider's instances report
/// 127.0.0.1, so a listener there answers every health check.
pub async fn proxy_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            drop(stream);
        }
    });
    port
}

/// Proxy `name` of the `reference` provider, checked on `port`, with `extra` merged
/// into its spec.
pub fn proxy(name: &str, port: u16, extra: serde_json::Value) -> Proxy {
    let mut spec = serde_json::json!({
        "provider": "reference",
        "placement": {"machineType": "small", "image": "debian-12"},
        "proxyPort": port,
        "healthCheck": {"periodSeconds": 2, "timeoutSeconds": 1},
    });
    for (key, value) in extra.as_object().cloned().unwrap_or_default() {
        spec[key] = value;
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// Waits (watching Events) until an Event about Proxy `name` has `reason`; returns it.
pub async fn wait_event(events: &Api<Event>, name: &str, reason: &str) -> Event {
    let what = format!("a {reason} Event about {name}");
    wait_event_matching(events, name, &what, |event| {
        event.reason.as_deref() == Some(reason)
    })
    .await
}

/// Waits (watching Events) until an Event about Proxy `name` passes `check`; returns
/// it. Panics with `what` and the Events seen about `name` (reason, note) after [`super::WAIT`].
pub async fn wait_event_matching(
    events: &Api<Event>,
    name: &str,
    what: &str,
    check: impl Fn(&Event) -> bool,
) -> Event {
    let seen = std::cell::RefCell::new(Vec::new());
    let found = watcher(events.clone(), watcher::Config::default())
        .applied_objects()
        .try_filter(|event| {
            let about = event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name);
            if about {
                seen.borrow_mut().push((
                    event.reason.clone().unwrap_or_default(),
                    event.note.clone().unwrap_or_default(),
                ));
            }
            std::future::ready(about && check(event))
        });
    let mut found = std::pin::pin!(found);
    match tokio::time::timeout(super::WAIT, found.try_next()).await {
        Ok(Ok(Some(event))) => event,
        _ => panic!("timed out waiting for {what}: saw {:#?}", seen.borrow()),
    }
}

/// A Create of `key` on the reference provider's `small` machine type and `debian-12`
/// image, tagged with `tags`: an instance made behind the operator's back (an orphan,
/// another cluster's, a superseded one).
pub fn instance_request(key: &str, tags: &[(&str, &str)]) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        tags: tags
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "small".into(),
            image: "debian-12".into(),
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}
