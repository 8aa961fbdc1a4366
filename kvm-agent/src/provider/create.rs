//! CreateInstance on one host, idempotent at every step.
//!
//! [`crate::provider::instances::Instances::create`] plans the request, takes the key's lock and
//! then:
//! 1. **existing domain** ([`existing_instance`]), on the planned host and then on every
//!    other configured host, since a key names one instance whatever host it is on: a
//!    domain for the key whose metadata has the same spec digest is started if it is not
//!    running and returned; another digest is ALREADY_EXISTS naming the key and its host;
//!    on the planned host, a domain with the name but not the agent's metadata is
//!    ALREADY_EXISTS too (it is never touched). Another host that cannot answer within a
//!    few seconds is skipped and logged, so one host down does not stop Creates;
//! 2. **base image**: the content-addressed base volume, from the image cache;
//! 3. **overlay** (`create_from_base` from here on): a qcow2 overlay on the base file,
//!    as large as the machine type's disk and never smaller than the base; created in one
//!    libvirt call, reused when an earlier attempt made it for the same base and size
//!    (remade when the image or machine type changed in between);
//! 4. **seed**: any old seed volume deleted, a new one created and the NoCloud image
//!    (built in memory) uploaded, always, before the domain exists (a cancelled attempt may
//!    have left a truncated seed, so one is never reused). On a bridge host with a static
//!    block, the host's allocation lock is taken first and the address chosen
//!    ([`crate::libvirt::static_addresses`]): the seed's `network-config` configures it,
//!    and the lock is held until step 5 records it in the domain's metadata;
//! 5. **define** the domain: file disks whose paths libvirt reported for the volumes,
//!    the metadata element with key, name, tags, creation time and spec digest;
//! 6. with an address identity, **reserve** its address: reservations no domain holds
//!    any longer are swept, then the network's DHCP host entry for the identity's MAC
//!    (which the domain's NIC has) is found or made ([`crate::libvirt::reservations`]);
//!    after the define, so a reservation never exists without its domain, and before the
//!    start, so the guest's first DHCP request gets the address;
//! 7. **start** it, and return the instance (PROVISIONING until it has an address).
//!
//! Before step 2, a new instance with an address identity is refused while another
//! key's instance of the identity exists on the host (ADDRESS_IDENTITY_IN_USE).
//!
//! A failure at any point leaves only what a repeated Create reuses (overlay, defined
//! domain) or replaces (seed): a retry ends with one running domain, one overlay and one
//! seed. [`FaultHook`] lets tests fail Create after each [`CreateStep`].

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use egressproxy_provider::pb;
use tokio::time::Instant;

use crate::config::Attachment;
use crate::error::Error;
use crate::guest::network_config::{StaticNetwork, network_config};
use crate::guest::seed::build_seed;
use crate::images::cache::BaseImage;
use crate::libvirt::domains::FoundDomain;
use crate::libvirt::domains::{self, NicKind};
use crate::libvirt::identity_mac::{mac_for_identity, static_nic_mac};
use crate::libvirt::reservations;
use crate::libvirt::static_addresses::{self, StaticChoice};
use crate::libvirt::volumes;
use crate::libvirt::xml::domain::{DomainSpec, VirtType};
use crate::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use crate::provider::plan::CreatePlan;
use crate::provider::state::to_contract_instance;
use crate::provider::sync::AllocationLocks;
use crate::transport::bulk::upload_volume;
use crate::transport::call::LibvirtOp;
use crate::transport::pool::HostPool;

/// A step of Create after which a test may inject a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CreateStep {
    /// The base image volume is ready.
    BaseImage,
    /// The overlay exists.
    Overlay,
    /// An empty seed volume exists (its upload has not started).
    SeedVolume,
    /// The seed is uploaded.
    SeedUpload,
    /// The domain is defined, not started.
    Define,
    /// The address identity's DHCP reservation exists (a no-op without an identity).
    Reservation,
    /// The domain is started.
    Start,
}

impl CreateStep {
    /// Every step, in order.
    pub const ALL: [CreateStep; 7] = [
        CreateStep::BaseImage,
        CreateStep::Overlay,
        CreateStep::SeedVolume,
        CreateStep::SeedUpload,
        CreateStep::Define,
        CreateStep::Reservation,
        CreateStep::Start,
    ];
}

/// Called after each [`CreateStep`]; an error fails Create there. For tests only: the
/// agent itself never sets one.
#[derive(Clone, Default)]
pub struct FaultHook(Option<Arc<StepHook>>);

type StepHook = dyn Fn(CreateStep) -> Result<(), Error> + Send + Sync;

