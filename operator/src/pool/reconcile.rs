//! One pool's reconcile: observe → plan → act → status.
//!
//! 1. **Observe**: list the members (the pool's label, then its controller reference:
//!    a Proxy that merely carries the label is not a member). The list is read from
//!    the apiserver, not a cache, so a member created by the last pass is never
//!    created twice.
//! 2. **Plan** ([`super::plan`], pure).
//! 3. **Act**: delete first, then create (an existing name means an earlier pass made
//!    it: nothing to do); an Event for each.
//! 4. **Service**: the pool's Service lists the serving address of every Ready member
//!    ([`crate::proxy_service::build`]), so a member whose health check fails leaves it
//!    at the pool's next pass, which its Proxy's status change starts.
//! 5. **Status**: counts, the members, `Ready` and `Available`, written only when it
//!    changed.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use super::member::{
    POOL_LABEL, is_member, new_member, owner_reference, selector, serving_address, template_hash,
    view,
};
use super::plan::{Bounds, Member, Plan, Removal, plan};
use crate::context::Context;
use crate::crd::{PoolMemberStatus, Proxy, ProxyPool, ProxyPoolStatus, pool_condition};
use crate::error::{Error, Result};
use crate::events::EventType;
use crate::proxy_service::{self, ServiceFor, can_be_an_endpoint, is_service_name};
use crate::status::{FIELD_MANAGER, set_condition};

/// How long a pool waits for a change before it looks again anyway.
const RESYNC: Duration = Duration::from_secs(300);
/// How long a pool waits after a failed pass.
const RETRY: Duration = Duration::from_secs(5);

/// Reconciles one pool (module doc).
pub async fn reconcile(pool: Arc<ProxyPool>, ctx: Arc<Context>) -> Result<Action> {
    if pool.metadata.deletion_timestamp.is_some() {
        // Kubernetes' garbage collector deletes the members (they carry the pool's
        // controller reference), and each member's own finalizer deletes its VM.
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
    let views: Vec<Member> = members.iter().map(|p| view(&pool, &hash, p)).collect();
    let bounds = Bounds {
        replicas: pool.spec.replicas,
        max_surge: pool.spec.max_surge,
        max_unavailable: pool.spec.max_unavailable,
        targets: pool.spec.spread.len(),
    };
    let todo = plan(bounds, &views);
    act(&ctx, &pool, &proxies, &todo).await?;

    let service_name = sync_service(&ctx, &pool, &members).await?;
    let status = status(&pool, &members, &views, &todo, service_name);
    write_status(&ctx, &pool, status).await?;
    Ok(Action::requeue(RESYNC))
}

/// Logs a failed pass and retries it soon.
pub fn error_policy(pool: Arc<ProxyPool>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(pool = %pool.name_any(), error = %error.describe(), "pool reconcile failed");
    Action::requeue(RETRY)
}

/// Carries out `todo`: deletions first, then creations.
async fn act(ctx: &Context, pool: &ProxyPool, proxies: &Api<Proxy>, todo: &Plan) -> Result<()> {
    let regarding = pool.object_ref(&());
    for (name, why) in &todo.delete {
        match proxies.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => continue,
            Err(error) => return Err(error.into()),
        }
        let note = match why {
            Removal::Surplus => format!("deleted member {name}: more members than spec.replicas"),
            Removal::Outdated => {
                format!("deleted member {name}: made from an older template or spread")
            }
        };
        ctx.publish_about(&regarding, EventType::Normal, "MemberDeleted", &note)
            .await;
    }
    for new in &todo.create {
        let Some(member) = new_member(pool, new.index, new.target) else {
            continue;
        };
        match proxies.create(&PostParams::default(), &member).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(error.into()),
        }
        let placement = &member.spec.placement;
        let at = placement
            .host
            .as_ref()
            .map(|h| format!(" on host {h}"))
            .or_else(|| placement.zone.as_ref().map(|z| format!(" in zone {z}")))
            .unwrap_or_default();
        let note = format!("created member {}{at}", member.name_any());
        ctx.publish_about(&regarding, EventType::Normal, "MemberCreated", &note)
            .await;
    }
    Ok(())
}

/// The pool's Service name, if it is to have one.
fn service_name(pool: &ProxyPool) -> Option<String> {
    let enabled = pool.spec.service.as_ref().is_none_or(|s| s.enabled);
    let name = pool.name_any();
    (enabled && is_service_name(&name)).then_some(name)
}

/// Makes the pool's Service list its Ready members; returns the Service's name.
async fn sync_service(
    ctx: &Context,
    pool: &ProxyPool,
    members: &[Proxy],
) -> Result<Option<String>> {
    let Some(name) = service_name(pool) else {
        let owner = pool.uid().unwrap_or_default();
        proxy_service::withdraw_owned(
            ctx,
            &pool.namespace().unwrap_or_default(),
            &pool.name_any(),
            &owner,
        )
        .await?;
        return Ok(None);
    };
    let Some(owner) = owner_reference(pool) else {
        return Ok(None);
    };
    let mut addresses: Vec<_> = members
        .iter()
        .filter_map(serving_address)
        .filter(|ip| can_be_an_endpoint(*ip))
        .collect();
    addresses.sort();
    addresses.dedup();
    let wanted = proxy_service::build(ServiceFor {
        owner,
        namespace: pool.namespace(),
        name: name.clone(),
        owner_label: POOL_LABEL,
        settings: pool.spec.service.clone().unwrap_or_default(),
        port: i32::from(pool.spec.template.spec.proxy_port),
        addresses,
        empty_family: "IPv4",
    });
    proxy_service::apply(ctx, &wanted).await?;
    Ok(Some(name))
}

/// The pool's status after this pass: the members it saw, less those it deleted.
fn status(
    pool: &ProxyPool,
    members: &[Proxy],
    views: &[Member],
    todo: &Plan,
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
        })
        .collect();
    member_status.sort_by(|a, b| a.name.cmp(&b.name));

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
        (
            "MembersServing",
            format!("the Service has {ready} endpoints"),
        )
    } else {
        (
            "NoMemberReady",
            "no member is Ready: the Service refuses connections".to_owned(),
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
        members: member_status,
        observed_generation: generation,
        conditions,
    }
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
