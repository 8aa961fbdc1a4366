//! DHCP host reservations on a libvirt network for address identities, as blocking
//! functions of one connection.
//!
//! Where the identity → address mapping lives: in libvirt, never in the agent's memory.
//! The domain's metadata names its identity ([`crate::libvirt::xml::metadata::InstanceMetadata::address_identity`]), its
//! NIC has the identity's MAC ([`mac_for_identity`]), and the network's `<host mac ip/>`
//! list maps that MAC to the address. An agent that restarts reads all three back.
//!
//! Guarantees, with Create's order (domain defined, then [`reserve`], then started):
//! 1. **A reservation never outlives every domain of its identity for long.** It is made
//!    only once the identity's domain exists, and [`sweep`] removes every reservation
//!    under the agent's MAC prefix whose MAC no domain of the agent has. [`sweep`] reads
//!    the host list *before* it lists the domains, so a reservation that a concurrent
//!    Create (of this agent or another on the same hypervisor) has made always has its
//!    domain in the listing: the sweep never removes a live reservation.
//! 2. **Nothing unseen is removed.** When one of the agent's domains cannot be read, the
//!    sweep removes nothing (that domain may hold any of the reservations).
//! 3. **Idempotent.** [`reserve`] returns the identity's reservation when it exists, so a
//!    retried Create, or a restart of a stopped domain, keeps the address.
//! 4. **Two identities never share an address.** A new reservation takes an address no
//!    other `<host>` entry holds; libvirt itself refuses a second entry with the same
//!    address (two Creates, of this agent or another, choosing at once), and the loser
//!    reads the host list again and chooses again, as often as it loses: each lost
//!    choice is an address another reservation took, so the range fills up (and the
//!    next choice is [`LibvirtError::AddressesExhausted`]) before the losses can go on.
//!    A refusal the host list does not explain (the address is still free) is returned.
//! 5. **The same address comes back.** The search starts at a place derived from the MAC,
//!    so an identity whose reservation was removed gets the same address again while no
//!    other identity has taken it (see [`choose_address`]).

use std::collections::HashSet;
use std::net::Ipv4Addr;

use virt::connect::Connect;
use virt::error::ErrorNumber;
use virt::network::Network;
use virt::sys;

use crate::libvirt::domains::agent_metadata;
use crate::libvirt::error::LibvirtError;
use crate::libvirt::identity_mac::{is_identity_mac, mac_for_identity};
use crate::libvirt::xml::network::{DhcpFacts, addresses_in, host_xml};
use crate::transport::call::CallFailure;

/// An identity's reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The identity's MAC.
    pub mac: String,
    /// The reserved address.
    pub ip: Ipv4Addr,
    /// Whether this call made it (`false`: it existed).
    pub created: bool,
    /// How many addresses this call chose that a concurrent reservation took first.
    pub lost_choices: u64,
}

/// The first address of `facts`' DHCP ranges, searched from a start derived from `mac`
/// and wrapping around, that no `<host>` entry holds and that is not the network's own;
/// `None` when every one is taken.
///
/// The start is the MAC's last four octets modulo the ranges' size, so the same identity
/// starts at the same address every time: after its reservation was removed it gets
/// that address again unless another identity has taken it since, or its search had to
/// skip over an address that is free now.
pub fn choose_address(facts: &DhcpFacts, mac: &str) -> Option<Ipv4Addr> {
    let sizes: Vec<u64> = facts.ranges.iter().copied().map(addresses_in).collect();
    let total = facts.range_size();
    if total == 0 {
        return None;
    }
    let seed = mac
        .split(':')
        .filter_map(|octet| u8::from_str_radix(octet, 16).ok())
        .fold(0u64, |acc, octet| {
            (acc << 8 | u64::from(octet)) & 0xffff_ffff
        });
    let at = |mut index: u64| {
        for ((start, _), size) in facts.ranges.iter().zip(&sizes) {
            if index < *size {
                return Ipv4Addr::from(u32::from(*start) + index as u32);
            }
            index -= size;
        }
        unreachable!("index below the ranges' total size")
    };
    let taken: HashSet<Ipv4Addr> = facts
        .hosts
        .iter()
        .filter_map(|h| h.ip)
        .chain(facts.own_addresses.iter().copied())
        .collect();
    (0..total)
        .map(|i| at((seed + i) % total))
        .find(|ip| !taken.contains(ip))
}

