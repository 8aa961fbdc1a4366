//! The `Proxy` custom resource.
//!
//! The schema validates what it can at admission, so users see mistakes from
//! `kubectl apply`, not from a condition minutes later: required fields, port and
//! interval ranges, exactly one cloud-init source, host and zone exclusive, the
//! cloud-init size in bytes (what providers count), and the placement immutable unless
//! `placementUpdatePolicy: Replace`.
//!
//! Integer fields are declared `int32` (with ranges) in the schema: the apiserver knows
//! no `uint16`/`uint32` formats and warns about them on every apply.

use std::collections::BTreeMap;

use egressproxy_provider::validation::MAX_USER_DATA_BYTES;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired state of an egress proxy: a VM running an HTTP proxy, made by a provider.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "egressproxy.dev",
    version = "v1alpha1",
    kind = "Proxy",
    plural = "proxies",
    shortname = "pxy",
    namespaced,
    status = "ProxyStatus",
    doc = "An egress proxy with a stable source address: a small VM running an HTTP proxy, created and kept running by the provider named in spec.provider. status.addresses tells where to send traffic; the Ready condition says whether the proxy really proxies.",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Provider","type":"string","jsonPath":".spec.provider"}"#,
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".status.addresses[0].address"}"#,
    printcolumn = r#"{"name":"Egress","type":"string","jsonPath":".status.egressAddress"}"#,
    printcolumn = r#"{"name":"Service","type":"string","jsonPath":".status.serviceName"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.placementUpdatePolicy == 'Replace' || self.placement == oldSelf.placement",
     "message": "spec.placement is immutable: set spec.placementUpdatePolicy to Replace to replace the VM (it gets a new address) when the placement changes"},
    {"rule": "self.provider == oldSelf.provider", "message": "spec.provider is immutable: create a new Proxy for another provider"},
]))]
pub struct ProxySpec {
    /// Name of the provider that runs the VM: a key of the operator's provider
    /// configuration (for example `kvm`).
    #[schemars(length(min = 1, max = 63))]
    pub provider: String,
    /// Where and on what the VM runs.
    pub placement: Placement,
    /// What a change of `placement` does: `Immutable` (rejected at admission) or
    /// `Replace` (a new VM replaces the old one, with a new address).
    #[serde(default)]
    pub placement_update_policy: PlacementUpdatePolicy,
    /// cloud-init input for the VM (installs and configures the proxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInit>,
    /// TCP port the proxy listens on inside the VM.
    #[serde(default = "default_proxy_port")]
    #[schemars(range(min = 1, max = 65535), extend("format" = "int32"))]
    pub proxy_port: u16,
    /// How the operator checks that the proxy really proxies. Default: TCP connect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// How long a new VM may take, from the provider's answer to Create, to run with an
    /// address and pass its first health check. Past it the VM is deleted and replaced:
    /// a VM that hung while booting never recovers by itself. Count the guest's boot and
    /// the proxy's installation by cloud-init. Default 600 seconds.
    #[serde(default = "default_provisioning_timeout")]
    #[schemars(range(min = 10, max = 86400), extend("format" = "int32"))]
    pub provisioning_timeout_seconds: u32,
    /// The address destinations see, for allow-lists. By default, when the provider
    /// keeps addresses for an identity, every VM of this Proxy (replacements
    /// included) gets the same address; set `address` to ask for a specific one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Egress>,
    /// The Service that workloads reach the proxy by
    /// (`http://NAME.NAMESPACE.svc:PORT`). Default: a ClusterIP Service named after the
    /// Proxy, whose endpoints list the proxy's address while the Proxy is Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ProxyService>,
}

/// The Proxy's egress address.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.checkUrl) || self.checkUrl.startsWith('http://') || self.checkUrl.startsWith('https://')", "message": "egress.checkUrl must start with http:// or https://"},
]))]
pub struct Egress {
    /// A specific address for the VM, from a range the provider offers on its network
    /// (for example `192.168.200.50`). It stays with this Proxy across replacements.
    /// Needs a provider with requested addresses (`CAPABILITY_REQUESTED_ADDRESS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 45))]
    pub address: Option<String>,
    /// An echo service that answers the caller's address alone in its body (for
    /// example `https://api.ipify.org`): fetched through the proxy once the VM is Ready
    /// and after each replacement, its answer is `status.egressAddress`, the address
    /// destinations really see. Overrides the provider's `egressCheckUrl` in the
    /// operator's provider configuration. Anyone who can read the Proxy sees it: put a
    /// URL with credentials in the provider configuration instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 8, max = 2048))]
    pub check_url: Option<String>,
}

