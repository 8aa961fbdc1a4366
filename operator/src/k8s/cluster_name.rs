//! The value of the `egressproxy.dev/cluster` tag on every instance this operator makes.
//!
//! Garbage collection deletes instances that carry this operator's tag and have no Proxy,
//! so two clusters that share a provider must never share the value: with a fixed default
//! each would delete the other's VMs as orphans. So there is no fixed default:
//!
//! 1. `--cluster-name` given: that name (readable in `virsh dumpxml`, listed by
//!    `ListInstances` filters; pick one per cluster).
//! 2. Otherwise the UID of the `kube-system` namespace: made by the apiserver when the
//!    cluster was created, different in every cluster, and the same for the cluster's
//!    whole life (every replica and every restart reads the same value). It needs `get`
//!    on that one namespace, which the chart grants.
//!
//! A cluster rebuilt from scratch gets a new UID: the old cluster's instances then carry
//! a name nobody uses, and are left alone, not deleted.

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;

/// The namespace whose UID names a cluster.
pub const IDENTITY_NAMESPACE: &str = "kube-system";

/// Where the cluster name came from, for the start-up log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `--cluster-name`.
    Flag,
    /// The UID of `kube-system`.
    KubeSystemUid,
}

/// The cluster name: `flag` when set (and not blank), else `kube-system`'s UID.
pub async fn resolve(
    flag: Option<&str>,
    client: &kube::Client,
) -> anyhow::Result<(String, Source)> {
    if let Some(name) = flag.map(str::trim).filter(|name| !name.is_empty()) {
        return Ok((name.to_owned(), Source::Flag));
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace = namespaces.get(IDENTITY_NAMESPACE).await.map_err(|error| {
        anyhow::anyhow!(
            "--cluster-name is not set, and the cluster's identity (the UID of namespace \
             {IDENTITY_NAMESPACE}) cannot be read: {error}; grant `get` on that namespace \
             (the chart does) or pass --cluster-name"
        )
    })?;
    let uid = namespace
        .metadata
        .uid
        .filter(|uid| !uid.is_empty())
        .ok_or_else(|| anyhow::anyhow!("namespace {IDENTITY_NAMESPACE} has no UID"))?;
    Ok((uid, Source::KubeSystemUid))
}
