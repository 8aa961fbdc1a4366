//! Names of everything the agent creates, derived from the instance key.
//!
//! Guarantees:
//! - **Deterministic.** The same key always gives the same domain and volume names, so a
//!   retried Create finds what an earlier attempt made.
//! - **Collision-free.** The key (1-128 characters of `[A-Za-z0-9._-]`, checked by the
//!   contract's validation and again here) is used verbatim after a fixed prefix, so two
//!   keys never share a name; each kind of object has its own suffix (`.root.qcow2`,
//!   `.seed.iso`) and base images their own prefix with a hex digest, so no instance's
//!   volume can take a base image's name or another kind's.
//! - **Safe for libvirt and file names.** Only `[A-Za-z0-9._-]` after an alphabetic
//!   prefix: no `/`, no leading `.` or `-`, nothing XML or a shell would interpret, at
//!   most 155 bytes (file names may have 255).
//!
//! The instance id returned to callers is `<host>/<key>`: the host is needed to find the
//! domain, and a key never contains `/`.

use std::fmt;

use egressproxy_provider::validation::MAX_KEY_LEN;

/// Prefix of every domain and instance volume the agent creates.
pub(crate) const INSTANCE_PREFIX: &str = "egressproxy-";
/// Prefix of base image volumes (followed by the image's SHA-256 in hex).
pub const BASE_PREFIX: &str = "egressproxy-base-";

/// The libvirt names of one instance's domain and volumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceNames {
    /// The libvirt domain.
    pub domain: String,
    /// The qcow2 overlay that is the VM's root disk.
    pub overlay_volume: String,
    /// The NoCloud seed ISO.
    pub seed_volume: String,
}

/// Why a key cannot name an instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("key must be 1 to {MAX_KEY_LEN} characters of [A-Za-z0-9._-]")]
pub struct InvalidKey;

/// Whether `key` is a valid instance key (the contract's rule).
pub(crate) fn is_valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl InstanceNames {
    /// The names for instance `key`.
    pub fn for_key(key: &str) -> Result<Self, InvalidKey> {
        if !is_valid_key(key) {
            return Err(InvalidKey);
        }
        let domain = format!("{INSTANCE_PREFIX}{key}");
        Ok(Self {
            overlay_volume: format!("{domain}.root.qcow2"),
            seed_volume: format!("{domain}.seed.iso"),
            domain,
        })
    }

    /// The key a domain name was derived from, if it is one of the agent's domains.
    pub(crate) fn key_of_domain(domain: &str) -> Option<&str> {
        domain
            .strip_prefix(INSTANCE_PREFIX)
            .filter(|key| is_valid_key(key))
    }
}

/// The guest's hostname for instance `key`: a valid DNS label (lowercase letters,
/// digits and `-`, at most 63 characters). Not unique (case and punctuation fold, long
/// keys are cut), which is fine for a hostname.
pub(crate) fn hostname_for_key(key: &str) -> String {
    let mut name: String = format!("{INSTANCE_PREFIX}{key}")
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .take(63)
        .collect();
    while name.ends_with('-') {
        name.pop();
    }
    name
}

/// The base volume of an image whose content has SHA-256 `sha256_hex` (lowercase hex).
///
/// Named by content, so a changed URL or checksum fetches a new base beside the old one
/// instead of overwriting the backing file of running VMs.
pub fn base_volume(sha256_hex: &str) -> Result<String, InvalidDigest> {
    if sha256_hex.len() != 64
        || !sha256_hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(InvalidDigest);
    }
    Ok(format!("{BASE_PREFIX}{sha256_hex}.img"))
}

/// A digest that is not 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a SHA-256 digest must be 64 lowercase hexadecimal digits")]
pub struct InvalidDigest;

/// A name for a transient KVM probe domain that no concurrent probe (another agent,
/// another replica, the host check beside a Create) shares: the process id and the
/// clock's nanoseconds.
pub(crate) fn probe_domain_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("egressproxy-probe-{}-{nanos}", std::process::id())
}

/// The provider id of an instance: the host it runs on and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstanceId {
    /// The host's name in the configuration.
    pub host: String,
    /// The instance key.
    pub key: String,
}

