//! The Service a Proxy is reached by, and the EndpointSlice behind it.
//!
//! Workloads use `http://NAME.NAMESPACE.svc:PORT` instead of an address read from the
//! Proxy's status, which changes when the VM is replaced. The Service has no selector
//! (a VM is no Pod), so the operator writes its endpoints itself:
//!
//! 1. **What is wanted** ([`desired`], pure): a Service named after the Proxy (type and
//!    annotations from `spec.service`, one port `proxy` = `spec.proxyPort`) and one
//!    EndpointSlice named `NAME-ipv4` or `NAME-ipv6`, after the family of the address.
//!    The address is the one the health check probes and the `Address` column shows
//!    (`status.addresses[0]`), and only while the Proxy is Ready: otherwise the slice
//!    has no endpoints, so kube-proxy refuses connections at once instead of sending
//!    them to a VM that does not proxy (ADR 0023). A disabled Service, a Proxy being
//!    deleted or a name that cannot be a Service's name wants nothing.
//! 2. **Compare** ([`service_matches`], [`slice_matches`], pure): only the fields the
//!    operator sets are compared, so what others add (a cloud's annotations, the
//!    allocated cluster IP) never counts as drift; an annotation this operator applied
//!    earlier and no longer wants does.
//! 3. **Write only the difference** ([`sync`]): each object that does not match is
//!    applied (server-side apply, field manager `egressproxy-operator`, forced: these
//!    objects are the operator's), slices of another family are deleted, and nothing is
//!    written when everything matches. [`crate::k8s::published`] spares the reads: a
//!    sync that wants what the last one wrote does nothing, and one that only changes
//!    slices' contents (the Proxy turned Ready, its address moved) writes just those.
//!    A new Proxy's first sync lists no slices: none can exist yet.
//!    A port changed by hand is first reset with a merge patch: the apply would add its
//!    port beside the stranger's, and two ports named `proxy` are invalid.
//! 4. **Ownership**: both carry a controller owner reference to the Proxy, so
//!    Kubernetes' garbage collector deletes them with it; cleanup deletes them first
//!    anyway ([`withdraw`]), so that no traffic goes to a VM being deleted.
//!
//! [`crate::endpoints::publisher`] runs [`sync`] for each Proxy, apart from its
//! reconcile; [`crate::endpoints::owned_watch`] sends it a Proxy whose objects someone
//! changed.
//! A pool's Service is built and written by the same [`build`] and [`apply`], from a
//! [`ServiceFor`] listing every Ready member's address (one slice per family).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};

use crate::context::Context;
use crate::crd::{Proxy, ProxyService, ProxyStatus, condition};
use crate::k8s::published::{Begin, Objects};
use crate::k8s::status::{FIELD_MANAGER, is_true};
use crate::shared::error::Result;

/// The label that marks a Service as this operator's (what its watch selects).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// That label's value on a Proxy's Service.
pub const MANAGED_BY: &str = "egressproxy-operator";
/// The label that names the Proxy a Service or EndpointSlice belongs to.
pub const PROXY_LABEL: &str = "egressproxy.dev/proxy";
/// The label by which kube-proxy finds a Service's EndpointSlices.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that tells the EndpointSlice controller a slice is not its own.
pub const SLICE_MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// That label's value on this operator's slices.
pub const SLICE_MANAGED_BY: &str = "egressproxy-operator.egressproxy.dev";
/// The name of the Service's one port, and of the slice's.
pub const PORT_NAME: &str = "proxy";
/// The longest Service name (an RFC 1035 label).
const MAX_SERVICE_NAME: usize = 63;

/// A Service and its EndpointSlices as the operator wants them.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    /// The Service.
    pub service: Service,
    /// Its EndpointSlices: one per address family in use, or one empty slice.
    pub slices: Vec<EndpointSlice>,
}

/// What a Service the operator keeps is made from, whichever object owns it (a Proxy
/// or a pool).
#[derive(Debug, Clone)]
pub struct ServiceFor {
    /// The controller reference to the owner.
    pub owner: OwnerReference,
    /// The owner's namespace, which the Service shares.
    pub namespace: Option<String>,
    /// The Service's name.
    pub name: String,
    /// The label that names the owner, set to `name`.
    pub owner_label: &'static str,
    /// Type and annotations.
    pub settings: ProxyService,
    /// The port served and sent to.
    pub port: i32,
    /// The endpoints: addresses of proxies that proxy now.
    pub addresses: Vec<IpAddr>,
    /// The family of the one empty slice kept when there are no addresses.
    pub empty_family: &'static str,
}

