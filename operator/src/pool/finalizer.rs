//! The finalizer a pool carries once it keeps spares: spares have no Kubernetes
//! object for the garbage collector to follow, so the pool deletes them itself before
//! it goes.
//!
//! 1. A pool with `spec.spares` above 0 gets [`SPARES_FINALIZER`] before its first
//!    spare is created, and keeps it (spares may remain after `spares` drops to 0,
//!    until a pass deletes them).
//! 2. A deleted pool holding it has every spare retired and deleted
//!    ([`super::spares::remove_all`]), then the finalizer removed. A provider that
//!    cannot be reached holds the pool until it answers; removing the finalizer by
//!    hand lets the pool go and leaves its spares at the provider.

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};

use super::spares;
use crate::context::Context;
use crate::crd::ProxyPool;
use crate::shared::error::Result;

/// The finalizer that guards a pool's spares.
pub const SPARES_FINALIZER: &str = "egressproxy.dev/spares";

/// Whether `pool` carries the finalizer.
pub fn holds(pool: &ProxyPool) -> bool {
    pool.finalizers().iter().any(|f| f == SPARES_FINALIZER)
}

/// Adds the finalizer to `pool` (step 1).
pub async fn add(ctx: &Context, pool: &ProxyPool) -> Result<()> {
    let mut finalizers = pool.finalizers().to_vec();
    finalizers.push(SPARES_FINALIZER.to_owned());
    write(ctx, pool, finalizers).await
}

/// Deletes the deleted `pool`'s spares, then lets it go (step 2).
pub async fn release(ctx: &Context, pool: &ProxyPool) -> Result<()> {
    let provider = ctx.providers.get(&pool.spec.template.spec.provider)?;
    spares::remove_all(ctx, pool, provider).await?;
    let finalizers = pool
        .finalizers()
        .iter()
        .filter(|f| *f != SPARES_FINALIZER)
        .cloned()
        .collect();
    write(ctx, pool, finalizers).await
}

/// Sets `pool`'s finalizers to `finalizers`, only while its resourceVersion is the one
/// read (another writer's change is not overwritten: the pass fails and runs again).
async fn write(ctx: &Context, pool: &ProxyPool, finalizers: Vec<String>) -> Result<()> {
    let api: Api<ProxyPool> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "metadata": {
            "finalizers": finalizers,
            "resourceVersion": pool.resource_version(),
        },
    });
    api.patch(
        &pool.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}
