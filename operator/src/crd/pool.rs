//! The `ProxyPool` custom resource: `replicas` interchangeable Proxies made from one
//! template, spread across the placements it lists, reached through one Service whose
//! endpoints are the Ready members only.
//!
//! The template's `spec` is a Proxy's spec without the Proxy's own transition rules
//! (an immutable placement, an immutable provider): in a pool, a template change is
//! how members are replaced, one by one, within `maxSurge` and `maxUnavailable`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::proxy::{ProxyService, ProxySpec};

/// The most members a pool may ask for.
pub const MAX_POOL_REPLICAS: u32 = 100;
/// The annotation by which a pool asks its new member to adopt a spare: the spare's
/// provider id. The member acts on it only before it has any instance of its own.
pub const ADOPT_INSTANCE_ANNOTATION: &str = "egressproxy.dev/adopt-instance";
/// The most spares a pool may keep: each holds a booted VM's memory.
pub const MAX_POOL_SPARES: u32 = 10;

/// Desired state of a pool of egress proxies.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "egressproxy.dev",
    version = "v1alpha1",
    kind = "ProxyPool",
    plural = "proxypools",
    shortname = "pxp",
    namespaced,
    status = "ProxyPoolStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    doc = "A pool of interchangeable egress proxies: spec.replicas Proxies made from spec.template, spread across spec.spread, behind one Service (named after the pool) whose endpoints are the Ready members. A member that fails its health check leaves the Service's endpoints at once; a template change replaces members one by one.",
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Up-to-date","type":"integer","jsonPath":".status.updatedReplicas"}"#,
    printcolumn = r#"{"name":"Spares","type":"integer","jsonPath":".status.sparesReady"}"#,
    printcolumn = r#"{"name":"Service","type":"string","jsonPath":".status.serviceName"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.maxSurge > 0 || self.maxUnavailable > 0", "message": "set spec.maxSurge or spec.maxUnavailable above 0: a template change needs room to replace a member"},
    {"rule": "!has(self.spreadAcross) || !has(self.spread) || size(self.spread) == 0", "message": "set spec.spread (a fixed list) or spec.spreadAcross (the provider's locations), not both"},
    {"rule": "!has(self.template.spec.egress) || !has(self.template.spec.egress.address)", "message": "remove spec.template.spec.egress.address: every member would ask for the same address (each member keeps an address of its own where the provider offers address identities)"},
]))]
pub struct ProxyPoolSpec {
    /// How many members the pool keeps. `kubectl scale proxypool NAME --replicas=N`
    /// sets it.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = MAX_POOL_REPLICAS), extend("format" = "int32"))]
    pub replicas: u32,
    /// The Proxy every member is made from.
    pub template: ProxyTemplate,
    /// Placements to spread members across: each entry names a `host` or a `zone`
    /// that replaces the template's. A new member goes where the fewest are. Empty:
    /// every member takes the template's placement.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub spread: Vec<SpreadTarget>,
    /// Spread members across every location of this kind that the template's provider
    /// lists for the template's machine type and image (`hosts`: within the
    /// template's zone, if it names one), instead of a fixed `spread` list. The list is
    /// asked again at every pass, so new locations are used as they appear; locations
    /// with no room for one more member are left out. `status.spreadTargets` shows the
    /// list in use. A provider that does not list locations leaves every member at the
    /// template's placement, with a `SpreadUnavailable` Warning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread_across: Option<SpreadAcross>,
    /// How many members above `replicas` a template change may create at once (new
    /// members are made Ready before old ones go). Default 1.
    #[serde(default = "default_max_surge")]
    #[schemars(range(min = 0, max = MAX_POOL_REPLICAS), extend("format" = "int32"))]
    pub max_surge: u32,
    /// How many members below `replicas` may be not Ready while a template change
    /// replaces them. Default 0: the pool never has fewer Ready members than before.
    #[serde(default)]
    #[schemars(range(min = 0, max = MAX_POOL_REPLICAS), extend("format" = "int32"))]
    pub max_unavailable: u32,
    /// How many booted, health-checked instances of the template the pool keeps besides
    /// its members, in no Service: a new member (scaling up) adopts one instead of
    /// waiting for a VM to boot, and the pool boots another in the background. Each
    /// holds a VM's memory while idle. Needs a provider that declares
    /// `CAPABILITY_UPDATE_TAGS`; with another, the pool keeps none and says so with a
    /// `SparesUnavailable` Warning. Default 0.
    #[serde(default)]
    #[schemars(range(min = 0, max = MAX_POOL_SPARES), extend("format" = "int32"))]
    pub spares: u32,
    /// The pool's Service (`http://NAME.NAMESPACE.svc:PORT`, the port being the
    /// template's `proxyPort`). Default: a ClusterIP Service named after the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ProxyService>,
}

