//! The reference provider: instances kept in memory, the smallest complete
//! implementation of the contract (like CSI's host-path driver).
//!
//! Read it to see what a provider must do:
//! 1. validate every request, naming the bad field ([`crate::validation`] plus the
//!    provider's own catalogue of hosts, machine types and images);
//! 2. make Create idempotent on the key, and refuse the same key with another spec;
//! 3. report PROVISIONING until the instance is usable, then RUNNING with addresses;
//! 4. make Delete of a missing instance succeed, and Get of one NOT_FOUND;
//! 5. list by tags, paged.
//!
//! Instances move from PROVISIONING to RUNNING after
//! [`ReferenceConfig::provisioning_delay`] and get [`ReferenceConfig::address`]
//! (loopback by default). [`Faults`] and the control service ([`control`]) let tests
//! inject errors, latency and hangs, and force an instance's state. A [`Misbehaviour`]
//! breaks one contract rule on purpose, to test the conformance suite.

pub mod control;
mod faults;
mod misbehave;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tonic::{Request, Response, Status};

pub use faults::{Fault, FaultEffect, Faults};
pub use misbehave::Misbehaviour;

use crate::pb::{self, InstanceState, placement::Location};
use crate::{CONTRACT_VERSION, ProviderError, validation};

/// The provider name the reference provider reports.
pub const PLUGIN_NAME: &str = "reference.egressproxy.dev";
const DEFAULT_PAGE_SIZE: usize = 100;
const MAX_PAGE_SIZE: usize = 1000;

/// What the reference provider offers and how it behaves.
#[derive(Debug, Clone)]
pub struct ReferenceConfig {
    /// Time from Create until an instance is RUNNING.
    pub provisioning_delay: Duration,
    /// The address every running instance reports.
    pub address: IpAddr,
    /// Valid `placement.host` names; the first is used when no location is given.
    pub hosts: Vec<String>,
    /// Valid `placement.zone` names.
    pub zones: Vec<String>,
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
            address: IpAddr::from([127, 0, 0, 1]),
            hosts: vec!["local".into()],
            zones: vec!["local-zone".into()],
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
}

