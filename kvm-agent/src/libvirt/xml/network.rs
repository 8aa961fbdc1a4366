//! The facts the agent reads from a libvirt network's XML: its IPv4 DHCP ranges and
//! host reservations; and the `<host>` element `virNetworkUpdate` takes.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::XmlError;

/// A network's IPv4 DHCP service, as its XML states it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DhcpFacts {
    /// Each `<ip>` element's own address (the host's side, never a guest's).
    pub own_addresses: Vec<Ipv4Addr>,
    /// The DHCP ranges, inclusive, in document order.
    pub ranges: Vec<(Ipv4Addr, Ipv4Addr)>,
    /// The host reservations: MAC (lowercase) and address.
    pub hosts: Vec<DhcpHost>,
}

/// One `<host mac ip/>` reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DhcpHost {
    /// The MAC, lowercase; `None` for a reservation by name or client id.
    pub mac: Option<String>,
    /// The reserved address; `None` for an entry without one (or not IPv4).
    pub ip: Option<Ipv4Addr>,
}

#[derive(Deserialize)]
struct NetworkXml {
    #[serde(default)]
    ip: Vec<IpXml>,
}

#[derive(Deserialize)]
struct IpXml {
    #[serde(rename = "@address", default)]
    address: Option<String>,
    #[serde(rename = "@family", default)]
    family: Option<String>,
    #[serde(default)]
    dhcp: Option<DhcpXml>,
}

#[derive(Deserialize)]
struct DhcpXml {
    #[serde(default)]
    range: Vec<RangeXml>,
    #[serde(default)]
    host: Vec<HostXml>,
}

#[derive(Deserialize)]
struct RangeXml {
    #[serde(rename = "@start")]
    start: String,
    #[serde(rename = "@end")]
    end: String,
}

#[derive(Deserialize, Serialize)]
#[serde(rename = "host")]
struct HostXml {
    #[serde(rename = "@mac", default, skip_serializing_if = "Option::is_none")]
    mac: Option<String>,
    #[serde(rename = "@ip", default, skip_serializing_if = "Option::is_none")]
    ip: Option<String>,
}

impl DhcpFacts {
    /// Reads the IPv4 DHCP facts of a network's XML (`virNetworkGetXMLDesc`).
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        let network: NetworkXml =
            quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
                what: "network XML",
                source,
            })?;
        let mut facts = DhcpFacts::default();
        for ip in network.ip {
            if ip.family.as_deref().is_some_and(|f| f != "ipv4") {
                continue;
            }
            if let Some(own) = ip.address.as_deref().and_then(|a| a.parse().ok()) {
                facts.own_addresses.push(own);
            }
            let Some(dhcp) = ip.dhcp else { continue };
            facts.ranges.extend(
                dhcp.range
                    .iter()
                    .filter_map(|r| Some((r.start.parse().ok()?, r.end.parse().ok()?))),
            );
            facts.hosts.extend(dhcp.host.into_iter().map(|h| DhcpHost {
                mac: h.mac.map(|m| m.to_ascii_lowercase()),
                ip: h.ip.and_then(|ip| ip.parse().ok()),
            }));
        }
        Ok(facts)
    }

    /// The address reserved for `mac`, if any.
    pub fn reserved_for(&self, mac: &str) -> Option<Ipv4Addr> {
        self.hosts
            .iter()
            .find(|h| h.mac.as_deref() == Some(mac))
            .and_then(|h| h.ip)
    }

    /// Whether a `<host>` entry holds `ip`, whatever its MAC.
    pub fn is_held(&self, ip: Ipv4Addr) -> bool {
        self.hosts.iter().any(|h| h.ip == Some(ip))
    }

    /// How many addresses the DHCP ranges hold together.
    pub fn range_size(&self) -> u64 {
        self.ranges.iter().copied().map(addresses_in).sum()
    }
}

/// How many addresses the inclusive DHCP range `(start, end)` holds.
pub fn addresses_in((start, end): (Ipv4Addr, Ipv4Addr)) -> u64 {
    u64::from(u32::from(end)).saturating_sub(u64::from(u32::from(start))) + 1
}

/// The `<host mac ip/>` element of a reservation, for `virNetworkUpdate`.
pub fn host_xml(mac: &str, ip: Option<Ipv4Addr>) -> Result<String, XmlError> {
    Ok(quick_xml::se::to_string(&HostXml {
        mac: Some(mac.to_owned()),
        ip: ip.map(|ip| ip.to_string()),
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ranges_and_hosts_of_ipv4_only() {
        let xml = "<network><name>default</name><forward mode='nat'/>\
            <ip address='192.168.122.1' netmask='255.255.255.0'><dhcp>\
            <range start='192.168.122.2' end='192.168.122.254'><lease expiry='1' unit='hours'/></range>\
            <host mac='76:6B:00:00:00:01' ip='192.168.122.10'/>\
            <host mac='52:54:00:00:00:02' name='x' ip='192.168.122.11'/>\
            </dhcp></ip>\
            <ip family='ipv6' address='fd00::1' prefix='64'><dhcp>\
            <range start='fd00::10' end='fd00::20'/></dhcp></ip></network>";
        let facts = DhcpFacts::parse(xml).unwrap();
        assert_eq!(
            facts.own_addresses,
            ["192.168.122.1".parse::<Ipv4Addr>().unwrap()]
        );
        assert_eq!(
            facts.ranges,
            [(
                "192.168.122.2".parse().unwrap(),
                "192.168.122.254".parse().unwrap()
            )]
        );
        assert_eq!(facts.hosts.len(), 2);
        assert_eq!(
            facts.reserved_for("76:6b:00:00:00:01"),
            Some("192.168.122.10".parse().unwrap())
        );
        let none = DhcpFacts::parse("<network><name>n</name></network>").unwrap();
        assert!(none.ranges.is_empty() && none.hosts.is_empty());
    }

    #[test]
    fn the_host_element_is_what_virsh_net_update_takes() {
        assert_eq!(
            host_xml("76:6b:00:00:00:01", Some("10.0.0.5".parse().unwrap())).unwrap(),
            r#"<host mac="76:6b:00:00:00:01" ip="10.0.0.5"/>"#
        );
        assert_eq!(
            host_xml("76:6b:00:00:00:01", None).unwrap(),
            r#"<host mac="76:6b:00:00:00:01"/>"#
        );
    }
}