/// The Service name of `proxy`, if it is to have a Service (see [`desired`]).
pub fn service_name(proxy: &Proxy) -> Option<String> {
    if proxy.metadata.deletion_timestamp.is_some() {
        return None;
    }
    service_name_for(&proxy.name_any(), proxy.spec.service.as_ref())
}

/// The name of the Service an object named `name` keeps with `settings`: its own
/// name, unless `settings` turn the Service off or the name cannot be a Service's.
pub fn service_name_for(name: &str, settings: Option<&ProxyService>) -> Option<String> {
    let enabled = settings.is_none_or(|s| s.enabled);
    (enabled && is_service_name(name)).then(|| name.to_owned())
}

/// What `proxy` with `status` wants (module doc, step 1); `None`: no Service at all.
pub fn desired(proxy: &Proxy, status: &ProxyStatus) -> Option<Desired> {
    let name = service_name(proxy)?;
    let chosen = checked_address(status);
    let ready = is_true(&status.conditions, condition::READY);
    Some(build(ServiceFor {
        owner: controller_reference(proxy)?,
        namespace: proxy.namespace(),
        name,
        owner_label: PROXY_LABEL,
        settings: proxy.spec.service.clone().unwrap_or_default(),
        port: i32::from(proxy.spec.proxy_port),
        addresses: chosen
            .filter(|ip| ready && can_be_an_endpoint(*ip))
            .into_iter()
            .collect(),
        empty_family: family(chosen),
    }))
}

/// The address the health check probes and the `Address` column shows.
pub fn checked_address(status: &ProxyStatus) -> Option<IpAddr> {
    status
        .addresses
        .first()
        .and_then(|a| a.address.parse::<IpAddr>().ok())
}

/// The EndpointSlice `addressType` of `ip` (`IPv4` when there is none).
fn family(ip: Option<IpAddr>) -> &'static str {
    match ip {
        Some(IpAddr::V6(_)) => "IPv6",
        _ => "IPv4",
    }
}

/// The Service and slices `wanted` describes.
pub fn build(wanted: ServiceFor) -> Desired {
    let meta = |name: String, labels: BTreeMap<String, String>| ObjectMeta {
        name: Some(name),
        namespace: wanted.namespace.clone(),
        labels: Some(labels),
        owner_references: Some(vec![wanted.owner.clone()]),
        ..ObjectMeta::default()
    };
    let name = wanted.name.clone();
    let service_labels = BTreeMap::from([
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
        (wanted.owner_label.to_owned(), name.clone()),
    ]);
    let mut service = Service {
        metadata: meta(name.clone(), service_labels),
        spec: Some(ServiceSpec {
            type_: Some(wanted.settings.kind.as_str().to_owned()),
            ports: Some(vec![ServicePort {
                name: Some(PORT_NAME.to_owned()),
                port: wanted.port,
                target_port: Some(IntOrString::Int(wanted.port)),
                protocol: Some("TCP".to_owned()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    };
    service.metadata.annotations = Some(wanted.settings.annotations.clone());

    let mut by_family: BTreeMap<&'static str, Vec<IpAddr>> = BTreeMap::new();
    for ip in &wanted.addresses {
        by_family.entry(family(Some(*ip))).or_default().push(*ip);
    }
    if by_family.is_empty() {
        by_family.insert(wanted.empty_family, Vec::new());
    }
    let slices = by_family
        .into_iter()
        .map(|(family, addresses)| {
            let labels = BTreeMap::from([
                (SERVICE_NAME_LABEL.to_owned(), name.clone()),
                (
                    SLICE_MANAGED_BY_LABEL.to_owned(),
                    SLICE_MANAGED_BY.to_owned(),
                ),
                (wanted.owner_label.to_owned(), name.clone()),
            ]);
            let endpoints = addresses
                .into_iter()
                .map(|ip| Endpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    ..Endpoint::default()
                })
                .collect();
            EndpointSlice {
                metadata: meta(slice_name(&name, family), labels),
                address_type: family.to_owned(),
                endpoints: Some(endpoints),
                ports: Some(vec![EndpointPort {
                    name: Some(PORT_NAME.to_owned()),
                    port: Some(wanted.port),
                    protocol: Some("TCP".to_owned()),
                    app_protocol: None,
                }]),
            }
        })
        .collect();
    Desired { service, slices }
}

/// The slice of family `IPv4` or `IPv6` of Service `service`.
fn slice_name(service: &str, family: &str) -> String {
    format!("{service}-{}", family.to_ascii_lowercase())
}

/// Whether `name` may name a Service: an RFC 1035 label. A Proxy's name may be longer
/// or hold dots (it is a DNS subdomain); such a Proxy gets no Service.
pub fn is_service_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_SERVICE_NAME
        && bytes[0].is_ascii_lowercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && !name.ends_with('-')
}

/// Whether the apiserver accepts `ip` in an EndpointSlice: never a loopback,
/// link-local or unspecified address (no other Pod could reach it anyway).
pub fn can_be_an_endpoint(ip: IpAddr) -> bool {
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || link_local)
}

/// The controller reference to `owner` (a Proxy or a pool). `blockOwnerDeletion` stays
/// unset: it would need `update` on the owner's `finalizers` subresource where that
/// admission check runs, and nothing waits on the owned objects' deletion.
pub fn controller_reference<K: Resource<DynamicType = ()>>(owner: &K) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: K::api_version(&()).into_owned(),
        kind: K::kind(&()).into_owned(),
        name: owner.meta().name.clone()?,
        uid: owner.meta().uid.clone()?,
        controller: Some(true),
        block_owner_deletion: None,
    })
}

