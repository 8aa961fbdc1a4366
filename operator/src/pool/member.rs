//! A pool's members: the Proxies it makes from its template, and how it tells them
//! apart.
//!
//! A member is named `POOL-N` (the lowest free N), so a create retried after a lost
//! answer finds the member it made instead of adding another. It carries the pool's
//! label (what the pool lists), the hash of the template it was made from (what tells
//! an outdated member), the template's labels and annotations, and a controller owner
//! reference to the pool, through which Kubernetes deletes it with the pool. Its spec
//! is the template's, with the spread target's host or zone in its placement.

use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use super::plan::Member;
use super::spread::Spread;
use crate::crd::{
    ADOPT_INSTANCE_ANNOTATION, Proxy, ProxyPool, ProxyService, SpreadTarget, condition,
};
use crate::endpoints::service::{checked_address, controller_reference};
use crate::k8s::status::is_true;

/// The label naming the pool a member (or the pool's Service) belongs to.
pub const POOL_LABEL: &str = "egressproxy.dev/pool";
/// The label holding the hash of the template a member was made from.
pub const TEMPLATE_HASH_LABEL: &str = "egressproxy.dev/template-hash";

/// The hash of `pool`'s template: 10 hex digits of its SHA-256.
pub fn template_hash(pool: &ProxyPool) -> String {
    let text = serde_json::to_string(&pool.spec.template).unwrap_or_default();
    let digest = Sha256::digest(text.as_bytes());
    digest[..5].iter().map(|b| format!("{b:02x}")).collect()
}

/// The label selector of `pool`'s members.
pub fn selector(pool: &ProxyPool) -> String {
    format!("{POOL_LABEL}={}", pool.name_any())
}

/// The name of member `index` of `pool`.
pub fn member_name(pool: &ProxyPool, index: u32) -> String {
    format!("{}-{index}", pool.name_any())
}

/// Whether `proxy` is a member of `pool` (the pool controls it).
pub fn is_member(pool: &ProxyPool, proxy: &Proxy) -> bool {
    let uid = pool.uid();
    proxy
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
}

/// Member `index` of `pool`, at spread target `target`, adopting spare `adopt` if set
/// (the annotation is its intent, written before any provider call: module doc of
/// `spares`).
pub fn new_member(
    pool: &ProxyPool,
    index: u32,
    target: Option<&SpreadTarget>,
    adopt: Option<&str>,
) -> Option<Proxy> {
    let template = &pool.spec.template;
    let mut labels = template.metadata.labels.clone();
    labels.insert(POOL_LABEL.to_owned(), pool.name_any());
    labels.insert(TEMPLATE_HASH_LABEL.to_owned(), template_hash(pool));
    let mut spec = template.spec.clone();
    // Workloads use the pool's Service; a member keeps one of its own only when the
    // template asks (its name could otherwise take the name another pool needs).
    if spec.service.is_none() {
        spec.service = Some(ProxyService {
            enabled: false,
            ..ProxyService::default()
        });
    }
    if let Some(to) = target {
        spec.placement.host = to.host.clone();
        spec.placement.zone = to.zone.clone();
    }
    let mut annotations = template.metadata.annotations.clone();
    if let Some(id) = adopt {
        annotations.insert(ADOPT_INSTANCE_ANNOTATION.to_owned(), id.to_owned());
    }
    let mut proxy = Proxy::new(&member_name(pool, index), spec);
    proxy.metadata = ObjectMeta {
        name: Some(member_name(pool, index)),
        namespace: pool.namespace(),
        labels: Some(labels),
        annotations: Some(annotations).filter(|a| !a.is_empty()),
        owner_references: Some(vec![controller_reference(pool)?]),
        ..ObjectMeta::default()
    };
    Some(proxy)
}

/// Which of `targets` `proxy`'s placement is at.
fn target_of(targets: &[SpreadTarget], proxy: &Proxy) -> Option<usize> {
    let placement = &proxy.spec.placement;
    targets.iter().position(|t| match (&t.host, &t.zone) {
        (Some(host), _) => placement.host.as_ref() == Some(host),
        (None, Some(zone)) => placement.zone.as_ref() == Some(zone),
        (None, None) => false,
    })
}

