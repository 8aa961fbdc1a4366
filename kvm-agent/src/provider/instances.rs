//! Create, Get, Delete, List and UpdateInstanceTags as the contract sees them, across
//! the configured hosts.
//!
//! Create's steps are in [`crate::provider::create`], UpdateInstanceTags' in
//! [`crate::provider::tags`].
//!
//! Each runs its libvirt work ([`crate::libvirt::domains`]) as one call on the host's pooled
//! connection, so it is off the runtime, traced and bounded by the caller's deadline;
//! errors are the crate's [`Error`], which the gRPC service turns into the contract's
//! through the one mapping ([`Error::to_provider_error`]). The contract rules applied
//! here:
//! - an id this provider cannot have returned (not `<host>/<key>`) names no instance:
//!   Get is NOT_FOUND and Delete succeeds, as for any missing instance;
//! - an id whose host is not (any longer) configured is FAILED_PRECONDITION, not an
//!   endless retry (which would pin the operator's finalizer);
//! - Get of a missing domain is NOT_FOUND; Delete of one succeeds; a domain with the
//!   instance's name but not the agent's metadata is missing for both (Delete leaves it
//!   and its volumes alone);
//! - List fails when any host cannot be reached, so a garbage collector never mistakes
//!   an unreachable host for an empty one;
//! - Create finds the key's instance on any host, not only the ones it may place it on;
//!   a host that cannot answer is skipped (see `existing_on_hosts`). A new instance goes
//!   to the named host, or to the host with the most room of the zone's hosts (or of
//!   all of them), as [`crate::provider::room`] chooses; where none has room, Create is
//!   RESOURCE_EXHAUSTED (CAPACITY_EXHAUSTED).

use std::sync::Arc;

use egressproxy_provider::pb;
use tokio::time::Instant;
use tracing::Instrument;

use crate::config::Config;
use crate::error::Error;
use crate::images::cache::{BaseImage, ImageCache, ImageCacheOptions};
use crate::libvirt::domains::{self, NicKind};
use crate::libvirt::host::capabilities::VirtTypes;
use crate::libvirt::naming::{InstanceId, InstanceNames};
use crate::libvirt::tags::{self, TagsUpdate};
use crate::provider::create::{self, CreateStep, FaultHook, Where};
use crate::provider::plan::{CreatePlan, plan_create};
use crate::provider::room;
use crate::provider::state::to_contract_instance;
use crate::provider::sync::{AllocationLocks, KeyLocks};
use crate::provider::tags::check_update_tags_request;
use crate::transport::call::LibvirtOp;
use crate::transport::pool::{HostPool, Pool};

/// How long Create asks another host whether the key's instance is there.
const ELSEWHERE_LOOKUP: std::time::Duration = std::time::Duration::from_secs(5);

/// The instances on every configured host.
#[derive(Debug, Clone)]
pub struct Instances {
    config: Arc<Config>,
    pool: Arc<Pool>,
    images: Arc<ImageCache>,
    key_locks: Arc<KeyLocks>,
    allocation_locks: Arc<AllocationLocks>,
    virt_types: Arc<VirtTypes>,
    faults: FaultHook,
}

impl Instances {
    /// Instances on the hosts of `config`, reached through `pool`.
    pub fn new(config: Arc<Config>, pool: Arc<Pool>) -> Self {
        Self {
            images: Arc::new(ImageCache::new(ImageCacheOptions::from_transport(
                &config.transport,
            ))),
            config,
            pool,
            key_locks: Arc::default(),
            allocation_locks: Arc::default(),
            virt_types: Arc::default(),
            faults: FaultHook::default(),
        }
    }

    /// The same, failing Create where `faults` says (tests of Create's idempotency).
    pub fn with_fault_hook(mut self, faults: FaultHook) -> Self {
        self.faults = faults;
        self
    }

    /// The pool of connections to the hosts.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The `domainType: auto` answers, shared by Create and ValidatePlacement.
    pub fn virt_types(&self) -> &VirtTypes {
        &self.virt_types
    }

    /// The configuration.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// The base image cache Create uses.
    pub fn image_cache(&self) -> &Arc<ImageCache> {
        &self.images
    }

