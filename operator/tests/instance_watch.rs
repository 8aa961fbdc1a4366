//! The operator learns instance changes from the provider's WatchInstances stream,
//! against a real kube-apiserver and the reference provider as a process. The Proxies
//! here are polled only once an hour (every backoff and the health check period set
//! long), so a Proxy that becomes Ready, or recovers, within the test's wait can only
//! have been told by the watch.

mod common;

use std::time::Duration;

use common::fixtures::{proxy, proxy_port};
use common::freezing_relay::FreezingRelay;
use common::{Controller, reference_config, wait_ready};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::Proxy;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::shared::backoff::Backoff;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use kube::api::{Api, PostParams};

/// Longer than any wait of the test: a reconcile that comes from a requeue would come
/// too late to pass it.
const HOUR: Duration = Duration::from_secs(3600);

/// Makes every requeue an hour away.
fn poll_hourly(ctx: &mut Context) {
    ctx.poll_backoff = Backoff::new(HOUR, HOUR);
    ctx.retry_backoff = Backoff::new(HOUR, HOUR);
}

fn start_controller(
    env: &egressproxy_integration::kube_env::KubeTestEnv,
    provider: &ReferenceProvider,
    configure: impl FnOnce(&mut Context),
) -> Controller {
    start_controller_at(env, provider.endpoint(), configure)
}

fn start_controller_at(
    env: &egressproxy_integration::kube_env::KubeTestEnv,
    endpoint: &str,
    configure: impl FnOnce(&mut Context),
) -> Controller {
    Controller::start_configured(
        env,
        WatchScope::Namespaces(vec![env.namespace.clone()]),
        &reference_config(endpoint, "5s"),
        &format!("test-{}", env.namespace),
        configure,
    )
}

/// A Proxy checked every hour.
fn hourly_proxy(name: &str, port: u16) -> Proxy {
    proxy(
        name,
        port,
        serde_json::json!({"healthCheck": {"periodSeconds": 3600, "timeoutSeconds": 1}}),
    )
}

async fn call_count(provider: &ReferenceProvider, method: &str) -> u64 {
    let counts = ControlServiceClient::connect(provider.endpoint().to_owned())
        .await
        .unwrap()
        .get_call_counts(control::GetCallCountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .counts;
    counts.get(method).copied().unwrap_or_default()
}

/// The value of the metric line that starts with `series`, if any.
fn metric(controller: &Controller, series: &str) -> Option<f64> {
    controller
        .ctx
        .metrics
        .encode()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn a_proxy_becomes_ready_when_the_watch_says_running_not_at_its_next_poll() {
    let env = common::env_with_crd("watch-ready").await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "1s"]).unwrap();
    let controller = start_controller(&env, &provider, poll_hourly);
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(&PostParams::default(), &hourly_proxy("p", port))
        .await
        .unwrap();
    let ready = wait_ready(&proxies, "p").await;
    let status = ready.status.unwrap();
    assert!(status.provider_id.is_some(), "{status:?}");
    assert!(
        call_count(&provider, "WatchInstances").await >= 1,
        "the operator opened a watch"
    );
    assert_eq!(
        metric(
            &controller,
            "egressproxy_provider_watch_up{provider=\"reference\"}"
        ),
        Some(1.0)
    );
    let updates = metric(
        &controller,
        "egressproxy_provider_watch_events_total{provider=\"reference\",type=\"UPDATED\"}",
    );
    assert!(
        updates >= Some(2.0),
        "PROVISIONING, then RUNNING: {updates:?}"
    );
}