impl FaultHook {
    /// A hook that runs `hook` after each step.
    pub fn new(hook: impl Fn(CreateStep) -> Result<(), Error> + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(hook)))
    }

    /// Runs the hook for `step`.
    pub fn after(&self, step: CreateStep) -> Result<(), Error> {
        match &self.0 {
            Some(hook) => hook(step),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for FaultHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "FaultHook(set)"
        } else {
            "FaultHook(none)"
        })
    }
}

/// Where step 1 looks for the key's domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    /// On the host the plan chose: a domain with the name that is not the agent's
    /// takes the name.
    Planned,
    /// On another host: only the agent's own domain for the key matters.
    Elsewhere,
}

/// Step 1 on `host`: the key's existing instance (started if need be), `None` when
/// there is none.
pub async fn existing_instance(
    host: &Arc<HostPool>,
    plan: &CreatePlan,
    key: &str,
    place: Where,
    deadline: Instant,
) -> Result<Option<pb::Instance>, Error> {
    let domain = plan.names.domain.clone();
    let lookup = domain.clone();
    let found = host
        .call(
            LibvirtOp::new("virDomainLookupByName").domain(domain.clone()),
            deadline,
            move |conn| domains::find_domain(conn, &lookup),
        )
        .await?;
    match found {
        FoundDomain::Nothing => Ok(None),
        FoundDomain::Foreign if place == Where::Elsewhere => Ok(None),
        FoundDomain::Foreign => Err(Error::DomainNameTaken {
            host: host.name().to_owned(),
            key: key.to_owned(),
            domain,
        }),
        FoundDomain::Ours { spec_sha256, .. } if spec_sha256 != plan.spec_sha256 => {
            Err(Error::SpecMismatch {
                host: host.name().to_owned(),
                key: key.to_owned(),
            })
        }
        FoundDomain::Ours {
            running,
            address_identity,
            ..
        } => {
            if !running {
                // A Create stopped between define and reserve, or a sweep after the
                // domain was stopped: the address is reserved again before the guest
                // asks DHCP for one.
                if let Some(identity) = &address_identity {
                    reserve(host, &domain, identity, deadline).await?;
                }
                start(host, &domain, deadline).await?;
            }
            Ok(Some(read(host, plan, deadline).await?))
        }
    }
}

/// The reservation of `identity` on `host`'s network, for the instance's `domain`
/// (traced with it); first the sweep of reservations no domain holds any longer, so
/// that an address a crashed Delete left reserved is free again. Nothing on a bridge
/// (the plan refuses identities where a host has one).
async fn reserve(
    host: &Arc<HostPool>,
    domain: &str,
    identity: &str,
    deadline: Instant,
) -> Result<(), Error> {
    let Attachment::Network(network) = host.config().attachment() else {
        return Ok(());
    };
    sweep_reservations(host, deadline).await?;
    let identity = identity.to_owned();
    let reservation = host
        .call(
            LibvirtOp::new("virNetworkUpdate").domain(domain),
            deadline,
            move |conn| reservations::reserve(conn, &network, &identity),
        )
        .await?;
    tracing::info!(
        domain,
        mac = %reservation.mac,
        address = %reservation.ip,
        created = reservation.created,
        lost_choices = reservation.lost_choices,
        "address identity reserved"
    );
    Ok(())
}

/// Removes the reservations on `host`'s network that no domain of the agent holds (see
/// [`reservations::sweep`]); nothing on a bridge.
pub async fn sweep_reservations(host: &Arc<HostPool>, deadline: Instant) -> Result<(), Error> {
    let Attachment::Network(network) = host.config().attachment() else {
        return Ok(());
    };
    let removed = host
        .call(LibvirtOp::new("virNetworkUpdate"), deadline, move |conn| {
            reservations::sweep(conn, &network)
        })
        .await?;
    if !removed.is_empty() {
        tracing::info!(
            host = host.name(),
            ?removed,
            "removed reservations no domain holds"
        );
    }
    Ok(())
}

/// Before a new instance of `plan` is made on `host`: its address identity must not be
/// held by an instance of another key there (ADDRESS_IDENTITY_IN_USE), nor its MAC by
/// another identity's instance.
pub async fn check_identity_free(
    host: &Arc<HostPool>,
    plan: &CreatePlan,
    key: &str,
    deadline: Instant,
) -> Result<(), Error> {
    let Some(identity) = plan.address_identity.clone() else {
        return Ok(());
    };
    let asked = identity.clone();
    let holders = host
        .call(
            LibvirtOp::new("virConnectListAllDomains"),
            deadline,
            move |conn| reservations::holders_of(conn, &asked),
        )
        .await?;
    if let Some(holder) = holders.keys.iter().find(|k| *k != key) {
        return Err(Error::AddressIdentityInUse {
            identity,
            holder: format!("{}/{holder}", host.name()),
        });
    }
    if let Some(other) = holders.mac_shared_with {
        return Err(Error::IdentityMacShared {
            identity,
            other,
            host: host.name().to_owned(),
        });
    }
    Ok(())
}

