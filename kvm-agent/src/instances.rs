//! Get, Delete and List as the contract sees them, across the configured hosts.
//!
//! Each runs its libvirt work ([`crate::instance_ops`]) as one call on the host's pooled
//! connection, so it is off the runtime, traced and bounded by the caller's deadline;
//! errors leave as [`ProviderError`]s through the one mapping
//! ([`Error::to_provider_error`]). The contract rules applied here:
//! - an id that does not parse is INVALID_ARGUMENT on `id`;
//! - an id whose host is not (any longer) configured is FAILED_PRECONDITION, not an
//!   endless retry (lesson 10);
//! - Get of a missing domain is NOT_FOUND; Delete of one succeeds;
//! - List fails when any host cannot be reached, so a garbage collector never mistakes
//!   an unreachable host for an empty one.

use std::sync::Arc;

use egressproxy_provider::{ProviderError, pb};
use tokio::time::Instant;

use crate::config::{Attachment, Config, HostConfig};
use crate::error::Error;
use crate::instance_ops::{self, DomainSnapshot, NicKind};
use crate::instance_state::{instance_state, to_contract_address};
use crate::libvirt_call::LibvirtOp;
use crate::naming::{InstanceId, InstanceNames};
use crate::pool::{HostPool, Pool};

/// The instances on every configured host.
#[derive(Debug, Clone)]
pub struct Instances {
    config: Arc<Config>,
    pool: Arc<Pool>,
}

impl Instances {
    /// Instances on the hosts of `config`, reached through `pool`.
    pub fn new(config: Arc<Config>, pool: Arc<Pool>) -> Self {
        Self { config, pool }
    }

    /// The instance `id`: state, addresses, tags, placement.
    pub async fn get(&self, id: &str, deadline: Instant) -> Result<pb::Instance, ProviderError> {
        let (id, host, names) = self.resolve(id)?;
        let nic = nic_kind(host.config());
        let op = LibvirtOp::new("virDomainLookupByName").domain(names.domain.clone());
        let lookup = names.clone();
        let snapshot = host
            .call(op, deadline, move |conn| {
                instance_ops::read_instance(conn, &lookup, nic)
            })
            .await?;
        match snapshot {
            Some(snapshot) => Ok(to_contract_instance(&id.host, snapshot)),
            None => Err(ProviderError::not_found(format!(
                "instance {id} does not exist (no domain {} on host {})",
                names.domain, id.host
            ))),
        }
    }

    /// Deletes the instance `id` with its overlay and seed; a missing one is success.
    pub async fn delete(&self, id: &str, deadline: Instant) -> Result<(), ProviderError> {
        let (id, host, names) = self.resolve(id)?;
        let storage_pool = host.config().storage_pool.clone();
        let op = LibvirtOp::new("virDomainUndefineFlags").domain(names.domain.clone());
        let deleted = host
            .call(op, deadline, move |conn| {
                instance_ops::delete_instance(conn, &names, &storage_pool)
            })
            .await?;
        tracing::info!(
            instance.id = %id,
            domain_deleted = deleted.domain,
            volumes_deleted = deleted.volumes.len(),
            "deleted instance"
        );
        Ok(())
    }

    /// Every instance, on every host, whose tags contain all of `selector`; sorted by
    /// host, then domain name.
    pub async fn list(
        &self,
        selector: &[(String, String)],
        deadline: Instant,
    ) -> Result<Vec<pb::Instance>, ProviderError> {
        let mut instances = Vec::new();
        for host in &self.config.hosts {
            let pool = self.pool.host(&host.name)?;
            let selector = selector.to_vec();
            let found = pool
                .call(
                    LibvirtOp::new("virConnectListAllDomains"),
                    deadline,
                    move |conn| instance_ops::list_instances(conn, &selector),
                )
                .await?;
            instances.extend(
                found
                    .into_iter()
                    .map(|snapshot| to_contract_instance(&host.name, snapshot)),
            );
        }
        Ok(instances)
    }

    fn resolve(
        &self,
        id: &str,
    ) -> Result<(InstanceId, Arc<HostPool>, InstanceNames), ProviderError> {
        egressproxy_provider::validation::check_id(id)?;
        let parsed = InstanceId::parse(id).ok_or_else(|| {
            ProviderError::invalid_argument(
                "id",
                "not an id this provider returned (expected <host>/<key>)",
            )
        })?;
        let host = self.pool.host(&parsed.host).map_err(|e| match e {
            Error::UnknownHost { .. } => e.to_provider_error().with_reason("HOST_NOT_CONFIGURED"),
            other => other.to_provider_error(),
        })?;
        let names = InstanceNames::for_key(&parsed.key)
            .map_err(|e| ProviderError::invalid_argument("id", e.to_string()))?;
        Ok((parsed, host, names))
    }
}

fn nic_kind(host: &HostConfig) -> NicKind {
    match host.attachment() {
        Attachment::Network(_) => NicKind::Network,
        Attachment::Bridge(_) => NicKind::Bridge,
    }
}

/// The contract's view of a domain on `host`.
pub fn to_contract_instance(host: &str, snapshot: DomainSnapshot) -> pb::Instance {
    let (state, message) = instance_state(snapshot.state, !snapshot.addresses.is_empty());
    let metadata = snapshot.metadata;
    let id = InstanceId {
        host: host.to_owned(),
        key: metadata.key.clone(),
    };
    pb::Instance {
        id: id.to_string(),
        key: metadata.key,
        name: metadata.name,
        state: state.into(),
        state_message: message.to_owned(),
        addresses: snapshot
            .addresses
            .into_iter()
            .map(to_contract_address)
            .collect(),
        create_time: metadata.created.parse().ok(),
        tags: metadata.tags.into_iter().collect(),
        placement: Some(pb::Placement {
            location: Some(pb::placement::Location::Host(metadata.placement.host)),
            machine_type: metadata.placement.machine_type,
            image: metadata.placement.image,
        }),
        proxy_port: metadata.proxy_port,
    }
}
