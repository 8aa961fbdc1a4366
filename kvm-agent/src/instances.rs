//! Create, Get, Delete and List as the contract sees them, across the configured hosts.
//!
//! Create's steps are in [`crate::instance_create`].
//!
//! Each runs its libvirt work ([`crate::instance_ops`]) as one call on the host's pooled
//! connection, so it is off the runtime, traced and bounded by the caller's deadline;
//! errors leave as [`ProviderError`]s through the one mapping
//! ([`Error::to_provider_error`]). The contract rules applied here:
//! - an id this provider cannot have returned (not `<host>/<key>`) names no instance:
//!   Get is NOT_FOUND and Delete succeeds, as for any missing instance;
//! - an id whose host is not (any longer) configured is FAILED_PRECONDITION, not an
//!   endless retry (lesson 10);
//! - Get of a missing domain is NOT_FOUND; Delete of one succeeds; a domain with the
//!   instance's name but not the agent's metadata is missing for both (Delete leaves it
//!   and its volumes alone);
//! - List fails when any host cannot be reached, so a garbage collector never mistakes
//!   an unreachable host for an empty one.

use std::sync::Arc;

use egressproxy_provider::{ProviderError, pb};
use tokio::time::Instant;
use tracing::Instrument;

use crate::config::{Attachment, Config, HostConfig};
use crate::create_plan::plan_create;
use crate::error::Error;
use crate::image_cache::{BaseImage, ImageCache, ImageCacheOptions};
use crate::instance_create::{self, CreateStep, FaultHook, KeyLocks, VirtTypes};
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
    images: Arc<ImageCache>,
    key_locks: Arc<KeyLocks>,
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
    /// [`crate::instance_create`].
    pub async fn create(
        &self,
        request: &pb::CreateInstanceRequest,
        deadline: Instant,
    ) -> Result<pb::Instance, ProviderError> {
        let images = self.images.clone();
        self.create_with(request, deadline, move |host, plan| async move {
            let (name, image) = &plan.image;
            images.ensure_base(&host, name, image, deadline).await
        })
        .await
    }

    /// [`Instances::create`] with another source of the base image: `ensure_base`
    /// provides the base image volume on the chosen host. See
    /// [`crate::instance_create`].
    ///
    /// Once the key's lock is taken, the steps run in a task of their own that holds the
    /// lock until they end: a caller that goes away (tonic drops the handler's future
    /// when the client cancels or its deadline passes) does not stop them half-way, nor
    /// let a Delete or another Create of the key run beside them. The task ends when the
    /// steps are done or the request's deadline has passed.
    pub async fn create_with<F, Fut>(
        &self,
        request: &pb::CreateInstanceRequest,
        deadline: Instant,
        ensure_base: F,
    ) -> Result<pb::Instance, ProviderError>
    where
        F: FnOnce(Arc<HostPool>, crate::create_plan::CreatePlan) -> Fut + Send + 'static,
        Fut: Future<Output = Result<BaseImage, Error>> + Send + 'static,
    {
        let plan = plan_create(&self.config, request)?;
        let host = self.pool.host(&plan.host.name)?;
        let turn = self
            .key_locks
            .lock(host.name(), &request.key, deadline)
            .await?;
        let this = self.clone();
        let owned_request = request.clone();
        // Dropping the JoinHandle (when this future is dropped) detaches the task; it
        // does not abort it.
        let steps = tokio::spawn(
            async move {
                let _turn = turn;
                this.create_locked(host, plan, &owned_request, deadline, ensure_base)
                    .await
            }
            .in_current_span(),
        );
        match steps.await {
            Ok(result) => result,
            Err(e) => Err(ProviderError::transient(format!(
                "Create of key {} stopped unexpectedly: {e}",
                request.key
            ))
            .with_reason("AGENT_WORKER_FAILED")),
        }
    }

    /// Create's steps, with the key's lock held.
    async fn create_locked<F, Fut>(
        &self,
        host: Arc<HostPool>,
        plan: crate::create_plan::CreatePlan,
        request: &pb::CreateInstanceRequest,
        deadline: Instant,
        ensure_base: F,
    ) -> Result<pb::Instance, ProviderError>
    where
        F: FnOnce(Arc<HostPool>, crate::create_plan::CreatePlan) -> Fut,
        Fut: Future<Output = Result<BaseImage, Error>>,
    {
        if let Some(existing) =
            instance_create::existing_instance(&host, &plan, &request.key, deadline).await?
        {
            return Ok(existing);
        }
        let virt_type = self.virt_types.for_host(&host, deadline).await?;
        let base = ensure_base(host.clone(), plan.clone()).await?;
        self.faults.after(CreateStep::BaseImage)?;
        instance_create::create_from_base(
            &host,
            &plan,
            request,
            &base,
            virt_type,
            &self.faults,
            deadline,
        )
        .await
    }

    /// The instance `id`: state, addresses, tags, placement.
    pub async fn get(&self, id: &str, deadline: Instant) -> Result<pb::Instance, ProviderError> {
        let Some((id, host, names)) = self.resolve(id)? else {
            return Err(ProviderError::not_found(format!(
                "instance {id} does not exist (this provider's ids are <host>/<key>)"
            )));
        };
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

    /// Deletes the instance `id` with its overlay and seed; a missing one is success. Waits
    /// for a Create of the same key in this agent to finish first.
    pub async fn delete(&self, id: &str, deadline: Instant) -> Result<(), ProviderError> {
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
                instance_ops::delete_instance(conn, &names, &storage_pool)
            })
            .await?;
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

    /// The host and names of instance `id`; `None` when `id` cannot name an instance of
    /// this provider.
    fn resolve(
        &self,
        id: &str,
    ) -> Result<Option<(InstanceId, Arc<HostPool>, InstanceNames)>, ProviderError> {
        egressproxy_provider::validation::check_id(id)?;
        let Some(parsed) = InstanceId::parse(id) else {
            return Ok(None);
        };
        let host = self.pool.host(&parsed.host).map_err(|e| match e {
            Error::UnknownHost { .. } => e.to_provider_error().with_reason("HOST_NOT_CONFIGURED"),
            other => other.to_provider_error(),
        })?;
        let names = InstanceNames::for_key(&parsed.key)
            .map_err(|e| ProviderError::invalid_argument("id", e.to_string()))?;
        Ok(Some((parsed, host, names)))
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
