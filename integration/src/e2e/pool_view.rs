//! A ProxyPool on the running [`Stack`] as the pool benchmarks read it, each part
//! followed by a watch into a [`Timeline`]:
//! - [`follow_listed`]: the addresses the pool's EndpointSlices list as ready (what
//!   kube-proxy spreads connections over);
//! - [`follow_members`]: each member Proxy's readiness, instance and adoption;
//! - [`follow_pool`]: the pool's status (its Ready spares, its members' addresses);
//! - [`follow_ready_proxies`]: which of the run's Proxies are Ready, pool or not.
//!
//! Proxies and pools are read as dynamic objects: this crate does not depend on the
//! operator's types, only on the fields the CRD documents.

use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::{Resource, ResourceExt};

use super::stack::Stack;
use super::timeline::{Timeline, follow};

/// The label on every member Proxy, with its pool's name.
pub const POOL_LABEL: &str = "egressproxy.dev/pool";
/// The annotation naming the spare a new member adopts.
pub const ADOPT_ANNOTATION: &str = "egressproxy.dev/adopt-instance";

/// The addresses `service`'s EndpointSlices list as ready, sorted.
pub fn listed(slices: &[Arc<EndpointSlice>], service: &str) -> Vec<String> {
    let mut addresses: Vec<String> = slices
        .iter()
        .filter(|s| {
            s.labels()
                .get("kubernetes.io/service-name")
                .map(String::as_str)
                == Some(service)
        })
        .flat_map(|s| s.endpoints.clone().unwrap_or_default())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses)
        .collect();
    addresses.sort();
    addresses
}

/// Follows what the EndpointSlices of Service `service` list ([`listed`]).
pub fn follow_listed(stack: &Stack, service: &str) -> Timeline<Vec<String>> {
    let api: Api<EndpointSlice> = stack.kube.namespaced();
    let service = service.to_owned();
    follow(api, (), move |slices| listed(slices, &service))
}

/// One member Proxy, as its status says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberView {
    /// The Proxy's name.
    pub name: String,
    /// Its `Ready` condition is True.
    pub ready: bool,
    /// Its `Healthy` condition exists: its current VM's proxy answered once.
    pub healthy: bool,
    /// `status.replacements`: VMs it gave up.
    pub replacements: u64,
    /// `status.instanceKey`: its instance's key at the provider.
    pub instance_key: Option<String>,
    /// The spare its pool told it to adopt.
    pub adopting: Option<String>,
    /// It is being deleted.
    pub deleting: bool,
}

impl MemberView {
    fn of(proxy: &DynamicObject) -> Self {
        let status = &proxy.data["status"];
        let condition = |type_: &str| {
            status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == type_)
                .map(|c| c["status"] == "True")
        };
        Self {
            name: proxy.name_any(),
            ready: condition("Ready") == Some(true),
            healthy: condition("Healthy").is_some(),
            replacements: status["replacements"].as_u64().unwrap_or(0),
            instance_key: status["instanceKey"].as_str().map(str::to_owned),
            adopting: proxy.annotations().get(ADOPT_ANNOTATION).cloned(),
            deleting: proxy.meta().deletion_timestamp.is_some(),
        }
    }
}

fn resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("egressproxy.dev", "v1alpha1", kind))
}

/// Follows the member Proxies of pool `pool` (by its label), sorted by name.
pub fn follow_members(stack: &Stack, pool: &str) -> Timeline<Vec<MemberView>> {
    let proxies = resource("Proxy");
    let api: Api<DynamicObject> =
        Api::namespaced_with(stack.kube.client.clone(), &stack.kube.namespace, &proxies);
    let pool = pool.to_owned();
    follow(api, proxies, move |objects| {
        let mut members: Vec<MemberView> = objects
            .iter()
            .filter(|p| p.labels().get(POOL_LABEL) == Some(&pool))
            .map(|p| MemberView::of(p))
            .collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        members
    })
}

/// Follows the names of the run's Ready Proxies, sorted.
pub fn follow_ready_proxies(stack: &Stack) -> Timeline<Vec<String>> {
    let proxies = resource("Proxy");
    let api: Api<DynamicObject> =
        Api::namespaced_with(stack.kube.client.clone(), &stack.kube.namespace, &proxies);
    follow(api, proxies, |objects| {
        let mut ready: Vec<String> = objects
            .iter()
            .map(|p| MemberView::of(p))
            .filter(|m| m.ready)
            .map(|m| m.name)
            .collect();
        ready.sort();
        ready
    })
}

/// A pool's status, the parts the benchmarks read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolView {
    /// `status.sparesReady`.
    pub spares_ready: u64,
    /// `status.members`: each member's name and the address the Service lists for it.
    pub members: Vec<(String, Option<String>)>,
}

/// Follows the status of ProxyPool `pool` (the default view while it does not exist).
pub fn follow_pool(stack: &Stack, pool: &str) -> Timeline<PoolView> {
    let pools = resource("ProxyPool");
    let api: Api<DynamicObject> =
        Api::namespaced_with(stack.kube.client.clone(), &stack.kube.namespace, &pools);
    let pool = pool.to_owned();
    follow(api, pools, move |objects| {
        let Some(found) = objects.iter().find(|p| p.name_any() == pool) else {
            return PoolView::default();
        };
        let status = &found.data["status"];
        PoolView {
            spares_ready: status["sparesReady"].as_u64().unwrap_or(0),
            members: status["members"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| {
                    (
                        m["name"].as_str().unwrap_or_default().to_owned(),
                        m["address"].as_str().map(str::to_owned),
                    )
                })
                .collect(),
        }
    })
}