/// Whether `actual` carries every label of `wanted`, this operator's controller
/// reference, and exactly the annotations wanted of those this operator manages.
fn meta_matches(wanted: &ObjectMeta, actual: &ObjectMeta) -> bool {
    let labels = actual.labels.clone().unwrap_or_default();
    let labelled = wanted
        .labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let owned = wanted.owner_references.iter().flatten().all(|w| {
        actual
            .owner_references
            .iter()
            .flatten()
            .any(|a| a.uid == w.uid && a.controller == Some(true))
    });
    let want = wanted.annotations.clone().unwrap_or_default();
    let have = actual.annotations.clone().unwrap_or_default();
    let annotated = want.iter().all(|(k, v)| have.get(k) == Some(v))
        && annotations_applied(actual)
            .iter()
            .all(|k| want.contains_key(k) || !have.contains_key(k));
    labelled && owned && annotated
}

/// The annotation keys this operator's applies set on an object, from its managed
/// fields.
fn annotations_applied(meta: &ObjectMeta) -> BTreeSet<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter(|entry| {
            entry.manager.as_deref() == Some(FIELD_MANAGER)
                && entry.operation.as_deref() == Some("Apply")
        })
        .filter_map(|entry| entry.fields_v1.as_ref())
        .filter_map(|fields| fields.0["f:metadata"]["f:annotations"].as_object().cloned())
        .flat_map(|annotations| annotations.into_iter().map(|(k, _)| k))
        .filter_map(|k| k.strip_prefix("f:").map(str::to_owned))
        .collect()
}

/// The ports as compared: what the operator sets of each.
fn port_view(service: &Service) -> Vec<(Option<String>, i32, Option<IntOrString>, String)> {
    service
        .spec
        .iter()
        .flat_map(|spec| spec.ports.iter().flatten())
        .map(|p| {
            (
                p.name.clone(),
                p.port,
                p.target_port.clone(),
                p.protocol.clone().unwrap_or_else(|| "TCP".into()),
            )
        })
        .collect()
}

fn service_type(service: &Service) -> String {
    service
        .spec
        .as_ref()
        .and_then(|spec| spec.type_.clone())
        .unwrap_or_else(|| "ClusterIP".into())
}

/// Whether the Service `actual` is what `wanted` asks (module doc, step 2).
pub fn service_matches(wanted: &Service, actual: &Service) -> bool {
    meta_matches(&wanted.metadata, &actual.metadata)
        && service_type(wanted) == service_type(actual)
        && port_view(wanted) == port_view(actual)
}

