//! The MAC address of an instance's NIC, derived from its address identity.
//!
//! Guarantees:
//! - **Deterministic.** The same identity always gives the same MAC, on every host and
//!   across agent restarts, so a DHCP server that keys its reservations and leases by
//!   MAC (libvirt's dnsmasq) hands a replacement the address of the instance it
//!   replaces, and the agent can tell which reservation belongs to which identity
//!   without keeping anything in memory.
//! - **Locally administered unicast, under a prefix of the agent's own.** The first
//!   octet `0x76` has the locally-administered bit set and the multicast bit clear, so the
//!   MAC never collides with a vendor's (IEEE-assigned) address. The two-octet prefix
//!   `76:6b` is not QEMU's `52:54:00`, which libvirt gives every NIC without a MAC: a
//!   reservation someone made for a libvirt-generated MAC never looks like the agent's,
//!   and the reservation sweep only ever removes entries under [`IDENTITY_MAC_PREFIX`].
//! - **32 bits of SHA-256** of the identity follow the prefix. Two identities share a MAC
//!   with a chance of about n²/2³³ for n identities on one network (1 in 17,000 for 1,000
//!   identities); Create detects it and refuses the second identity, so two identities
//!   never share an address.

use sha2::{Digest, Sha256};

/// The first two octets of every MAC derived from an address identity.
pub const IDENTITY_MAC_PREFIX: [u8; 2] = [0x76, 0x6b];

/// The MAC (lowercase, colon-separated, as libvirt writes it) of `identity`'s NIC.
pub fn mac_for_identity(identity: &str) -> String {
    let digest = Sha256::digest(identity.as_bytes());
    let octets = [
        IDENTITY_MAC_PREFIX[0],
        IDENTITY_MAC_PREFIX[1],
        digest[0],
        digest[1],
        digest[2],
        digest[3],
    ];
    octets
        .iter()
        .map(|o| format!("{o:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The MAC of the NIC of an instance on a bridge with static addresses: its identity's,
/// or, without one, one derived from its key the same way (as `key:<key>`, which no
/// identity can be: identities have no `:`). The seed's `network-config` matches the NIC
/// by it, so it must be known before the domain exists.
pub fn static_nic_mac(identity: Option<&str>, key: &str) -> String {
    match identity {
        Some(identity) => mac_for_identity(identity),
        None => mac_for_identity(&format!("key:{key}")),
    }
}

/// Whether `mac` (any case) is one the agent derived from an identity.
pub fn is_identity_mac(mac: &str) -> bool {
    let prefix = format!(
        "{:02x}:{:02x}:",
        IDENTITY_MAC_PREFIX[0], IDENTITY_MAC_PREFIX[1]
    );
    mac.len() == 17 && mac.to_ascii_lowercase().starts_with(&prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mac_is_stable_locally_administered_unicast_and_marked_as_the_agents() {
        let mac = mac_for_identity("0b6f3c1e-proxy-uid");
        assert_eq!(mac, mac_for_identity("0b6f3c1e-proxy-uid"));
        assert_ne!(mac, mac_for_identity("0b6f3c1e-proxy-uie"));
        let first = u8::from_str_radix(&mac[..2], 16).unwrap();
        assert_eq!(first & 0b10, 0b10, "locally administered: {mac}");
        assert_eq!(first & 0b01, 0, "unicast: {mac}");
        assert!(is_identity_mac(&mac), "{mac}");
        assert!(is_identity_mac(&mac.to_ascii_uppercase()), "{mac}");
        assert!(!is_identity_mac("52:54:00:12:34:56"));
        assert_eq!(mac.len(), 17);
        // A fixed value: changing the derivation would move every identity's address.
        assert_eq!(mac_for_identity("a"), "76:6b:ca:97:81:12");
        assert_eq!(static_nic_mac(Some("a"), "k"), mac_for_identity("a"));
        assert_eq!(static_nic_mac(None, "a"), mac_for_identity("key:a"));
        assert_ne!(static_nic_mac(None, "a"), static_nic_mac(None, "b"));
    }
}
