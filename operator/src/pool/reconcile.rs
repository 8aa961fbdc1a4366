//! One pool's reconcile: observe → plan → act → status.
//!
//! 1. **Observe**: list the members (the pool's label, then its controller reference:
//!    a Proxy that merely carries the label is not a member). The list is read from
//!    the apiserver, not a cache, so a member created by the last pass is never
//!    created twice.
//! 2. **Plan** ([`super::plan`], pure), over the spread targets of this pass
//!    ([`super::spread`]: the fixed list, or the provider's locations).
//! 3. **Service**: the pool's Service lists the serving address of every Ready member
//!    that stays ([`crate::endpoints::service::build`]): a member to be deleted leaves the
//!    endpoints first, and a member whose health check fails leaves them at the pool's
//!    next pass, which its Proxy's status change starts. A Service of that name that is
//!    not the pool's is left alone, with a Warning, and no `serviceName`.
//! 4. **Act**: delete (each member only while it is still the Proxy listed: its UID is
//!    a precondition), then create. A swap (a member replacing a lost VM, for a Ready
//!    spare) is a delete then a create that adopts the spare, with a `MemberSwapped`
//!    Event naming both members and the spare; the spares are found before the plan
//!    when a member is replacing, so the plan knows which spares a swap may take. A name that exists already is an earlier pass's
//!    member (nothing to do), or a stranger's Proxy: then the member takes the next
//!    free name, with a Warning. An Event for each.
//! 5. **Spares** (a pool with `spec.spares`, or that had some: it holds the
//!    [`super::finalizer`]): found and checked ([`super::spares`]) before the members
//!    are created, so a new member is told to adopt a Ready one ([`super::spare_plan`]);
//!    then the spare plan runs (create, retire, delete). A provider that fails here
//!    only costs the spares: members are still created, cold.
//! 6. **Status**: counts, the members, the spares, `Ready`, `Available` and
//!    `SparesReady`, written only when it changed.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use super::member::{
    POOL_LABEL, is_member, new_member, selector, serving_address, template_hash, view,
};
use super::plan::{Bounds, Member, NewMember, Plan, Removal, plan};
use super::spare_pass::SparesNext;
use super::spare_plan::{self, Spare};
use super::spread::{self, Spread};
use super::{finalizer, spare_pass, spares};
use crate::context::Context;
use crate::crd::{PoolMemberStatus, Proxy, ProxyPool, ProxyPoolStatus, pool_condition};
use crate::endpoints::service::{
    self, ServiceFor, can_be_an_endpoint, controller_reference, service_name_for,
};
use crate::k8s::events::EventType;
use crate::k8s::status::{FIELD_MANAGER, set_condition};
use crate::shared::error::{Error, Result};

/// How long a pool waits for a change before it looks again anyway.
const RESYNC: Duration = Duration::from_secs(300);
/// How long a pool waits to check its spares again while one boots.
const SPARES_BOOTING: Duration = Duration::from_secs(2);
/// How long a pool waits to try its spares again after a step on them failed.
const SPARES_FAILED: Duration = Duration::from_secs(30);
/// How long a pool waits after a failed pass.
const RETRY: Duration = Duration::from_secs(5);
/// How many rounds of names held by other Proxies one pass steps over before it
/// leaves the rest to the next pass.
const MAX_TAKEN_NAMES: usize = 8;

