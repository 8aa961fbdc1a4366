//! The `egressproxy.provider.v1.Provider` gRPC service of the agent.
//!
//! Each call:
//! 1. takes its deadline from the request's `grpc-timeout` (a little earlier, so the
//!    agent's own DEADLINE_EXCEEDED reaches the caller before the caller gives up), or
//!    `transport.defaultCallTimeout` when the caller set none;
//! 2. runs on [`Instances`] (Create, Get, Delete, List, UpdateInstanceTags), the host check
//!    (ValidatePlacement) or the hosts' figures (ListLocations), every libvirt call bounded by that deadline and traced under
//!    the request's span;
//! 3. answers errors through the crate's one mapping, here at the gRPC edge and nowhere
//!    else: the work returns the crate's [`Error`], which becomes the contract's
//!    [`ProviderError`] ([`Error::to_provider_error`]) and then a `tonic::Status`.
//!
//! WatchInstances streams from [`crate::provider::watch`]'s hub: a sweep of every
//! host each second, and every Create, Delete and tag update at once.
//!
//! ListInstances pages over the matching instances sorted by id with the contract
//! crate's paging: the token names the last id of the previous page (with a checksum, so
//! a token the agent did not issue is INVALID_ARGUMENT), instances created or deleted
//! between pages neither repeat nor shift the rest, and a page stays under 4 MiB. ValidatePlacement resolves the placement as Create would
//! (unknown names are INVALID_ARGUMENT) and runs `check-host` on the chosen host: a
//! failed check is FAILED_PRECONDITION listing what to fix; warnings (TCG instead of KVM)
//! come back as the response's warnings.

use std::time::Duration;

use egressproxy_provider::{
    CONTRACT_VERSION, ProviderError, paging, parse_grpc_timeout, pb, validation,
};
use tokio::time::Instant;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::config::{DomainType, Firmware};
use crate::error::Error;
use crate::libvirt::host::check::{self, Status as CheckStatus};
use crate::provider::instances::Instances;
use crate::provider::locations::list_locations;
use crate::provider::plan::resolve_placement;
use crate::provider::room;
use crate::provider::watch::InstanceWatch;
use crate::transport::call::LibvirtOp;

/// The name GetPluginInfo reports.
pub(crate) const PLUGIN_NAME: &str = "kvm.egressproxy.dev";
/// Instances per ListInstances page when the caller sets no size: the largest, because
/// every page costs a full sweep of the hosts whatever its size (a few round trips plus
/// one metadata read per domain), so fewer pages are cheaper.
pub(crate) const DEFAULT_PAGE_SIZE: usize = paging::MAX_PAGE_SIZE;
/// The optional features the agent has. IPv6: the guest agent and DHCP leases report
/// the global IPv6 addresses of a guest on an IPv6 network, and the agent passes them on.
pub(crate) const CAPABILITIES: [pb::Capability; 6] = [
    pb::Capability::ValidatePlacement,
    pb::Capability::VendorData,
    pb::Capability::Ipv6,
    pb::Capability::ListLocations,
    pb::Capability::WatchInstances,
    pb::Capability::UpdateTags,
];
/// [`CAPABILITIES`], CAPABILITY_ADDRESS_IDENTITY where every host attaches its
/// instances to a libvirt network or to a bridge with a static block (see
/// `plan::address_identities_supported`), and CAPABILITY_REQUESTED_ADDRESS where every
/// host has a static block (`plan::requested_addresses_supported`).
pub(crate) fn capabilities(config: &crate::config::Config) -> Vec<pb::Capability> {
    let mut all = CAPABILITIES.to_vec();
    if crate::provider::plan::address_identities_supported(config) {
        all.push(pb::Capability::AddressIdentity);
    }
    if crate::provider::plan::requested_addresses_supported(config) {
        all.push(pb::Capability::RequestedAddress);
    }
    all
}

/// How much earlier than the caller's deadline the agent gives up.
const DEADLINE_MARGIN: Duration = Duration::from_millis(250);

/// The Provider service on the configured hosts. Cheap to clone.
#[derive(Debug, Clone)]
pub struct KvmProvider {
    instances: Instances,
    watch: InstanceWatch,
}

impl KvmProvider {
    /// The service over `instances`. Its WatchInstances streams follow what
    /// [`KvmProvider::sweep_forever`] finds; without it they see only Creates and
    /// Deletes.
    pub fn new(instances: Instances) -> Self {
        Self {
            instances,
            watch: InstanceWatch::default(),
        }
    }

    /// Sweeps the hosts for WatchInstances every `interval` for ever (see
    /// [`crate::provider::watch`]).
    pub async fn sweep_forever(&self, interval: Duration) {
        self.watch
            .clone()
            .sweep_forever(self.instances.clone(), interval)
            .await;
    }

