//! What a proxy pod records about its instance, so that the cluster alone holds the
//! provider's state and a restarted provider finds every instance as it was.
//!
//! 1. **Name from key.** The pod's name is derived from the idempotency key
//!    ([`pod_name`]), so the apiserver's name uniqueness makes Create idempotent, also
//!    between racing Creates and across restarts: the loser of a race gets
//!    `AlreadyExists` and reads the winner's pod. The name is the instance id.
//! 2. **Ownership by label.** [`MANAGED_BY_LABEL`] marks the pods this provider made;
//!    nothing without it is listed, read or deleted.
//! 3. **The rest in annotations.** Key, name, tags and the placement as requested are
//!    annotations ([`Recorded`]): tag keys and values may hold any character up to
//!    256 bytes, which label syntax does not allow. Cloud-init is never recorded: this
//!    provider refuses it (see `request`).

use std::collections::BTreeMap;

use egressproxy_provider::pb::{self, placement::Location};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The label on every pod this provider made, with [`MANAGED_BY`] as its value.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// The provider's name, as GetPluginInfo reports it and the managed-by label holds.
pub const MANAGED_BY: &str = "kube.egressproxy.dev";
/// The annotation holding [`Recorded`] as JSON.
pub const RECORD_ANNOTATION: &str = "kube.egressproxy.dev/instance";
/// Prefix of every pod name; the rest is a digest of the key.
const POD_NAME_PREFIX: &str = "egress-proxy-";
/// Hex digits of the key's digest in a pod name (160 bits: no collision in practice).
const KEY_DIGEST_HEX: usize = 40;

/// The pod name (and instance id) of an idempotency key. Keys may hold upper case and
/// `_`, which pod names may not, so the name is a digest, not the key itself.
pub fn pod_name(key: &str) -> String {
    let digest = hex::encode(Sha256::digest(key.as_bytes()));
    format!("{POD_NAME_PREFIX}{}", &digest[..KEY_DIGEST_HEX])
}

/// Whether `id` can be a pod name this provider made (anything else names no instance).
pub fn is_instance_id(id: &str) -> bool {
    id.strip_prefix(POD_NAME_PREFIX).is_some_and(|digest| {
        digest.len() == KEY_DIGEST_HEX
            && digest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The instance's facts that a pod spec does not hold, as the annotation stores them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recorded {
    /// The idempotency key.
    pub key: String,
    /// The human name.
    #[serde(default)]
    pub name: String,
    /// The tags, exactly.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// The placement as requested: what a repeated Create is compared with.
    pub requested: RequestedPlacement,
    /// The proxy port.
    pub proxy_port: u32,
}

/// A placement as requested, in a form JSON keeps (the generated type has no serde).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestedPlacement {
    /// The node asked for, if one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The zone asked for, if one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// The machine type.
    pub machine_type: String,
    /// The image.
    pub image: String,
}

impl RequestedPlacement {
    /// From the request's placement.
    pub fn from_pb(placement: &pb::Placement) -> Self {
        let (host, zone) = match &placement.location {
            Some(Location::Host(host)) => (Some(host.clone()), None),
            Some(Location::Zone(zone)) => (None, Some(zone.clone())),
            None => (None, None),
        };
        RequestedPlacement {
            host,
            zone,
            machine_type: placement.machine_type.clone(),
            image: placement.image.clone(),
        }
    }

    /// As the contract echoes it: the requested location, or the node chosen when none
    /// was requested.
    pub fn echo(&self, chosen_node: Option<&str>) -> pb::Placement {
        let location = match (&self.host, &self.zone) {
            (Some(host), _) => Some(Location::Host(host.clone())),
            (None, Some(zone)) => Some(Location::Zone(zone.clone())),
            (None, None) => chosen_node.map(|node| Location::Host(node.to_owned())),
        };
        pb::Placement {
            location,
            machine_type: self.machine_type.clone(),
            image: self.image.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_names_are_valid_ids_and_differ_by_key() {
        let a = pod_name("uid-0");
        assert!(is_instance_id(&a), "{a}");
        assert!(a.len() <= 63, "a pod name must be a DNS label: {a}");
        assert_ne!(a, pod_name("uid-1"));
        assert_eq!(a, pod_name("uid-0"));
    }

    #[test]
    fn other_names_are_not_ids() {
        for id in ["", "egress-proxy-", "web", &format!("{}0", pod_name("k"))] {
            assert!(!is_instance_id(id), "{id}");
        }
        assert!(!is_instance_id(&pod_name("k").to_uppercase()));
    }

    #[test]
    fn a_placement_left_to_the_provider_echoes_the_chosen_node() {
        let requested = RequestedPlacement::from_pb(&pb::Placement {
            location: None,
            machine_type: "small".into(),
            image: "squid".into(),
        });
        assert_eq!(
            requested.echo(Some("node-a")).location,
            Some(Location::Host("node-a".into()))
        );
        let zoned = RequestedPlacement {
            zone: Some("z1".into()),
            ..requested
        };
        assert_eq!(
            zoned.echo(Some("node-a")).location,
            Some(Location::Zone("z1".into()))
        );
    }
}
