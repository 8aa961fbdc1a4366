//! The reference provider: instances kept in memory, the smallest complete
//! implementation of the contract (like CSI's host-path driver).
//!
//! Read it to see what a provider must do:
//! 1. validate every request, naming the bad field ([`crate::validation`] plus the
//!    provider's own catalogue of hosts, machine types and images);
//! 2. make Create idempotent on the key, and refuse the same key with another spec;
//! 3. report PROVISIONING until the instance is usable, then RUNNING with addresses;
//! 4. make Delete of a missing instance succeed, and Get of one NOT_FOUND; while an
//!    instance is DELETING, Create of its key answers UNAVAILABLE (KEY_BEING_DELETED);
//! 5. list by tags, paged with the crate's [`crate::paging`] (tokens it can recognise,
//!    pages bounded in count and bytes);
//! 6. change an instance's tags only by compare-and-set, under the lock Create and
//!    Delete take (`tags.rs`).
//!
//! Instances move from PROVISIONING to RUNNING after
//! [`ReferenceConfig::provisioning_delay`] and get [`ReferenceConfig::address`]
//! (loopback by default), or, when created with an address identity, an address of
//! [`ReferenceConfig::identity_addresses`] ([`addresses`]); a deleted one stays DELETING
//! for [`ReferenceConfig::deleting_delay`]. Every change is told to a [`WatchHub`]
//! (Create, Delete, a forced state, and timers at the end of provisioning and of
//! DELETING), which serves WatchInstances. [`Faults`] and the control service
//! ([`control`], served only when asked for) let tests inject errors, latency and
//! hangs, and force an instance's state; [`MemoryProvider::call_counts`] and
//! [`MemoryProvider::peak_calls_in_flight`] tell them how callers used the provider. A
//! [`Misbehaviour`] breaks one contract rule on purpose, to test the conformance suite.

pub mod addresses;
pub mod control;
mod faults;
mod in_flight;
mod locations;
mod misbehave;
mod tags;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tonic::{Request, Response, Status};

pub use addresses::AddressRange;
pub use faults::{Fault, FaultEffect, Faults};
pub use locations::DEFAULT_MAX_INSTANCES;
pub use misbehave::Misbehaviour;

use crate::pb::{self, InstanceState, placement::Location};
use crate::watch::WatchHub;
use crate::{CONTRACT_VERSION, ProviderError, paging, validation};

/// The provider name the reference provider reports.
pub const PLUGIN_NAME: &str = "reference.egressproxy.dev";
/// The least time an instance provisions for a provider that ignores Deletes meanwhile
/// (see `MemoryProvider::provisioning_delay`).
const SLOW_PROVISIONING: Duration = Duration::from_secs(5);
/// How far apart concurrent Creates may arrive and still race, for the misbehaviours
/// that break concurrent Creates. With 20 and 50 ms, the suite's concurrent Creates
/// arrived further apart than that on a loaded machine, did not race, and the
/// misbehaviour went unseen.
const RACE_WINDOW: Duration = Duration::from_secs(1);
/// What `--misbehave unusable-address-ranged` validates in place of an unusable
/// requested address: a usable one, so the range check meets the original.
const UNUSABLE_STAND_IN: &str = "192.0.2.1";

/// What the reference provider offers and how it behaves.
#[derive(Debug, Clone)]
pub struct ReferenceConfig {
    /// Time from Create until an instance is RUNNING.
    pub provisioning_delay: Duration,
    /// Time from Delete until an instance is gone (DELETING meanwhile).
    pub deleting_delay: Duration,
    /// The address every running instance created without an address identity reports.
    pub address: IpAddr,
    /// The address such an instance reports instead on some hosts: a host with its
    /// own network, as a real provider's hosts have.
    pub host_addresses: BTreeMap<String, IpAddr>,
    /// Whether address identities and requested addresses are offered (declared and
    /// honoured); without them, Create refuses both fields as INVALID_ARGUMENT, as a
    /// provider that does not declare their capabilities must.
    pub address_identities: bool,
    /// Whether UpdateInstanceTags is offered (declared and implemented); without it the
    /// call answers UNIMPLEMENTED, as a provider of a contract before 1.5.0 does.
    pub update_tags: bool,
    /// The range instances created with an address identity get their address from.
    pub identity_addresses: AddressRange,
    /// Valid `placement.host` names. A Create without a location goes to the host with
    /// the most room (the first of those on a tie).
    pub hosts: Vec<String>,
    /// Valid `placement.zone` names. A Create in a zone goes to the zone's host with the
    /// most room.
    pub zones: Vec<String>,
    /// The zone of each host (a host not listed is in no zone).
    pub host_zones: BTreeMap<String, String>,
    /// The most instances each host holds (a host not listed: [`DEFAULT_MAX_INSTANCES`]).
    /// A Create on a host without room answers RESOURCE_EXHAUSTED.
    pub max_instances: BTreeMap<String, u32>,
    /// Valid `placement.machine_type` names.
    pub machine_types: Vec<String>,
    /// Valid `placement.image` names.
    pub images: Vec<String>,
    /// The contract version GetPluginInfo reports (tests of callers' version checks
    /// change it; normally [`CONTRACT_VERSION`]).
    pub contract_version: String,
    /// A contract rule to break on purpose (tests of the conformance suite only).
    pub misbehave: Option<Misbehaviour>,
}

