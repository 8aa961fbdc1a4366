//! Who the provider is and what it says it can do: health, reflection, plugin info,
//! and capabilities that match behaviour.

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, describe};
use crate::pb;

const PROVIDER_SERVICE: &str = "egressproxy.provider.v1.Provider";

impl Suite<'_> {
    pub(super) async fn health_serving(&mut self) -> Checked {
        let mut health = HealthClient::new(self.channel.clone());
        for service in [PROVIDER_SERVICE, ""] {
            let shown = if service.is_empty() {
                "\"\" (the server)"
            } else {
                service
            };
            let mut request = tonic::Request::new(HealthCheckRequest {
                service: service.to_owned(),
            });
            request.set_timeout(std::time::Duration::from_secs(10));
            let answer = health.check(request).await.map_err(|status| {
                Outcome::fail(
                    format!("grpc.health.v1.Health/Check for {shown} answers SERVING"),
                    describe::status(&status),
                )
            })?;
            let status = answer.into_inner().status();
            if status != ServingStatus::Serving {
                return Err(Outcome::fail(
                    format!("grpc.health.v1.Health/Check for {shown} answers SERVING"),
                    status.as_str_name(),
                ));
            }
        }
        Ok(())
    }

    async fn reflect(&self, request: MessageRequest) -> Result<MessageResponse, String> {
        let mut client = ServerReflectionClient::new(self.channel.clone());
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(request),
        };
        let mut call = tonic::Request::new(tokio_stream::iter([request]));
        call.set_timeout(std::time::Duration::from_secs(10));
        let mut answers = client
            .server_reflection_info(call)
            .await
            .map_err(|status| describe::status(&status))?
            .into_inner();
        match answers.message().await {
            Ok(Some(ServerReflectionResponse {
                message_response: Some(response),
                ..
            })) => Ok(response),
            Ok(_) => Err("an empty reflection stream".into()),
            Err(status) => Err(describe::status(&status)),
        }
    }

    pub(super) async fn reflection(&mut self) -> Checked {
        let expected = format!("reflection v1 lists {PROVIDER_SERVICE}");
        let listed = match self
            .reflect(MessageRequest::ListServices(String::new()))
            .await
        {
            Ok(MessageResponse::ListServicesResponse(list)) => list,
            Ok(_) => {
                return Err(Outcome::fail(
                    expected,
                    "an answer that is not a service list",
                ));
            }
            Err(got) => return Err(Outcome::fail(expected, got)),
        };
        let names: Vec<String> = listed.service.into_iter().map(|s| s.name).collect();
        if !names.iter().any(|n| n == PROVIDER_SERVICE) {
            return Err(Outcome::fail(
                expected,
                format!("services [{}]", names.join(", ")),
            ));
        }
        for symbol in [
            "google.rpc.ErrorInfo",
            "google.rpc.BadRequest",
            "google.rpc.Status",
        ] {
            let expected = format!(
                "reflection v1 serves the file defining {symbol}, so clients decode error details"
            );
            match self
                .reflect(MessageRequest::FileContainingSymbol(symbol.into()))
                .await
            {
                Ok(MessageResponse::FileDescriptorResponse(files))
                    if !files.file_descriptor_proto.is_empty() => {}
                Ok(MessageResponse::ErrorResponse(error)) => {
                    return Err(Outcome::fail(
                        expected,
                        format!("error {}: {}", error.error_code, error.error_message),
                    ));
                }
                Ok(_) => return Err(Outcome::fail(expected, "no file descriptor")),
                Err(got) => return Err(Outcome::fail(expected, got)),
            }
        }
        Ok(())
    }

    pub(super) async fn plugin_info(&mut self) -> Checked {
        let info = self
            .client
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .map_err(|status| Outcome::fail("GetPluginInfo answers", describe::status(&status)))?
            .into_inner();
        let valid_name = info.name.contains('.')
            && info.name.split('.').all(|label| {
                !label.is_empty()
                    && label
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            });
        if !valid_name {
            return Err(Outcome::fail(
                "name is a lowercase dotted domain name such as kvm.egressproxy.dev",
                format!("name {:?}", info.name),
            ));
        }
        let major = |version: &str| version.split('.').next().unwrap_or_default().to_owned();
        let expected = major(crate::CONTRACT_VERSION);
        if major(&info.contract_version) != expected {
            return Err(Outcome::fail(
                format!("contract_version {expected}.x"),
                format!("contract_version {:?}", info.contract_version),
            ));
        }
        Ok(())
    }

    pub(super) async fn capabilities_match_behaviour(&mut self) -> Checked {
        let capabilities = self.capabilities().await?;
        let placement = pb::ValidatePlacementRequest {
            placement: Some(self.target.placement.clone()),
        };
        let validated = self.client.validate_placement(placement).await;
        match (
            capabilities.contains(&pb::Capability::ValidatePlacement),
            validated,
        ) {
            (true, Err(status)) if status.code() == tonic::Code::Unimplemented => {
                return Err(Outcome::fail(
                    "ValidatePlacement implemented, as CAPABILITY_VALIDATE_PLACEMENT declares",
                    describe::status(&status),
                ));
            }
            (false, Ok(_)) => {
                return Err(Outcome::fail(
                    "ValidatePlacement answers UNIMPLEMENTED without CAPABILITY_VALIDATE_PLACEMENT (or the capability is declared)",
                    "success: the call is implemented but not declared",
                ));
            }
            (false, Err(status)) if status.code() != tonic::Code::Unimplemented => {
                return Err(Outcome::fail(
                    "ValidatePlacement answers UNIMPLEMENTED without CAPABILITY_VALIDATE_PLACEMENT",
                    describe::status(&status),
                ));
            }
            _ => {}
        }
        if !capabilities.contains(&pb::Capability::VendorData) {
            let mut request = self.request("vendor-data");
            if let Some(cloud_init) = request.cloud_init.as_mut() {
                cloud_init.vendor_data = Some(b"#cloud-config\n{}\n".to_vec());
            }
            let result = self.create_raw(request).await;
            let status = expect_code(
                result,
                tonic::Code::InvalidArgument,
                "Create with vendor_data, without CAPABILITY_VENDOR_DATA",
            )?;
            let details = tonic_types::StatusExt::get_error_details(&status);
            let named = details.bad_request().is_some_and(|bad| {
                bad.field_violations
                    .iter()
                    .any(|v| v.field == "cloud_init.vendor_data")
            });
            if !named {
                return Err(Outcome::fail(
                    "BadRequest naming cloud_init.vendor_data",
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }
}
