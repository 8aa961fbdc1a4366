//! An instance's domain on a hypervisor, as blocking functions of one libvirt
//! connection: find, define, start (Create), read (Get), list (List), delete (Delete).
//!
//! They run inside [`crate::transport::pool::HostPool::call`] (off the runtime, traced, bounded by
//! the caller's deadline) in the agent, and directly against libvirt's `test:///default`
//! driver in tests. They return plain data, never libvirt objects (whose `Drop` calls
//! into libvirt).
//!
//! Guarantees:
//! - **Read.** A domain is the agent's when it has the agent's name prefix *and* its
//!   metadata element; a domain without it is not reported (never deleted by the GC).
//!   Addresses come from the guest agent, then the DHCP lease, then ARP;
//!   a source that cannot answer (agent not running yet, no lease on a bridge) is skipped.
//! - **Delete** is idempotent: it destroys (already off is fine), undefines with the
//!   managed-save, snapshot-metadata and NVRAM flags, and deletes the overlay and seed.
//!   A missing domain, volume or pool is success (nothing to clean; a failure would pin
//!   the operator's finalizer forever). A domain with the name but
//!   without the agent's metadata is left alone with those volumes (success: for the
//!   contract there is no such instance).
//! - **Create** steps are repeatable: [`find_domain`] tells an instance's domain apart
//!   from a foreign one with its name; [`define_domain`] and [`start_domain`] accept a
//!   domain that is already defined or already running.
//! - **List** reads each domain's metadata once and skips a domain that vanishes or
//!   cannot be read (never delete what you cannot see); failing to list at all
//!   fails the call.

use std::collections::HashMap;
use std::net::IpAddr;

use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::ErrorNumber;
use virt::sys;

use crate::config::Attachment;
use crate::libvirt::addresses::{ADDRESS_SOURCES, AddressSource, usable_addresses};
use crate::libvirt::error::LibvirtError;
use crate::libvirt::naming::InstanceNames;
use crate::libvirt::volumes::lookup_volume;
use crate::libvirt::xml::domain::DomainFacts;
use crate::libvirt::xml::metadata::{InstanceMetadata, METADATA_NAMESPACE};
use crate::transport::call::CallFailure;
use crate::transport::libvirt_error::classify_libvirt;

/// What the agent knows about one of its domains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainSnapshot {
    /// The domain's name.
    pub domain: String,
    /// The agent's metadata element.
    pub metadata: InstanceMetadata,
    /// libvirt's `virDomainState`.
    pub state: sys::virDomainState,
    /// Usable guest addresses, from the first source that had any.
    pub addresses: Vec<IpAddr>,
}

/// Whether the NIC sits on a host bridge (no DHCP leases there) or a libvirt network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NicKind {
    /// A libvirt network: leases are worth asking for.
    Network,
    /// A host bridge.
    Bridge,
}

impl NicKind {
    /// The kind of NIC a domain attached to `attachment` has.
    pub fn of(attachment: &Attachment) -> Self {
        match attachment {
            Attachment::Network(_) => NicKind::Network,
            Attachment::Bridge(_) => NicKind::Bridge,
        }
    }
}

fn is(error: &virt::error::Error, code: ErrorNumber) -> bool {
    error.code().is(code)
}

