//! A bridge host's static address block (`hosts[].staticAddresses`): the range the agent
//! hands out itself, with the prefix, gateway and DNS servers the guest is configured
//! with through its NoCloud `network-config`.
//!
//! The block is what a bridge lacks for address identities: on a libvirt network the
//! agent reserves an address in libvirt's DHCP server; on a bridge the DHCP server (if
//! any) is not the agent's, so the agent picks the address from this range, records it
//! in the domain's metadata and configures the guest statically.
//!
//! [`StaticAddresses::problems`] is the validation: each problem names its field.

use std::net::IpAddr;

use serde::Deserialize;

/// The static address block of a bridge host.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StaticAddresses {
    /// The first address the agent may give an instance.
    pub first: IpAddr,
    /// The last address the agent may give an instance (inclusive).
    pub last: IpAddr,
    /// The prefix length of the bridge's subnet (e.g. 24).
    pub prefix_length: u8,
    /// The default route's next hop, inside the subnet and outside the range. Unset: no
    /// default route (the partner is on the bridge's subnet itself).
    #[serde(default)]
    pub gateway: Option<IpAddr>,
    /// DNS servers the guest uses, in order.
    #[serde(default)]
    pub dns: Vec<IpAddr>,
}

/// The most addresses one block may hold: the allocation walks the range, so a /64's
/// worth of IPv6 would never end.
pub const MAX_RANGE_SIZE: u128 = 1 << 16;

impl StaticAddresses {
    /// Whether `address` is inside the range.
    pub fn contains(&self, address: IpAddr) -> bool {
        match (bits(self.first), bits(self.last), bits(address)) {
            (Some(first), Some(last), Some(at)) if same_family(self.first, address) => {
                first <= at && at <= last
            }
            _ => false,
        }
    }

    /// The number of addresses in the range (0 when `first` is after `last`).
    pub fn size(&self) -> u128 {
        match (bits(self.first), bits(self.last)) {
            (Some(first), Some(last)) if last >= first => last - first + 1,
            _ => 0,
        }
    }

    /// The range's `index`th address, when the range has one.
    pub fn nth(&self, index: u128) -> Option<IpAddr> {
        if index >= self.size() {
            return None;
        }
        let at = bits(self.first)? + index;
        Some(match self.first {
            IpAddr::V4(_) => IpAddr::from(u32::try_from(at).ok()?.to_be_bytes()),
            IpAddr::V6(_) => IpAddr::from(at.to_be_bytes()),
        })
    }

    /// The range as people write it, `first-last`, for messages.
    pub fn describe(&self) -> String {
        format!("{}-{}/{}", self.first, self.last, self.prefix_length)
    }

    /// Every problem of the block, each as (field under `at`, what to do).
    pub fn problems(&self, at: &str) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        let mut p =
            |field: &str, message: String| problems.push((format!("{at}.{field}"), message));
        let max_prefix = match self.first {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        if self.prefix_length == 0 || self.prefix_length > max_prefix {
            p(
                "prefixLength",
                format!(
                    "{} is not a prefix length of this family: use 1 to {max_prefix}",
                    self.prefix_length
                ),
            );
            return problems;
        }
        if !same_family(self.first, self.last) {
            p(
                "last",
                format!(
                    "{} is not of the family of first ({})",
                    self.last, self.first
                ),
            );
            return problems;
        }
        for (field, address) in [("first", self.first), ("last", self.last)] {
            if !in_prefix(self.first, self.prefix_length, address) {
                p(
                    field,
                    format!(
                        "{address} is outside the subnet {}",
                        subnet(self.first, self.prefix_length)
                    ),
                );
            } else if let Some(why) = unusable(address, self.prefix_length) {
                p(
                    field,
                    format!("{address} is {why}; an instance cannot hold it"),
                );
            }
        }
        if self.size() == 0 {
            p(
                "last",
                format!(
                    "{} is before first ({}): first must be <= last",
                    self.last, self.first
                ),
            );
        } else if self.size() > MAX_RANGE_SIZE {
            p(
                "last",
                format!(
                    "the range holds {} addresses; at most {MAX_RANGE_SIZE} are allowed",
                    self.size()
                ),
            );
        }
        if let Some(gateway) = self.gateway {
            if !same_family(gateway, self.first)
                || !in_prefix(self.first, self.prefix_length, gateway)
            {
                p(
                    "gateway",
                    format!(
                        "{gateway} is outside the subnet {}: the guest could not reach it",
                        subnet(self.first, self.prefix_length)
                    ),
                );
            } else if self.contains(gateway) {
                p(
                    "gateway",
                    format!(
                        "{gateway} is inside the range {}: an instance would get the \
                         gateway's address; move the range or the gateway",
                        self.describe()
                    ),
                );
            }
        }
        for (i, server) in self.dns.iter().enumerate() {
            if server.is_unspecified() || server.is_multicast() {
                p(
                    &format!("dns[{i}]"),
                    format!("{server} is not a DNS server's address"),
                );
            }
        }
        problems
    }
}

fn same_family(a: IpAddr, b: IpAddr) -> bool {
    a.is_ipv4() == b.is_ipv4()
}