    /// Creates the instance of `request`, or returns the one its key already names. See
    /// [`crate::provider::create`].
    pub async fn create(
        &self,
        request: &pb::CreateInstanceRequest,
        deadline: Instant,
    ) -> Result<pb::Instance, Error> {
        let images = self.images.clone();
        self.create_with(request, deadline, move |host, plan| async move {
            let (name, image) = &plan.image;
            Ok(images.ensure_base(&host, name, image, deadline).await?)
        })
        .await
    }

    /// [`Instances::create`] with another source of the base image: `ensure_base`
    /// provides the base image volume on the chosen host. See
    /// [`crate::provider::create`].
    ///
    /// Once the key's lock is taken, the steps run in a task of their own that holds the
    /// lock until they end: a caller that goes away (tonic drops the handler's future
    /// when the client cancels or its deadline passes) does not stop them half-way, nor
    /// let a Delete or another Create of the key run beside them. The task ends when the
    /// steps are done or the request's deadline has passed.
    pub(crate) async fn create_with<F, Fut>(
        &self,
        request: &pb::CreateInstanceRequest,
        deadline: Instant,
        ensure_base: F,
    ) -> Result<pb::Instance, Error>
    where
        F: FnOnce(Arc<HostPool>, crate::provider::plan::CreatePlan) -> Fut + Send + 'static,
        Fut: Future<Output = Result<BaseImage, Error>> + Send + 'static,
    {
        let plan = plan_create(&self.config, request)?;
        let first = plan.candidates.first().map(|h| h.name.clone());
        let turn = self
            .key_locks
            .lock(first.as_deref().unwrap_or_default(), &request.key, deadline)
            .await?;
        let this = self.clone();
        let owned_request = request.clone();
        // Dropping the JoinHandle (when this future is dropped) detaches the task; it
        // does not abort it.
        let steps = tokio::spawn(
            async move {
                let _turn = turn;
                this.create_locked(plan, &owned_request, deadline, ensure_base)
                    .await
            }
            .in_current_span(),
        );
        match steps.await {
            Ok(result) => result,
            Err(e) => Err(Error::CreateTaskFailed {
                key: request.key.clone(),
                reason: e.to_string(),
            }),
        }
    }

    /// Create's steps, with the key's lock held: the key's instance wherever it is, else
    /// a host chosen by room and a new instance there.
    async fn create_locked<F, Fut>(
        &self,
        plan: CreatePlan,
        request: &pb::CreateInstanceRequest,
        deadline: Instant,
        ensure_base: F,
    ) -> Result<pb::Instance, Error>
    where
        F: FnOnce(Arc<HostPool>, CreatePlan) -> Fut,
        Fut: Future<Output = Result<BaseImage, Error>>,
    {
        let named = match &plan.location {
            Some(egressproxy_provider::pb::placement::Location::Host(name)) => {
                Some(self.pool.host(name)?)
            }
            _ => None,
        };
        if let Some(named) = &named
            && let Some(existing) =
                create::existing_instance(named, &plan, &request.key, Where::Planned, deadline)
                    .await?
        {
            return Ok(existing);
        }
        if let Some(existing) = self
            .existing_on_hosts(
                named.as_ref().map(|h| h.name()),
                &plan,
                &request.key,
                deadline,
            )
            .await?
        {
            return Ok(existing);
        }
        let host = self.place(&plan, deadline).await?;
        if named.is_none()
            && let Some(existing) =
                create::existing_instance(&host, &plan, &request.key, Where::Planned, deadline)
                    .await?
        {
            return Ok(existing);
        }
        create::check_identity_free(&host, &plan, &request.key, deadline).await?;
        let virt_type = self.virt_types.for_host(&host, deadline).await?;
        let base = ensure_base(host.clone(), plan.clone()).await?;
        self.faults.after(CreateStep::BaseImage)?;
        create::create_from_base(
            &host,
            &plan,
            request,
            &base,
            virt_type,
            &self.allocation_locks,
            &self.faults,
            deadline,
        )
        .await
    }

    /// The host a new instance of `plan` goes to: the one with the most room among its
    /// candidates (see [`crate::provider::room`]), measured now.
    async fn place(&self, plan: &CreatePlan, deadline: Instant) -> Result<Arc<HostPool>, Error> {
        let candidates = room::measure(&self.pool, &plan.candidates, deadline).await;
        let host = room::choose_host(
            candidates,
            &plan.machine_type.0,
            &plan.machine_type.1,
            &room::asked(plan.location.as_ref()),
        )?;
        Ok(self.pool.host(&host)?)
    }