async fn start(host: &Arc<HostPool>, domain: &str, deadline: Instant) -> Result<(), Error> {
    let name = domain.to_owned();
    host.call(
        LibvirtOp::new("virDomainCreate").domain(domain),
        deadline,
        move |conn| domains::start_domain(conn, &name),
    )
    .await?;
    Ok(())
}

async fn read(
    host: &Arc<HostPool>,
    plan: &CreatePlan,
    deadline: Instant,
) -> Result<pb::Instance, Error> {
    let names = plan.names.clone();
    let nic = NicKind::of(&host.config().attachment());
    let snapshot = host
        .call(
            LibvirtOp::new("virDomainLookupByName").domain(names.domain.clone()),
            deadline,
            move |conn| domains::read_instance(conn, &names, nic),
        )
        .await?;
    snapshot
        .map(|s| to_contract_instance(host.name(), s))
        .ok_or_else(|| Error::InstanceVanished {
            domain: plan.names.domain.clone(),
        })
}

/// The address `plan` gets from `host`'s static block, chosen from what the host's
/// domains hold (the caller holds the host's allocation lock); `None` where the host has
/// no block.
async fn choose_static(
    host: &Arc<HostPool>,
    plan: &CreatePlan,
    key: &str,
    deadline: Instant,
) -> Result<Option<std::net::IpAddr>, Error> {
    let Some(block) = host.config().static_block().cloned() else {
        return Ok(None);
    };
    let held = host
        .call(
            LibvirtOp::new("virConnectListAllDomains"),
            deadline,
            static_addresses::held_addresses,
        )
        .await?;
    let choice = static_addresses::choose_static_address(
        &block,
        &held,
        plan.address_identity.as_deref(),
        plan.requested_address,
        key,
    );
    match choice {
        StaticChoice::Granted(address) => Ok(Some(address)),
        StaticChoice::NotInRange => Err(Error::AddressNotInRange {
            requested: plan
                .requested_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
            host: host.name().to_owned(),
            range: block.describe(),
        }),
        StaticChoice::Taken { holder } => Err(Error::AddressTaken {
            requested: plan
                .requested_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
            holder: format!("{}/{holder}", host.name()),
        }),
        StaticChoice::Exhausted => Err(Error::StaticAddressesExhausted {
            host: host.name().to_owned(),
            range: block.describe(),
        }),
        StaticChoice::IdentityInUse { holder } => Err(Error::AddressIdentityInUse {
            identity: plan.address_identity.clone().unwrap_or_default(),
            holder: format!("{}/{holder}", host.name()),
        }),
    }
}

