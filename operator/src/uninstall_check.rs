//! `egressproxy-operator uninstall-check`: the chart's pre-delete hook, which refuses
//! `helm uninstall` while Proxies exist.
//!
//! Uninstalling the operator while Proxies exist would leave each of them stuck on its
//! finalizer (nothing removes it once the operator is gone) and its VM running with no
//! one to delete it; with `crds.keep=false` the CRD's deletion would hang on them too.
//! So the hook, run as the operator's ServiceAccount before anything is deleted:
//!
//! 1. lists the Proxies in the operator's scope (its `--namespace` flags);
//! 2. none: exits 0 and the uninstall goes on;
//! 3. some: names them (the first [`SHOWN`]) and says what to do, on stderr (what
//!    `kubectl logs` of the hook's Job shows), and exits 1, which stops the uninstall
//!    before anything is deleted: delete the Proxies (the operator deletes their VMs and
//!    removes the finalizers), then uninstall again; or uninstall anyway with
//!    `--no-hooks`, leaving the VMs and the Proxies with their finalizers (a reinstall of
//!    the chart picks them up again).

use kube::ResourceExt;
use kube::api::ListParams;

use crate::k8s::watch_scope::WatchScope;

/// How many Proxies the refusal names.
pub const SHOWN: usize = 10;

/// `Ok(())` when no Proxy exists in `scope`; else the message that refuses.
pub async fn check(
    client: &kube::Client,
    scope: &WatchScope,
) -> anyhow::Result<Result<(), String>> {
    let mut found = Vec::new();
    for api in scope.apis(client) {
        for proxy in api.list(&ListParams::default()).await?.items {
            found.push(format!(
                "{}/{}",
                proxy.namespace().unwrap_or_default(),
                proxy.name_any()
            ));
        }
    }
    if found.is_empty() {
        return Ok(Ok(()));
    }
    found.sort();
    let delete = match scope {
        WatchScope::AllNamespaces => {
            "kubectl delete proxypools,proxies --all --all-namespaces --wait".to_owned()
        }
        WatchScope::Namespaces(namespaces) => namespaces
            .iter()
            .map(|namespace| {
                format!("kubectl delete proxypools,proxies --all -n {namespace} --wait")
            })
            .collect::<Vec<_>>()
            .join("; "),
    };
    let more = found.len().saturating_sub(SHOWN);
    let mut named = found
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if more > 0 {
        named.push_str(&format!(" and {more} more"));
    }
    Ok(Err(format!(
        "refusing to uninstall: {} Proxies still exist ({named}). Uninstalling now would \
         leave their VMs running and each Proxy stuck on its finalizer. Delete them first \
         (the operator deletes their VMs): {delete}; then run helm uninstall again. To \
         uninstall anyway, keeping the VMs and the Proxies as they are (a reinstall picks \
         them up again), run helm uninstall --no-hooks.",
        found.len()
    )))
}