/// The Service the operator keeps for a Proxy.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyService {
    /// Whether the operator keeps a Service for the Proxy. `false` deletes it.
    #[serde(default = "default_service_enabled")]
    pub enabled: bool,
    /// The Service's type: `ClusterIP` (default), `NodePort` or `LoadBalancer`.
    #[serde(rename = "type", default)]
    pub kind: ServiceKind,
    /// Annotations set on the Service (for a load balancer's settings, for example).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Default for ProxyService {
    fn default() -> Self {
        ProxyService {
            enabled: default_service_enabled(),
            kind: ServiceKind::default(),
            annotations: BTreeMap::new(),
        }
    }
}

fn default_service_enabled() -> bool {
    true
}

/// The type of a Proxy's Service.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ServiceKind {
    /// A cluster-internal virtual IP.
    #[default]
    ClusterIP,
    /// A cluster IP and a port on every node.
    NodePort,
    /// A NodePort Service and a load balancer, if the cluster has one.
    LoadBalancer,
}

impl ServiceKind {
    /// The name Kubernetes gives the type in `spec.type`.
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceKind::ClusterIP => "ClusterIP",
            ServiceKind::NodePort => "NodePort",
            ServiceKind::LoadBalancer => "LoadBalancer",
        }
    }
}

fn default_proxy_port() -> u16 {
    3128
}

fn default_provisioning_timeout() -> u32 {
    600
}

/// Where and on what the VM runs: names from the provider's configuration.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!(has(self.host) && has(self.zone))", "message": "set placement.host or placement.zone, not both"},
]))]
pub struct Placement {
    /// A specific hypervisor or host. Unset with `zone` unset: the provider chooses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub host: Option<String>,
    /// A zone or failure domain; the provider picks a host in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub zone: Option<String>,
    /// Machine type (size), for example `small`.
    #[schemars(length(min = 1, max = 253))]
    pub machine_type: String,
    /// Image, for example `debian-12`.
    #[schemars(length(min = 1, max = 253))]
    pub image: String,
}

/// What a change of placement does.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum PlacementUpdatePolicy {
    /// The placement cannot change.
    #[default]
    Immutable,
    /// A change replaces the VM.
    Replace,
}

/// cloud-init input: inline, or from a Secret (recommended: user-data often holds
/// secrets).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.userData) != has(self.userDataSecretRef)", "message": "set exactly one of cloudInit.userData and cloudInit.userDataSecretRef"},
    {"rule": format!("!has(self.userData) || size(bytes(self.userData)) <= {MAX_USER_DATA_BYTES}"), "message": format!("cloudInit.userData is over {MAX_USER_DATA_BYTES} bytes (UTF-8; a multi-byte character counts more than once): move large files into the image or a Secret-fetched script")},
    {"rule": format!("!has(self.vendorData) || size(bytes(self.vendorData)) <= {MAX_USER_DATA_BYTES}"), "message": format!("cloudInit.vendorData is over {MAX_USER_DATA_BYTES} bytes (UTF-8; a multi-byte character counts more than once)")},
]))]
pub struct CloudInit {
    /// Inline user-data (`#cloud-config`, a script, or MIME multipart). At most 65536
    /// bytes in UTF-8 (a multi-byte character counts more than once), the providers'
    /// limit. Visible to anyone who can read the Proxy: put secrets in a Secret instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_USER_DATA_BYTES))]
    pub user_data: Option<String>,
    /// User-data from a key of a Secret in the Proxy's namespace (at most 65536 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_secret_ref: Option<SecretKeyRef>,
    /// Inline vendor-data (for providers with the vendor-data capability). At most
    /// 65536 bytes in UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_USER_DATA_BYTES))]
    pub vendor_data: Option<String>,
}

/// A key of a Secret in the Proxy's namespace.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key in the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// How the operator checks the proxy.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.type != 'Http' || has(self.url)", "message": "healthCheck.url is required when healthCheck.type is Http"},
    {"rule": "self.timeoutSeconds <= self.periodSeconds", "message": "healthCheck.timeoutSeconds must not exceed healthCheck.periodSeconds"},
]))]
pub struct HealthCheck {
    /// `Tcp`: connect to the proxy port. `Http`: send a GET for `url` through the proxy
    /// and expect any HTTP response.
    #[serde(rename = "type", default)]
    pub kind: HealthCheckKind,
    /// URL requested through the proxy (with `type: Http`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub url: Option<String>,
    /// Seconds between checks.
    #[serde(default = "default_period")]
    #[schemars(range(min = 1, max = 3600), extend("format" = "int32"))]
    pub period_seconds: u32,
    /// Seconds before one check fails.
    #[serde(default = "default_timeout")]
    #[schemars(range(min = 1, max = 300), extend("format" = "int32"))]
    pub timeout_seconds: u32,
    /// Consecutive failures before the proxy is reported unhealthy.
    #[serde(default = "default_failure_threshold")]
    #[schemars(range(min = 1, max = 100), extend("format" = "int32"))]
    pub failure_threshold: u32,
}