/// `proxy` as the plan sees it, given `pool`'s current template hash `hash` and this
/// pass's `spread`.
pub fn view(pool: &ProxyPool, hash: &str, spread: &Spread, proxy: &Proxy) -> Member {
    let name = proxy.name_any();
    let prefix = format!("{}-", pool.name_any());
    let index = name
        .strip_prefix(&prefix)
        .and_then(|n| n.parse().ok())
        .unwrap_or(u32::MAX);
    let target = target_of(&spread.targets, proxy);
    let made_from_this_template =
        proxy.labels().get(TEMPLATE_HASH_LABEL).map(String::as_str) == Some(hash);
    Member {
        name,
        index,
        // Members at a location the provider stopped listing stay (module doc of
        // `spread`); a fixed list that no longer names a member's place moves it.
        updated: made_from_this_template
            && (spread.from_provider || spread.targets.is_empty() || target.is_some()),
        ready: is_ready(proxy),
        replacing: is_replacing(proxy),
        deleting: proxy.metadata.deletion_timestamp.is_some(),
        target,
    }
}

/// The spare `proxy` was told to adopt and has not yet settled (it records no
/// instance key yet): promised to it, so no other member is told the same.
pub fn promised_spare(proxy: &Proxy) -> Option<&str> {
    let settled = proxy
        .status
        .as_ref()
        .is_some_and(|s| s.instance_key.is_some() || s.provider_id.is_some());
    if settled || proxy.metadata.deletion_timestamp.is_some() {
        return None;
    }
    proxy
        .annotations()
        .get(ADOPT_INSTANCE_ANNOTATION)
        .map(String::as_str)
}

/// Whether `proxy` is replacing a VM it lost: it is not Ready, it gave up a VM
/// (`status.replacements`), and its current VM, if any, has never passed a health
/// check (the Healthy condition goes with each lost VM). From the moment the Proxy
/// forgets the lost VM until its successor first answers, through the Proxy's own
/// status, so the pool's watch of members sees it without a timer. A member booting
/// its first VM (no replacement yet), or Degraded (its VM answered once), is not.
pub fn is_replacing(proxy: &Proxy) -> bool {
    let Some(status) = proxy.status.as_ref() else {
        return false;
    };
    let answered_once = status
        .conditions
        .iter()
        .any(|c| c.type_ == condition::HEALTHY);
    !is_ready(proxy) && status.replacements > 0 && !answered_once
}

/// Whether `proxy` is Ready (it proxies now).
pub fn is_ready(proxy: &Proxy) -> bool {
    proxy
        .status
        .as_ref()
        .is_some_and(|s| is_true(&s.conditions, condition::READY))
}