/// Whether the EndpointSlice `actual` is what `wanted` asks (module doc, step 2).
pub fn slice_matches(wanted: &EndpointSlice, actual: &EndpointSlice) -> bool {
    let endpoints = |slice: &EndpointSlice| {
        slice
            .endpoints
            .iter()
            .flatten()
            .map(|e| {
                let ready = e.conditions.as_ref().and_then(|c| c.ready);
                (e.addresses.clone(), ready)
            })
            .collect::<Vec<_>>()
    };
    meta_matches(&wanted.metadata, &actual.metadata)
        && wanted.address_type == actual.address_type
        && endpoints(wanted) == endpoints(actual)
        && wanted.ports == actual.ports
}

/// The label selector of the slices of Service `name` that this operator made.
fn slices_of(name: &str) -> ListParams {
    ListParams::default().labels(&format!(
        "{SERVICE_NAME_LABEL}={name},{SLICE_MANAGED_BY_LABEL}={SLICE_MANAGED_BY}"
    ))
}

/// Makes the Service and EndpointSlice of `proxy` what its `status` asks, writing only
/// what differs (module doc, step 3); with nothing wanted, deletes what it owns.
/// Returns how many objects it wrote or deleted. When no drift was reported since its
/// last sync, it reads nothing if that sync made them exactly this, and only writes the
/// slices that changed if nothing else did ([`crate::k8s::published`]).
pub async fn sync(ctx: &Context, proxy: &Proxy, status: &ProxyStatus) -> Result<u32> {
    let uid = proxy.uid().unwrap_or_default();
    let wanted = desired(proxy, status);
    let objects = digests(wanted.as_ref());
    let (ticket, written) = match (ctx.published.begin(&uid, &objects), &wanted) {
        (Begin::Unchanged, _) => return Ok(0),
        (Begin::SlicesOnly { ticket, slices }, Some(wanted)) => {
            (ticket, apply_slices(ctx, wanted, &slices).await?)
        }
        (Begin::Full { ticket }, Some(wanted)) => {
            match apply(ctx, wanted).await? {
                Some(written) => (ticket, written),
                // Another owner's Service: look again next time.
                None => return Ok(0),
            }
        }
        (Begin::SlicesOnly { ticket, .. } | Begin::Full { ticket }, None) => {
            (ticket, withdraw(ctx, proxy).await?)
        }
    };
    ctx.published.done(&uid, ticket, objects);
    Ok(written)
}

/// Digests of what is wanted (nothing, or the objects as they would be applied).
fn digests(wanted: Option<&Desired>) -> Objects {
    fn digest<T: serde::Serialize>(object: &T) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        serde_json::to_vec(object)
            .unwrap_or_default()
            .hash(&mut hasher);
        hasher.finish()
    }
    let Some(wanted) = wanted else {
        return Objects::default();
    };
    Objects {
        service: Some(digest(&wanted.service)),
        slices: wanted
            .slices
            .iter()
            .map(|slice| (slice.name_any(), digest(slice)))
            .collect(),
    }
}

/// Applies the slices of `wanted` named in `names`, reading nothing: the Service and
/// the other slices are known to be as wanted. Returns how many it wrote.
async fn apply_slices(ctx: &Context, wanted: &Desired, names: &[String]) -> Result<u32> {
    let namespace = wanted.service.namespace().unwrap_or_default();
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &namespace);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut writes = 0;
    for slice in wanted
        .slices
        .iter()
        .filter(|s| names.contains(&s.name_any()))
    {
        slices
            .patch(&slice.name_any(), &params, &Patch::Apply(&typed(slice)))
            .await?;
        writes += 1;
    }
    ctx.metrics.service_writes(writes);
    Ok(writes)
}

