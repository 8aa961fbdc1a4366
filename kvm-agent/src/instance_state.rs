//! What a domain's libvirt state and its interfaces mean for the contract.
//!
//! State (lesson 9): `running` and `blocked` are RUNNING once the guest has an address,
//! PROVISIONING before; `nostate` is PROVISIONING (a domain between states), never
//! STOPPED, which would make the operator delete and recreate a booting VM; `paused`,
//! `shutdown`, `shutoff`, `crashed` and `pmsuspended` are STOPPED.
//!
//! Addresses (lesson 8): the guest agent answers only once it is installed and running,
//! DHCP leases exist only on libvirt networks, and ARP is empty until the guest sends
//! traffic. So the sources are tried in [`ADDRESS_SOURCES`] order and the first that
//! yields a usable address wins; loopback, link-local, unspecified and multicast
//! addresses are never usable. No address yet is PROVISIONING, not an error.

use std::net::IpAddr;

use egressproxy_provider::pb;
use virt::sys;

/// Where an address comes from, in the order they are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressSource {
    /// `qemu-guest-agent` inside the guest.
    Agent,
    /// The DHCP lease of a libvirt network.
    Lease,
    /// The host's ARP table.
    Arp,
}

/// The order in which address sources are tried.
pub const ADDRESS_SOURCES: [AddressSource; 3] = [
    AddressSource::Agent,
    AddressSource::Lease,
    AddressSource::Arp,
];

impl AddressSource {
    /// The `virDomainInterfaceAddressesSource` value.
    pub fn libvirt_source(self) -> sys::virDomainInterfaceAddressesSource {
        match self {
            AddressSource::Agent => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
            AddressSource::Lease => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
            AddressSource::Arp => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP,
        }
    }

    /// Whether this source can answer for a NIC on a host bridge (leases need a libvirt
    /// network).
    pub fn works_on_bridge(self) -> bool {
        self != AddressSource::Lease
    }
}

/// The contract state of a domain in libvirt state `state`, with a message for humans.
pub fn instance_state(
    state: sys::virDomainState,
    has_address: bool,
) -> (pb::InstanceState, &'static str) {
    use pb::InstanceState as S;
    match state {
        sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED if has_address => (S::Running, ""),
        sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED => {
            (S::Provisioning, "booting: waiting for an address")
        }
        sys::VIR_DOMAIN_NOSTATE => (S::Provisioning, "starting"),
        sys::VIR_DOMAIN_PAUSED => (S::Stopped, "paused"),
        sys::VIR_DOMAIN_SHUTDOWN => (S::Stopped, "shutting down"),
        sys::VIR_DOMAIN_SHUTOFF => (S::Stopped, "shut off"),
        sys::VIR_DOMAIN_CRASHED => (S::Stopped, "crashed"),
        sys::VIR_DOMAIN_PMSUSPENDED => (S::Stopped, "suspended by the guest"),
        // A state newer than this agent: not a reason to replace the VM.
        _ => (S::Provisioning, "in a state this agent does not know"),
    }
}

/// Whether `address` can reach the guest from outside it.
pub fn is_usable_address(address: IpAddr) -> bool {
    if address.is_loopback() || address.is_unspecified() || address.is_multicast() {
        return false;
    }
    match address {
        IpAddr::V4(v4) => !v4.is_link_local() && !v4.is_broadcast(),
        IpAddr::V6(v6) => !v6.is_unicast_link_local(),
    }
}

/// The usable addresses of `interfaces` (one source's answer), in order, without
/// duplicates. With `mac`, only the NIC with that hardware address counts (the guest
/// agent also reports `lo` and any bridge the guest itself runs).
pub fn usable_addresses(interfaces: &[virt::domain::Interface], mac: Option<&str>) -> Vec<IpAddr> {
    let mut found = Vec::new();
    for interface in interfaces {
        if let (Some(want), Some(have)) = (mac, interface.hwaddr.as_deref())
            && !want.eq_ignore_ascii_case(have)
        {
            continue;
        }
        for ip in &interface.addrs {
            let Ok(address) = ip.addr.parse::<IpAddr>() else {
                continue;
            };
            if is_usable_address(address) && !found.contains(&address) {
                found.push(address);
            }
        }
    }
    found
}

