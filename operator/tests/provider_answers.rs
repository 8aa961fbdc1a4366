//! Answers a provider must not give, as the operator reads them: a CreateInstance
//! answer without an instance (or with an empty id) is a provider bug, reported and
//! retried (Create is idempotent), never recorded as an empty provider id. Before, the
//! operator took `instance.unwrap_or_default()` and recorded "" while GetInstance
//! refused the same answer. A small fake serves the broken answers; no real provider
//! can be made to give them.

use std::sync::Arc;

use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::error::{Error, Retry};
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::pb;
use egressproxy_provider::server::ProviderServer;
use tonic::{Request, Response, Status};

/// Answers CreateInstance with `instance`, and nothing else.
struct Answers {
    instance: Option<pb::Instance>,
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not part of this fake"))
}

#[tonic::async_trait]
impl pb::provider_server::Provider for Answers {
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
        Ok(Response::new(pb::CreateInstanceResponse {
            instance: self.instance.clone(),
        }))
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
    async fn list_instances(
        &self,
        _: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        unimplemented()
    }
    async fn validate_placement(
        &self,
        _: Request<pb::ValidatePlacementRequest>,
    ) -> Result<Response<pb::ValidatePlacementResponse>, Status> {
        unimplemented()
    }
}

async fn providers_answering(instance: Option<pb::Instance>) -> Providers {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(ProviderServer::new(Answers { instance }).serve(listener, std::future::pending()));
    let config = ProvidersConfig::parse(&format!(
        "providers:\n  broken:\n    endpoint: {endpoint}\n    callTimeout: 5s\n"
    ))
    .unwrap();
    Providers::new(config, Arc::new(Metrics::default()))
}

#[tokio::test]
async fn a_create_answer_without_an_instance_is_a_retried_provider_bug() {
    let empty_id = pb::Instance {
        key: "uid-0".into(),
        ..Default::default()
    };
    for instance in [None, Some(empty_id)] {
        let providers = providers_answering(instance.clone()).await;
        let provider = providers.get("broken").unwrap();
        let error = provider
            .create(pb::CreateInstanceRequest {
                key: "uid-0".into(),
                ..Default::default()
            })
            .await
            .expect_err("an answer without an instance id is not an instance");
        let Error::Provider { source, op, .. } = &error else {
            panic!("{instance:?}: {error:?}");
        };
        assert_eq!(*op, "CreateInstance");
        assert_eq!(source.reason, "MALFORMED_RESPONSE", "{instance:?}");
        assert_eq!(error.retry(), Retry::Backoff, "{instance:?}");
    }
}