/// Reconciles one pool (module doc).
pub async fn reconcile(pool: Arc<ProxyPool>, ctx: Arc<Context>) -> Result<Action> {
    if pool.metadata.deletion_timestamp.is_some() {
        // Kubernetes' garbage collector deletes the members (they carry the pool's
        // controller reference), and each member's own finalizer deletes its VM; the
        // spares have no object, so the pool deletes them itself.
        if finalizer::holds(&pool) {
            finalizer::release(&ctx, &pool).await?;
        }
        return Ok(Action::await_change());
    }
    if pool.spec.spares > 0 && !finalizer::holds(&pool) {
        // The change starts the next pass, which may create spares.
        finalizer::add(&ctx, &pool).await?;
        return Ok(Action::await_change());
    }
    let namespace = pool.namespace().unwrap_or_default();
    let proxies: Api<Proxy> = Api::namespaced(ctx.client.clone(), &namespace);
    let listed = proxies
        .list(&ListParams::default().labels(&selector(&pool)))
        .await?;
    let members: Vec<Proxy> = listed
        .items
        .into_iter()
        .filter(|p| is_member(&pool, p))
        .collect();
    let hash = template_hash(&pool);
    let spread = spread::resolve(&pool, ctx.providers.get(&pool.spec.template.spec.provider)).await;
    let provider = ctx.providers.get(&pool.spec.template.spec.provider);
    if let Some(why) = &spread.unavailable {
        ctx.publish_about(
            &pool.object_ref(&()),
            EventType::Warning,
            "SpreadUnavailable",
            why,
        )
        .await;
    }
    let views: Vec<Member> = members
        .iter()
        .map(|p| view(&pool, &hash, &spread, p))
        .collect();
    let bounds = Bounds {
        replicas: pool.spec.replicas,
        max_surge: pool.spec.max_surge,
        max_unavailable: pool.spec.max_unavailable,
        targets: spread.targets.len(),
    };
    // A member replacing a lost VM may be swapped for a Ready spare: the plan needs the
    // spares first then. Otherwise they are looked at after the Service, which a
    // member leaving its endpoints should not wait for.
    let find_spares = async || match (&provider, finalizer::holds(&pool)) {
        (Ok(provider), true) => spare_pass::find(&ctx, &pool, provider, &spread, &members).await,
        _ => None,
    };
    let spares_first = views.iter().any(|v| v.replacing && !v.deleting);
    let mut spares = if spares_first {
        find_spares().await
    } else {
        None
    };
    let adoptable = spares
        .as_ref()
        .map(|s| s.adoptable(&spread))
        .unwrap_or_default();
    let todo = plan(bounds, &views, &adoptable);
    // The members that stay, in the Service before anything is deleted: a member on its
    // way out leaves the endpoints before its VM does.
    let staying: Vec<&Proxy> = members
        .iter()
        .filter(|p| !todo.delete.iter().any(|(name, _)| *name == p.name_any()))
        .collect();
    let service_name = sync_service(&ctx, &pool, &staying).await?;
    delete_members(&ctx, &pool, &proxies, &members, &todo).await?;
    if !spares_first {
        spares = find_spares().await;
    }
    let spare_list = spares.as_mut().map(|s| &mut s.found.spares);
    create_members(
        &ctx,
        &pool,
        &proxies,
        &views,
        &spread,
        todo.create.clone(),
        spare_list,
    )
    .await?;
    let spare_report = match (&provider, spares) {
        (Ok(provider), Some(found)) => {
            Some(spare_pass::act(&ctx, &pool, provider, &spread, found).await)
        }
        _ => None,
    };

    let mut status = status(&pool, &members, &views, &todo, &spread, service_name);
    let spares_next = spare_pass::report(&pool, spare_report.as_ref(), &mut status);
    write_status(&ctx, &pool, status).await?;
    // A booting spare has no object whose change would start a pass: look again soon.
    Ok(Action::requeue(match spares_next {
        SparesNext::Settled => RESYNC,
        SparesNext::Booting => SPARES_BOOTING,
        SparesNext::Failed => SPARES_FAILED,
    }))
}

/// Logs a failed pass and retries it soon.
pub fn error_policy(pool: Arc<ProxyPool>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(pool = %pool.name_any(), error = %error.describe(), "pool reconcile failed");
    Action::requeue(RETRY)
}

/// Deletes the members `todo` names, each only while it is still the Proxy that was
/// listed (its UID as a precondition): the operator deletes only its pools' members.
async fn delete_members(
    ctx: &Context,
    pool: &ProxyPool,
    proxies: &Api<Proxy>,
    members: &[Proxy],
    todo: &Plan,
) -> Result<()> {
    let regarding = pool.object_ref(&());
    for (name, why) in &todo.delete {
        let uid = members
            .iter()
            .find(|m| m.name_any() == *name)
            .and_then(|m| m.uid());
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid,
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match proxies.delete(name, &params).await {
            Ok(_) => {}
            // Gone, or another Proxy of that name now: not this member any more.
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => continue,
            Err(error) => return Err(error.into()),
        }
        let note = match why {
            Removal::Surplus => format!("deleted member {name}: more members than spec.replicas"),
            Removal::Outdated => {
                format!("deleted member {name}: made from an older template or spread")
            }
            Removal::Swapped => format!(
                "deleted member {name}: it lost its VM, and a new member adopting a Ready \
                 spare takes its place"
            ),
        };
        ctx.publish_about(&regarding, EventType::Normal, "MemberDeleted", &note)
            .await;
    }
    Ok(())
}