/// An address as the contract reports it. The agent only knows addresses on the
/// hypervisor's networks, so they are internal.
pub fn to_contract_address(address: IpAddr) -> pb::Address {
    pb::Address {
        address: address.to_string(),
        scope: pb::AddressScope::Internal.into(),
        family: match address {
            IpAddr::V4(_) => pb::IpFamily::V4,
            IpAddr::V6(_) => pb::IpFamily::V6,
        }
        .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::InstanceState as S;
    use virt::domain::{IPAddress, Interface};

    fn interface(name: &str, mac: Option<&str>, addrs: &[&str]) -> Interface {
        Interface {
            name: name.into(),
            hwaddr: mac.map(Into::into),
            naddrs: addrs.len() as u64,
            addrs: addrs
                .iter()
                .map(|a| IPAddress {
                    typed: if a.contains(':') {
                        i64::from(sys::VIR_IP_ADDR_TYPE_IPV6)
                    } else {
                        i64::from(sys::VIR_IP_ADDR_TYPE_IPV4)
                    },
                    addr: (*a).into(),
                    prefix: 24,
                })
                .collect(),
        }
    }

    #[test]
    fn every_libvirt_state_maps_as_lesson_9_says() {
        let table = [
            (sys::VIR_DOMAIN_RUNNING, true, S::Running),
            (sys::VIR_DOMAIN_BLOCKED, true, S::Running),
            (sys::VIR_DOMAIN_RUNNING, false, S::Provisioning),
            (sys::VIR_DOMAIN_BLOCKED, false, S::Provisioning),
            (sys::VIR_DOMAIN_NOSTATE, true, S::Provisioning),
            (sys::VIR_DOMAIN_NOSTATE, false, S::Provisioning),
            (sys::VIR_DOMAIN_PAUSED, true, S::Stopped),
            (sys::VIR_DOMAIN_SHUTDOWN, true, S::Stopped),
            (sys::VIR_DOMAIN_SHUTOFF, false, S::Stopped),
            (sys::VIR_DOMAIN_CRASHED, false, S::Stopped),
            (sys::VIR_DOMAIN_PMSUSPENDED, true, S::Stopped),
            (99, true, S::Provisioning),
        ];
        for (state, has_address, want) in table {
            assert_eq!(
                instance_state(state, has_address).0,
                want,
                "state {state} address {has_address}"
            );
        }
    }

    #[test]
    fn loopback_link_local_unspecified_and_multicast_are_skipped() {
        for bad in [
            "127.0.0.1",
            "::1",
            "169.254.3.4",
            "fe80::5054:ff:fe12:3456",
            "0.0.0.0",
            "::",
            "224.0.0.1",
            "ff02::1",
            "255.255.255.255",
        ] {
            assert!(!is_usable_address(bad.parse().unwrap()), "{bad}");
        }
        for good in ["192.168.122.10", "10.0.0.5", "2001:db8::10", "fd00::10"] {
            assert!(is_usable_address(good.parse().unwrap()), "{good}");
        }
    }

    #[test]
    fn agent_answer_is_filtered_to_the_nic_and_deduplicated() {
        let interfaces = [
            interface("lo", Some("00:00:00:00:00:00"), &["127.0.0.1", "::1"]),
            interface(
                "enp1s0",
                Some("52:54:00:AB:CD:EF"),
                &["192.168.122.10", "fe80::1", "192.168.122.10", "fd00::10"],
            ),
            interface("docker0", Some("02:42:ac:11:00:01"), &["172.17.0.1"]),
        ];
        let mine = usable_addresses(&interfaces, Some("52:54:00:ab:cd:ef"));
        assert_eq!(
            mine,
            [
                "192.168.122.10".parse::<IpAddr>().unwrap(),
                "fd00::10".parse().unwrap()
            ]
        );
        let any = usable_addresses(&interfaces, None);
        assert_eq!(any.len(), 3, "{any:?}");
        assert!(usable_addresses(&interfaces[..1], None).is_empty());
    }

    #[test]
    fn unparseable_addresses_are_ignored() {
        let interfaces = [interface("vnet0", None, &["not-an-ip", "192.168.1.9"])];
        assert_eq!(
            usable_addresses(&interfaces, Some("52:54:00:00:00:01")),
            ["192.168.1.9".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn sources_are_tried_agent_lease_arp_and_leases_need_a_network() {
        assert_eq!(
            ADDRESS_SOURCES.map(AddressSource::libvirt_source),
            [
                sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
                sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
                sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP
            ]
        );
        assert!(!AddressSource::Lease.works_on_bridge());
        assert!(AddressSource::Arp.works_on_bridge());
    }

    #[test]
    fn contract_addresses_carry_their_family() {
        let v6 = to_contract_address("2001:db8::10".parse().unwrap());
        assert_eq!(v6.family(), pb::IpFamily::V6);
        assert_eq!(v6.scope(), pb::AddressScope::Internal);
        assert_eq!(
            to_contract_address("10.0.0.1".parse().unwrap()).family(),
            pb::IpFamily::V4
        );
    }
}