impl Default for ReferenceConfig {
    fn default() -> Self {
        ReferenceConfig {
            provisioning_delay: Duration::from_secs(2),
            deleting_delay: Duration::ZERO,
            address: IpAddr::from([127, 0, 0, 1]),
            host_addresses: BTreeMap::new(),
            address_identities: true,
            update_tags: true,
            identity_addresses: AddressRange::DEFAULT,
            hosts: vec!["local".into()],
            zones: vec!["local-zone".into()],
            host_zones: BTreeMap::from([("local".into(), "local-zone".into())]),
            max_instances: BTreeMap::new(),
            machine_types: vec!["small".into(), "medium".into()],
            images: vec!["debian-12".into()],
            contract_version: CONTRACT_VERSION.into(),
            misbehave: None,
        }
    }
}

/// The in-memory provider. Cheap to clone; clones share state.
#[derive(Debug, Clone)]
pub struct MemoryProvider {
    config: Arc<ReferenceConfig>,
    state: Arc<Mutex<State>>,
    faults: Faults,
    /// Calls running now, and the most that ran at once.
    in_flight: in_flight::CallsInFlight,
    hub: WatchHub,
    /// Wakes an update held in its race window (only to misbehave, see `tags.rs`).
    tag_race: Arc<tokio::sync::Notify>,
}

#[derive(Debug, Default)]
struct State {
    instances: BTreeMap<String, Record>,
    ids_by_key: HashMap<String, String>,
    calls: BTreeMap<String, u64>,
    /// Keys whose instances are gone (only kept to misbehave).
    deleted_keys: Vec<String>,
    /// The last new instance and when it was made (only kept to misbehave).
    last_created: Option<(Instant, pb::Instance)>,
    /// Updates of tags compared and not yet set (only kept to misbehave).
    tag_updates_racing: usize,
    /// Whether a CreateInstance has been answered yet (only kept to misbehave).
    answered_a_create: bool,
    /// Instances gone that still hold their identity's address (only kept to
    /// misbehave): id, identity, address.
    unreleased: Vec<(String, Option<String>, Option<Ipv4Addr>)>,
}

#[derive(Debug)]
struct Record {
    instance: pb::Instance,
    /// The host it takes room on (`None`: a zone without hosts, only to misbehave).
    host: Option<String>,
    created: Instant,
    /// When Delete was called; the instance is DELETING until `deleting_delay` later.
    deleted: Option<Instant>,
    spec: Spec,
    forced_state: Option<InstanceState>,
    /// The address it holds for its address identity.
    address: Option<Ipv4Addr>,
    /// The tags it had before its first UpdateInstanceTags (only kept to misbehave).
    listed_tags: Option<HashMap<String, String>>,
}

/// What must match for a repeated Create to return the existing instance: the
/// placement as requested, cloud-init (an unset one is the same as an empty one) and
/// the port. The name and tags are not part of it.
#[derive(Debug, PartialEq)]
struct Spec {
    placement: Option<pb::Placement>,
    cloud_init: Option<pb::CloudInit>,
    proxy_port: u32,
    name: Option<String>,
    tags: Option<HashMap<String, String>>,
    address_identity: Option<String>,
    requested_address: Option<String>,
}

impl MemoryProvider {
    /// A provider with `config` and no faults.
    pub fn new(config: ReferenceConfig) -> Self {
        MemoryProvider {
            config: Arc::new(config),
            state: Arc::default(),
            faults: Faults::default(),
            in_flight: in_flight::CallsInFlight::default(),
            hub: WatchHub::default(),
            tag_race: Arc::default(),
        }
    }

    /// The provider's fault injector.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Forces an instance's state (`None` returns it to normal behaviour).
    pub fn set_state(&self, id: &str, state: Option<InstanceState>) -> Result<(), ProviderError> {
        let mut guard = self.lock();
        let record = guard
            .instances
            .get_mut(id)
            .ok_or_else(|| ProviderError::not_found(format!("instance {id} does not exist")))?;
        record.forced_state = state;
        let now = self.snapshot(record);
        self.hub.updated(now);
        Ok(())
    }

    /// Calls received per Provider method.
    pub fn call_counts(&self) -> BTreeMap<String, u64> {
        self.lock().calls.clone()
    }

    /// The most calls of each Provider method that ran at once (injected latency
    /// included), since the provider started or [`Self::restart_peak_calls_in_flight`].
    pub fn peak_calls_in_flight(&self) -> BTreeMap<String, u64> {
        self.in_flight.peak()
    }