/// Creates `creates`. A name held by a Proxy that is not a member (a user's, or a
/// member of an earlier pool of this name) is skipped with a Warning, and that member
/// is created under the next free name instead, so the pool still reaches `replicas`.
async fn create_members(
    ctx: &Context,
    pool: &ProxyPool,
    proxies: &Api<Proxy>,
    views: &[Member],
    spread: &Spread,
    mut creates: Vec<NewMember>,
    mut spares: Option<&mut Vec<Spare>>,
) -> Result<()> {
    let regarding = pool.object_ref(&());
    let mut used: BTreeSet<u32> = views
        .iter()
        .map(|m| m.index)
        .chain(creates.iter().map(|c| c.index))
        .collect();
    for _ in 0..MAX_TAKEN_NAMES {
        let mut blocked = Vec::new();
        for new in &creates {
            let target = new.target.and_then(|t| spread.targets.get(t));
            let at = spares::placed_at(target);
            let adopt = spares.as_deref_mut().and_then(|s| spare_plan::pick(s, &at));
            let Some(member) = new_member(pool, new.index, target, adopt.as_deref()) else {
                continue;
            };
            let name = member.name_any();
            match proxies.create(&PostParams::default(), &member).await {
                Ok(_) => {
                    let placement = &member.spec.placement;
                    let at = placement
                        .host
                        .as_ref()
                        .map(|h| format!(" on host {h}"))
                        .or_else(|| placement.zone.as_ref().map(|z| format!(" in zone {z}")))
                        .unwrap_or_default();
                    let adopting = adopt
                        .as_ref()
                        .map(|id| format!(", adopting spare {id}"))
                        .unwrap_or_default();
                    let note = format!("created member {name}{at}{adopting}");
                    ctx.publish_about(&regarding, EventType::Normal, "MemberCreated", &note)
                        .await;
                    if let Some(lost) = &new.replaces {
                        let spare = adopt.as_ref().map_or_else(
                            || "which found no spare left and boots a VM".to_owned(),
                            |id| format!("adopting spare {id}"),
                        );
                        let note = format!(
                            "member {lost} lost its VM: replaced by member {name}, {spare}"
                        );
                        ctx.publish_about(&regarding, EventType::Normal, "MemberSwapped", &note)
                            .await;
                    }
                }
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    let holder = proxies.get_opt(&name).await?;
                    if holder.as_ref().is_none_or(|p| is_member(pool, p)) {
                        // An earlier pass made it (its answer was lost), or it is gone
                        // again: the next pass sees the truth.
                        continue;
                    }
                    blocked.push((new.target, new.replaces.clone()));
                    // Not told to anyone after all: free for the next member.
                    if let (Some(list), Some(id)) = (spares.as_deref_mut(), &adopt) {
                        list.iter_mut()
                            .filter(|s| &s.id == id)
                            .for_each(|s| s.promised = false);
                    }
                    let note = format!(
                        "Proxy {name} exists and is not a member of this pool: using another \
                         name (rename or delete that Proxy to free this one)"
                    );
                    ctx.publish_about(&regarding, EventType::Warning, "MemberNameTaken", &note)
                        .await;
                }
                Err(error) => return Err(error.into()),
            }
        }
        if blocked.is_empty() {
            return Ok(());
        }
        creates = blocked
            .into_iter()
            .map(|(target, replaces)| {
                let index = (0..).find(|i| !used.contains(i)).unwrap_or(u32::MAX);
                used.insert(index);
                NewMember {
                    index,
                    target,
                    replaces,
                }
            })
            .collect();
    }
    Ok(())
}

/// Makes the pool's Service list the serving addresses of `members`; returns the
/// Service's name, or `None` without one (turned off, or its name held by a Service
/// that is not the pool's: then a Warning says so).
async fn sync_service(
    ctx: &Context,
    pool: &ProxyPool,
    members: &[&Proxy],
) -> Result<Option<String>> {
    let namespace = pool.namespace().unwrap_or_default();
    let owner_uid = pool.uid().unwrap_or_default();
    let (Some(name), Some(owner)) = (
        service_name_for(&pool.name_any(), pool.spec.service.as_ref()),
        controller_reference(pool),
    ) else {
        service::withdraw_owned(ctx, &namespace, &pool.name_any(), &owner_uid).await?;
        return Ok(None);
    };
    let mut addresses: Vec<_> = members
        .iter()
        .filter_map(|m| serving_address(m))
        .filter(|ip| can_be_an_endpoint(*ip))
        .collect();
    addresses.sort();
    addresses.dedup();
    let wanted = service::build(ServiceFor {
        owner,
        namespace: pool.namespace(),
        name: name.clone(),
        owner_label: POOL_LABEL,
        settings: pool.spec.service.clone().unwrap_or_default(),
        port: i32::from(pool.spec.template.spec.proxy_port),
        addresses,
        empty_family: "IPv4",
    });
    if service::apply(ctx, &wanted).await?.is_none() {
        let note = format!(
            "a Service named {name} exists and is not this pool's: the pool has no Service \
             (rename or delete that Service, or set spec.service.enabled: false)"
        );
        ctx.publish_about(
            &pool.object_ref(&()),
            EventType::Warning,
            "ServiceNameTaken",
            &note,
        )
        .await;
        return Ok(None);
    }
    Ok(Some(name))
}

