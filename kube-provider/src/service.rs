//! The gRPC face of [`KubeProvider`]: each call's work is in `provider`, and every
//! error becomes a gRPC status here, through the shared
//! [`ProviderError::to_status`](egressproxy_provider::ProviderError::to_status) only.
//!
//! ValidatePlacement and ListLocations are left to the generated defaults
//! (UNIMPLEMENTED), as their capabilities are not declared.

use egressproxy_provider::{CONTRACT_VERSION, pb};
use tonic::{Request, Response, Status};

use crate::provider::KubeProvider;
use crate::record::MANAGED_BY;

#[tonic::async_trait]
impl pb::provider_server::Provider for KubeProvider {
    async fn get_plugin_info(
        &self,
        _request: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: MANAGED_BY.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            contract_version: CONTRACT_VERSION.into(),
            manifest: [
                ("platform".to_owned(), "kubernetes pods".to_owned()),
                ("namespace".to_owned(), self.config().namespace.clone()),
            ]
            .into(),
        }))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        // The watch and tag updates: no vendor-data (no cloud-init at all), node
        // addresses are IPv4 and internal, and an instance's address is its node's, which
        // is stable only as long as the node is: no address identities.
        Ok(Response::new(pb::GetCapabilitiesResponse {
            capabilities: vec![
                pb::Capability::WatchInstances.into(),
                pb::Capability::UpdateTags.into(),
            ],
        }))
    }

    async fn create_instance(
        &self,
        request: Request<pb::CreateInstanceRequest>,
    ) -> Result<Response<pb::CreateInstanceResponse>, Status> {
        let instance = self
            .create(request.into_inner())
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(pb::CreateInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn get_instance(
        &self,
        request: Request<pb::GetInstanceRequest>,
    ) -> Result<Response<pb::GetInstanceResponse>, Status> {
        let instance = self
            .get(&request.into_inner().id)
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(pb::GetInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn delete_instance(
        &self,
        request: Request<pb::DeleteInstanceRequest>,
    ) -> Result<Response<pb::DeleteInstanceResponse>, Status> {
        self.delete(&request.into_inner().id)
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(pb::DeleteInstanceResponse {}))
    }

    async fn list_instances(
        &self,
        request: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        let page = self
            .list(&request.into_inner())
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(page))
    }

    async fn update_instance_tags(
        &self,
        request: Request<pb::UpdateInstanceTagsRequest>,
    ) -> Result<Response<pb::UpdateInstanceTagsResponse>, Status> {
        let instance = self
            .update_tags(request.get_ref())
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(pb::UpdateInstanceTagsResponse {
            instance: Some(instance),
        }))
    }

    async fn watch_instances(
        &self,
        request: Request<pb::WatchInstancesRequest>,
    ) -> Result<Response<egressproxy_provider::watch::WatchStream>, Status> {
        let stream = self
            .watch(&request.into_inner())
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(stream))
    }
}