    /// The deadline of a call whose metadata is `metadata`. See the module docs.
    pub fn deadline(&self, metadata: &MetadataMap) -> Instant {
        match metadata
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
        {
            Some(timeout) => {
                let margin = DEADLINE_MARGIN.min(timeout / 10);
                Instant::now() + timeout - margin
            }
            None => self.instances.pool().default_deadline(),
        }
    }

    /// ValidatePlacement's work; see the module docs.
    pub async fn validate(
        &self,
        placement: Option<&pb::Placement>,
        deadline: Instant,
    ) -> Result<pb::ValidatePlacementResponse, Error> {
        let resolved = resolve_placement(self.instances.config(), placement)?;
        // The host a Create would choose now; without room anywhere, the first that
        // answered, with a warning (room is not a property of the placement).
        let candidates = room::measure(self.instances.pool(), &resolved.candidates, deadline).await;
        let mut warnings = Vec::new();
        let answered = candidates
            .iter()
            .find(|c| c.measured.is_ok())
            .map(|c| c.host.clone());
        let chosen = match room::choose_host(
            candidates,
            &resolved.machine_type.0,
            &resolved.machine_type.1,
            &room::asked(resolved.location.as_ref()),
        ) {
            Ok(host) => host,
            Err(error @ Error::NoRoom { .. }) => {
                warnings.push(format!(
                    "a Create now would answer RESOURCE_EXHAUSTED: {error}"
                ));
                answered.unwrap_or_default()
            }
            Err(error) => return Err(error),
        };
        let host_config = resolved
            .candidates
            .iter()
            .find(|h| h.name == chosen)
            .cloned()
            .unwrap_or_else(|| resolved.candidates[0].clone());
        let host = self.instances.pool().host(&host_config.name)?;
        let needs_uefi = resolved.image.1.firmware == Firmware::Uefi;
        // `auto`: the agent's cached answer (one probe per host per run, shared with
        // Create), not a probe per call.
        let auto = match host_config.domain_type {
            DomainType::Auto => Some(
                self.instances
                    .virt_types()
                    .auto_choice(&host, deadline)
                    .await?,
            ),
            _ => None,
        };
        let report = host
            .call(LibvirtOp::new("check-host"), deadline, move |conn| {
                check::check_host_with(conn, &host_config, needs_uefi, auto)
            })
            .await?;
        let line = |check: &check::Check| match &check.fix {
            Some(fix) => format!("{}: {} (fix: {fix})", check.name, check.detail),
            None => format!("{}: {}", check.name, check.detail),
        };
        let failures: Vec<String> = report
            .checks
            .iter()
            .filter(|c| c.status == CheckStatus::Fail)
            .map(line)
            .collect();
        if !failures.is_empty() {
            return Err(Error::HostNotReady {
                host: report.host,
                failures,
            });
        }
        warnings.extend(
            report
                .checks
                .iter()
                .filter(|c| c.status == CheckStatus::Warn)
                .map(line),
        );
        Ok(pb::ValidatePlacementResponse {
            resolved: Some(resolved.to_contract(&chosen)),
            warnings,
        })
    }

    /// One page of ListInstances.
    pub async fn list_page(
        &self,
        request: &pb::ListInstancesRequest,
        deadline: Instant,
    ) -> Result<pb::ListInstancesResponse, Error> {
        validation::check_list_request(request)?;
        // Refuse a foreign token before sweeping the hosts.
        paging::decode_token(&request.page_token)?;
        let page_size = paging::page_size(request.page_size, DEFAULT_PAGE_SIZE);
        let mut selector: Vec<(String, String)> = request
            .tag_selector
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        selector.sort();
        let mut instances = self.instances.list(&selector, deadline).await?;
        instances.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(paging::page(instances, &request.page_token, page_size)?)
    }
}

/// The answer of a failed call, logged as the caller gets it: a warning when the agent or
/// a host is at fault, debug when the request was (invalid argument, already exists, not
/// found) or lost a race another caller won (TAGS_CHANGED).
fn logged_failure(call: &str, error: Error) -> Status {
    use egressproxy_provider::ErrorClass as C;
    let lost_a_race = matches!(error, Error::TagsChanged { .. });
    let error = ProviderError::from(error);
    match error.class {
        // Another caller's tag update won: the caller reads again, nothing is wrong.
        _ if lost_a_race => tracing::debug!(%error, "{call} refused"),
        C::InvalidArgument | C::AlreadyExists | C::NotFound => {
            tracing::debug!(%error, "{call} refused");
        }
        _ => tracing::warn!(%error, reason = %error.reason, "{call} failed"),
    }
    error.into()
}