/// The pool's status after this pass: the members it saw, less those it deleted.
fn status(
    pool: &ProxyPool,
    members: &[Proxy],
    views: &[Member],
    todo: &Plan,
    spread: &Spread,
    service_name: Option<String>,
) -> ProxyPoolStatus {
    let deleted = |name: &str| todo.delete.iter().any(|(n, _)| n == name);
    let live: Vec<(&Proxy, &Member)> = members
        .iter()
        .zip(views)
        .filter(|(_, v)| !v.deleting && !deleted(&v.name))
        .collect();
    let count = |f: &dyn Fn(&Member) -> bool| live.iter().filter(|(_, v)| f(v)).count() as u32;
    let ready = count(&|v| v.ready);
    let updated = count(&|v| v.updated);
    let updated_ready = count(&|v| v.updated && v.ready);
    let replicas = live.len() as u32;
    let wanted = pool.spec.replicas;
    let mut member_status: Vec<PoolMemberStatus> = live
        .iter()
        .map(|(proxy, v)| PoolMemberStatus {
            name: v.name.clone(),
            ready: v.ready,
            updated: v.updated,
            address: serving_address(proxy).map(|ip| ip.to_string()),
            egress_address: proxy.status.as_ref().and_then(|s| s.egress_address.clone()),
        })
        .collect();
    member_status.sort_by(|a, b| a.name.cmp(&b.name));
    let egress_addresses = egress_addresses(&member_status);

    let mut conditions = pool
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let generation = pool.metadata.generation;
    let all_ready = updated_ready >= wanted && replicas == wanted && updated == wanted;
    let (reason, message) = if all_ready {
        (
            "AllMembersReady",
            format!("{ready} of {wanted} members Ready"),
        )
    } else if updated < replicas {
        (
            "RollingOut",
            format!("{updated} of {wanted} members up to date, {ready} Ready"),
        )
    } else if replicas != wanted {
        ("Scaling", format!("{replicas} members, {wanted} wanted"))
    } else {
        (
            "MembersNotReady",
            format!("{ready} of {wanted} members Ready"),
        )
    };
    set_condition(
        &mut conditions,
        pool_condition::READY,
        all_ready,
        reason,
        message,
        generation,
    );
    let (reason, message) = if ready > 0 {
        ("MembersServing", format!("{ready} members Ready"))
    } else {
        (
            "NoMemberReady",
            "no member is Ready: the pool's Service, if any, refuses connections".to_owned(),
        )
    };
    set_condition(
        &mut conditions,
        pool_condition::AVAILABLE,
        ready > 0,
        reason,
        message,
        generation,
    );

    ProxyPoolStatus {
        replicas,
        ready_replicas: ready,
        updated_replicas: updated,
        selector: Some(selector(pool)),
        service_name,
        spread_targets: spread.targets.clone(),
        members: member_status,
        egress_addresses,
        observed_generation: generation,
        conditions,
        ..ProxyPoolStatus::default()
    }
}

/// The members' egress addresses, sorted by address (not text: `10.0.0.9` comes
/// before `10.0.0.10`), each once.
fn egress_addresses(members: &[PoolMemberStatus]) -> Vec<String> {
    let addresses: std::collections::BTreeSet<std::net::IpAddr> = members
        .iter()
        .filter_map(|m| m.egress_address.as_deref()?.parse().ok())
        .collect();
    addresses.into_iter().map(|ip| ip.to_string()).collect()
}

/// Writes `status` unless the pool already has it.
async fn write_status(ctx: &Context, pool: &ProxyPool, status: ProxyPoolStatus) -> Result<()> {
    if pool.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<ProxyPool> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": ProxyPool::api_version(&()),
        "kind": ProxyPool::kind(&()),
        "status": status,
    });
    api.patch_status(
        &pool.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_is_sorted_by_address_with_each_once() {
        let member = |name: &str, egress: Option<&str>| PoolMemberStatus {
            name: name.into(),
            egress_address: egress.map(str::to_owned),
            ..PoolMemberStatus::default()
        };
        let members = [
            member("a", Some("10.0.0.10")),
            member("b", Some("10.0.0.9")),
            member("c", None),
            member("d", Some("10.0.0.10")),
            member("e", Some("2001:db8::1")),
        ];
        assert_eq!(
            egress_addresses(&members),
            ["10.0.0.9", "10.0.0.10", "2001:db8::1"]
        );
    }
}