#[derive(Debug, Default)]
struct State {
    instances: BTreeMap<String, Record>,
    ids_by_key: HashMap<String, String>,
    calls: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct Record {
    instance: pb::Instance,
    created: Instant,
    spec: Spec,
    forced_state: Option<InstanceState>,
}

/// What must match for a repeated Create to return the existing instance.
#[derive(Debug, PartialEq)]
struct Spec {
    placement: Option<pb::Placement>,
    cloud_init: Option<pb::CloudInit>,
    proxy_port: u32,
}

impl MemoryProvider {
    /// A provider with `config` and no faults.
    pub fn new(config: ReferenceConfig) -> Self {
        MemoryProvider {
            config: Arc::new(config),
            state: Arc::default(),
            faults: Faults::default(),
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
        Ok(())
    }

    /// Calls received per Provider method.
    pub fn call_counts(&self) -> BTreeMap<String, u64> {
        self.lock().calls.clone()
    }

    /// Counts the call, then applies any injected fault; returns how long to hold the
    /// answer back once the work is done.
    async fn enter(&self, method: &str) -> Result<Option<Duration>, Status> {
        *self.lock().calls.entry(method.to_owned()).or_default() += 1;
        self.faults.apply(method).await.map_err(Status::from)
    }

    fn breaks(&self, misbehaviour: Misbehaviour) -> bool {
        self.config.misbehave == Some(misbehaviour)
    }

    /// An error as the configured misbehaviour (if any) would send it.
    fn answer_error(&self, status: Status) -> Status {
        match self.config.misbehave {
            Some(misbehaviour) => misbehaviour.error(status),
            None => status,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Checks names against the catalogue and fills in the host when none is given.
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
            Some(location) => Some(location.clone()),
            None => config.hosts.first().cloned().map(Location::Host),
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
        let provisioned = record.created.elapsed() >= self.config.provisioning_delay;
        let state = record.forced_state.unwrap_or(if provisioned {
            InstanceState::Running
        } else {
            InstanceState::Provisioning
        });
        instance.set_state(state);
        if state == InstanceState::Running {
            let address = self.config.address;
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
        if self.breaks(Misbehaviour::PlacementNotEchoed)
            && let Some(placement) = instance.placement.as_mut()
        {
            placement.machine_type = "something-else".into();
        }
        if self.breaks(Misbehaviour::WrongProxyPort) {
            instance.proxy_port = 3128;
        }
        instance.state_message = match state {
            InstanceState::Provisioning => "booting".into(),
            InstanceState::Stopped => "stopped".into(),
            _ => String::new(),
        };
        instance
    }

    /// One page of ListInstances: instances after the token that match the selector.
    fn list_page(
        &self,
        request: &pb::ListInstancesRequest,
        page_size: usize,
    ) -> (Vec<pb::Instance>, String) {
        let state = self.lock();
        let start = std::ops::Bound::Excluded(request.page_token.clone());
        let range = if request.page_token.is_empty() {
            state.instances.range::<String, _>(..)
        } else {
            state.instances.range((start, std::ops::Bound::Unbounded))
        };
        let mut instances: Vec<pb::Instance> = range
            .filter(|(_, record)| {
                let tags = &record.instance.tags;
                let matches = |(key, value): (&String, &String)| tags.get(key) == Some(value);
                if self.breaks(Misbehaviour::OrTagMatching) {
                    request.tag_selector.iter().any(matches)
                } else {
                    request.tag_selector.iter().all(matches)
                }
            })
            .take(page_size + 1)
            .map(|(_, record)| {
                let mut instance = self.snapshot(record);
                if self.breaks(Misbehaviour::ListStateDisagrees)
                    && instance.state() == InstanceState::Running
                {
                    instance.set_state(InstanceState::Provisioning);
                    instance.addresses.clear();
                }
                instance
            })
            .collect();
        let next_page_token = if instances.len() > page_size {
            instances.truncate(page_size);
            instances
                .last()
                .map(|instance| instance.id.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        if self.breaks(Misbehaviour::CyclingPageToken) && !instances.is_empty() {
            return (instances, "cycle".into());
        }
        (instances, next_page_token)
    }

    /// CreateInstance's work: validate, then return the key's instance or make one.
    fn create(&self, request: pb::CreateInstanceRequest) -> Result<pb::Instance, Status> {
        validation::check_create_request(&request)?;
        let placement = request
            .placement
            .as_ref()
            .expect("validated: placement is set");
        let resolved = self.resolve(placement)?;
        let spec = Spec {
            placement: request.placement.clone(),
            cloud_init: request.cloud_init.clone(),
            proxy_port: request.proxy_port,
        };

        let mut state = self.lock();
        if let Some(id) = state.ids_by_key.get(&request.key) {
            let record = &state.instances[id];
            if record.spec != spec {
                return Err(ProviderError::already_exists(format!(
                    "key {} belongs to instance {id}, created with a different placement, \
                     cloud-init or proxy port: delete it first or use another key",
                    request.key
                ))
                .into());
            }
            let instance = self.snapshot(record);
            return Ok(instance);
        }
        let id = format!("ref-{}", uuid::Uuid::new_v4());
        let record = Record {
            instance: pb::Instance {
                id: id.clone(),
                key: request.key.clone(),
                name: request.name,
                create_time: Some(SystemTime::now().into()),
                tags: request.tags,
                placement: Some(resolved),
                proxy_port: request.proxy_port,
                ..Default::default()
            },
            created: Instant::now(),
            spec,
            forced_state: None,
        };
        let instance = self.snapshot(&record);
        tracing::info!(instance.id = %id, instance.key = %request.key, "created instance");
        state.ids_by_key.insert(request.key, id.clone());
        state.instances.insert(id, record);
        Ok(instance)
    }
}

impl MemoryProvider {
    /// The contract's empty-id check (or the misbehaviour that skips it).
    fn check_id(&self, id: &str) -> Result<(), Status> {
        if id.is_empty() && self.breaks(Misbehaviour::EmptyIdNotFound) {
            return Err(ProviderError::not_found("instance  does not exist").into());
        }
        validation::check_id(id).map_err(|e| self.answer_error(e.into()))
    }

    /// Removes the instance (a missing one is fine).
    fn delete(&self, id: &str) {
        let mut state = self.lock();
        if self.breaks(Misbehaviour::DeletingForever) {
            if let Some(record) = state.instances.get_mut(id) {
                record.forced_state = Some(InstanceState::Deleting);
            }
            return;
        }
        if let Some(record) = state.instances.remove(id) {
            state.ids_by_key.remove(&record.instance.key);
            tracing::info!(instance.id = %id, "deleted instance");
            if self.breaks(Misbehaviour::DeletesForeign) {
                let oldest = state
                    .instances
                    .iter()
                    .min_by_key(|(_, record)| record.created)
                    .map(|(id, _)| id.clone());
                if let Some(other) = oldest.and_then(|other| state.instances.remove(&other)) {
                    state.ids_by_key.remove(&other.instance.key);
                }
            }
        }
    }
}

/// Holds an answer back (a `DelayResponse` fault): the work is done, the caller waits.
async fn hold_answer(hold: Option<Duration>) {
    if let Some(delay) = hold {
        tokio::time::sleep(delay).await;
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
        _request: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        let hold = self.enter("GetPluginInfo").await?;
        hold_answer(hold).await;
        Ok(Response::new(pb::GetPluginInfoResponse {
            name: PLUGIN_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            contract_version: self.config.contract_version.clone(),
            manifest: [("storage".to_string(), "memory".to_string())].into(),
        }))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        let hold = self.enter("GetCapabilities").await?;
        let capabilities = [
            pb::Capability::ValidatePlacement,
            pb::Capability::VendorData,
            pb::Capability::Ipv6,
        ]
        .into_iter()
        .filter(|c| {
            *c != pb::Capability::ValidatePlacement
                || !self.breaks(Misbehaviour::UndeclaredCapability)
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
        let hold = self.enter("CreateInstance").await?;
        let request = request.into_inner();
        if self.breaks(Misbehaviour::RacyCreate)
            && !self.lock().ids_by_key.contains_key(&request.key)
        {
            // Check, wait, then create without checking again: racing Creates each
            // make an instance.
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.lock().ids_by_key.remove(&request.key);
        }
        let instance = self.create(request).map_err(|s| self.answer_error(s))?;
        hold_answer(hold).await;
        Ok(Response::new(pb::CreateInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn get_instance(
        &self,
        request: Request<pb::GetInstanceRequest>,
    ) -> Result<Response<pb::GetInstanceResponse>, Status> {
        let hold = self.enter("GetInstance").await?;
        let id = request.into_inner().id;
        self.check_id(&id)?;
        let instance = {
            let state = self.lock();
            let record = state.instances.get(&id);
            record.map(|record| self.snapshot(record))
        };
        let instance = instance.ok_or_else(|| {
            self.answer_error(
                ProviderError::not_found(format!("instance {id} does not exist")).into(),
            )
        })?;
        hold_answer(hold).await;
        Ok(Response::new(pb::GetInstanceResponse {
            instance: Some(instance),
        }))
    }

    async fn delete_instance(
        &self,
        request: Request<pb::DeleteInstanceRequest>,
    ) -> Result<Response<pb::DeleteInstanceResponse>, Status> {
        let hold = self.enter("DeleteInstance").await?;
        let id = request.into_inner().id;
        self.check_id(&id)?;
        self.delete(&id);
        hold_answer(hold).await;
        Ok(Response::new(pb::DeleteInstanceResponse {}))
    }

    async fn list_instances(
        &self,
        request: Request<pb::ListInstancesRequest>,
    ) -> Result<Response<pb::ListInstancesResponse>, Status> {
        let hold = self.enter("ListInstances").await?;
        let request = request.into_inner();
        let page_size = match request.page_size {
            _ if self.breaks(Misbehaviour::IgnorePageSize) => DEFAULT_PAGE_SIZE,
            None | Some(0) => DEFAULT_PAGE_SIZE,
            Some(size) => (size as usize).min(MAX_PAGE_SIZE),
        };
        let (instances, next_page_token) = self.list_page(&request, page_size);
        hold_answer(hold).await;
        Ok(Response::new(pb::ListInstancesResponse {
            instances,
            next_page_token,
        }))
    }

    async fn validate_placement(
        &self,
        request: Request<pb::ValidatePlacementRequest>,
    ) -> Result<Response<pb::ValidatePlacementResponse>, Status> {
        let hold = self.enter("ValidatePlacement").await?;
        let placement = request.into_inner().placement;
        validation::check_placement_request(placement.as_ref())
            .map_err(|e| self.answer_error(e.into()))?;
        let resolved = self
            .resolve(placement.as_ref().expect("validated: placement is set"))
            .map_err(|e| self.answer_error(e.into()))?;
        hold_answer(hold).await;
        Ok(Response::new(pb::ValidatePlacementResponse {
            resolved: Some(resolved),
            warnings: vec![],
        }))
    }
}
