//! Which Proxies the operator serves: every namespace, or a list of namespaces.
//!
//! A list exists so that the operator can run with namespaced Roles only (the chart's
//! `operator.watchNamespaces`): it then never lists, watches or reads anything outside
//! those namespaces, including when it collects garbage.

use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use kube::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::crd::Proxy;
use crate::k8s::merged_watch;
use crate::k8s::watch_health::{ALL_NAMESPACES, WatchHealth};

/// The annotation `kubectl apply` keeps its last input in.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// The longest name Kubernetes accepts for a namespace (an RFC 1123 label).
const MAX_NAMESPACE_LEN: usize = 63;

/// The namespaces whose Proxies the operator watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchScope {
    /// Every namespace (needs cluster-wide permissions).
    AllNamespaces,
    /// These namespaces only: sorted, without duplicates, never empty.
    Namespaces(Vec<String>),
}

impl WatchScope {
    /// The scope of `--namespace` values: each may hold a comma-separated list; none
    /// at all means every namespace. Errors name the offending value.
    pub fn from_flags<I, S>(values: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut namespaces = Vec::new();
        for value in values {
            for name in value.as_ref().split(',') {
                let name = name.trim();
                check_namespace_name(name)?;
                namespaces.push(name.to_owned());
            }
        }
        namespaces.sort();
        namespaces.dedup();
        Ok(if namespaces.is_empty() {
            WatchScope::AllNamespaces
        } else {
            WatchScope::Namespaces(namespaces)
        })
    }

    /// Whether a Proxy in `namespace` is in scope.
    pub fn contains(&self, namespace: &str) -> bool {
        match self {
            WatchScope::AllNamespaces => true,
            WatchScope::Namespaces(namespaces) => namespaces
                .binary_search_by(|n| n.as_str().cmp(namespace))
                .is_ok(),
        }
    }

    /// The key of each of its watches, as [`WatchHealth`] reports them: each
    /// namespace, or [`ALL_NAMESPACES`] for the one watch of all.
    pub fn watch_keys(&self) -> Vec<String> {
        match self {
            WatchScope::AllNamespaces => vec![ALL_NAMESPACES.to_owned()],
            WatchScope::Namespaces(namespaces) => namespaces.clone(),
        }
    }

    /// One API handle per watched namespace, or one for all namespaces.
    pub fn apis(&self, client: &kube::Client) -> Vec<Api<Proxy>> {
        match self {
            WatchScope::AllNamespaces => vec![Api::all(client.clone())],
            WatchScope::Namespaces(namespaces) => namespaces
                .iter()
                .map(|namespace| Api::namespaced(client.clone(), namespace))
                .collect(),
        }
    }

    /// The Proxies in scope as one watch stream that a single reflector store can
    /// follow (see [`merged_watch`] for how several namespaces become one), trimmed
    /// ([`trim`]), each namespace's watch reported to `health`. `store`
    /// is the store the stream feeds: the merged stream looks up there the objects it
    /// needs again. A failing watch is logged with its namespace: a missing Role in one
    /// namespace is the likeliest mistake, and the watch retries with backoff until it
    /// is fixed, holding back no other namespace.
    pub fn watch(
        &self,
        client: &kube::Client,
        config: watcher::Config,
        health: Arc<WatchHealth>,
        store: Store<Proxy>,
    ) -> BoxStream<'static, Result<watcher::Event<Proxy>, watcher::Error>> {
        let mut streams: Vec<_> = self
            .apis(client)
            .into_iter()
            .map(|api| {
                let namespace = api.namespace().unwrap_or(ALL_NAMESPACES).to_owned();
                let key = namespace.clone();
                let health = health.clone();
                let stream = watcher(api, config.clone())
                    .default_backoff()
                    .modify(trim)
                    .inspect(move |event| health.saw(&key, event))
                    .inspect_err({
                        let namespace = namespace.clone();
                        move |error| {
                            tracing::warn!(%namespace, %error,
                                "cannot watch Proxies: check the operator's permissions in this namespace");
                        }
                    })
                    .boxed();
                (namespace, stream)
            })
            .collect();
        if streams.len() == 1 {
            return streams.remove(0).1;
        }
        let lookup = move |namespace: &str, name: &str| {
            let key = ObjectRef::new(name).within(namespace);
            store.get(&key).map(|proxy| (*proxy).clone())
        };
        merged_watch::merge(streams, lookup).boxed()
    }
}

