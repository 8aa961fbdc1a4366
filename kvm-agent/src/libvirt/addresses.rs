//! Where a guest's addresses come from, and which of them can reach it.
//!
//! The guest agent answers only once it is installed and running, DHCP leases exist only
//! on libvirt networks, and ARP is empty until the guest sends traffic. So the
//! sources are tried in [`ADDRESS_SOURCES`] order and the first that yields a usable
//! address wins; loopback, link-local, unspecified and multicast addresses are never
//! usable.

use std::net::IpAddr;

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
    pub(crate) fn libvirt_source(self) -> sys::virDomainInterfaceAddressesSource {
        match self {
            AddressSource::Agent => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT,
            AddressSource::Lease => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE,
            AddressSource::Arp => sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_ARP,
        }
    }

    /// Whether this source can answer for a NIC on a host bridge (leases need a libvirt
    /// network).
    pub(crate) fn works_on_bridge(self) -> bool {
        self != AddressSource::Lease
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
pub(crate) fn usable_addresses(
    interfaces: &[virt::domain::Interface],
    mac: Option<&str>,
) -> Vec<IpAddr> {
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

#[cfg(test)]
mod tests {
    use super::*;
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
}