    /// Starts [`Self::peak_calls_in_flight`] again from the calls running now.
    pub fn restart_peak_calls_in_flight(&self) {
        self.in_flight.restart_peaks();
    }

    /// Counts the call, then applies any injected fault; returns the call's place among
    /// those in flight (hold it until the answer goes) and how long to hold the answer
    /// back once the work is done.
    async fn enter(
        &self,
        method: &str,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<(in_flight::InFlight, Option<Duration>), Status> {
        let running = self.in_flight.enter(method);
        *self.lock().calls.entry(method.to_owned()).or_default() += 1;
        if self.breaks(Misbehaviour::RefusesTraceContext) && metadata.contains_key("traceparent") {
            return Err(self.encode(
                &ProviderError::permanent("this provider does not take trace context")
                    .with_reason("TRACE_CONTEXT_REFUSED"),
            ));
        }
        let hold = self
            .faults
            .apply(method)
            .await
            .map_err(|e| self.encode(&e))?;
        Ok((running, hold))
    }

    fn breaks(&self, misbehaviour: Misbehaviour) -> bool {
        self.config.misbehave == Some(misbehaviour)
    }

    /// How long a new instance is PROVISIONING. The provider that ignores a Delete while
    /// an instance provisions does so for at least [`SLOW_PROVISIONING`]: with the
    /// 100 ms a test configures, a loaded machine let more than that pass between the
    /// suite's Create and its Delete, the Delete was honoured, and the misbehaviour went
    /// unseen.
    fn provisioning_delay(&self) -> Duration {
        if self.breaks(Misbehaviour::DeleteIgnoredWhileProvisioning) {
            self.config.provisioning_delay.max(SLOW_PROVISIONING)
        } else {
            self.config.provisioning_delay
        }
    }

    /// An error as the contract says to send it, or as the configured misbehaviour
    /// breaks it.
    fn encode(&self, error: &ProviderError) -> Status {
        match self.config.misbehave {
            Some(misbehaviour) => misbehaviour.encode(error),
            None => error.to_status(),
        }
    }

    /// Removes the instances whose DELETING time is over.
    fn purge(&self, state: &mut State) {
        if self.breaks(Misbehaviour::DeletingForever) {
            return;
        }
        let delay = self.config.deleting_delay;
        let gone: Vec<String> = state
            .instances
            .iter()
            .filter(|(_, record)| record.deleted.is_some_and(|at| at.elapsed() >= delay))
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            if let Some(record) = state.instances.remove(&id) {
                if self.breaks(Misbehaviour::IdentityNeverReleased) {
                    state.unreleased.push((
                        id.clone(),
                        record.instance.address_identity.clone(),
                        record.address,
                    ));
                }
                let key = record.instance.key;
                if state.ids_by_key.get(&key) == Some(&id) {
                    state.ids_by_key.remove(&key);
                }
                state.deleted_keys.push(key);
                self.hub.deleted(&id);
                tracing::info!(instance.id = %id, "instance gone");
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Checks names against the catalogue; the location stays as requested (see
    /// `choose` for where an instance goes).
    fn resolve(&self, placement: &pb::Placement) -> Result<pb::Placement, ProviderError> {
        let config = &self.config;
        let mut violations = Vec::new();
        let known = |names: &[String], name: &str| names.iter().any(|n| n == name);
        let location = match &placement.location {
            Some(Location::Host(host)) if !known(&config.hosts, host) => {
                violations.push(("placement.host", unknown("host", host, &config.hosts)));
                None
            }
            Some(Location::Zone(zone)) if !known(&config.zones, zone) => {
                violations.push(("placement.zone", unknown("zone", zone, &config.zones)));
                None
            }
            location => location.clone(),
        };
        if !known(&config.machine_types, &placement.machine_type) {
            let text = unknown(
                "machine type",
                &placement.machine_type,
                &config.machine_types,
            );
            violations.push(("placement.machine_type", text));
        }
        if !known(&config.images, &placement.image) {
            violations.push((
                "placement.image",
                unknown("image", &placement.image, &config.images),
            ));
        }
        let mut violations = violations.into_iter();
        if let Some((field, description)) = violations.next() {
            return Err(violations.fold(
                ProviderError::invalid_argument(field, description),
                |error, (field, description)| error.with_violation(field, description),
            ));
        }
        Ok(pb::Placement {
            location,
            ..placement.clone()
        })
    }

    fn snapshot(&self, record: &Record) -> pb::Instance {
        let mut instance = record.instance.clone();
        let provisioned = record.created.elapsed() >= self.provisioning_delay();
        let state = match (record.deleted, record.forced_state) {
            (Some(_), _) => InstanceState::Deleting,
            (None, Some(forced)) => forced,
            (None, None) if provisioned => InstanceState::Running,
            (None, None) => InstanceState::Provisioning,
        };
        instance.set_state(state);
        if state == InstanceState::Running && !self.breaks(Misbehaviour::RunningWithoutAddress) {
            let host_address = record
                .host
                .as_ref()
                .and_then(|host| self.config.host_addresses.get(host))
                .copied()
                .unwrap_or(self.config.address);
            let address = record.address.map_or(host_address, IpAddr::V4);
            instance.addresses.push(pb::Address {
                address: if self.breaks(Misbehaviour::AddressNotAnIp) {
                    "not-an-ip".into()
                } else {
                    address.to_string()
                },
                scope: pb::AddressScope::Internal.into(),
                family: if address.is_ipv4() {
                    pb::IpFamily::V4
                } else {
                    pb::IpFamily::V6
                }
                .into(),
            });
        }
        if let Some(placement) = instance.placement.as_mut() {
            if self.breaks(Misbehaviour::PlacementNotEchoed) {
                placement.machine_type = "something-else".into();
            }
            if self.breaks(Misbehaviour::ChosenLocationMissing)
                && record
                    .spec
                    .placement
                    .as_ref()
                    .is_some_and(|p| p.location.is_none())
            {
                placement.location = None;
            }
        }
        if self.breaks(Misbehaviour::WrongProxyPort) {
            instance.proxy_port = 3128;
        }
        instance.state_message = match state {
            InstanceState::Provisioning => "booting".into(),
            InstanceState::Stopped => "stopped".into(),
            InstanceState::Deleting => "being deleted".into(),
            _ => String::new(),
        };
        instance
    }

    /// ListInstances' work: the matching instances, one page of them.
    fn list(
        &self,
        request: &pb::ListInstancesRequest,
    ) -> Result<pb::ListInstancesResponse, ProviderError> {
        validation::check_list_request(request)?;
        let page_size = match request.page_size {
            _ if self.breaks(Misbehaviour::IgnorePageSize) => paging::DEFAULT_PAGE_SIZE,
            _ if self.breaks(Misbehaviour::PageSizeCappedLow) => {
                paging::page_size(request.page_size, paging::DEFAULT_PAGE_SIZE).min(2)
            }
            Some(size)
                if size as usize > paging::MAX_PAGE_SIZE
                    && self.breaks(Misbehaviour::RefusesLargePageSize) =>
            {
                return Err(ProviderError::invalid_argument(
                    "page_size",
                    format!("at most {}", paging::MAX_PAGE_SIZE),
                ));
            }
            requested => paging::page_size(requested, paging::DEFAULT_PAGE_SIZE),
        };
        let mut token = request.page_token.as_str();
        if self.breaks(Misbehaviour::AcceptsForeignPageToken)
            && paging::decode_token(token).is_err()
        {
            token = "";
        }
        let mut state = self.lock();
        self.purge(&mut state);
        let instances = state.instances.values().filter(|record| {
            let tags = self.listed_tags(record);
            let matches = |(key, value): (&String, &String)| tags.get(key) == Some(value);
            if self.breaks(Misbehaviour::DeletingNotListed) && record.deleted.is_some() {
                false
            } else if self.breaks(Misbehaviour::SelectorIgnored) {
                true
            } else if self.breaks(Misbehaviour::OrTagMatching) {
                request.tag_selector.iter().any(matches)
            } else {
                request.tag_selector.iter().all(matches)
            }
        });
        let instances = instances.map(|record| {
            let mut instance = self.snapshot(record);
            if self.breaks(Misbehaviour::ListStateDisagrees)
                && instance.state() == InstanceState::Running
            {
                instance.set_state(InstanceState::Provisioning);
                instance.addresses.clear();
            }
            if self.breaks(Misbehaviour::NoCreateTimeInList) {
                instance.create_time = None;
            }
            instance.tags = self.listed_tags(record).clone();
            instance
        });
        let mut page = paging::page(instances, token, page_size)?;
        if self.breaks(Misbehaviour::CyclingPageToken) && !page.instances.is_empty() {
            page.next_page_token = paging::encode_token("cycle");
        }
        Ok(page)
    }

    /// The spec a Create is compared by (see [`Spec`]), or as a misbehaviour compares.
    fn spec(&self, request: &pb::CreateInstanceRequest, resolved: &pb::Placement) -> Spec {
        let mut cloud_init = if self.breaks(Misbehaviour::UnsetCloudInitDiffers) {
            request.cloud_init.clone()
        } else {
            Some(request.cloud_init.clone().unwrap_or_default())
        };
        if self.breaks(Misbehaviour::UnsetVendorDataEqualsEmpty)
            && let Some(cloud_init) = cloud_init.as_mut()
        {
            cloud_init.vendor_data = cloud_init.vendor_data.take().filter(|v| !v.is_empty());
        }
        Spec {
            placement: if self.breaks(Misbehaviour::ResolvedPlacementCompared) {
                Some(resolved.clone())
            } else if self.breaks(Misbehaviour::MachineTypeNotCompared) {
                request.placement.clone().map(|placement| pb::Placement {
                    machine_type: String::new(),
                    ..placement
                })
            } else {
                request.placement.clone()
            },
            cloud_init: cloud_init.filter(|_| !self.breaks(Misbehaviour::CloudInitNotCompared)),
            proxy_port: request.proxy_port,
            name: self
                .breaks(Misbehaviour::NameCompared)
                .then(|| request.name.clone()),
            tags: self
                .breaks(Misbehaviour::TagsCompared)
                .then(|| request.tags.clone()),
            address_identity: request
                .address_identity
                .clone()
                .filter(|_| !self.breaks(Misbehaviour::IdentityNotCompared)),
            requested_address: request
                .requested_address
                .clone()
                .filter(|_| !self.breaks(Misbehaviour::RequestedAddressNotCompared)),
        }
    }

    /// Checks a Create request as the contract says (or as a misbehaviour does).
    fn check_create(&self, request: &mut pb::CreateInstanceRequest) -> Result<(), ProviderError> {
        if self.breaks(Misbehaviour::MissingPlacementAccepted) && request.placement.is_none() {
            request.placement = Some(self.default_placement());
        }
        if self.breaks(Misbehaviour::RequestedAddressTrimmed)
            && let Some(text) = request.requested_address.as_mut()
        {
            *text = text.trim().to_owned();
        }
        let mut checked = request.clone();
        if self.breaks(Misbehaviour::IdentityUnchecked) && checked.address_identity.is_some() {
            checked.address_identity = Some("unchecked".into());
        }
        if self.breaks(Misbehaviour::LaxKeyCharset) && checked.key.ends_with('\n') {
            checked.key.pop();
        }
        if self.breaks(Misbehaviour::AcceptsOnePast)
            && checked.tags.len() == validation::MAX_TAGS + 1
        {
            let extra = checked.tags.keys().max().cloned().unwrap_or_default();
            checked.tags.remove(&extra);
        }
        if self.breaks(Misbehaviour::VendorDataUnbounded)
            && let Some(cloud_init) = checked.cloud_init.as_mut()
        {
            cloud_init.vendor_data = cloud_init.vendor_data.take().map(|mut v| {
                v.truncate(validation::MAX_USER_DATA_BYTES);
                v
            });
        }
        if self.breaks(Misbehaviour::RefusesBoundary)
            && request.key.len() >= validation::MAX_KEY_LEN
        {
            return Err(ProviderError::invalid_argument(
                "key",
                "at most 127 characters",
            ));
        }
        if self.breaks(Misbehaviour::VendorDataRefused)
            && request
                .cloud_init
                .as_ref()
                .is_some_and(|c| c.vendor_data.is_some())
        {
            return Err(ProviderError::invalid_argument(
                "cloud_init.vendor_data",
                "vendor_data is not taken",
            ));
        }
        if !self.config.address_identities {
            refuse_address_fields(request)?;
        }
        if self.breaks(Misbehaviour::UnusableAddressRanged)
            && checked
                .requested_address
                .as_deref()
                .is_some_and(|text| text.parse::<std::net::IpAddr>().is_ok())
        {
            checked.requested_address = Some(UNUSABLE_STAND_IN.into());
        }
        validation::check_create_request(&checked).map_err(|mut error| {
            for violation in &mut error.field_violations {
                if self.breaks(Misbehaviour::DebugEscapedPaths)
                    && let Some(key) = request
                        .tags
                        .keys()
                        .find(|key| validation::map_entry_path("tags", key) == violation.field)
                {
                    violation.field = format!("tags[{key:?}]");
                }
                if self.breaks(Misbehaviour::CutFieldPaths) {
                    violation.field = crate::error::bounded::cut_word(&violation.field);
                }
            }
            error
        })
    }

    /// The placement a misbehaving provider puts in for a missing one: the first
    /// machine type and image, the location left to it.
    fn default_placement(&self) -> pb::Placement {
        pb::Placement {
            location: None,
            machine_type: self.config.machine_types[0].clone(),
            image: self.config.images[0].clone(),
        }
    }

    /// CreateInstance's work: validate, then return the key's instance or make one.
    fn create(
        &self,
        mut request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, ProviderError> {
        self.check_create(&mut request)?;
        let placement = request
            .placement
            .as_ref()
            .expect("validated: placement is set");
        let resolved = self.resolve(placement)?;

        let mut state = self.lock();
        self.purge(&mut state);
        let (host, resolved) = self.choose(&state, &resolved);
        let spec = self.spec(&request, &resolved);
        if self.breaks(Misbehaviour::KeyReuseRefused) && state.deleted_keys.contains(&request.key) {
            return Err(ProviderError::already_exists(format!(
                "key {} was used before",
                request.key
            )));
        }
        if let Some(id) = state.ids_by_key.get(&request.key) {
            let record = &state.instances[id];
            if let Some(deleted) = record.deleted {
                let left = self.config.deleting_delay.saturating_sub(deleted.elapsed());
                let reason = if self.breaks(Misbehaviour::WrongDeletingReason) {
                    "INSTANCE_DELETING"
                } else {
                    "KEY_BEING_DELETED"
                };
                return Err(ProviderError::transient(format!(
                    "key {} belongs to instance {id}, which is being deleted: retry once it is gone",
                    request.key
                ))
                .with_reason(reason)
                .with_retry_after(Some(left.max(Duration::from_millis(10)))));
            }
            if record.spec != spec {
                return Err(ProviderError::already_exists(format!(
                    "key {} belongs to instance {id}, created with a different placement, \
                     cloud-init or proxy port: delete it first or use another key",
                    request.key
                )));
            }
            return Ok(self.snapshot(record));
        }
        if self.breaks(Misbehaviour::MergesConcurrentCreates)
            && let Some((at, instance)) = &state.last_created
            && at.elapsed() < RACE_WINDOW
        {
            return Ok(instance.clone());
        }
        if !self.breaks(Misbehaviour::CreatesWithoutRoom) {
            self.check_room(&state, host.as_deref(), &resolved)?;
        }
        let address = match &request.address_identity {
            Some(identity) if !self.breaks(Misbehaviour::IdentityIgnored) => {
                let requested = request
                    .requested_address
                    .as_deref()
                    .map(|text| text.parse().expect("validated: an IP address"));
                let holders = state
                    .instances
                    .iter()
                    .map(|(id, record)| addresses::Holder {
                        id,
                        identity: record.instance.address_identity.as_deref(),
                        address: record.address,
                    })
                    .chain(state.unreleased.iter().map(|(id, identity, address)| {
                        addresses::Holder {
                            id,
                            identity: identity.as_deref(),
                            address: *address,
                        }
                    }));
                Some(addresses::grant(
                    self.config.identity_addresses,
                    identity,
                    requested,
                    holders,
                    self.config.misbehave,
                )?)
            }
            _ => None,
        };
        let id = format!("ref-{}", uuid::Uuid::new_v4());
        let record = Record {
            host,
            instance: pb::Instance {
                id: id.clone(),
                key: request.key.clone(),
                name: request.name,
                create_time: Some(SystemTime::now().into()),
                tags: request.tags,
                placement: Some(resolved),
                proxy_port: request.proxy_port,
                address_identity: request.address_identity,
                ..Default::default()
            },
            created: Instant::now(),
            deleted: None,
            spec,
            forced_state: None,
            address,
            listed_tags: None,
        };
        let instance = self.snapshot(&record);
        tracing::info!(instance.id = %id, instance.key = %request.key, "created instance");
        state.last_created = Some((Instant::now(), instance.clone()));
        state.ids_by_key.insert(request.key, id.clone());
        state.instances.insert(id.clone(), record);
        self.hub.updated(instance.clone());
        self.refresh_after(&id, self.provisioning_delay());
        Ok(instance)
    }

    /// A Create whose caller's deadline is short stores its instance, then never
    /// indexes its key: the deadline cuts it off (only to misbehave).
    async fn create_then_hang(&self, request: pb::CreateInstanceRequest) -> Status {
        let id = format!("ref-{}", uuid::Uuid::new_v4());
        let record = Record {
            host: None,
            instance: pb::Instance {
                id: id.clone(),
                key: request.key,
                name: request.name,
                create_time: Some(SystemTime::now().into()),
                tags: request.tags,
                placement: request.placement,
                proxy_port: request.proxy_port,
                ..Default::default()
            },
            created: Instant::now(),
            deleted: None,
            spec: Spec {
                placement: None,
                cloud_init: None,
                proxy_port: 0,
                name: None,
                tags: None,
                address_identity: None,
                requested_address: None,
            },
            forced_state: None,
            address: None,
            listed_tags: None,
        };
        self.lock().instances.insert(id, record);
        std::future::pending().await
    }
}

impl MemoryProvider {
    /// The contract's empty-id check (or the misbehaviour that skips it).
    fn check_id(&self, id: &str) -> Result<(), ProviderError> {
        if id.is_empty() && self.breaks(Misbehaviour::EmptyIdNotFound) {
            return Err(ProviderError::not_found("instance  does not exist"));
        }
        validation::check_id(id)
    }

    /// GetInstance's work.
    fn get(&self, id: &str) -> Result<pb::Instance, ProviderError> {
        self.check_id(id)?;
        let mut state = self.lock();
        self.purge(&mut state);
        match state.instances.get(id) {
            Some(record) => {
                let mut instance = self.snapshot(record);
                if self.breaks(Misbehaviour::NoCreateTimeInGet) {
                    instance.create_time = None;
                }
                Ok(instance)
            }
            None if self.breaks(Misbehaviour::MissingIsPermanent) => Err(ProviderError::permanent(
                format!("instance {id} does not exist"),
            )),
            None => Err(ProviderError::not_found(format!(
                "instance {id} does not exist"
            ))),
        }
    }

    /// DeleteInstance's work: the instance is DELETING, then gone (a missing one is
    /// fine).
    fn delete(&self, id: &str) -> Result<(), ProviderError> {
        self.check_id(id)?;
        let mut state = self.lock();
        self.purge(&mut state);
        let Some(record) = state.instances.get_mut(id) else {
            if self.breaks(Misbehaviour::DeleteMissingNotFound) {
                return Err(ProviderError::not_found(format!(
                    "instance {id} does not exist"
                )));
            }
            return Ok(());
        };
        let provisioning = record.deleted.is_none()
            && record.forced_state.is_none()
            && record.created.elapsed() < self.provisioning_delay();
        if provisioning && self.breaks(Misbehaviour::DeleteIgnoredWhileProvisioning) {
            return Ok(());
        }
        if record.deleted.is_none() {
            record.deleted = Some(Instant::now());
            tracing::info!(instance.id = %id, "deleting instance");
            let now = self.snapshot(record);
            self.hub.updated(now);
            self.refresh_after(id, self.config.deleting_delay);
        }
        if self.breaks(Misbehaviour::DeletesForeign) {
            let oldest = state
                .instances
                .iter()
                .filter(|(other, _)| *other != id)
                .min_by_key(|(_, record)| record.created)
                .map(|(id, _)| id.clone());
            if let Some(other) = oldest.and_then(|other| state.instances.remove(&other)) {
                state.ids_by_key.remove(&other.instance.key);
            }
        }
        self.purge(&mut state);
        Ok(())
    }
}

/// Holds an answer back (a `DelayResponse` fault): the work is done, the caller waits.
async fn hold_answer(hold: Option<Duration>) {
    if let Some(delay) = hold {
        tokio::time::sleep(delay).await;
    }
}

/// A provider without CAPABILITY_ADDRESS_IDENTITY and CAPABILITY_REQUESTED_ADDRESS
/// refuses their fields, naming each that is set.
fn refuse_address_fields(request: &pb::CreateInstanceRequest) -> Result<(), ProviderError> {
    let set = [
        ("address_identity", request.address_identity.is_some()),
        ("requested_address", request.requested_address.is_some()),
    ];
    let mut refused = set.into_iter().filter(|(_, set)| *set).map(|(field, _)| {
        (
            field,
            format!("this provider does not offer address identities: leave {field} unset"),
        )
    });
    match refused.next() {
        None => Ok(()),
        Some((field, description)) => Err(refused.fold(
            ProviderError::invalid_argument(field, description),
            |error, (field, description)| error.with_violation(field, description),
        )),
    }
}

fn unknown(what: &str, name: &str, known: &[String]) -> String {
    format!(
        "unknown {what} {name:?}: this provider offers {}",
        known.join(", ")
    )
}

#[tonic::async_trait]
impl pb::provider_server::Provider for MemoryProvider {
    async fn get_plugin_info(
        &self,
        request: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        let (_running, hold) = self.enter("GetPluginInfo", request.metadata()).await?;
        hold_answer(hold).await;
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: PLUGIN_NAME.into(),
            vendor_version: if self.breaks(Misbehaviour::NonSemverVersion) {
                "latest".into()
            } else {
                env!("CARGO_PKG_VERSION").into()
            },
            contract_version: self.config.contract_version.clone(),
            manifest: [("storage".to_string(), "memory".to_string())].into(),
        }))
    }

    async fn get_capabilities(
        &self,
        request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        let (_running, hold) = self.enter("GetCapabilities", request.metadata()).await?;
        let capabilities = [
            pb::Capability::ValidatePlacement,
            pb::Capability::VendorData,
            pb::Capability::Ipv6,
            pb::Capability::ListLocations,
            pb::Capability::WatchInstances,
            pb::Capability::AddressIdentity,
            pb::Capability::RequestedAddress,
            pb::Capability::UpdateTags,
        ]
        .into_iter()
        .filter(|c| match c {
            pb::Capability::ValidatePlacement => !self.breaks(Misbehaviour::UndeclaredCapability),
            pb::Capability::ListLocations => !self.breaks(Misbehaviour::LocationsUndeclared),
            pb::Capability::WatchInstances => !self.breaks(Misbehaviour::WatchUndeclared),
            pb::Capability::UpdateTags => {
                self.config.update_tags && !self.breaks(Misbehaviour::TagsUpdateUndeclared)
            }
            pb::Capability::AddressIdentity | pb::Capability::RequestedAddress => {
                self.config.address_identities
                    && !self.breaks(Misbehaviour::UndeclaredAddressIdentity)
            }
            _ => true,
        });
        hold_answer(hold).await;
        Ok(Response::new(pb::GetCapabilitiesResponse {
            capabilities: capabilities.map(Into::into).collect(),
        }))
    }

    async fn create_instance(
        &self,
        request: Request<pb::CreateInstanceRequest>,
    ) -> Result<Response<pb::CreateInstanceResponse>, Status> {
        let (_running, hold) = self.enter("CreateInstance", request.metadata()).await?;
        if self.breaks(Misbehaviour::TransientWithoutErrorInfo)
            && !std::mem::replace(&mut self.lock().answered_a_create, true)
        {
            return Err(Status::unavailable("busy"));
        }
        let short_deadline = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(crate::parse_grpc_timeout)
            .is_some_and(|timeout| timeout < Duration::from_secs(1));
        let request = request.into_inner();
        if self.breaks(Misbehaviour::OrphansCancelledCreate)
            && short_deadline
            && !self.lock().ids_by_key.contains_key(&request.key)
        {
            return Err(self.create_then_hang(request).await);
        }
        if self.breaks(Misbehaviour::RacyCreate)
            && !self.lock().ids_by_key.contains_key(&request.key)
        {
            // Check, wait, then create without checking again: racing Creates each
            // make an instance.
            tokio::time::sleep(RACE_WINDOW).await;
            self.lock().ids_by_key.remove(&request.key);
        }
        let instance = self.create(request).map_err(|e| self.encode(&e))?;
        hold_answer(hold).await;
        Ok(Response::new(pb::CreateInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn get_instance(
        &self,
        request: Request<pb::GetInstanceRequest>,
    ) -> Result<Response<pb::GetInstanceResponse>, Status> {
        let (_running, hold) = self.enter("GetInstance", request.metadata()).await?;
        let instance = self
            .get(&request.into_inner().id)
            .map_err(|e| self.encode(&e))?;
        hold_answer(hold).await;
        Ok(Response::new(pb::GetInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn delete_instance(
        &self,
        request: Request<pb::DeleteInstanceRequest>,
    ) -> Result<Response<pb::DeleteInstanceResponse>, Status> {
        let (_running, hold) = self.enter("DeleteInstance", request.metadata()).await?;
        self.delete(&request.into_inner().id)
            .map_err(|e| self.encode(&e))?;
        hold_answer(hold).await;
        Ok(Response::new(pb::DeleteInstanceResponse {}))
    }

    async fn list_instances(
        &self,
        request: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        let (_running, hold) = self.enter("ListInstances", request.metadata()).await?;
        if self.breaks(Misbehaviour::CancelledAtDeadline) {
            // Far longer than the check's 1 ms deadline, so that tonic's own timer ends
            // the call even when a loaded machine wakes both timers late at once.
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let page = self
            .list(&request.into_inner())
            .map_err(|e| self.encode(&e))?;
        hold_answer(hold).await;
        Ok(Response::new(page))
    }

    async fn validate_placement(
        &self,
        request: Request<pb::ValidatePlacementRequest>,
    ) -> Result<Response<pb::ValidatePlacementResponse>, Status> {
        let (_running, hold) = self.enter("ValidatePlacement", request.metadata()).await?;
        let mut placement = request.into_inner().placement;
        if self.breaks(Misbehaviour::ValidateMissingPlacementAccepted) && placement.is_none() {
            placement = Some(self.default_placement());
        }
        let (resolved, warnings) = if self.breaks(Misbehaviour::ValidateAcceptsAnything) {
            (placement.unwrap_or_default(), Vec::new())
        } else {
            validation::check_placement_request(placement.as_ref())
                .and_then(|()| {
                    self.resolve(placement.as_ref().expect("validated: placement is set"))
                })
                .map(|resolved| self.placed(&resolved))
                .map_err(|e| self.encode(&e))?
        };
        hold_answer(hold).await;
        Ok(Response::new(pb::ValidatePlacementResponse {
            resolved: Some(resolved)
                .filter(|_| !self.breaks(Misbehaviour::ValidateResolvesNothing)),
            warnings,
        }))
    }

    async fn watch_instances(
        &self,
        request: Request<pb::WatchInstancesRequest>,
    ) -> Result<Response<crate::watch::WatchStream>, Status> {
        let (_running, hold) = self.enter("WatchInstances", request.metadata()).await?;
        let stream = self.watch_stream(request.into_inner())?;
        hold_answer(hold).await;
        Ok(Response::new(stream))
    }

    async fn update_instance_tags(
        &self,
        request: Request<pb::UpdateInstanceTagsRequest>,
    ) -> Result<Response<pb::UpdateInstanceTagsResponse>, Status> {
        let (_running, hold) = self.enter("UpdateInstanceTags", request.metadata()).await?;
        if !self.config.update_tags {
            return Err(self.encode(&ProviderError::unimplemented(
                "this provider does not offer UpdateInstanceTags (no CAPABILITY_UPDATE_TAGS)",
            )));
        }
        let instance = self
            .update_tags(request.into_inner())
            .await
            .map_err(|e| self.encode(&e))?;
        hold_answer(hold).await;
        Ok(Response::new(pb::UpdateInstanceTagsResponse {
            instance: Some(instance),
        }))
    }

    async fn list_locations(
        &self,
        request: Request<pb::ListLocationsRequest>,
    ) -> Result<Response<pb::ListLocationsResponse>, Status> {
        let (_running, hold) = self.enter("ListLocations", request.metadata()).await?;
        let answer = self
            .locations_page(&request.into_inner())
            .map_err(|e| self.encode(&e))?;
        hold_answer(hold).await;
        Ok(Response::new(answer))
    }
}
