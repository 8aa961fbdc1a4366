//! A pool's spares at the provider: finding them, checking them, creating, retiring
//! and deleting them. What to do is decided in [`super::spare_plan`].
//!
//! 1. **Find**: ListInstances with the pool's UID and this cluster's tags; an instance
//!    whose role tag is neither spare nor retiring is not a spare (a member adopted it
//!    and replaced its tags). Nothing is kept in memory between passes.
//! 2. **Check**: a running spare's proxy is probed as a member's would be (the
//!    template's port and health check, at the address [`probe_address`] picks). A
//!    spare not Ready within the template's `provisioningTimeoutSeconds` of its
//!    creation is stuck, and replaced.
//! 3. **Create**: under a key never used before (`<pool-uid>-spare-N-T`, N counted in
//!    `status.sparesCreated`, T the time in nanoseconds): a key once used may now name
//!    a member's instance, and a repeated Create of it would return that one. A spare
//!    is found by its tags, not its key, so a Create whose answer was lost leaves a
//!    spare the next pass finds (at worst one too many, which it retires).
//! 4. **Retire**: a compare-and-set of the spare's tags (role `retiring`), then
//!    DeleteInstance: a member adopting the spare at the same moment either wins (the
//!    pool's update answers TAGS_CHANGED and the spare is left to it) or loses (it
//!    goes cold). A crash between the two leaves a retiring spare the next pass deletes.
//! 5. **Pool deleted**: every spare is retired and deleted before the pool's finalizer
//!    goes, so none outlives its pool.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use egressproxy_provider::pb;
use kube::{Resource, ResourceExt};

use super::member::template_hash;
use super::spare_plan::{Spare, SparePlan};
use super::spread::Spread;
use crate::context::Context;
use crate::crd::{ProxyPool, SpreadTarget};
use crate::k8s::cloud_init;
use crate::k8s::events::EventType;
use crate::probe::address::probe_address;
use crate::probe::health_check;
use crate::providers::Provider;
use crate::providers::instance_tags as tags;
use crate::providers::placement;
use crate::shared::error::Result;

/// The `placed-at` tag of a spare at `target` (`None`: the template's placement).
pub fn placed_at(target: Option<&SpreadTarget>) -> String {
    match target {
        Some(SpreadTarget {
            host: Some(host), ..
        }) => format!("host/{host}"),
        Some(SpreadTarget {
            zone: Some(zone), ..
        }) => format!("zone/{zone}"),
        _ => "template".to_owned(),
    }
}

/// The `placed-at` of every place this pass puts spares.
pub fn places(spread: &Spread) -> Vec<String> {
    if spread.targets.is_empty() {
        return vec![placed_at(None)];
    }
    spread.targets.iter().map(|t| placed_at(Some(t))).collect()
}

/// The tags that select `pool`'s spares (and the retiring ones).
fn selector(ctx: &Context, pool: &ProxyPool) -> HashMap<String, String> {
    HashMap::from([
        (tags::CLUSTER.to_owned(), ctx.cluster_name.clone()),
        (tags::POOL_UID.to_owned(), pool.uid().unwrap_or_default()),
    ])
}

/// `pool`'s spares as the provider lists them now, each with its tags.
#[derive(Debug)]
pub struct Found {
    /// The spares, as the plan sees them.
    pub spares: Vec<Spare>,
    /// Each spare's tags, by id: what a retirement expects.
    tags: HashMap<String, HashMap<String, String>>,
}

/// Finds and checks `pool`'s spares (module doc, steps 1 and 2); `promised`: the ids
/// new members were told to adopt.
pub async fn find(
    ctx: &Context,
    pool: &ProxyPool,
    provider: &Provider,
    spread: &Spread,
    promised: &BTreeSet<String>,
) -> Result<Found> {
    let listed = provider.list(&selector(ctx, pool)).await?;
    let hash = template_hash(pool);
    let places = places(spread);
    let template = &pool.spec.template.spec;
    let check = template.health_check.clone().unwrap_or_default();
    let timeout = Duration::from_secs(u64::from(template.provisioning_timeout_seconds));
    let checks = listed.iter().map(|instance| {
        let check = check.clone();
        async move {
            if instance.state() != pb::InstanceState::Running {
                return false;
            }
            let Some(ip) = probe_address(&instance.addresses) else {
                return false;
            };
            let address = SocketAddr::new(ip, template.proxy_port);
            health_check::probe(address, &check).await.is_ok()
        }
    });
    let ready = futures::future::join_all(checks).await;
    let mut found = Found {
        spares: Vec::new(),
        tags: HashMap::new(),
    };
    for (instance, ready) in listed.into_iter().zip(ready) {
        let tag = |key: &str| instance.tags.get(key).map(String::as_str);
        let retiring = match tag(tags::ROLE) {
            Some(tags::ROLE_SPARE) => false,
            Some(tags::ROLE_RETIRING) => true,
            _ => continue,
        };
        let at = tag(tags::PLACED_AT).unwrap_or_default().to_owned();
        let stuck = !ready && age(&instance) > timeout;
        let placed_here = spread.from_provider || places.contains(&at);
        found.spares.push(Spare {
            serial: serial(&instance.key),
            updated: tag(tags::TEMPLATE_HASH) == Some(hash.as_str()) && placed_here,
            ready,
            promised: promised.contains(&instance.id),
            retiring,
            stuck,
            at,
            id: instance.id.clone(),
        });
        found.tags.insert(instance.id, instance.tags);
    }
    found.spares.sort_by_key(|s| s.serial);
    Ok(found)
}

