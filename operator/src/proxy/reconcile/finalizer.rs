//! The finalizer `egressproxy.dev/instance`: a Proxy carries it once an instance may
//! exist for it, and keeps it until its cleanup has deleted every such instance.
//!
//! 1. **Added** in the reconcile that makes the first provider call able to leave an
//!    instance behind (a Create, or the adoption of a spare), just before that call.
//!    The same write therefore both guards the VM and records that one may exist: the
//!    Proxy's status needs no write of its own before the Create. A Proxy refused
//!    earlier (a mistyped provider, a missing Secret, a placement no host offers)
//!    never carries it, and is deleted at once without asking any provider.
//! 2. **Removed** once a deleted Proxy's cleanup has deleted its instances.
//!
//! Both writes are JSON Patches that test the list they change, as kube-runtime's own
//! helper does: another controller's finalizer is never overwritten or removed, and a
//! list that changed in between fails the write, and the reconcile runs again. They
//! test the UID first: a Proxy deleted and created again under the same name (a pool
//! reuses its members' names) while a reconcile worked from the old one's copy must
//! not take the old one's finalizer, nor lose its own.
//!
//! 3. **Restored** when a Proxy whose status records an instance has lost it (removed
//!    by hand, or by a tool that rewrote the metadata): without it, its deletion would
//!    leave the VM behind.

use json_patch::jsonptr::PointerBuf;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::Value;

use crate::crd::Proxy;

/// The finalizer that guards every Proxy's VM.
pub const FINALIZER: &str = "egressproxy.dev/instance";

/// Whether `proxy` carries the finalizer.
pub(super) fn holds(proxy: &Proxy) -> bool {
    proxy.finalizers().iter().any(|f| f == FINALIZER)
}

/// Adds the finalizer to `proxy` (steps 1 and 3), whose UID and finalizers are as read.
pub(super) async fn add_to(api: &Api<Proxy>, proxy: &Proxy) -> Result<(), kube::Error> {
    let mut patch = vec![same_uid(proxy)];
    if proxy.finalizers().is_empty() {
        // The API server never stores an empty list: none reads as null.
        patch.extend([
            test(pointer(&[]), Value::Null),
            add(pointer(&[]), serde_json::json!([FINALIZER])),
        ]);
    } else {
        patch.extend([
            test(pointer(&[]), serde_json::json!(proxy.finalizers())),
            add(pointer(&["-"]), Value::from(FINALIZER)),
        ]);
    }
    write(api, proxy, patch).await
}

/// Removes the finalizer from `proxy` (step 2), whose finalizers are as read.
pub(super) async fn remove_from(api: &Api<Proxy>, proxy: &Proxy) -> Result<(), kube::Error> {
    let Some(index) = proxy.finalizers().iter().position(|f| f == FINALIZER) else {
        return Ok(());
    };
    let index = index.to_string();
    let patch = vec![
        same_uid(proxy),
        test(pointer(&[&index]), Value::from(FINALIZER)),
        json_patch::PatchOperation::Remove(json_patch::RemoveOperation {
            path: pointer(&[&index]),
        }),
    ];
    write(api, proxy, patch).await
}

async fn write(
    api: &Api<Proxy>,
    proxy: &Proxy,
    operations: Vec<json_patch::PatchOperation>,
) -> Result<(), kube::Error> {
    api.patch::<Proxy>(
        &proxy.name_any(),
        &PatchParams::default(),
        &Patch::Json(json_patch::Patch(operations)),
    )
    .await?;
    Ok(())
}

/// Tests that the Proxy written is the one read (its UID), not a later one of its name.
fn same_uid(proxy: &Proxy) -> json_patch::PatchOperation {
    test(
        PointerBuf::from_tokens(["metadata", "uid"]),
        serde_json::json!(proxy.metadata.uid),
    )
}

fn test(path: PointerBuf, value: Value) -> json_patch::PatchOperation {
    json_patch::PatchOperation::Test(json_patch::TestOperation { path, value })
}

fn add(path: PointerBuf, value: Value) -> json_patch::PatchOperation {
    json_patch::PatchOperation::Add(json_patch::AddOperation { path, value })
}

/// `/metadata/finalizers`, followed by `tokens`.
fn pointer(tokens: &[&str]) -> PointerBuf {
    PointerBuf::from_tokens(
        ["metadata", "finalizers"]
            .into_iter()
            .chain(tokens.iter().copied()),
    )
}