    /// The key's instance on any host but `except`, if the agent made one there: a key
    /// names one instance on any host, and an earlier Create may have placed it
    /// elsewhere (another requested host, or another host with more room then). The
    /// hosts are asked at once, each for at most [`ELSEWHERE_LOOKUP`]; one that cannot
    /// answer is skipped and logged, so that a host that is down does not stop Creates
    /// on the others (an instance of the key there is found again by Get, List and
    /// garbage collection once it is back).
    async fn existing_on_hosts(
        &self,
        except: Option<&str>,
        plan: &CreatePlan,
        key: &str,
        deadline: Instant,
    ) -> Result<Option<pb::Instance>, Error> {
        let others = self
            .config
            .hosts
            .iter()
            .filter(|h| Some(h.name.as_str()) != except)
            .map(|h| self.pool.host(&h.name))
            .collect::<Result<Vec<_>, _>>()?;
        let bound = deadline.min(Instant::now() + ELSEWHERE_LOOKUP);
        let answers = futures::future::join_all(
            others
                .iter()
                .map(|other| create::existing_instance(other, plan, key, Where::Elsewhere, bound)),
        )
        .await;
        for (other, answer) in others.iter().zip(answers) {
            match answer {
                Ok(Some(existing)) => return Ok(Some(existing)),
                Ok(None) => {}
                Err(error) if error.class() == egressproxy_provider::ErrorClass::AlreadyExists => {
                    return Err(error);
                }
                Err(error) => tracing::warn!(
                    host = other.name(),
                    instance.key = key,
                    %error,
                    "create: could not ask this host whether the key's instance is there; \
                     going on without it"
                ),
            }
        }
        Ok(None)
    }

    /// Instance `id` read again while no Create or Delete of its key runs in this agent:
    /// `None` while one runs (the domain is half made or half gone: defined but not yet
    /// started reads as shut off), `Ok(None)` when the instance is gone.
    pub async fn read_settled(&self, id: &str) -> Option<Result<Option<pb::Instance>, Error>> {
        let (parsed, host, _) = match self.resolve(id) {
            Ok(Some(resolved)) => resolved,
            Ok(None) => return Some(Ok(None)),
            Err(error) => return Some(Err(error)),
        };
        // A deadline already passed: the lock is taken only if it is free now.
        let _turn = self
            .key_locks
            .lock(host.name(), &parsed.key, Instant::now())
            .await
            .ok()?;
        match self.get(id, self.pool.default_deadline()).await {
            Ok(instance) => Some(Ok(Some(instance))),
            Err(Error::InstanceNotFound { .. }) => Some(Ok(None)),
            Err(error) => Some(Err(error)),
        }
    }

    /// The instance `id`: state, addresses, tags, placement.
    pub async fn get(&self, id: &str, deadline: Instant) -> Result<pb::Instance, Error> {
        let Some((id, host, names)) = self.resolve(id)? else {
            return Err(Error::InstanceNotFound {
                id: id.to_owned(),
                detail: "this provider's ids are <host>/<key>".to_owned(),
            });
        };
        let nic = NicKind::of(&host.config().attachment());
        let op = LibvirtOp::new("virDomainLookupByName").domain(names.domain.clone());
        let lookup = names.clone();
        let snapshot = host
            .call(op, deadline, move |conn| {
                domains::read_instance(conn, &lookup, nic)
            })
            .await?;
        match snapshot {
            Some(snapshot) => Ok(to_contract_instance(&id.host, snapshot)),
            None => Err(Error::InstanceNotFound {
                id: id.to_string(),
                detail: format!("no domain {} on host {}", names.domain, id.host),
            }),
        }
    }