#[tonic::async_trait]
impl pb::provider_server::Provider for KvmProvider {
    async fn get_plugin_info(
        &self,
        _request: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        let hosts: Vec<&str> = self.instances.pool().host_names().collect();
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: PLUGIN_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            contract_version: CONTRACT_VERSION.into(),
            manifest: [
                ("hypervisor".to_string(), "libvirt".to_string()),
                ("hosts".to_string(), hosts.join(",")),
            ]
            .into(),
        }))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        Ok(Response::new(pb::GetCapabilitiesResponse {
            capabilities: capabilities(self.instances.config())
                .into_iter()
                .map(Into::into)
                .collect(),
        }))
    }

    async fn create_instance(
        &self,
        request: Request<pb::CreateInstanceRequest>,
    ) -> Result<Response<pb::CreateInstanceResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        let instance = self
            .instances
            .create(request.get_ref(), deadline)
            .await
            .map_err(|e| logged_failure("CreateInstance", e))?;
        self.watch.created(&instance);
        Ok(Response::new(pb::CreateInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn get_instance(
        &self,
        request: Request<pb::GetInstanceRequest>,
    ) -> Result<Response<pb::GetInstanceResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        let instance = self.instances.get(&request.get_ref().id, deadline).await?;
        Ok(Response::new(pb::GetInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn delete_instance(
        &self,
        request: Request<pb::DeleteInstanceRequest>,
    ) -> Result<Response<pb::DeleteInstanceResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        self.instances
            .delete(&request.get_ref().id, deadline)
            .await
            .map_err(|e| logged_failure("DeleteInstance", e))?;
        self.watch.deleted(&request.get_ref().id);
        Ok(Response::new(pb::DeleteInstanceResponse {}))
    }

    async fn watch_instances(
        &self,
        request: Request<pb::WatchInstancesRequest>,
    ) -> Result<Response<egressproxy_provider::watch::WatchStream>, Status> {
        let stream = self
            .watch
            .hub()
            .watch(request.get_ref())
            .map_err(|error| -> Status { error.into() })?;
        Ok(Response::new(stream))
    }

    async fn list_instances(
        &self,
        request: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        Ok(Response::new(
            self.list_page(request.get_ref(), deadline).await?,
        ))
    }

    async fn validate_placement(
        &self,
        request: Request<pb::ValidatePlacementRequest>,
    ) -> Result<Response<pb::ValidatePlacementResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        Ok(Response::new(
            self.validate(request.get_ref().placement.as_ref(), deadline)
                .await?,
        ))
    }

    async fn update_instance_tags(
        &self,
        request: Request<pb::UpdateInstanceTagsRequest>,
    ) -> Result<Response<pb::UpdateInstanceTagsResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        let instance = self
            .instances
            .update_tags(request.get_ref(), deadline)
            .await
            .map_err(|e| logged_failure("UpdateInstanceTags", e))?;
        self.watch.updated(&instance);
        Ok(Response::new(pb::UpdateInstanceTagsResponse {
            instance: Some(instance),
        }))
    }

    async fn list_locations(
        &self,
        request: Request<pb::ListLocationsRequest>,
    ) -> Result<Response<pb::ListLocationsResponse>, Status> {
        let deadline = self.deadline(request.metadata());
        Ok(Response::new(
            list_locations(
                self.instances.config(),
                self.instances.pool(),
                request.get_ref(),
                deadline,
            )
            .await?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::state::to_contract_address;

    /// Every address family the agent can report is declared: a global IPv6 address
    /// reaches callers as a V6 address, so CAPABILITY_IPV6 must be there.
    #[test]
    fn every_address_family_reported_is_declared() {
        for ip in ["192.0.2.10", "2001:db8::10"] {
            let address = to_contract_address(ip.parse().unwrap());
            if address.family() == pb::IpFamily::V6 {
                assert!(CAPABILITIES.contains(&pb::Capability::Ipv6), "{ip}");
            }
        }
    }

    /// Address capabilities follow the hosts' attachments: networks give identities,
    /// static blocks on bridges identities and requested addresses, a bare bridge none.
    #[test]
    fn address_capabilities_follow_the_hosts_attachments() {
        let config =
            |hosts: &str| crate::config::Config::parse(&format!("hosts:\n{hosts}")).unwrap();
        let block = "staticAddresses: {first: 192.0.2.10, last: 192.0.2.20, prefixLength: 24}";
        let table = [
            ("- {name: a, local: true}\n".to_owned(), true, false),
            (
                "- {name: a, local: true, bridge: br0}\n".to_owned(),
                false,
                false,
            ),
            (
                format!("- {{name: a, local: true, bridge: br0, {block}}}\n"),
                true,
                true,
            ),
            (
                format!(
                    "- {{name: a, local: true, bridge: br0, {block}}}\n- {{name: b, local: true}}\n"
                ),
                true,
                false,
            ),
        ];
        for (hosts, identity, requested) in table {
            let declared = capabilities(&config(&hosts));
            assert_eq!(
                (
                    declared.contains(&pb::Capability::AddressIdentity),
                    declared.contains(&pb::Capability::RequestedAddress)
                ),
                (identity, requested),
                "{hosts}"
            );
        }
    }
}
