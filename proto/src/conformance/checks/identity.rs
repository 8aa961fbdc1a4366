//! Who the provider is and what it says it can do: health, reflection, plugin info,
//! capabilities that match behaviour, and trace context accepted.

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe};
use crate::pb;
use crate::validation::MAX_STRING_BYTES;

const PROVIDER_SERVICE: &str = "egressproxy.provider.v1.Provider";
/// The most bytes of keys and values GetPluginInfoResponse.manifest may hold.
const MAX_MANIFEST_BYTES: usize = 4096;

/// Semantic Versioning 2.0: `MAJOR.MINOR.PATCH`, numbers without leading zeros, then
/// optional `-pre.release` and `+build` identifiers of `[0-9A-Za-z-]`.
pub(crate) fn is_semver(version: &str) -> bool {
    let (rest, build) = match version.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (version, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let number = |part: &str| {
        !part.is_empty()
            && part.bytes().all(|b| b.is_ascii_digit())
            && (part == "0" || !part.starts_with('0'))
    };
    let identifiers = |text: &str, numeric_rule: bool| {
        text.split('.').all(|id| {
            !id.is_empty()
                && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && (!numeric_rule || !id.bytes().all(|b| b.is_ascii_digit()) || number(id))
        })
    };
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|part| number(part))
        && pre.is_none_or(|pre| identifiers(pre, true))
        && build.is_none_or(|build| identifiers(build, false))
}

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
        for (field, version) in [
            ("vendor_version", &info.vendor_version),
            ("contract_version", &info.contract_version),
        ] {
            if !is_semver(version) || version.len() > MAX_STRING_BYTES {
                return Err(Outcome::fail(
                    format!(
                        "{field} is a semantic version (MAJOR.MINOR.PATCH) of at most {MAX_STRING_BYTES} bytes"
                    ),
                    format!("{field} {version:?}"),
                ));
            }
        }
        let manifest_bytes: usize = info.manifest.iter().map(|(k, v)| k.len() + v.len()).sum();
        if info.name.len() > MAX_STRING_BYTES || manifest_bytes > MAX_MANIFEST_BYTES {
            return Err(Outcome::fail(
                format!(
                    "a name of at most {MAX_STRING_BYTES} bytes and a manifest of at most {MAX_MANIFEST_BYTES}"
                ),
                format!(
                    "a {}-byte name, a {manifest_bytes}-byte manifest",
                    info.name.len()
                ),
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
        let validated = self.client.validate_placement(placement).await.map(|_| ());
        declared_matches(
            "ValidatePlacement",
            "CAPABILITY_VALIDATE_PLACEMENT",
            capabilities.contains(&pb::Capability::ValidatePlacement),
            validated,
        )?;
        let listed = self
            .client
            .list_locations(pb::ListLocationsRequest::default())
            .await
            .map(|_| ());
        declared_matches(
            "ListLocations",
            "CAPABILITY_LIST_LOCATIONS",
            capabilities.contains(&pb::Capability::ListLocations),
            listed,
        )?;
        let nothing = pb::WatchInstancesRequest {
            tag_selector: [(TAG.to_owned(), format!("not-{}", self.ledger.run_id()))].into(),
            ..Default::default()
        };
        let watched = self.client.watch_instances(nothing).await.map(drop);
        declared_matches(
            "WatchInstances",
            "CAPABILITY_WATCH_INSTANCES",
            capabilities.contains(&pb::Capability::WatchInstances),
            watched,
        )?;
        let update = pb::UpdateInstanceTagsRequest {
            id: format!("cf-{}-no-such-instance", self.ledger.run_id()),
            ..Default::default()
        };
        let updated = self.client.update_instance_tags(update).await.map(drop);
        declared_matches(
            "UpdateInstanceTags",
            "CAPABILITY_UPDATE_TAGS",
            capabilities.contains(&pb::Capability::UpdateTags),
            updated,
        )?;
        if capabilities.contains(&pb::Capability::VendorData) {
            let mut request = self.request("vendor-data");
            if let Some(cloud_init) = request.cloud_init.as_mut() {
                cloud_init.vendor_data = Some(b"#cloud-config\n{}\n".to_vec());
            }
            let created = self.create_raw(request).await.map_err(|status| {
                Outcome::fail(
                    "Create with vendor_data succeeds, as CAPABILITY_VENDOR_DATA declares",
                    describe::status(&status),
                )
            })?;
            self.delete(&created.id).await?;
        } else {
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

    pub(super) async fn trace_context_accepted(&mut self) -> Checked {
        let parents = [
            (
                "a well-formed traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
            ("a malformed traceparent", "not-a-trace-context"),
        ];
        for (what, value) in parents {
            let parent: tonic::metadata::MetadataValue<_> = value.parse().expect("ASCII metadata");
            let selector = self.ledger.selector();
            let with_parent = parent.clone();
            let info = self
                .retrying("GetPluginInfo", |mut client| {
                    let mut info = tonic::Request::new(pb::GetPluginInfoRequest {});
                    info.metadata_mut()
                        .insert("traceparent", with_parent.clone());
                    async move { client.get_plugin_info(info).await }
                })
                .await;
            let answered = match info {
                Ok(_) => self
                    .retrying("ListInstances", |mut client| {
                        let mut list = tonic::Request::new(pb::ListInstancesRequest {
                            tag_selector: selector.clone(),
                            page_size: Some(1),
                            page_token: String::new(),
                        });
                        list.metadata_mut().insert("traceparent", parent.clone());
                        async move { client.list_instances(list).await }
                    })
                    .await
                    .map(|_| ()),
                Err(status) => Err(status),
            };
            if let Err(status) = answered {
                return Err(Outcome::fail(
                    format!("GetPluginInfo and ListInstances with {what} succeed"),
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }
}

/// An optional call is implemented exactly when its capability is declared: with it,
/// never UNIMPLEMENTED; without it, UNIMPLEMENTED and nothing else.
fn declared_matches(
    call: &str,
    capability: &str,
    declared: bool,
    answer: Result<(), tonic::Status>,
) -> Checked {
    match (declared, answer) {
        (true, Err(status)) if status.code() == tonic::Code::Unimplemented => Err(Outcome::fail(
            format!("{call} implemented, as {capability} declares"),
            describe::status(&status),
        )),
        (false, Ok(())) => Err(Outcome::fail(
            format!(
                "{call} answers UNIMPLEMENTED without {capability} (or the capability is declared)"
            ),
            "success: the call is implemented but not declared",
        )),
        (false, Err(status)) if status.code() != tonic::Code::Unimplemented => Err(Outcome::fail(
            format!("{call} answers UNIMPLEMENTED without {capability}"),
            describe::status(&status),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::is_semver;

    #[test]
    fn versions_are_semantic_versions() {
        for good in [
            "1.0.0",
            "1.1.0",
            "0.1.0",
            "10.20.30",
            "1.0.0-rc.1",
            "1.0.0+abc.5",
            "1.0.0-alpha-1+x",
        ] {
            assert!(is_semver(good), "{good}");
        }
        for bad in [
            "",
            "1",
            "1.0",
            "v1.0.0",
            "01.0.0",
            "1.0.0-",
            "1.0.0-01",
            "1.0.0+",
            "latest",
            "1.0.0.0",
            "1.0.0-a..b",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
    }
}