    /// Deletes the instance `id` with its overlay and seed; a missing one is success. Waits
    /// for a Create of the same key in this agent to finish first.
    pub async fn delete(&self, id: &str, deadline: Instant) -> Result<(), Error> {
        let Some((id, host, names)) = self.resolve(id)? else {
            return Ok(());
        };
        // After an in-flight Create of the key, so that Create cannot re-make what this
        // deletes.
        let _turn = self.key_locks.lock(host.name(), &id.key, deadline).await?;
        let storage_pool = host.config().storage_pool.clone();
        let names_domain = names.domain.clone();
        let op = LibvirtOp::new("virDomainUndefineFlags").domain(names.domain.clone());
        let deleted = host
            .call(op, deadline, move |conn| {
                domains::delete_instance(conn, &names, &storage_pool)
            })
            .await?;
        // The identity's reservation goes with its last domain; also one that an
        // interrupted Delete or Create left behind.
        // A sweep that cannot finish for a reason retrying cannot fix must not pin the
        // caller's Delete; the next Create or Delete on the host sweeps again.
        if let Err(error) = create::sweep_reservations(&host, deadline).await {
            if error.class().is_retryable() {
                return Err(error);
            }
            tracing::warn!(instance.id = %id, %error, "delete: reservations not swept");
        }
        if deleted.foreign_domain_left {
            tracing::warn!(
                instance.id = %id,
                domain = %names_domain,
                "delete: the domain with this instance's name is not the agent's \
                 (no metadata); it and its volumes were left alone"
            );
        } else {
            tracing::info!(
                instance.id = %id,
                domain_deleted = deleted.domain,
                volumes_deleted = deleted.volumes.len(),
                "deleted instance"
            );
        }
        Ok(())
    }

    /// UpdateInstanceTags: replaces the tags of the instance the request names while they
    /// are exactly its `expected_tags`, under the key's lock. See
    /// [`crate::provider::tags`].
    pub async fn update_tags(
        &self,
        request: &pb::UpdateInstanceTagsRequest,
        deadline: Instant,
    ) -> Result<pb::Instance, Error> {
        let (expected, new) = check_update_tags_request(request)?;
        let not_found = |detail: String| Error::InstanceNotFound {
            id: request.id.clone(),
            detail,
        };
        let Some((id, host, names)) = self.resolve(&request.id)? else {
            return Err(not_found("this provider's ids are <host>/<key>".to_owned()));
        };
        let _turn = self.key_locks.lock(host.name(), &id.key, deadline).await?;
        let nic = NicKind::of(&host.config().attachment());
        let op = LibvirtOp::new("virDomainSetMetadata").domain(names.domain.clone());
        let domain = names.domain.clone();
        let outcome = host
            .call(op, deadline, move |conn| {
                tags::compare_and_set_tags(conn, &names, &expected, &new, nic)
            })
            .await?;
        match outcome {
            TagsUpdate::NoInstance => {
                Err(not_found(format!("no domain {domain} on host {}", id.host)))
            }
            TagsUpdate::TagsDiffer => Err(Error::TagsChanged { id: id.to_string() }),
            TagsUpdate::Done { written, snapshot } => {
                if written {
                    tracing::info!(instance.id = %id, "updated instance tags");
                }
                Ok(to_contract_instance(&id.host, *snapshot))
            }
        }
    }

    /// Every instance, on every host, whose tags contain all of `selector`; sorted by
    /// host, then domain name.
    pub async fn list(
        &self,
        selector: &[(String, String)],
        deadline: Instant,
    ) -> Result<Vec<pb::Instance>, Error> {
        let mut instances = Vec::new();
        for host in &self.config.hosts {
            let pool = self.pool.host(&host.name)?;
            let selector = selector.to_vec();
            let nic = NicKind::of(&host.attachment());
            let found = pool
                .call(
                    LibvirtOp::new("virConnectListAllDomains"),
                    deadline,
                    move |conn| domains::list_instances(conn, &selector, nic),
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

    /// The host and names of instance `id`; `None` when `id` cannot name an instance of
    /// this provider.
    fn resolve(
        &self,
        id: &str,
    ) -> Result<Option<(InstanceId, Arc<HostPool>, InstanceNames)>, Error> {
        egressproxy_provider::validation::check_id(id)?;
        let Some(parsed) = InstanceId::parse(id) else {
            return Ok(None);
        };
        let host = self.pool.host(&parsed.host)?;
        let names = InstanceNames::for_key(&parsed.key).map_err(|e| Error::InvalidArgument {
            field: "id",
            reason: e.to_string(),
        })?;
        Ok(Some((parsed, host, names)))
    }
}