/// How long ago the provider says it created `instance` (zero when it does not say).
fn age(instance: &pb::Instance) -> Duration {
    instance
        .create_time
        .and_then(|t| SystemTime::try_from(t).ok())
        .and_then(|created| SystemTime::now().duration_since(created).ok())
        .unwrap_or_default()
}

/// The number in a spare's key (`<pool-uid>-spare-N-T`); none: the last.
fn serial(key: &str) -> u32 {
    key.rsplit_once("-spare-")
        .and_then(|(_, rest)| rest.split('-').next()?.parse().ok())
        .unwrap_or(u32::MAX)
}

/// Carries out `todo` (module doc, steps 3 and 4); returns `status.sparesCreated`
/// after it.
pub async fn act(
    ctx: &Context,
    pool: &ProxyPool,
    provider: &Provider,
    spread: &Spread,
    found: &Found,
    todo: &SparePlan,
) -> Result<u32> {
    let regarding = pool.object_ref(&());
    for id in &todo.delete {
        provider.delete(id).await?;
    }
    for (id, why) in &todo.retire {
        if retire(provider, id, found.tags.get(id)).await? {
            let note = format!("deleted spare {id}: {why}");
            ctx.publish_about(&regarding, EventType::Normal, "SpareDeleted", &note)
                .await;
        }
    }
    // The pool read at the start of a pass may lag its own last status write; the
    // spares listed do not.
    let listed = found
        .spares
        .iter()
        .filter(|s| s.serial != u32::MAX)
        .map(|s| s.serial.saturating_add(1))
        .max();
    let recorded = pool.status.as_ref().map_or(0, |s| s.spares_created);
    let created = recorded.max(listed.unwrap_or(0));
    if todo.create.is_empty() {
        return Ok(created);
    }
    let next = created.saturating_add(todo.create.len() as u32);
    let cloud_init = cloud_init::read(
        &ctx.client,
        &pool.namespace().unwrap_or_default(),
        &pool.spec.template.spec,
    )
    .await?;
    for (serial, at) in (created..next).zip(&todo.create) {
        let request = create_request(ctx, pool, spread, serial, at, cloud_init.clone());
        let instance = provider.create(request).await?;
        let note = format!("created spare {} ({at})", instance.id);
        ctx.publish_about(&regarding, EventType::Normal, "SpareCreated", &note)
            .await;
    }
    Ok(next)
}

/// The CreateInstance of spare number `serial` at `at`. No address identity: the
/// spare is nobody's yet (the adopting member keeps the spare's address until its
/// first replacement, which gets the member's own identity).
fn create_request(
    ctx: &Context,
    pool: &ProxyPool,
    spread: &Spread,
    serial: u32,
    at: &str,
    cloud_init: pb::CloudInit,
) -> pb::CreateInstanceRequest {
    let template = &pool.spec.template.spec;
    let mut at_target = template.placement.clone();
    if let Some(target) = spread.targets.iter().find(|t| placed_at(Some(t)) == at) {
        at_target.host = target.host.clone();
        at_target.zone = target.zone.clone();
    }
    let namespace = pool.namespace().unwrap_or_default();
    let tags = HashMap::from([
        (tags::CLUSTER.to_owned(), ctx.cluster_name.clone()),
        (tags::NAMESPACE.to_owned(), namespace.clone()),
        (tags::POOL.to_owned(), pool.name_any()),
        (tags::POOL_UID.to_owned(), pool.uid().unwrap_or_default()),
        (tags::ROLE.to_owned(), tags::ROLE_SPARE.to_owned()),
        (tags::TEMPLATE_HASH.to_owned(), template_hash(pool)),
        (tags::PLACED_AT.to_owned(), at.to_owned()),
    ]);
    pb::CreateInstanceRequest {
        key: format!(
            "{}-spare-{serial}-{:x}",
            pool.uid().unwrap_or_default(),
            jiff::Timestamp::now().as_nanosecond()
        ),
        name: format!("{namespace}/{}-spare-{serial}", pool.name_any()),
        tags,
        placement: Some(placement::to_pb(&at_target)),
        cloud_init: Some(cloud_init),
        proxy_port: u32::from(template.proxy_port),
        address_identity: None,
        requested_address: None,
    }
}

/// Marks spare `id` retiring (if its tags are still `expected`), then deletes it;
/// `false` when a member adopted it first, or it is gone.
async fn retire(
    provider: &Provider,
    id: &str,
    expected: Option<&HashMap<String, String>>,
) -> Result<bool> {
    let Some(expected) = expected else {
        return Ok(false);
    };
    let mut retiring = expected.clone();
    retiring.insert(tags::ROLE.to_owned(), tags::ROLE_RETIRING.to_owned());
    match provider.update_tags(id, expected.clone(), retiring).await {
        Ok(_) => {}
        Err(error) if Provider::lost_the_instance(&error) => return Ok(false),
        Err(error) => return Err(error),
    }
    provider.delete(id).await?;
    Ok(true)
}

/// Retires and deletes every spare of `pool` (module doc, step 5); a provider that
/// cannot hand over has them deleted outright (nobody can adopt them).
pub async fn remove_all(ctx: &Context, pool: &ProxyPool, provider: &Provider) -> Result<()> {
    let hand_over = provider
        .offers(pb::Capability::UpdateTags)
        .await
        .unwrap_or(false);
    for instance in provider.list(&selector(ctx, pool)).await? {
        let role = instance.tags.get(tags::ROLE).map(String::as_str);
        match role {
            Some(tags::ROLE_SPARE) if hand_over => {
                retire(provider, &instance.id, Some(&instance.tags)).await?;
            }
            Some(tags::ROLE_SPARE | tags::ROLE_RETIRING) => provider.delete(&instance.id).await?,
            _ => {}
        }
    }
    Ok(())
}