/// The address traffic goes to while `proxy` is Ready.
pub fn serving_address(proxy: &Proxy) -> Option<IpAddr> {
    if !is_ready(proxy) || proxy.metadata.deletion_timestamp.is_some() {
        return None;
    }
    proxy.status.as_ref().and_then(checked_address)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(spread: serde_json::Value) -> ProxyPool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": "egress", "namespace": "team", "uid": "pool-uid"},
            "spec": {
                "replicas": 2,
                "spread": spread,
                "template": {
                    "metadata": {"labels": {"team": "a"}},
                    "spec": {
                        "provider": "reference",
                        "placement": {"machineType": "small", "image": "debian-12", "zone": "z0"},
                    },
                },
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_member_takes_the_template_the_pool_s_labels_and_its_spread_target() {
        let pool = pool(serde_json::json!([{"host": "h1"}, {"zone": "z2"}]));
        let member = new_member(&pool, 3, pool.spec.spread.get(1), None).unwrap();
        assert_eq!(member.name_any(), "egress-3");
        assert_eq!(member.spec.placement.zone.as_deref(), Some("z2"));
        assert_eq!(member.spec.placement.host, None);
        assert_eq!(member.labels()["team"], "a");
        assert_eq!(member.labels()[POOL_LABEL], "egress");
        assert!(is_member(&pool, &member));
        assert_eq!(
            member.spec.service.as_ref().map(|s| s.enabled),
            Some(false),
            "a member has no Service of its own unless the template asks"
        );

        let hash = template_hash(&pool);
        let seen = view(&pool, &hash, &fixed(&pool), &member);
        assert_eq!((seen.index, seen.target, seen.updated), (3, Some(1), true));

        let mut changed = pool.clone();
        changed.spec.template.spec.proxy_port = 8080;
        assert_ne!(template_hash(&changed), hash);
        assert!(
            !view(
                &changed,
                &template_hash(&changed),
                &fixed(&changed),
                &member
            )
            .updated
        );

        // The hash of a template is fixed: a change in how templates serialise would
        // roll every member of every pool, so it must be a deliberate one.
        assert_eq!(hash, "3d190a7e3a");

        // A spread target removed from the list makes its members outdated.
        let mut narrowed = pool.clone();
        narrowed.spec.spread.truncate(1);
        assert!(!view(&narrowed, &hash, &fixed(&narrowed), &member).updated);
    }

    fn fixed(pool: &ProxyPool) -> Spread {
        Spread {
            targets: pool.spec.spread.clone(),
            ..Spread::default()
        }
    }

    #[test]
    fn only_a_member_that_lost_its_vm_and_has_not_answered_since_is_replacing() {
        use crate::crd::ProxyStatus;
        use crate::k8s::status::set_condition;
        let pool = pool(serde_json::json!([]));
        let with = |replacements: u32, conditions: &[(&str, bool)]| {
            let mut proxy = new_member(&pool, 0, None, None).unwrap();
            let mut status = ProxyStatus {
                replacements,
                ..ProxyStatus::default()
            };
            for (type_, value) in conditions {
                set_condition(&mut status.conditions, type_, *value, "x", "", None);
            }
            proxy.status = Some(status);
            proxy
        };
        let rows = [
            (
                "booting its first VM",
                with(0, &[(condition::READY, false)]),
                false,
            ),
            (
                "its VM vanished: forgotten, the next not created yet",
                with(1, &[(condition::READY, false)]),
                true,
            ),
            (
                "Degraded: its VM answered once, not replaced",
                with(0, &[(condition::READY, false), (condition::HEALTHY, false)]),
                false,
            ),
            (
                "Degraded after an earlier replacement",
                with(1, &[(condition::READY, false), (condition::HEALTHY, false)]),
                false,
            ),
            (
                "Ready again after a replacement",
                with(1, &[(condition::READY, true), (condition::HEALTHY, true)]),
                false,
            ),
        ];
        for (what, proxy, replacing) in rows {
            assert_eq!(is_replacing(&proxy), replacing, "{what}");
        }
        let mut no_status = new_member(&pool, 0, None, None).unwrap();
        no_status.status = None;
        assert!(!is_replacing(&no_status), "a new member");
    }

    #[test]
    fn a_member_at_a_location_the_provider_stopped_listing_stays_up_to_date() {
        let pool = pool(serde_json::json!([]));
        let at = |host: &str| SpreadTarget {
            host: Some(host.to_owned()),
            zone: None,
        };
        let member = new_member(&pool, 0, Some(&at("h1")), Some("spare-1")).unwrap();
        assert_eq!(member.spec.placement.host.as_deref(), Some("h1"));
        assert_eq!(member.annotations()[ADOPT_INSTANCE_ANNOTATION], "spare-1");
        let hash = template_hash(&pool);
        let listed = Spread {
            targets: vec![at("h0"), at("h1")],
            from_provider: true,
            unavailable: None,
        };
        let seen = view(&pool, &hash, &listed, &member);
        assert_eq!((seen.target, seen.updated), (Some(1), true));

        let h1_full = Spread {
            targets: vec![at("h0")],
            ..listed
        };
        let seen = view(&pool, &hash, &h1_full, &member);
        assert_eq!((seen.target, seen.updated), (None, true));
    }
}
