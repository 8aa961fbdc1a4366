//! The seed's `network-config`: the static address an instance got from its bridge
//! host's block (`hosts[].staticAddresses`), for cloud-init to configure in the guest.
//!
//! What the document says, and why:
//! 1. **Network config version 2**, one ethernet matched by the NIC's MAC (the domain
//!    defines the MAC, so the match holds whatever the kernel names the NIC) and named
//!    `eth0` (`set-name`: cloud-init's renderers other than netplan need a name for it).
//! 2. **DHCP off** (`dhcp4: false`, `dhcp6: false`): a DHCP server on the bridge that the
//!    agent does not control would otherwise give the NIC a second, different address.
//! 3. **The address with the block's prefix**, a **default route** (`to: 0.0.0.0/0` or
//!    `::/0`, via the gateway; none without a gateway: `routes`, not the deprecated
//!    `gateway4`) and the **DNS servers** (`nameservers.addresses`).
//!
//! The caller cannot send a `network-config` of its own (the contract's cloud-init has
//! only user-data and vendor-data), so this document is the only one, and cloud-init's
//! NoCloud datasource prefers it to the fallback (DHCP on the first NIC). A user-data
//! `network:` key is not read by cloud-init for NoCloud, so it cannot override it either.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Serialize;

use crate::config::StaticAddresses;

/// The name the guest's NIC gets.
pub const GUEST_NIC_NAME: &str = "eth0";

/// One instance's static network settings: its address and its host's block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticNetwork<'a> {
    /// The NIC's MAC, lowercase `aa:bb:cc:dd:ee:ff`.
    pub mac: &'a str,
    /// The instance's address.
    pub address: IpAddr,
    /// The block it comes from: prefix length, gateway, DNS servers.
    pub block: &'a StaticAddresses,
}

#[derive(Serialize)]
struct Document<'a> {
    version: u8,
    ethernets: BTreeMap<&'static str, Ethernet<'a>>,
}

#[derive(Serialize)]
struct Ethernet<'a> {
    #[serde(rename = "match")]
    matching: Match<'a>,
    #[serde(rename = "set-name")]
    set_name: &'static str,
    dhcp4: bool,
    dhcp6: bool,
    addresses: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nameservers: Option<Nameservers>,
}

#[derive(Serialize)]
struct Match<'a> {
    macaddress: &'a str,
}

#[derive(Serialize)]
struct Route {
    to: &'static str,
    via: String,
}

#[derive(Serialize)]
struct Nameservers {
    addresses: Vec<String>,
}

/// The `network-config` document (YAML) for `network`. See the module docs.
pub fn network_config(network: &StaticNetwork<'_>) -> String {
    let block = network.block;
    let routes = block
        .gateway
        .map(|via| Route {
            to: if via.is_ipv4() { "0.0.0.0/0" } else { "::/0" },
            via: via.to_string(),
        })
        .into_iter()
        .collect();
    let nameservers = (!block.dns.is_empty()).then(|| Nameservers {
        addresses: block.dns.iter().map(IpAddr::to_string).collect(),
    });
    let document = Document {
        version: 2,
        ethernets: BTreeMap::from([(
            GUEST_NIC_NAME,
            Ethernet {
                matching: Match {
                    macaddress: network.mac,
                },
                set_name: GUEST_NIC_NAME,
                dhcp4: false,
                dhcp6: false,
                addresses: vec![format!("{}/{}", network.address, block.prefix_length)],
                routes,
                nameservers,
            },
        )]),
    };
    serde_norway::to_string(&document).expect("strings, numbers and booleans always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(gateway: Option<&str>, dns: &[&str]) -> StaticAddresses {
        StaticAddresses {
            first: "192.0.2.10".parse().unwrap(),
            last: "192.0.2.20".parse().unwrap(),
            prefix_length: 24,
            gateway: gateway.map(|g| g.parse().unwrap()),
            dns: dns.iter().map(|d| d.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn the_document_matches_the_mac_and_sets_address_route_and_dns_without_dhcp() {
        let block = block(Some("192.0.2.1"), &["192.0.2.53", "2001:db8::53"]);
        let text = network_config(&StaticNetwork {
            mac: "76:6b:01:02:03:04",
            address: "192.0.2.12".parse().unwrap(),
            block: &block,
        });
        let doc: serde_norway::Value = serde_norway::from_str(&text).unwrap();
        let eth = &doc["ethernets"]["eth0"];
        assert_eq!(doc["version"].as_u64(), Some(2), "{text}");
        assert_eq!(
            eth["match"]["macaddress"].as_str(),
            Some("76:6b:01:02:03:04")
        );
        assert_eq!(eth["dhcp4"].as_bool(), Some(false));
        assert_eq!(eth["dhcp6"].as_bool(), Some(false));
        assert_eq!(eth["addresses"][0].as_str(), Some("192.0.2.12/24"));
        assert_eq!(eth["routes"][0]["to"].as_str(), Some("0.0.0.0/0"));
        assert_eq!(eth["routes"][0]["via"].as_str(), Some("192.0.2.1"));
        assert_eq!(
            eth["nameservers"]["addresses"][1].as_str(),
            Some("2001:db8::53")
        );
    }

    #[test]
    fn without_gateway_or_dns_there_is_no_route_and_no_nameservers() {
        let block = block(None, &[]);
        let text = network_config(&StaticNetwork {
            mac: "76:6b:01:02:03:04",
            address: "192.0.2.12".parse().unwrap(),
            block: &block,
        });
        assert!(
            !text.contains("routes") && !text.contains("nameservers"),
            "{text}"
        );
    }
}