/// Steps 3 to 6 on `base`. See the module docs.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn create_from_base(
    host: &Arc<HostPool>,
    plan: &CreatePlan,
    request: &pb::CreateInstanceRequest,
    base: &BaseImage,
    virt_type: VirtType,
    allocation: &AllocationLocks,
    faults: &FaultHook,
    deadline: Instant,
) -> Result<pb::Instance, Error> {
    let storage_pool = host.config().storage_pool.clone();
    let names = plan.names.clone();

    // Never smaller than the base: qemu-img refuses to shrink, and the guest's
    // filesystem spans the base's size.
    let capacity = (plan.machine_type.1.disk_gib << 30).max(base.capacity_bytes);
    let (pool, name, base_path, format) = (
        storage_pool.clone(),
        names.overlay_volume.clone(),
        base.path.clone(),
        base.format,
    );
    let overlay = host
        .call(
            LibvirtOp::new("virStorageVolCreateXML").volume(names.overlay_volume.clone()),
            deadline,
            move |conn| volumes::ensure_overlay(conn, &pool, &name, capacity, &base_path, format),
        )
        .await?;
    tracing::debug!(
        volume = %names.overlay_volume,
        reused = !overlay.created,
        replaced = overlay.replaced,
        "overlay ready"
    );
    faults.after(CreateStep::Overlay)?;

    // Held until the define records the address (or until Create fails before it, which
    // leaves the address free).
    let allocation_turn = match host.config().static_block() {
        Some(_) => Some(allocation.lock(host.name(), &request.key, deadline).await?),
        None => None,
    };
    let static_address = choose_static(host, plan, &request.key, deadline).await?;
    let mac = match static_address {
        Some(_) => Some(static_nic_mac(
            plan.address_identity.as_deref(),
            &request.key,
        )),
        None => plan.address_identity.as_deref().map(mac_for_identity),
    };
    let network = match (static_address, host.config().static_block(), &mac) {
        (Some(address), Some(block), Some(mac)) => Some(network_config(&StaticNetwork {
            mac,
            address,
            block,
        })),
        _ => None,
    };
    let seed = build_seed(
        &plan.documents,
        &request.key,
        &plan.hostname,
        network.as_deref(),
    );
    let seed_len = seed.len() as u64;
    let (pool, name) = (storage_pool.clone(), names.seed_volume.clone());
    let seed_path: PathBuf = host
        .call(
            LibvirtOp::new("virStorageVolCreateXML").volume(names.seed_volume.clone()),
            deadline,
            move |conn| volumes::recreate_seed_volume(conn, &pool, &name, seed_len),
        )
        .await?;
    faults.after(CreateStep::SeedVolume)?;
    upload_volume(
        host,
        &storage_pool,
        &names.seed_volume,
        std::io::Cursor::new(seed),
        seed_len,
        deadline,
    )
    .await?;
    faults.after(CreateStep::SeedUpload)?;

    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type,
        vcpus: plan.machine_type.1.vcpus,
        memory_mib: plan.machine_type.1.memory_mib,
        firmware: plan.image.1.firmware,
        overlay_path: overlay.path,
        seed_path,
        attachment: host.config().attachment(),
        mac,
        metadata: InstanceMetadata {
            key: request.key.clone(),
            name: request.name.clone(),
            created: now_rfc3339(),
            proxy_port: request.proxy_port,
            spec_sha256: plan.spec_sha256.clone(),
            address_identity: plan.address_identity.clone(),
            static_address,
            placement: PlacementRecord {
                host: host.name().to_owned(),
                zone: match &plan.location {
                    Some(pb::placement::Location::Zone(zone)) => Some(zone.clone()),
                    _ => None,
                },
                machine_type: plan.machine_type.0.clone(),
                image: plan.image.0.clone(),
                base_volume: base.volume.clone(),
            },
            tags: request
                .tags
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        },
    };
    let xml = spec.to_xml().map_err(|e| Error::DomainXmlInvalid {
        domain: names.domain.clone(),
        reason: e.to_string(),
    })?;
    host.call(
        LibvirtOp::new("virDomainDefineXML").domain(names.domain.clone()),
        deadline,
        move |conn| domains::define_domain(conn, &xml),
    )
    .await?;
    drop(allocation_turn);
    faults.after(CreateStep::Define)?;

    // Only now that the domain exists, so that a sweep never finds the reservation
    // without it (see `libvirt::reservations`), and before the start, so that the
    // guest's first DHCP request already gets the identity's address.
    if let Some(identity) = &plan.address_identity {
        reserve(host, &names.domain, identity, deadline).await?;
    }
    faults.after(CreateStep::Reservation)?;

    start(host, &names.domain, deadline).await?;
    faults.after(CreateStep::Start)?;
    tracing::info!(
        instance.id = %format!("{}/{}", host.name(), request.key),
        domain = %names.domain,
        base = %base.volume,
        "created instance"
    );
    read(host, plan, deadline).await
}

/// Now, RFC 3339 in whole seconds.
fn now_rfc3339() -> String {
    let mut now = prost_types::Timestamp::from(std::time::SystemTime::now());
    now.nanos = 0;
    now.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creation_time_is_rfc3339_and_parses_back() {
        let text = now_rfc3339();
        assert!(text.ends_with('Z') && text.contains('T'), "{text}");
        assert!(text.parse::<prost_types::Timestamp>().is_ok(), "{text}");
    }

    #[test]
    fn the_fault_hook_fails_only_its_step() {
        let hook = FaultHook::new(|step| match step {
            CreateStep::Define => Err(Error::from(crate::transport::error::TransportError::io(
                "injected",
                std::io::Error::from(std::io::ErrorKind::Other),
            ))),
            _ => Ok(()),
        });
        assert!(hook.after(CreateStep::Overlay).is_ok());
        assert!(hook.after(CreateStep::Define).is_err());
        assert!(FaultHook::default().after(CreateStep::Define).is_ok());
        assert_eq!(format!("{hook:?}"), "FaultHook(set)");
    }
}