fn dhcp_facts(net: &Network, name: &str) -> Result<DhcpFacts, CallFailure<LibvirtError>> {
    DhcpFacts::parse(&net.xml_desc(0)?)
        .map_err(|e| CallFailure::Agent(LibvirtError::xml(format!("network {name}"), e)))
}

/// Changes the running network and its persistent definition alike, so the host list
/// is the same after libvirtd or the network restarts.
fn update_flags(net: &Network) -> Result<sys::virNetworkUpdateFlags, CallFailure<LibvirtError>> {
    let mut flags = 0;
    if net.is_active()? {
        flags |= sys::VIR_NETWORK_UPDATE_AFFECT_LIVE;
    }
    if net.is_persistent()? {
        flags |= sys::VIR_NETWORK_UPDATE_AFFECT_CONFIG;
    }
    Ok(flags)
}

/// The reservation of `identity` on `network_name`: the existing one, or a new one for an
/// address [`choose_address`] picks. See the module docs.
pub fn reserve(
    conn: &Connect,
    network_name: &str,
    identity: &str,
) -> Result<Reservation, CallFailure<LibvirtError>> {
    reserve_with(conn, network_name, identity, &mut |_| {})
}

/// [`reserve`], calling `before_update` with each address chosen, just before libvirt is
/// asked to reserve it: where tests let a concurrent reservation take it first.
pub fn reserve_with(
    conn: &Connect,
    network_name: &str,
    identity: &str,
    before_update: &mut dyn FnMut(Ipv4Addr),
) -> Result<Reservation, CallFailure<LibvirtError>> {
    let mac = mac_for_identity(identity);
    let net = conn.lookup_network_by_name(network_name)?;
    let mut lost_choices = 0;
    // The address libvirt refused last, with its refusal.
    let mut refused: Option<(Ipv4Addr, virt::error::Error)> = None;
    loop {
        let facts = dhcp_facts(&net, network_name)?;
        if let Some(ip) = facts.reserved_for(&mac) {
            return Ok(Reservation {
                mac,
                ip,
                created: false,
                lost_choices,
            });
        }
        if let Some((ip, refusal)) = refused.take() {
            // Lost to a concurrent reservation only when another entry holds the address
            // now. The bound is for addresses freed as fast as they are taken: without
            // frees, the range is full (and the choice below fails) before it is reached.
            if !facts.is_held(ip) || lost_choices > facts.range_size() {
                return Err(refusal.into());
            }
        }
        if facts.ranges.is_empty() {
            return Err(CallFailure::Agent(LibvirtError::NoDhcpRange {
                network: network_name.to_owned(),
            }));
        }
        let Some(ip) = choose_address(&facts, &mac) else {
            return Err(CallFailure::Agent(LibvirtError::AddressesExhausted {
                network: network_name.to_owned(),
            }));
        };
        let xml = host_xml(&mac, Some(ip))
            .map_err(|e| CallFailure::Agent(LibvirtError::xml("DHCP host entry", e)))?;
        before_update(ip);
        match net.update(
            sys::VIR_NETWORK_UPDATE_COMMAND_ADD_LAST,
            sys::VIR_NETWORK_SECTION_IP_DHCP_HOST,
            -1,
            &xml,
            update_flags(&net)?,
        ) {
            Ok(()) => {
                return Ok(Reservation {
                    mac,
                    ip,
                    created: true,
                    lost_choices,
                });
            }
            // An entry with the address (or this MAC) exists: another Create may have
            // made it between the read and the update. The next read tells.
            Err(e) if e.code().is(ErrorNumber::OperationInvalid) => {
                lost_choices += 1;
                refused = Some((ip, e));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Removes every reservation on `network_name` under the agent's MAC prefix whose MAC no
/// domain of the agent has; returns the MACs removed. Nothing when a domain of the agent
/// cannot be read. See the module docs.
pub fn sweep(conn: &Connect, network_name: &str) -> Result<Vec<String>, CallFailure<LibvirtError>> {
    let net = match conn.lookup_network_by_name(network_name) {
        Ok(net) => net,
        // No network, no reservations on it.
        Err(e) if e.code().is(ErrorNumber::NoNetwork) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    // The host list first, then the domains: see guarantee 1.
    let facts = dhcp_facts(&net, network_name)?;
    let Some(metadata) = agent_metadata(conn)? else {
        return Ok(Vec::new());
    };
    let kept: HashSet<String> = metadata
        .iter()
        .filter_map(|m| m.address_identity.as_deref().map(mac_for_identity))
        .collect();
    let mut removed = Vec::new();
    for host in &facts.hosts {
        let Some(mac) = host.mac.as_deref() else {
            continue;
        };
        if !is_identity_mac(mac) || kept.contains(mac) {
            continue;
        }
        let xml = host_xml(mac, host.ip)
            .map_err(|e| CallFailure::Agent(LibvirtError::xml("DHCP host entry", e)))?;
        match net.update(
            sys::VIR_NETWORK_UPDATE_COMMAND_DELETE,
            sys::VIR_NETWORK_SECTION_IP_DHCP_HOST,
            -1,
            &xml,
            update_flags(&net)?,
        ) {
            Ok(()) => removed.push(mac.to_owned()),
            // A concurrent sweep removed it first.
            Err(e)
                if e.code().is(ErrorNumber::OperationInvalid)
                    && dhcp_facts(&net, network_name)?.reserved_for(mac).is_none() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(removed)
}

/// Who holds `identity` on this host, as Create must know before it makes an instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityHolders {
    /// Keys of the agent's domains created with the identity.
    pub keys: Vec<String>,
    /// Another identity whose MAC is the same as this one's, if a domain has one.
    pub mac_shared_with: Option<String>,
}

/// The agent's domains with `identity`, and any other identity with its MAC. A domain
/// whose metadata cannot be read now is not counted.
pub fn holders_of(
    conn: &Connect,
    identity: &str,
) -> Result<IdentityHolders, CallFailure<LibvirtError>> {
    let mac = mac_for_identity(identity);
    let mut holders = IdentityHolders::default();
    for metadata in agent_metadata(conn)?.unwrap_or_default() {
        match metadata.address_identity {
            Some(held) if held == identity => holders.keys.push(metadata.key),
            Some(other) if mac_for_identity(&other) == mac => {
                holders.mac_shared_with = Some(other);
            }
            _ => {}
        }
    }
    holders.keys.sort();
    Ok(holders)
}

/// The reservations under the agent's MAC prefix on `network_name`: MAC and address.
pub fn identity_reservations(
    conn: &Connect,
    network_name: &str,
) -> Result<Vec<(String, Option<Ipv4Addr>)>, CallFailure<LibvirtError>> {
    let facts = dhcp_facts(&conn.lookup_network_by_name(network_name)?, network_name)?;
    Ok(facts
        .hosts
        .into_iter()
        .filter_map(|h| Some((h.mac.filter(|m| is_identity_mac(m))?, h.ip)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::libvirt::xml::network::DhcpHost;

    fn ip(text: &str) -> Ipv4Addr {
        text.parse().unwrap()
    }

    fn facts(range: (&str, &str), held: &[&str]) -> DhcpFacts {
        DhcpFacts {
            own_addresses: vec![ip("10.0.0.1")],
            ranges: vec![(ip(range.0), ip(range.1))],
            hosts: held
                .iter()
                .map(|h| DhcpHost {
                    mac: Some("52:54:00:00:00:01".into()),
                    ip: Some(ip(h)),
                })
                .collect(),
        }
    }

    #[test]
    fn the_choice_starts_at_the_macs_place_skips_what_is_held_and_wraps() {
        // Seed 0x00000002 in a range of 4: index 2.
        let mac = "76:6b:00:00:00:02";
        type Case<'a> = ((&'a str, &'a str), &'a [&'a str], Option<&'a str>);
        let cases: &[Case] = &[
            (("10.0.0.10", "10.0.0.13"), &[], Some("10.0.0.12")),
            (
                ("10.0.0.10", "10.0.0.13"),
                &["10.0.0.12"],
                Some("10.0.0.13"),
            ),
            (
                ("10.0.0.10", "10.0.0.13"),
                &["10.0.0.12", "10.0.0.13"],
                Some("10.0.0.10"),
            ),
            (
                ("10.0.0.10", "10.0.0.13"),
                &["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"],
                None,
            ),
            // The network's own address is never a guest's.
            (("10.0.0.1", "10.0.0.1"), &[], None),
        ];
        for (range, held, expected) in cases {
            assert_eq!(
                choose_address(&facts(*range, held), mac),
                expected.map(ip),
                "{range:?} {held:?}"
            );
        }
        let two_ranges = DhcpFacts {
            own_addresses: vec![],
            ranges: vec![
                (ip("10.0.0.10"), ip("10.0.0.11")),
                (ip("10.0.1.10"), ip("10.0.1.11")),
            ],
            hosts: vec![],
        };
        assert_eq!(choose_address(&two_ranges, mac), Some(ip("10.0.1.10")));
        assert_eq!(choose_address(&DhcpFacts::default(), mac), None);
    }
}
