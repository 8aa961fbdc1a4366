//! The identity of the Proxy being reconciled, resolved once at the start.

use std::collections::HashMap;

use kube::ResourceExt;

use crate::crd::Proxy;
use crate::providers::instance_tags as tags;

/// A Proxy's UID, namespace and name: the UID keys every in-memory entry and tags
/// every instance; namespace and name address the object and its Events.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProxyKey {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
}

impl ProxyKey {
    /// The key of `proxy`. Proxies come from the API server, which always sets all
    /// three; an object without them yields empty strings rather than a panic.
    pub fn of(proxy: &Proxy) -> ProxyKey {
        ProxyKey {
            uid: proxy.uid().unwrap_or_default(),
            namespace: proxy.namespace().unwrap_or_default(),
            name: proxy.name_any(),
        }
    }

    /// The tags of this Proxy's instances, made by the operator of cluster `cluster`.
    pub fn instance_tags(&self, cluster: &str) -> HashMap<String, String> {
        HashMap::from([
            (tags::CLUSTER.to_owned(), cluster.to_owned()),
            (tags::NAMESPACE.to_owned(), self.namespace.clone()),
            (tags::NAME.to_owned(), self.name.clone()),
            (tags::UID.to_owned(), self.uid.clone()),
        ])
    }

    /// The idempotency key of the instance after `replacements` replacements.
    pub fn instance_key(&self, replacements: u32) -> String {
        format!("{}-{replacements}", self.uid)
    }
}

impl std::fmt::Display for ProxyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}
