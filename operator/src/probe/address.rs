//! Which of an instance's addresses the operator checks its proxy at (a member's and a
//! pool's spare's alike).

use std::net::{IpAddr, SocketAddr};

use egressproxy_provider::pb;

use super::address_fields::is_internal;

/// The address the proxy is checked at, as the contract tells callers to choose: the
/// first `INTERNAL` address of an IP family the operator reaches, and an `EXTERNAL` one
/// only when there is none. An external address is often not reachable from inside the
/// cluster, where the operator and the proxy's clients run; an address of a family the
/// operator has no route for (IPv6 in an IPv4-only cluster) is tried only when no other
/// is left.
pub fn probe_address(addresses: &[pb::Address]) -> Option<IpAddr> {
    choose_address(addresses, has_route)
}

/// [`probe_address`] with the reachability of an address given.
fn choose_address(addresses: &[pb::Address], reaches: impl Fn(IpAddr) -> bool) -> Option<IpAddr> {
    let usable: Vec<(bool, IpAddr)> = addresses
        .iter()
        .filter_map(|a| {
            let ip = a
                .address
                .parse::<IpAddr>()
                .ok()
                .filter(|ip| !ip.is_unspecified())?;
            Some((is_internal(a), ip))
        })
        .collect();
    let first = |internal: bool, reachable: bool| {
        usable
            .iter()
            .find(|(is_internal, ip)| *is_internal == internal && (!reachable || reaches(*ip)))
            .map(|(_, ip)| *ip)
    };
    first(true, true)
        .or_else(|| first(false, true))
        .or_else(|| first(true, false))
        .or_else(|| first(false, false))
}

/// Whether this host has a route to `ip`: the kernel's route lookup for a UDP socket
/// connected to it (no packet is sent). False for a family the host has no address or
/// route for.
fn has_route(ip: IpAddr) -> bool {
    let any: SocketAddr = match ip {
        IpAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    std::net::UdpSocket::bind(any)
        .and_then(|socket| socket.connect(SocketAddr::new(ip, 9)))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(ip: &str, scope: pb::AddressScope) -> pb::Address {
        let mut address = pb::Address {
            address: ip.to_owned(),
            ..pb::Address::default()
        };
        address.set_scope(scope);
        address
    }

    #[test]
    fn an_internal_address_wins_over_an_external_one_listed_first() {
        let addresses = [
            address("203.0.113.7", pb::AddressScope::External),
            address("10.0.0.7", pb::AddressScope::Internal),
        ];
        assert_eq!(probe_address(&addresses), Some("10.0.0.7".parse().unwrap()));
    }

    #[test]
    fn an_external_address_is_used_when_there_is_no_internal_one() {
        let addresses = [
            address("not-an-ip", pb::AddressScope::Internal),
            address("203.0.113.7", pb::AddressScope::External),
        ];
        assert_eq!(
            probe_address(&addresses),
            Some("203.0.113.7".parse().unwrap())
        );
    }

    /// Before, the first internal address won whatever its family: an IPv6 address
    /// listed first was checked from an IPv4-only cluster.
    #[test]
    fn the_first_internal_address_of_a_family_the_operator_reaches_wins() {
        let addresses = [
            address("2001:db8::7", pb::AddressScope::Internal),
            address("10.0.0.7", pb::AddressScope::Internal),
            address("203.0.113.7", pb::AddressScope::External),
        ];
        let v4_only = |ip: IpAddr| ip.is_ipv4();
        assert_eq!(
            choose_address(&addresses, v4_only),
            Some("10.0.0.7".parse().unwrap())
        );
        let both = |_: IpAddr| true;
        assert_eq!(
            choose_address(&addresses, both),
            Some("2001:db8::7".parse().unwrap())
        );
        // Nothing internal is reachable: a reachable external one, then anything.
        let only_public = |ip: IpAddr| ip == "203.0.113.7".parse::<IpAddr>().unwrap();
        assert_eq!(
            choose_address(&addresses, only_public),
            Some("203.0.113.7".parse().unwrap())
        );
        let none = |_: IpAddr| false;
        assert_eq!(
            choose_address(&addresses, none),
            Some("2001:db8::7".parse().unwrap())
        );
    }

    /// Before, a scope this operator does not know (a newer provider's) was read as
    /// internal, so such an address listed first won over an internal one.
    #[test]
    fn a_scope_this_operator_does_not_know_counts_as_external() {
        let newer_scope = pb::Address {
            address: "203.0.113.7".to_owned(),
            scope: 7,
            family: pb::IpFamily::V4 as i32,
        };
        let addresses = [
            newer_scope.clone(),
            address("10.0.0.7", pb::AddressScope::Internal),
        ];
        let any = |_: IpAddr| true;
        assert_eq!(
            choose_address(&addresses, any),
            Some("10.0.0.7".parse().unwrap())
        );
        // Alone, it is used as an external address is: better than none.
        assert_eq!(
            choose_address(&[newer_scope], any),
            Some("203.0.113.7".parse().unwrap())
        );
    }

    #[test]
    fn loopback_has_a_route() {
        assert!(has_route("127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn no_usable_address_is_none() {
        assert_eq!(probe_address(&[]), None);
        assert_eq!(
            probe_address(&[address("", pb::AddressScope::Internal)]),
            None
        );
    }
}
