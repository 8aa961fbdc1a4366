//! Addresses from a bridge host's static block (`hosts[].staticAddresses`), with the
//! domains' own metadata as the allocation table.
//!
//! Where the table lives: each of the agent's domains on the host records the address
//! it was given
//! ([`crate::libvirt::xml::metadata::InstanceMetadata::static_address`]), written in
//! the same `virDomainDefineXML` that makes the domain. There is no other record, so
//! ListInstances (the domains) and the allocations cannot disagree: an address is held
//! exactly while a domain records it, a crash before the define leaves nothing held, one after it leaves
//! a domain that holds it (and that a retried Create of the key finds and keeps), and a
//! Delete's undefine releases it in the same call. A restarted agent reads the table
//! back with [`held_addresses`].
//!
//! Guarantees, with the caller holding the host's allocation lock from
//! [`held_addresses`] until the domain is defined (the provider does):
//! 1. **Two instances never share an address**: the choice ([`choose_static_address`])
//!    skips every address a domain holds, and no other Create of the agent on the host
//!    chooses before this one's domain exists.
//! 2. **Nothing unseen is handed out**: when a domain of the agent cannot be read, the
//!    table is unknown and [`held_addresses`] fails (transient) rather than risk handing
//!    out that domain's address.
//! 3. **An identity is one instance at a time**: a domain of another key that holds the
//!    identity refuses the choice (`IdentityInUse`, as the identity check before the
//!    lock does), so two Creates that raced past that check never share an address.
//! 4. **An identity gets its address back**: an identity's domain keeps its address; an
//!    identity with no domain left searches from a place derived from the identity, so its
//!    next instance gets the address it had while no one else took it (or, as with the
//!    DHCP reservations, an earlier free one its first search skipped).
//! 5. **A requested address** is granted when it is in the range and no domain holds it;
//!    otherwise the outcome says why ([`StaticChoice`]).

use std::net::IpAddr;

use sha2::{Digest, Sha256};
use virt::connect::Connect;

use crate::config::StaticAddresses;
use crate::libvirt::domains::agent_metadata;
use crate::libvirt::error::LibvirtError;
use crate::transport::call::CallFailure;

/// An address a domain of the agent holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldAddress {
    /// The address.
    pub address: IpAddr,
    /// The key of the instance that holds it.
    pub key: String,
    /// That instance's address identity.
    pub identity: Option<String>,
}

/// What a Create gets from the block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StaticChoice {
    /// This address.
    Granted(IpAddr),
    /// The requested address is outside the block.
    NotInRange,
    /// The requested address is held by the instance with this key.
    Taken {
        /// The holder's key.
        holder: String,
    },
    /// Every address of the block is held.
    Exhausted,
    /// An instance of another key holds the identity (and its address): a Create that
    /// passed the identity check before taking the allocation lock raced another.
    IdentityInUse {
        /// The holder's key.
        holder: String,
    },
}

/// The address for a new instance with `identity` (and `requested`, if asked), given
/// what is `held`. See the module docs.
pub fn choose_static_address(
    block: &StaticAddresses,
    held: &[HeldAddress],
    identity: Option<&str>,
    requested: Option<IpAddr>,
    key: &str,
) -> StaticChoice {
    if let Some(identity) = identity
        && let Some(other) = held
            .iter()
            .find(|h| h.identity.as_deref() == Some(identity) && h.key != key)
    {
        return StaticChoice::IdentityInUse {
            holder: other.key.clone(),
        };
    }
    if let Some(requested) = requested {
        if !block.contains(requested) {
            return StaticChoice::NotInRange;
        }
        return match held.iter().find(|h| h.address == requested) {
            Some(holder) if holder.identity.as_deref() != identity || identity.is_none() => {
                StaticChoice::Taken {
                    holder: holder.key.clone(),
                }
            }
            _ => StaticChoice::Granted(requested),
        };
    }
    if let Some(identity) = identity
        && let Some(own) = held
            .iter()
            .find(|h| h.identity.as_deref() == Some(identity) && block.contains(h.address))
    {
        return StaticChoice::Granted(own.address);
    }
    let size = block.size();
    if size == 0 {
        return StaticChoice::Exhausted;
    }
    let seed = identity.map_or_else(|| format!("key:{key}"), str::to_owned);
    let digest = Sha256::digest(seed.as_bytes());
    let start = u128::from(u64::from_be_bytes(
        digest[..8].try_into().expect("a SHA-256 has 32 bytes"),
    )) % size;
    (0..size)
        .filter_map(|i| block.nth((start + i) % size))
        .find(|candidate| held.iter().all(|h| h.address != *candidate))
        .map_or(StaticChoice::Exhausted, StaticChoice::Granted)
}

