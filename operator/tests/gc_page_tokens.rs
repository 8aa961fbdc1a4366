//! Garbage collection against a provider whose ListInstances pages form a cycle
//! (A → B → A) or never end (a new token on every page), provider bugs no real provider
//! here can be made to show, so a small fake serves them; the operator side (sweep,
//! Context, apiserver) is real. The sweep must stop, skip that provider, and log why.

mod common;

use std::sync::{Arc, Mutex};

use egressproxy_operator::context::Context;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::pb;
use egressproxy_provider::server::ProviderServer;
use tonic::{Request, Response, Status};
use tracing_subscriber::layer::SubscriberExt;

/// Answers ListInstances with pages whose next tokens follow `tokens` by page token;
/// without `tokens`, every page hands out a token never seen before.
struct CyclingPages {
    /// (page token asked for, next page token handed out).
    tokens: Option<Vec<(&'static str, &'static str)>>,
    pages_served: Arc<Mutex<u32>>,
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not part of this fake"))
}

#[tonic::async_trait]
impl pb::provider_server::Provider for CyclingPages {
    async fn get_plugin_info(
        &self,
        _: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        unimplemented()
    }
    async fn get_capabilities(
        &self,
        _: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        unimplemented()
    }
    async fn create_instance(
        &self,
        _: Request<pb::CreateInstanceRequest>,
    ) -> Result<Response<pb::CreateInstanceResponse>, Status> {
        unimplemented()
    }
    async fn get_instance(
        &self,
        _: Request<pb::GetInstanceRequest>,
    ) -> Result<Response<pb::GetInstanceResponse>, Status> {
        unimplemented()
    }
    async fn delete_instance(
        &self,
        _: Request<pb::DeleteInstanceRequest>,
    ) -> Result<Response<pb::DeleteInstanceResponse>, Status> {
        unimplemented()
    }
    async fn validate_placement(
        &self,
        _: Request<pb::ValidatePlacementRequest>,
    ) -> Result<Response<pb::ValidatePlacementResponse>, Status> {
        unimplemented()
    }
    async fn list_instances(
        &self,
        request: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        let asked = request.into_inner().page_token;
        let served = {
            let mut served = self.pages_served.lock().unwrap();
            *served += 1;
            *served
        };
        let next = match &self.tokens {
            Some(tokens) => tokens
                .iter()
                .find(|(token, _)| *token == asked)
                .map(|(_, next)| (*next).to_owned())
                .unwrap_or_default(),
            None => format!("page-{served}"),
        };
        Ok(Response::new(pb::ListInstancesResponse {
            instances: Vec::new(),
            next_page_token: next,
        }))
    }
}

/// Log lines written while a test runs.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn sweep_with_pages(
    tokens: Option<Vec<(&'static str, &'static str)>>,
) -> (Vec<String>, u32, String) {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(move || writer.clone()),
    );
    let _guard = tracing::subscriber::set_default(subscriber);

    let env = common::env_with_crd("gc-pages").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let pages_served = Arc::new(Mutex::new(0));
    let fake = CyclingPages {
        tokens,
        pages_served: pages_served.clone(),
    };
    tokio::spawn(ProviderServer::new(fake).serve(listener, std::future::pending()));
    let config = ProvidersConfig::parse(&format!(
        "providers:\n  cyclic:\n    endpoint: {endpoint}\n    callTimeout: 5s\n"
    ))
    .unwrap();
    let metrics = Arc::new(Metrics::default());
    let ctx = Context::new(
        env.client.clone(),
        Providers::new(config, metrics.clone()),
        "gc-pages".into(),
        metrics,
    );
    let cache = common::follow(&env.client, WatchScope::Namespaces(vec![env.namespace])).await;
    let sweep = egressproxy_operator::proxy::gc::sweep(&ctx, &cache, std::time::Duration::ZERO);
    let report = tokio::time::timeout(std::time::Duration::from_secs(30), sweep)
        .await
        .expect("the sweep must stop on a page walk that does not end");
    let served = *pages_served.lock().unwrap();
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    (report.failed_providers, served, text)
}

#[tokio::test]
async fn a_page_token_cycle_stops_the_sweep_of_that_provider_and_says_why() {
    let (failed, served, logs) =
        sweep_with_pages(Some(vec![("", "A"), ("A", "B"), ("B", "A")])).await;
    assert_eq!(failed, vec!["cyclic".to_owned()]);
    assert_eq!(served, 3, "pages '', A, B; then A again is refused");
    assert!(
        logs.contains("page token \\\"A\\\"") || logs.contains("page token \"A\""),
        "the log names the repeated token: {logs}"
    );
    assert!(logs.contains("cycle"), "{logs}");
}

#[tokio::test]
async fn a_repeated_page_token_stops_the_sweep_too() {
    let (failed, served, logs) = sweep_with_pages(Some(vec![("", "A"), ("A", "A")])).await;
    assert_eq!(failed, vec!["cyclic".to_owned()]);
    assert_eq!(served, 2);
    assert!(
        logs.contains("PAGE_TOKEN_CYCLE") || logs.contains("cycle"),
        "{logs}"
    );
}

#[tokio::test]
async fn a_page_walk_that_never_ends_stops_at_the_contracts_cap() {
    let (failed, served, logs) = sweep_with_pages(None).await;
    assert_eq!(failed, vec!["cyclic".to_owned()]);
    let cap = egressproxy_provider::validation::MAX_LIST_PAGES;
    assert_eq!(served as usize, cap, "the walk stops after {cap} pages");
    assert!(
        logs.contains(&format!("{cap} pages")) && logs.contains("never ends"),
        "the log says why: {logs}"
    );
}