#[tokio::test]
async fn a_watch_broken_by_a_provider_restart_comes_back_and_tells_what_went() {
    let env = common::env_with_crd("watch-restart").await;
    let mut provider = ReferenceProvider::start(&["--provisioning-delay", "1s"]).unwrap();
    let address = provider.address().to_owned();
    let controller = start_controller(&env, &provider, poll_hourly);
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(&PostParams::default(), &hourly_proxy("p", port))
        .await
        .unwrap();
    let before = wait_ready(&proxies, "p").await;
    let old_id = before.status.unwrap().provider_id.unwrap();

    // The provider restarts on the same address with no instances (they lived in its
    // memory): the operator's stream breaks, is reopened with its token, and the
    // provider answers RESTARTED with a snapshot that lacks the Proxy's instance.
    provider.kill();
    let provider = ReferenceProvider::start_at(&address, &["--provisioning-delay", "1s"]).unwrap();
    let replaced = common::wait_until(
        &proxies,
        "p",
        "a new instance, Ready",
        |p: Option<&Proxy>| {
            p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
                s.provider_id.as_deref().is_some_and(|id| id != old_id)
                    && s.phase == Some(egressproxy_operator::crd::Phase::Ready)
            })
        },
    )
    .await
    .unwrap();
    assert_eq!(replaced.status.unwrap().replacements, 1);
    assert!(
        call_count(&provider, "WatchInstances").await >= 1,
        "the operator watches the restarted provider"
    );
    let restarts = metric(
        &controller,
        "egressproxy_provider_watch_events_total{provider=\"reference\",type=\"RESTARTED\"}",
    );
    assert_eq!(restarts, Some(1.0));
    assert_eq!(
        metric(
            &controller,
            "egressproxy_provider_watch_up{provider=\"reference\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test]
async fn a_provider_without_the_capability_is_polled_and_never_watched() {
    let env = common::env_with_crd("watch-none").await;
    // WatchInstances works, but the provider does not declare it: the operator must
    // not call it.
    let provider = ReferenceProvider::start(&[
        "--provisioning-delay",
        "1s",
        "--misbehave",
        "watch-undeclared",
    ])
    .unwrap();
    let controller = start_controller(&env, &provider, |_| {});
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(&PostParams::default(), &hourly_proxy("p", port))
        .await
        .unwrap();
    wait_ready(&proxies, "p").await;
    assert_eq!(call_count(&provider, "WatchInstances").await, 0);
    let text = controller.ctx.metrics.encode();
    assert!(!text.contains("egressproxy_provider_watch_up{"), "{text}");
}

#[tokio::test]
async fn a_watch_cut_off_mid_stream_resumes_after_its_last_event() {
    let env = common::env_with_crd("watch-resume").await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "3s"]).unwrap();
    // The operator reaches the provider through a relay that can cut its connections.
    let relay = FreezingRelay::start(provider.address().parse().unwrap()).await;
    let controller = start_controller_at(&env, &format!("http://{}", relay.address()), poll_hourly);
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(&PostParams::default(), &hourly_proxy("p", port))
        .await
        .unwrap();
    let created = common::wait_until(&proxies, "p", "an instance", |p: Option<&Proxy>| {
        p.and_then(|p| p.status.as_ref())
            .is_some_and(|s| s.provider_id.is_some())
    })
    .await
    .unwrap();
    let id = created.status.unwrap().provider_id.unwrap();
    assert_eq!(
        metric(
            &controller,
            "egressproxy_provider_watch_up{provider=\"reference\"}"
        ),
        Some(1.0)
    );

    // The connection dies and no new one gets through while the instance turns RUNNING:
    // only a stream that resumes after its last event can tell the operator.
    relay.refuse();
    relay.cut();
    let client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(provider.endpoint()),
    )
    .unwrap();
    let mut running = ControlServiceClient::connect(provider.endpoint().to_owned())
        .await
        .unwrap();
    drop(
        running
            .get_call_counts(control::GetCallCountsRequest {})
            .await,
    );
    wait_running(client, &id).await;
    relay.thaw();

    wait_ready(&proxies, "p").await;
    let count = |type_: &str| {
        metric(
            &controller,
            &format!(
                "egressproxy_provider_watch_events_total{{provider=\"reference\",type=\"{type_}\"}}"
            ),
        )
    };
    assert_eq!(
        count("SYNCED"),
        Some(1.0),
        "a resumed stream sends no snapshot"
    );
    assert_eq!(count("RESTARTED"), None, "it went on after its last event");
}

/// Waits until the provider reports instance `id` RUNNING (its watch, from the test's
/// own connection).
async fn wait_running(mut client: egressproxy_provider::client::Client, id: &str) {
    let request = egressproxy_provider::pb::WatchInstancesRequest {
        id: id.to_owned(),
        ..Default::default()
    };
    let mut stream = client.watch_instances(request).await.unwrap().into_inner();
    let running = async {
        while let Some(event) = stream.message().await.unwrap() {
            if event
                .instance
                .is_some_and(|i| i.state() == egressproxy_provider::pb::InstanceState::Running)
            {
                return;
            }
        }
    };
    tokio::time::timeout(common::WAIT, running)
        .await
        .expect("the instance never ran");
}