/// Every address a domain of the agent on this host holds. Fails when a domain of the
/// agent cannot be read now: the table would be incomplete.
pub fn held_addresses(conn: &Connect) -> Result<Vec<HeldAddress>, CallFailure<LibvirtError>> {
    let Some(all) = agent_metadata(conn)? else {
        return Err(CallFailure::Agent(LibvirtError::AllocationTableUnreadable));
    };
    Ok(all
        .into_iter()
        .filter_map(|m| {
            Some(HeldAddress {
                address: m.static_address?,
                key: m.key,
                identity: m.address_identity,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(first: &str, last: &str) -> StaticAddresses {
        StaticAddresses {
            first: first.parse().unwrap(),
            last: last.parse().unwrap(),
            prefix_length: 24,
            gateway: None,
            dns: vec![],
        }
    }

    fn held(address: &str, key: &str, identity: Option<&str>) -> HeldAddress {
        HeldAddress {
            address: address.parse().unwrap(),
            key: key.into(),
            identity: identity.map(str::to_owned),
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_choice_keeps_identities_apart_and_honours_requests() {
        let range = block("192.0.2.10", "192.0.2.13");
        let first = choose_static_address(&range, &[], Some("id-a"), None, "k1");
        let StaticChoice::Granted(a) = first else {
            panic!("{first:?}")
        };
        assert!(range.contains(a));
        // The same identity with nothing held starts at the same place: the same address.
        assert_eq!(
            choose_static_address(&range, &[], Some("id-a"), None, "k2"),
            first
        );
        // A domain of this key (a Create retried) holds one: that one.
        let own = [held("192.0.2.13", "k1", Some("id-a"))];
        assert_eq!(
            choose_static_address(&range, &own, Some("id-a"), None, "k1"),
            StaticChoice::Granted(ip("192.0.2.13"))
        );
        // A domain of another key holds the identity: two Creates raced past the
        // identity check, and the second must not share the first one's address.
        assert_eq!(
            choose_static_address(&range, &own, Some("id-a"), None, "k2"),
            StaticChoice::IdentityInUse {
                holder: "k1".into()
            }
        );
        assert_eq!(
            choose_static_address(&range, &own, Some("id-a"), Some(ip("192.0.2.13")), "k2"),
            StaticChoice::IdentityInUse {
                holder: "k1".into()
            }
        );
        // Another identity never gets a held address.
        let mut all: Vec<HeldAddress> = Vec::new();
        for (i, identity) in ["a", "b", "c", "d"].iter().enumerate() {
            let StaticChoice::Granted(got) =
                choose_static_address(&range, &all, Some(identity), None, &format!("k{i}"))
            else {
                panic!("{identity}")
            };
            assert!(all.iter().all(|h| h.address != got), "{got} given twice");
            all.push(held(&got.to_string(), &format!("k{i}"), Some(identity)));
        }
        assert_eq!(
            choose_static_address(&range, &all, Some("e"), None, "k9"),
            StaticChoice::Exhausted
        );
        assert_eq!(
            choose_static_address(&range, &all, None, None, "k9"),
            StaticChoice::Exhausted
        );
        // Requests: in range and free, outside, held by another.
        let one = [held("192.0.2.11", "k1", Some("id-a"))];
        let cases = [
            (ip("192.0.2.12"), StaticChoice::Granted(ip("192.0.2.12"))),
            (ip("192.0.2.14"), StaticChoice::NotInRange),
            (ip("2001:db8::1"), StaticChoice::NotInRange),
            (
                ip("192.0.2.11"),
                StaticChoice::Taken {
                    holder: "k1".into(),
                },
            ),
        ];
        for (requested, want) in cases {
            assert_eq!(
                choose_static_address(&range, &one, Some("id-b"), Some(requested), "k2"),
                want,
                "{requested}"
            );
        }
        // The identity's own address, asked for again by its own key, is its own.
        assert_eq!(
            choose_static_address(&range, &one, Some("id-a"), Some(ip("192.0.2.11")), "k1"),
            StaticChoice::Granted(ip("192.0.2.11"))
        );
    }
}