fn default_replicas() -> u32 {
    1
}

fn default_max_surge() -> u32 {
    1
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The Proxy a member is made from.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct ProxyTemplate {
    /// Labels and annotations every member gets.
    #[serde(default, skip_serializing_if = "TemplateMetadata::is_empty")]
    pub metadata: TemplateMetadata,
    /// A member's spec. Unlike a Proxy's, it may change: members are replaced.
    #[schemars(schema_with = "template_spec_schema")]
    pub spec: ProxySpec,
}

/// Labels and annotations of a member.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct TemplateMetadata {
    /// Labels every member carries (besides the pool's own).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations every member carries.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl TemplateMetadata {
    fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.annotations.is_empty()
    }
}

/// A Proxy's spec schema without its transition rules, which compare a Proxy with its
/// former self: in a template, a change is allowed and rolls the members.
fn template_spec_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = <ProxySpec as JsonSchema>::json_schema(generator);
    if let Some(object) = schema.as_object_mut() {
        object.remove("x-kubernetes-validations");
    }
    schema
}

/// The kind of location `spreadAcross` spreads members across.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum SpreadAcross {
    /// Every host the provider lists.
    Hosts,
    /// Every zone the provider lists.
    Zones,
}

/// One place members are spread to: a host or a zone.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.host) != has(self.zone)", "message": "each spread entry sets exactly one of host and zone"},
]))]
pub struct SpreadTarget {
    /// A host, as in `placement.host`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub host: Option<String>,
    /// A zone, as in `placement.zone`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub zone: Option<String>,
}

/// Observed state of a pool.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyPoolStatus {
    /// Members that exist and are not being deleted.
    #[serde(default)]
    #[schemars(extend("format" = "int32"))]
    pub replicas: u32,
    /// Members that are Ready (and so listed in the Service's endpoints).
    #[serde(default)]
    #[schemars(extend("format" = "int32"))]
    pub ready_replicas: u32,
    /// Members made from the current template and spread.
    #[serde(default)]
    #[schemars(extend("format" = "int32"))]
    pub updated_replicas: u32,
    /// Spares that run and pass the health check: a new member adopts one of these.
    #[serde(default)]
    #[schemars(extend("format" = "int32"))]
    pub spares_ready: u32,
    /// Spares made from the current template (booting or ready).
    #[serde(default)]
    #[schemars(extend("format" = "int32"))]
    pub spares: u32,
    /// How many spares the pool has asked the provider for: the next spare's number
    /// (its name, `POOL-spare-N`, and the order members adopt spares in).
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(extend("format" = "int32"))]
    pub spares_created: u32,
    /// The label selector of the members (for `kubectl scale` and autoscalers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The Service that workloads reach the pool by; unset when disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// Where new members go: `spec.spread`, or the locations the provider listed for
    /// `spec.spreadAcross` at the last pass.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spread_targets: Vec<SpreadTarget>,
    /// Every member: its name, whether it is Ready, its address.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<PoolMemberStatus>,
    /// The egress addresses its members were observed with (each member's
    /// `status.egressAddress`), sorted, each once: the allow-list to hand to a partner.
    /// A member whose address was not observed yet is missing from it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress_addresses: Vec<String>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (every wanted member Ready and up to date) and `Available` (at least
    /// one member Ready: the Service works).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One member as the pool sees it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolMemberStatus {
    /// The member Proxy's name.
    pub name: String,
    /// Whether it is Ready.
    pub ready: bool,
    /// Whether it is made from the current template and spread.
    pub updated: bool,
    /// The address the Service sends traffic to, while Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The source address destinations see (its `status.egressAddress`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_address: Option<String>,
}

/// The pool's condition types.
pub mod pool_condition {
    /// Every wanted member exists, is up to date and is Ready.
    pub const READY: &str = "Ready";
    /// At least one member is Ready: the Service has an endpoint.
    pub const AVAILABLE: &str = "Available";
    /// As many spares as `spec.spares` run and pass the health check (false with a
    /// provider that cannot hand instances over: the reason says so).
    pub const SPARES_READY: &str = "SparesReady";
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use super::*;

    #[test]
    fn the_template_spec_drops_the_proxy_s_transition_rules_but_keeps_its_fields() {
        let crd = serde_json::to_value(ProxyPool::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["template"]["properties"]["spec"];
        assert!(spec["properties"]["placement"].is_object(), "{spec}");
        assert!(spec.get("x-kubernetes-validations").is_none(), "{spec}");
        let scale = &crd["spec"]["versions"][0]["subresources"]["scale"];
        assert_eq!(scale["labelSelectorPath"], ".status.selector");
    }
}