fn bits(address: IpAddr) -> Option<u128> {
    Some(match address {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    })
}

fn width(address: IpAddr) -> u32 {
    if address.is_ipv4() { 32 } else { 128 }
}

fn network_bits(address: IpAddr, prefix: u8) -> u128 {
    let width = width(address);
    let host_bits = width - u32::from(prefix);
    let all = bits(address).unwrap_or_default();
    if host_bits >= 128 {
        0
    } else {
        all >> host_bits << host_bits
    }
}

/// Whether `address` is in the subnet of `base`/`prefix`.
fn in_prefix(base: IpAddr, prefix: u8, address: IpAddr) -> bool {
    same_family(base, address) && network_bits(base, prefix) == network_bits(address, prefix)
}

fn subnet(base: IpAddr, prefix: u8) -> String {
    let net = network_bits(base, prefix);
    let address = match base {
        IpAddr::V4(_) => IpAddr::from((net as u32).to_be_bytes()),
        IpAddr::V6(_) => IpAddr::from(net.to_be_bytes()),
    };
    format!("{address}/{prefix}")
}

/// Why an instance cannot hold `address` in a subnet of `prefix`, if it cannot.
fn unusable(address: IpAddr, prefix: u8) -> Option<&'static str> {
    if address.is_loopback() {
        return Some("a loopback address");
    }
    if address.is_multicast() {
        return Some("a multicast address");
    }
    if address.is_unspecified() {
        return Some("the unspecified address");
    }
    match address {
        IpAddr::V4(v4) => {
            if v4.is_link_local() {
                return Some("a link-local address");
            }
            let host_bits = 32 - u32::from(prefix);
            if host_bits >= 2 {
                let host = u32::from(v4) & ((1u32 << host_bits) - 1);
                if host == 0 {
                    return Some("the subnet's network address");
                }
                if host == (1u32 << host_bits) - 1 {
                    return Some("the subnet's broadcast address");
                }
            }
            None
        }
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0 == 0xfe80).then_some("a link-local address"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(first: &str, last: &str, prefix: u8, gateway: Option<&str>) -> StaticAddresses {
        StaticAddresses {
            first: first.parse().unwrap(),
            last: last.parse().unwrap(),
            prefix_length: prefix,
            gateway: gateway.map(|g| g.parse().unwrap()),
            dns: vec!["192.0.2.1".parse().unwrap()],
        }
    }

    fn fields(block: &StaticAddresses) -> Vec<String> {
        block.problems("s").into_iter().map(|(f, _)| f).collect()
    }

    #[test]
    fn a_sound_block_has_no_problem_and_counts_its_addresses() {
        let good = block("192.0.2.10", "192.0.2.20", 24, Some("192.0.2.1"));
        assert!(good.problems("s").is_empty(), "{:?}", good.problems("s"));
        assert_eq!(good.size(), 11);
        assert_eq!(good.nth(10), Some("192.0.2.20".parse().unwrap()));
        assert_eq!(good.nth(11), None);
        assert!(good.contains("192.0.2.15".parse().unwrap()));
        assert!(!good.contains("192.0.2.21".parse().unwrap()));
        assert!(!good.contains("2001:db8::1".parse().unwrap()));
        let v6 = StaticAddresses {
            dns: vec![],
            ..block("2001:db8::10", "2001:db8::1f", 64, Some("2001:db8::1"))
        };
        assert!(v6.problems("s").is_empty(), "{:?}", v6.problems("s"));
        assert_eq!(v6.nth(15), Some("2001:db8::1f".parse().unwrap()));
    }

    #[test]
    fn each_problem_names_its_field() {
        type Case<'a> = (StaticAddresses, &'a [&'a str]);
        let cases: Vec<Case> = vec![
            // first after last
            (block("192.0.2.20", "192.0.2.10", 24, None), &["s.last"]),
            // outside the prefix
            (block("192.0.2.10", "192.0.3.10", 24, None), &["s.last"]),
            // gateway inside the range, and outside the subnet
            (
                block("192.0.2.10", "192.0.2.20", 24, Some("192.0.2.15")),
                &["s.gateway"],
            ),
            (
                block("192.0.2.10", "192.0.2.20", 24, Some("198.51.100.1")),
                &["s.gateway"],
            ),
            (
                block("192.0.2.10", "192.0.2.20", 33, None),
                &["s.prefixLength"],
            ),
            (
                block("192.0.2.10", "192.0.2.20", 0, None),
                &["s.prefixLength"],
            ),
            (block("192.0.2.10", "2001:db8::1", 24, None), &["s.last"]),
            // network and broadcast addresses
            (
                block("192.0.2.0", "192.0.2.255", 24, None),
                &["s.first", "s.last"],
            ),
            (
                block("2001:db8::", "2001:db8::1:0:0", 64, None),
                &["s.last"],
            ),
        ];
        for (block, want) in cases {
            assert_eq!(fields(&block), want, "{block:?}");
        }
        let mut bad_dns = block("192.0.2.10", "192.0.2.20", 24, None);
        bad_dns.dns = vec!["0.0.0.0".parse().unwrap()];
        assert_eq!(fields(&bad_dns), ["s.dns[0]"]);
    }
}