/// The domain `name`, or `None` when it does not exist.
pub(crate) fn lookup_domain(
    conn: &Connect,
    name: &str,
) -> Result<Option<Domain>, CallFailure<LibvirtError>> {
    match conn.lookup_domain_by_name(name) {
        Ok(domain) => Ok(Some(domain)),
        Err(e) if is(&e, ErrorNumber::NoDomain) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The agent's metadata of `domain`, or `None` when it has none.
pub(crate) fn read_metadata(
    domain: &Domain,
) -> Result<Option<InstanceMetadata>, CallFailure<LibvirtError>> {
    let element = match domain.metadata(
        sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
        Some(METADATA_NAMESPACE),
        0,
    ) {
        Ok(element) => element,
        Err(e) if is(&e, ErrorNumber::NoDomainMetadata) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // Unparseable metadata is treated like none: the domain is not provably ours.
    Ok(InstanceMetadata::parse(&element).ok())
}

/// Reads the instance `names` with its state and addresses; `None` when its domain does
/// not exist or is not the agent's.
pub fn read_instance(
    conn: &Connect,
    names: &InstanceNames,
    nic: NicKind,
) -> Result<Option<DomainSnapshot>, CallFailure<LibvirtError>> {
    let Some(domain) = lookup_domain(conn, &names.domain)? else {
        return Ok(None);
    };
    let Some(metadata) = read_metadata(&domain)? else {
        return Ok(None);
    };
    let state = domain.state()?.0.to_raw();
    let addresses = running_addresses(&domain, &names.domain, state, nic)?;
    Ok(Some(DomainSnapshot {
        domain: names.domain.clone(),
        metadata,
        state,
        addresses,
    }))
}

/// The usable addresses of `domain` (named `name`) in libvirt state `state`: those of its
/// first NIC when it runs, none otherwise. Get and List both read addresses here, so the
/// same domain has the same addresses, and so the same contract state, in both.
fn running_addresses(
    domain: &Domain,
    name: &str,
    state: sys::virDomainState,
    nic: NicKind,
) -> Result<Vec<IpAddr>, CallFailure<LibvirtError>> {
    if !matches!(state, sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED) {
        return Ok(Vec::new());
    }
    let facts = DomainFacts::parse(&domain.xml_desc(0)?)
        .map_err(|e| CallFailure::Agent(LibvirtError::xml(format!("domain {name}"), e)))?;
    discover_addresses(domain, facts.macs.first().map(String::as_str), nic)
}

/// Guest addresses from the first source that has any, in [`ADDRESS_SOURCES`] order.
pub(crate) fn discover_addresses(
    domain: &Domain,
    mac: Option<&str>,
    nic: NicKind,
) -> Result<Vec<IpAddr>, CallFailure<LibvirtError>> {
    for source in ADDRESS_SOURCES {
        if nic == NicKind::Bridge && !source.works_on_bridge() {
            continue;
        }
        match domain.interface_addresses(source.libvirt_source(), 0) {
            Ok(interfaces) => {
                let found = usable_addresses(&interfaces, mac);
                if !found.is_empty() {
                    return Ok(found);
                }
            }
            // The agent is not installed or not running yet, or the source does not
            // apply to this domain: try the next one.
            Err(e) if source_cannot_answer(&e, source) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Vec::new())
}

fn source_cannot_answer(error: &virt::error::Error, source: AddressSource) -> bool {
    let general = error.code().is_any(vec![
        ErrorNumber::OperationInvalid,
        ErrorNumber::OperationUnsupported,
        ErrorNumber::NoSupport,
        ErrorNumber::ArgumentUnsupported,
        ErrorNumber::NoNetwork,
    ]);
    let agent = source == AddressSource::Agent
        && error.code().is_any(vec![
            ErrorNumber::AgentUnresponsive,
            ErrorNumber::AgentUnsynced,
            ErrorNumber::AgentCommandTimeout,
            ErrorNumber::AgentCommandFailed,
        ]);
    general || agent
}

/// Lists the agent's domains whose tags contain every `(key, value)` of `selector`,
/// sorted by domain name, each with its state and addresses as [`read_instance`] reads
/// them: a running VM with an address is running in a listing too, not provisioning.
///
/// One sweep is few round trips whatever the domain count: the states come from three
/// state-filtered listings (`states_by_listing`), and the per-domain reads (metadata, and
/// for running domains the addresses) are spread over [`METADATA_READERS`] threads on
/// the same connection, which libvirt pipelines, so a sweep costs about one round trip
/// per reader per domain share. An address source that fails for one domain for another
/// reason than a lost connection leaves that domain without addresses (provisioning)
/// rather than failing the whole listing.
pub fn list_instances(
    conn: &Connect,
    selector: &[(String, String)],
    nic: NicKind,
) -> Result<Vec<DomainSnapshot>, CallFailure<LibvirtError>> {
    list_instances_knowing(conn, selector, nic, &HashMap::new())
}

/// [`list_instances`], taking the addresses of a running domain from `known` (by domain
/// name) instead of asking its guest agent, leases or ARP again: a watcher that sweeps
/// every second asks only the domains still without an address.
pub fn list_instances_knowing(
    conn: &Connect,
    selector: &[(String, String)],
    nic: NicKind,
    known: &HashMap<String, Vec<IpAddr>>,
) -> Result<Vec<DomainSnapshot>, CallFailure<LibvirtError>> {
    let ours: Vec<(String, Domain)> = conn
        .list_all_domains(0)?
        .into_iter()
        .filter_map(|domain| {
            let name = domain.name().ok()?;
            InstanceNames::key_of_domain(&name)?;
            Some((name, domain))
        })
        .collect();
    let states = states_by_listing(conn)?;
    let metadata = pipelined(conn, &ours, |(_, domain)| read_metadata(domain))?;
    let mut found = Vec::new();
    for ((name, domain), metadata) in ours.iter().zip(metadata) {
        // A domain that vanished since the listing, or whose metadata cannot be read
        // now, is skipped: never report (and so never collect) what cannot be seen.
        let Some(Some(metadata)) = metadata else {
            continue;
        };
        if !selector
            .iter()
            .all(|(k, v)| metadata.tags.get(k) == Some(v))
        {
            continue;
        }
        let state = match states.get(name) {
            Some(state) => *state,
            // In none of the listings: a rarer state (blocked, nostate, crashed, ...),
            // or one that changed since; ask the domain itself.
            None => match domain.state() {
                Ok((state, _)) => state.to_raw(),
                Err(e) if connection_lost(conn, &e) => return Err(e.into()),
                Err(_) => continue,
            },
        };
        found.push((
            domain,
            DomainSnapshot {
                domain: name.clone(),
                metadata,
                state,
                addresses: Vec::new(),
            },
        ));
    }
    let addresses = pipelined(conn, &found, |(domain, snapshot)| {
        let running = matches!(
            snapshot.state,
            sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED
        );
        match known.get(&snapshot.domain) {
            Some(addresses) if running && !addresses.is_empty() => Ok(addresses.clone()),
            _ => running_addresses(domain, &snapshot.domain, snapshot.state, nic),
        }
    })?;
    let mut found: Vec<DomainSnapshot> = found
        .into_iter()
        .zip(addresses)
        .map(|((_, snapshot), addresses)| DomainSnapshot {
            addresses: addresses.unwrap_or_default(),
            ..snapshot
        })
        .collect();
    found.sort_by(|a, b| a.domain.cmp(&b.domain));
    Ok(found)
}

/// The metadata of every domain of the agent; `None` when one of them cannot be read
/// now (it vanished, or libvirt failed to answer for it), so that a caller that would
/// remove what no domain holds removes nothing it cannot see.
pub(crate) fn agent_metadata(
    conn: &Connect,
) -> Result<Option<Vec<InstanceMetadata>>, CallFailure<LibvirtError>> {
    let ours: Vec<Domain> = conn
        .list_all_domains(0)?
        .into_iter()
        .filter(|domain| {
            domain
                .name()
                .is_ok_and(|name| InstanceNames::key_of_domain(&name).is_some())
        })
        .collect();
    let read = pipelined(conn, &ours, read_metadata)?;
    // A domain with the agent's name prefix but no metadata is not the agent's.
    Ok(read
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .map(|all| all.into_iter().flatten().collect()))
}

/// Threads that read domain metadata concurrently during a listing.
pub const METADATA_READERS: usize = 8;

/// The state of every running, paused or shut-off domain, by name, in three calls.
fn states_by_listing(
    conn: &Connect,
) -> Result<std::collections::HashMap<String, sys::virDomainState>, CallFailure<LibvirtError>> {
    let mut states = std::collections::HashMap::new();
    for (filter, state) in [
        (
            sys::VIR_CONNECT_LIST_DOMAINS_RUNNING,
            sys::VIR_DOMAIN_RUNNING,
        ),
        (sys::VIR_CONNECT_LIST_DOMAINS_PAUSED, sys::VIR_DOMAIN_PAUSED),
        (
            sys::VIR_CONNECT_LIST_DOMAINS_SHUTOFF,
            sys::VIR_DOMAIN_SHUTOFF,
        ),
    ] {
        for domain in conn.list_all_domains(filter)? {
            if let Ok(name) = domain.name() {
                states.insert(name, state);
            }
        }
    }
    Ok(states)
}

/// `read` of every item, run by up to [`METADATA_READERS`] threads sharing `conn`, in the
/// items' order. A failure other than a lost connection counts as `None` (the domain
/// vanished, or cannot be read now); a dead connection fails the whole sweep instead of
/// making it look short.
fn pipelined<T: Sync, R: Send>(
    conn: &Connect,
    items: &[T],
    read: impl Fn(&T) -> Result<R, CallFailure<LibvirtError>> + Sync,
) -> Result<Vec<Option<R>>, CallFailure<LibvirtError>> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let share = items.len().div_ceil(METADATA_READERS);
    let read = &read;
    std::thread::scope(|scope| {
        let readers: Vec<_> = items
            .chunks(share)
            .map(|chunk| {
                scope.spawn(move || {
                    chunk
                        .iter()
                        .map(|item| match read(item) {
                            Ok(value) => Ok(Some(value)),
                            Err(CallFailure::Libvirt(e)) if connection_lost(conn, &e) => {
                                Err(CallFailure::Libvirt(e))
                            }
                            Err(_) => Ok(None),
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        let mut all = Vec::with_capacity(items.len());
        for reader in readers {
            // A reader's panic is the call's: the call wrapper reports it as its worker
            // ending abnormally, with the panic's message.
            let read = reader
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            all.extend(read?);
        }
        Ok(all)
    })
}

fn connection_lost(conn: &Connect, error: &virt::error::Error) -> bool {
    classify_libvirt(error, conn.is_alive().unwrap_or(false)).transport
}

/// What [`delete_instance`] found and removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deleted {
    /// The domain existed and was undefined.
    pub domain: bool,
    /// Volumes deleted.
    pub volumes: Vec<String>,
    /// A domain with the instance's name but without the agent's metadata exists: it,
    /// and the volumes with the instance's names, were left alone.
    pub foreign_domain_left: bool,
}

/// Deletes the instance `names`: domain, overlay and seed in `storage_pool`. Idempotent;
/// see the module docs.
///
/// A domain with the instance's name but without the agent's metadata is not the agent's
/// (Create refuses it, Get and List do not see it): it is never destroyed, and the
/// volumes with the instance's names, which may be its disks, are left too. For the
/// contract that instance does not exist, so its Delete succeeds like that of any
/// missing instance ([`Deleted::foreign_domain_left`] says so).
pub fn delete_instance(
    conn: &Connect,
    names: &InstanceNames,
    storage_pool: &str,
) -> Result<Deleted, CallFailure<LibvirtError>> {
    let mut deleted = Deleted::default();
    if let Some(domain) = lookup_domain(conn, &names.domain)? {
        if read_metadata(&domain)?.is_none() {
            deleted.foreign_domain_left = true;
            return Ok(deleted);
        }
        match domain.destroy() {
            Ok(()) => {}
            Err(e) if is(&e, ErrorNumber::OperationInvalid) || is(&e, ErrorNumber::NoDomain) => {}
            Err(e) => return Err(e.into()),
        }
        let flags =
            sys::VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | sys::VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA;
        // The NVRAM flag is needed for UEFI domains: libvirt refuses to undefine a domain
        // that has an NVRAM file without it. A driver without NVRAM
        // support (libvirt's test driver) rejects the flag as an invalid argument and
        // has no NVRAM to delete, so the undefine is repeated without it.
        let undefined = match domain.undefine_flags(flags | sys::VIR_DOMAIN_UNDEFINE_NVRAM) {
            Err(e) if is(&e, ErrorNumber::InvalidArg) => domain.undefine_flags(flags),
            other => other,
        };
        match undefined {
            Ok(()) => deleted.domain = true,
            Err(e) if is(&e, ErrorNumber::NoDomain) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let pool = match conn.lookup_storage_pool_by_name(storage_pool) {
        Ok(pool) => pool,
        Err(e) if is(&e, ErrorNumber::NoStoragePool) => return Ok(deleted),
        Err(e) => return Err(e.into()),
    };
    for volume in [&names.overlay_volume, &names.seed_volume] {
        let Some(vol) = lookup_volume(&pool, volume)? else {
            continue;
        };
        match vol.delete(0) {
            Ok(()) => deleted.volumes.push(volume.clone()),
            Err(e) if is(&e, ErrorNumber::NoStorageVolume) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(deleted)
}

/// What holds an instance's domain name on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FoundDomain {
    /// No domain by that name.
    Nothing,
    /// The agent's domain, created from the spec with this digest.
    Ours {
        /// `specSha256` from its metadata.
        spec_sha256: String,
        /// The address identity it was created with.
        address_identity: Option<String>,
        /// Whether it runs (running, blocked or paused by libvirt's start).
        running: bool,
    },
    /// A domain by that name without the agent's metadata.
    Foreign,
}

/// Looks up the domain `name` and reads its metadata once.
pub fn find_domain(conn: &Connect, name: &str) -> Result<FoundDomain, CallFailure<LibvirtError>> {
    let Some(domain) = lookup_domain(conn, name)? else {
        return Ok(FoundDomain::Nothing);
    };
    let Some(metadata) = read_metadata(&domain)? else {
        return Ok(FoundDomain::Foreign);
    };
    Ok(FoundDomain::Ours {
        spec_sha256: metadata.spec_sha256,
        address_identity: metadata.address_identity,
        running: domain.is_active()?,
    })
}

/// Starts the domain `name` unless it already runs.
pub fn start_domain(conn: &Connect, name: &str) -> Result<(), CallFailure<LibvirtError>> {
    let domain = conn.lookup_domain_by_name(name)?;
    if domain.is_active()? {
        return Ok(());
    }
    match domain.create() {
        Ok(()) => Ok(()),
        // Started by a concurrent caller between the check and the start.
        Err(e) if e.code().is(ErrorNumber::OperationInvalid) && domain.is_active()? => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Defines (or redefines, after an interrupted attempt) the domain from `xml`.
pub fn define_domain(conn: &Connect, xml: &str) -> Result<(), CallFailure<LibvirtError>> {
    conn.define_domain_xml(xml)?;
    Ok(())
}

/// libvirt's state of the domain `name` (`virDomainState`), for tests and logs.
pub fn domain_state(
    conn: &Connect,
    name: &str,
) -> Result<sys::virDomainState, CallFailure<LibvirtError>> {
    Ok(conn.lookup_domain_by_name(name)?.state()?.0.to_raw())
}