impl std::fmt::Display for WatchScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WatchScope::AllNamespaces => f.write_str("(all)"),
            WatchScope::Namespaces(namespaces) => f.write_str(&namespaces.join(",")),
        }
    }
}

/// A namespace name is an RFC 1123 label: refusing a bad one at start-up beats a
/// watch that fails forever.
fn check_namespace_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAMESPACE_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "--namespace {name:?} is not a namespace name: use lowercase letters, digits and \
             '-' (at most {MAX_NAMESPACE_LEN}, starting and ending with a letter or digit), \
             several separated by commas or by repeating --namespace"
        ))
    }
}

/// Drops what the operator never reads from a Proxy before it is cached:
/// `metadata.managedFields` (a record of every field manager's writes, often larger
/// than the spec) and the `kubectl apply` annotation (a second copy of the whole
/// object as the user applied it).
pub fn trim(proxy: &mut Proxy) {
    // `None`, not an emptied list: clearing a Vec keeps its buffer allocated.
    proxy.metadata.managed_fields = None;
    if let Some(annotations) = proxy.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comma_lists_and_repeats_make_one_sorted_scope() {
        let scope = WatchScope::from_flags(["team-b,team-a", " team-c ", "team-a"]).unwrap();
        assert_eq!(
            scope,
            WatchScope::Namespaces(vec!["team-a".into(), "team-b".into(), "team-c".into()])
        );
        assert!(scope.contains("team-b"));
        assert!(!scope.contains("team-d"));
        assert_eq!(scope.to_string(), "team-a,team-b,team-c");
    }

    #[test]
    fn no_namespace_means_every_namespace() {
        let none: [&str; 0] = [];
        let scope = WatchScope::from_flags(none).unwrap();
        assert_eq!(scope, WatchScope::AllNamespaces);
        assert!(scope.contains("anything"));
    }

    /// A Proxy as the apiserver serves it after `kubectl apply` and the operator's own
    /// writes: two field managers' records, the applied copy, and everything the
    /// operator reads.
    fn served_proxy() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {
                "name": "egress",
                "namespace": "team-a",
                "uid": "6f1c",
                "resourceVersion": "42",
                "generation": 3,
                "labels": {"team": "a"},
                "annotations": {
                    LAST_APPLIED: "{\"kind\":\"Proxy\",\"spec\":{\"provider\":\"reference\"}}",
                    "egressproxy.dev/reconcile-requested-at": "2024-01-01T00:00:00Z",
                },
                "finalizers": ["egressproxy.dev/instance"],
                "ownerReferences": [{
                    "apiVersion": "egressproxy.dev/v1alpha1", "kind": "ProxyPool",
                    "name": "pool", "uid": "9a0b", "controller": true,
                }],
                "managedFields": [
                    {"manager": "kubectl-client-side-apply", "operation": "Update",
                     "apiVersion": "egressproxy.dev/v1alpha1", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:spec": {"f:provider": {}}}},
                    {"manager": "egressproxy-operator", "operation": "Apply",
                     "apiVersion": "egressproxy.dev/v1alpha1", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:phase": {}}}, "subresource": "status"},
                ],
            },
            "spec": {
                "provider": "reference",
                "placement": {"machineType": "small", "image": "debian-12"},
                "proxyPort": 3128,
            },
            "status": {"phase": "Ready", "providerId": "i-1", "replacements": 1},
        })
    }

    #[test]
    fn trim_drops_the_field_managers_records_and_the_applied_copy_only() {
        let mut proxy: Proxy = serde_json::from_value(served_proxy()).unwrap();
        trim(&mut proxy);

        let mut expected = served_proxy();
        let metadata = expected["metadata"].as_object_mut().unwrap();
        metadata.remove("managedFields");
        metadata["annotations"]
            .as_object_mut()
            .unwrap()
            .remove(LAST_APPLIED);
        // Both sides go through the type, so the spec's defaults appear in both.
        let expected: Proxy = serde_json::from_value(expected).unwrap();
        assert_eq!(
            serde_json::to_value(&proxy).unwrap(),
            serde_json::to_value(&expected).unwrap()
        );
        assert_eq!(proxy.metadata.managed_fields, None, "gone, buffer and all");
    }

    #[test]
    fn bad_names_are_refused_with_the_flag_and_the_name() {
        for bad in ["team-a,,team-b", "Team", "-a", "a_b", &"x".repeat(64)] {
            let error = WatchScope::from_flags([bad]).unwrap_err();
            assert!(error.contains("--namespace"), "{bad}: {error}");
        }
    }
}