/// Makes the objects of `wanted` exist as described, writing only what differs.
/// Returns how many objects it wrote or deleted; `None` when a Service of that name
/// exists that another owner controls, which is left alone (and logged).
///
/// The slices are listed only when the Service exists: a sync writes slices only after
/// their Service, and a withdrawal deletes them before it, so without a Service there
/// is no stale slice to delete, and a new owner's first sync reads the Service alone.
/// (A Service deleted by hand leaves its slices; those of the wanted names are
/// rewritten, and any other goes with the owner.)
pub async fn apply(ctx: &Context, wanted: &Desired) -> Result<Option<u32>> {
    let namespace = wanted.service.namespace().unwrap_or_default();
    let owner = controller_uid(&wanted.service.metadata).unwrap_or_default();
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &namespace);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let name = wanted.service.name_any();
    let mut writes = 0;

    let current = services.get_opt(&name).await?;
    if let Some(current) = &current
        && !is_owned_by(&owner, &current.metadata)
    {
        tracing::warn!(%namespace, service = %name,
            "a Service of this name exists and is not the operator's: leaving it alone");
        return Ok(None);
    }
    if current
        .as_ref()
        .is_none_or(|current| !service_matches(&wanted.service, current))
    {
        if let Some(current) = &current
            && port_view(current) != port_view(&wanted.service)
        {
            let ports = serde_json::json!({"spec": {"ports": wanted.service.spec.as_ref().and_then(|s| s.ports.clone())}});
            let merge = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_owned()),
                ..PatchParams::default()
            };
            services.patch(&name, &merge, &Patch::Merge(&ports)).await?;
            writes += 1;
        }
        services
            .patch(&name, &params, &Patch::Apply(&typed(&wanted.service)))
            .await?;
        writes += 1;
    }

    let listed = if current.is_some() {
        slices.list(&slices_of(&name)).await?.items
    } else {
        Vec::new()
    };
    for slice in &wanted.slices {
        let slice_name = slice.name_any();
        let existing = listed.iter().find(|s| s.name_any() == slice_name);
        if existing.is_none_or(|existing| !slice_matches(slice, existing)) {
            slices
                .patch(&slice_name, &params, &Patch::Apply(&typed(slice)))
                .await?;
            writes += 1;
        }
    }
    for stale in listed
        .iter()
        .filter(|s| !wanted.slices.iter().any(|w| w.name_any() == s.name_any()))
    {
        if is_owned_by(&owner, &stale.metadata) {
            delete(&slices, &stale.name_any()).await?;
            writes += 1;
        }
    }
    ctx.metrics.service_writes(writes);
    Ok(Some(writes))
}

/// Deletes the Service and EndpointSlices `proxy` owns. Returns how many it deleted.
pub async fn withdraw(ctx: &Context, proxy: &Proxy) -> Result<u32> {
    let namespace = proxy.namespace().unwrap_or_default();
    let owner = proxy.uid().unwrap_or_default();
    withdraw_owned(ctx, &namespace, &proxy.name_any(), &owner).await
}

/// Deletes Service `name` in `namespace` and its slices, those that `owner` (a UID)
/// controls. Returns how many it deleted.
pub async fn withdraw_owned(
    ctx: &Context,
    namespace: &str,
    name: &str,
    owner: &str,
) -> Result<u32> {
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), namespace);
    let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), namespace);
    let mut writes = 0;
    for slice in slices.list(&slices_of(name)).await?.items {
        if is_owned_by(owner, &slice.metadata) {
            delete(&slices, &slice.name_any()).await?;
            writes += 1;
        }
    }
    if let Some(service) = services.get_opt(name).await?
        && is_owned_by(owner, &service.metadata)
    {
        delete(&services, name).await?;
        writes += 1;
    }
    ctx.metrics.service_writes(writes);
    Ok(writes)
}

/// The UID of the controller `meta` names.
fn controller_uid(meta: &ObjectMeta) -> Option<String> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
}

/// Whether `meta` carries a controller reference to the object with UID `owner`.
fn is_owned_by(owner: &str, meta: &ObjectMeta) -> bool {
    controller_uid(meta).is_some_and(|uid| uid == owner)
}