impl InstanceId {
    /// Parses `<host>/<key>`; the key is what follows the last `/`.
    pub(crate) fn parse(id: &str) -> Option<Self> {
        let (host, key) = id.rsplit_once('/')?;
        (!host.is_empty() && is_valid_key(key)).then(|| Self {
            host: host.to_owned(),
            key: key.to_owned(),
        })
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.host, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_deterministic_and_keep_the_key() {
        let names = InstanceNames::for_key("4f1c2d3e-uid-0").unwrap();
        assert_eq!(names, InstanceNames::for_key("4f1c2d3e-uid-0").unwrap());
        assert_eq!(names.domain, "egressproxy-4f1c2d3e-uid-0");
        assert_eq!(
            names.overlay_volume,
            "egressproxy-4f1c2d3e-uid-0.root.qcow2"
        );
        assert_eq!(names.seed_volume, "egressproxy-4f1c2d3e-uid-0.seed.iso");
        assert_eq!(
            InstanceNames::key_of_domain(&names.domain),
            Some("4f1c2d3e-uid-0")
        );
    }

    #[test]
    fn keys_that_differ_only_in_case_or_punctuation_get_different_names() {
        let keys = ["a", "A", "a.", "a-", "a_", "..", ".a", "a.root", "a.seed"];
        let mut seen = std::collections::BTreeSet::new();
        for key in keys {
            let n = InstanceNames::for_key(key).unwrap();
            for name in [n.domain, n.overlay_volume, n.seed_volume] {
                assert!(seen.insert(name.clone()), "{name} produced twice");
            }
        }
    }

    #[test]
    fn names_are_safe_for_files_and_libvirt() {
        let longest = "k".repeat(MAX_KEY_LEN);
        for key in [".", "..", "-x", longest.as_str()] {
            let n = InstanceNames::for_key(key).unwrap();
            for name in [&n.domain, &n.overlay_volume, &n.seed_volume] {
                assert!(name.len() <= 155, "{name}");
                assert!(name.starts_with(INSTANCE_PREFIX), "{name}");
                assert!(
                    name.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn invalid_keys_are_refused() {
        let too_long = "k".repeat(MAX_KEY_LEN + 1);
        for key in ["", "a/b", "a b", "a<b", "ü", "a\n", too_long.as_str()] {
            assert_eq!(InstanceNames::for_key(key), Err(InvalidKey), "{key:?}");
        }
    }

    #[test]
    fn base_volumes_are_named_by_digest_and_never_collide_with_instance_volumes() {
        let digest = "ab".repeat(32);
        let base = base_volume(&digest).unwrap();
        assert_eq!(base, format!("egressproxy-base-{digest}.img"));
        let lookalike = InstanceNames::for_key(&format!("base-{digest}")).unwrap();
        assert_ne!(lookalike.overlay_volume, base);
        assert_ne!(lookalike.seed_volume, base);
        assert_eq!(base_volume("AB"), Err(InvalidDigest));
        assert_eq!(base_volume(&"AB".repeat(32)), Err(InvalidDigest));
    }

    #[test]
    fn hostnames_are_dns_labels() {
        assert_eq!(hostname_for_key("UID_1.a"), "egressproxy-uid-1-a");
        assert_eq!(hostname_for_key("a-"), "egressproxy-a");
        let long = hostname_for_key(&"k".repeat(MAX_KEY_LEN));
        assert_eq!(long.len(), 63);
        for key in ["..", "-", "A.B_C", &"x-".repeat(64)] {
            let h = hostname_for_key(key);
            assert!(h.len() <= 63 && !h.ends_with('-'), "{h}");
            assert!(
                h.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{h}"
            );
        }
    }

    #[test]
    fn foreign_domains_have_no_key() {
        assert_eq!(InstanceNames::key_of_domain("debian"), None);
        assert_eq!(InstanceNames::key_of_domain("egressproxy-"), None);
        assert_eq!(InstanceNames::key_of_domain("egressproxy-a b"), None);
    }

    #[test]
    fn instance_ids_round_trip_with_any_host_name() {
        for host in ["hv1", "rack/hv 2", "h"] {
            let id = InstanceId {
                host: host.into(),
                key: "uid-1".into(),
            };
            assert_eq!(InstanceId::parse(&id.to_string()), Some(id));
        }
        assert_eq!(InstanceId::parse("no-slash"), None);
        assert_eq!(InstanceId::parse("/key"), None);
        assert_eq!(InstanceId::parse("hv1/"), None);
        assert_eq!(InstanceId::parse("hv1/bad key"), None);
    }
}