impl Default for HealthCheck {
    fn default() -> Self {
        HealthCheck {
            kind: HealthCheckKind::Tcp,
            url: None,
            period_seconds: default_period(),
            timeout_seconds: default_timeout(),
            failure_threshold: default_failure_threshold(),
        }
    }
}

fn default_period() -> u32 {
    30
}
fn default_timeout() -> u32 {
    5
}
fn default_failure_threshold() -> u32 {
    3
}

/// The kind of health check.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum HealthCheckKind {
    /// TCP connect to the proxy port.
    #[default]
    Tcp,
    /// An HTTP request sent through the proxy.
    Http,
}

/// Observed state of a Proxy.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyStatus {
    /// Summary: Pending, Provisioning, Ready, Degraded, Failed, Deleting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The provider's id of the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<String>,
    /// The idempotency key the VM was created with (the Proxy's UID and a
    /// replacement serial).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_key: Option<String>,
    /// The placement the current VM was created with (as asked for: a change of
    /// `spec.placement` is measured against it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// Where the current VM runs, as its provider last reported it: the host or zone
    /// asked for, or the host the provider chose when the placement named none. Unset
    /// until the provider has reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<InstanceLocation>,
    /// When the operator created the current VM: the provisioning timeout counts from
    /// here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_create_time: Option<Time>,
    /// The VM being replaced and why, until its successor is created (so the `Replaced`
    /// Event names both, after an operator restart too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacing: Option<ReplacedInstance>,
    /// Number of times the VM was replaced.
    #[serde(default)]
    #[schemars(range(max = 2147483647), extend("format" = "int32"))]
    pub replacements: u32,
    /// Addresses the proxy is reachable at: first the one the operator uses and checks
    /// (the first internal address of an IP family it reaches), then the rest in the
    /// provider's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<ProxyAddress>,
    /// The source address destinations see, as the egress check URL's echo service
    /// last saw it through the proxy (`spec.egress.checkUrl`, or the provider's
    /// `egressCheckUrl`): the address to put on a partner's allow-list. Unset until
    /// observed, or when no check URL is configured; the `EgressAddressObserved`
    /// condition says whether it was observed through the current VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_address: Option<String>,
    /// The Service that workloads reach the proxy by, in the Proxy's namespace; unset
    /// when `spec.service.enabled` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Provisioned`, `Healthy`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The last error, for humans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// Where a VM runs: one of a host or a zone, by the names the provider's
/// configuration gives them (a provider asked for a zone may report only the zone).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceLocation {
    /// The host it runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The zone it runs in, when the provider reports a zone rather than a host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

/// A VM being replaced.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplacedInstance {
    /// Its provider id.
    pub provider_id: String,
    /// Why it is replaced, for example `stopped (shut off)`.
    pub cause: String,
}

/// Summary of a Proxy's state.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Accepted; nothing created yet.
    Pending,
    /// The VM is being created or is booting.
    Provisioning,
    /// The VM runs and its proxy passes the health check.
    Ready,
    /// The VM runs but its proxy fails the health check.
    Degraded,
    /// A permanent error; the spec must change.
    Failed,
    /// The VM is being deleted.
    Deleting,
}

/// One address of the proxy.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyAddress {
    /// The IP address.
    pub address: String,
    /// `Internal` or `External` (a scope this operator does not know, from a newer
    /// provider, shows as `External`).
    pub scope: String,
    /// `IPv4` or `IPv6` (a family this operator does not know is read from the
    /// address), or `Unknown` when neither the provider nor the address tells it.
    pub family: String,
}

/// Condition types.
pub mod condition {
    /// Everything works: provisioned and healthy.
    pub const READY: &str = "Ready";
    /// The provider reports the VM running with an address.
    pub const PROVISIONED: &str = "Provisioned";
    /// The proxy passes its health check.
    pub const HEALTHY: &str = "Healthy";
    /// `status.egressAddress` was observed through the current VM (set only when an
    /// egress check URL is configured).
    pub const EGRESS_ADDRESS_OBSERVED: &str = "EgressAddressObserved";
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use super::*;

    /// The schema's size limits come from the contract's constant; its prose, which
    /// cannot, must still agree with it.
    #[test]
    fn every_user_data_limit_in_the_schema_is_the_contracts() {
        let crd = serde_json::to_value(Proxy::crd()).unwrap();
        let cloud_init = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["cloudInit"];
        let text = cloud_init.to_string();
        let numbers: Vec<&str> = text
            .split(|c: char| !c.is_ascii_digit())
            .filter(|n| n.len() >= 4)
            .collect();
        assert!(numbers.len() >= 6, "{numbers:?} in {text}");
        let limit = MAX_USER_DATA_BYTES.to_string();
        assert!(numbers.iter().all(|n| *n == limit), "{numbers:?}");
    }
}