async fn delete<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// `object` with its `apiVersion` and `kind`, as an apply needs them.
fn typed<K>(object: &K) -> serde_json::Value
where
    K: Resource<DynamicType = ()> + serde::Serialize,
{
    let mut value = serde_json::to_value(object).unwrap_or_default();
    value["apiVersion"] = K::api_version(&()).into();
    value["kind"] = K::kind(&()).into();
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ProxyAddress;
    use crate::k8s::status::set_condition;

    fn proxy(name: &str, service: serde_json::Value) -> Proxy {
        let mut spec = serde_json::json!({
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": 3128,
        });
        if !service.is_null() {
            spec["service"] = service;
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "namespace": "team", "uid": "u-1"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn status(ready: bool, addresses: &[&str]) -> ProxyStatus {
        let mut status = ProxyStatus {
            addresses: addresses
                .iter()
                .map(|a| ProxyAddress {
                    address: (*a).into(),
                    scope: "Internal".into(),
                    family: if a.contains(':') { "IPv6" } else { "IPv4" }.into(),
                })
                .collect(),
            ..ProxyStatus::default()
        };
        set_condition(&mut status.conditions, "Ready", ready, "x", "", None);
        status
    }

    fn endpoints(desired: &Desired) -> Vec<String> {
        desired
            .slices
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .flat_map(|e| e.addresses.clone())
            .collect()
    }

    /// A Proxy's name, its `spec.service`, its status, and the slice wanted: its name
    /// and endpoints (`None`: no Service at all).
    type Row = (
        &'static str,
        serde_json::Value,
        ProxyStatus,
        Option<(&'static str, Vec<&'static str>)>,
    );

    /// The same table as in `docs/operator.md` ("The Service").
    #[test]
    fn the_slice_lists_the_checked_address_only_while_ready() {
        let null = serde_json::Value::Null;
        let cases: [Row; 8] = [
            (
                "a",
                null.clone(),
                status(true, &["10.0.0.5", "10.0.0.6"]),
                Some(("a-ipv4", vec!["10.0.0.5"])),
            ),
            (
                "a",
                null.clone(),
                status(true, &["fd00::5", "10.0.0.5"]),
                Some(("a-ipv6", vec!["fd00::5"])),
            ),
            (
                "a",
                null.clone(),
                status(false, &["10.0.0.5"]),
                Some(("a-ipv4", vec![])),
            ),
            (
                "a",
                null.clone(),
                status(false, &[]),
                Some(("a-ipv4", vec![])),
            ),
            (
                "a",
                null.clone(),
                status(true, &["127.0.0.1"]),
                Some(("a-ipv4", vec![])),
            ),
            (
                "a",
                serde_json::json!({"enabled": false}),
                status(true, &["10.0.0.5"]),
                None,
            ),
            ("a.b", null.clone(), status(true, &["10.0.0.5"]), None),
            ("9a", null, status(true, &["10.0.0.5"]), None),
        ];
        for (i, (name, service, status, expected)) in cases.into_iter().enumerate() {
            let got = desired(&proxy(name, service), &status);
            let got = got.as_ref().map(|d| (d.slices[0].name_any(), endpoints(d)));
            let expected =
                expected.map(|(n, e)| (n.to_owned(), e.into_iter().map(str::to_owned).collect()));
            assert_eq!(got, expected, "case {i}");
        }
    }

    #[test]
    fn a_deleted_proxy_wants_nothing() {
        let mut p = proxy("a", serde_json::Value::Null);
        p.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::now(),
        ));
        assert!(desired(&p, &status(true, &["10.0.0.5"])).is_none());
    }

    #[test]
    fn the_service_takes_type_annotations_and_port_from_the_spec() {
        let p = proxy(
            "a",
            serde_json::json!({"type": "LoadBalancer", "annotations": {"x": "y"}}),
        );
        let d = desired(&p, &status(true, &["10.0.0.5"])).unwrap();
        assert_eq!(service_type(&d.service), "LoadBalancer");
        assert_eq!(
            port_view(&d.service),
            vec![(
                Some("proxy".into()),
                3128,
                Some(IntOrString::Int(3128)),
                "TCP".into()
            )]
        );
        assert_eq!(
            d.service.annotations().get("x").map(String::as_str),
            Some("y")
        );
        let owner = &d.service.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("Proxy", Some(true))
        );
    }

    #[test]
    fn what_others_add_is_no_drift_but_a_changed_port_or_annotation_is() {
        let p = proxy("a", serde_json::json!({"annotations": {"x": "y"}}));
        let wanted = desired(&p, &status(true, &["10.0.0.5"])).unwrap().service;
        let mut actual = wanted.clone();
        actual
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("other".into(), "v".into());
        actual
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("cloud".into(), "v".into());
        actual.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.10".into());
        assert!(service_matches(&wanted, &actual));

        let mut port = actual.clone();
        port.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 9999;
        assert!(!service_matches(&wanted, &port));
        let mut annotation = actual.clone();
        annotation
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("x".into(), "z".into());
        assert!(!service_matches(&wanted, &annotation));

        // An annotation the operator applied and no longer wants is drift.
        let mut applied = actual;
        applied.metadata.managed_fields = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
                manager: Some(FIELD_MANAGER.into()),
                operation: Some("Apply".into()),
                fields_v1: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1(
                    serde_json::json!({"f:metadata": {"f:annotations": {"f:x": {}, "f:cloud": {}}}}),
                )),
                ..Default::default()
            },
        ]);
        assert!(!service_matches(&wanted, &applied));
    }
}
