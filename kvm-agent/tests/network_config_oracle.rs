//! The seed's `network-config` as cloud-init's own code reads it: the judge is
//! `tests/network_config_oracle.py`, which reads a seed directory the way the NoCloud
//! datasource does, parses the document with cloud-init's network-state parser (broken
//! parts fail instead of being skipped) and renders it with the ENI renderer of the
//! guest image. cloud-init must find the NIC by its MAC and configure exactly the static
//! address, prefix, default route and DNS servers the agent meant, with no DHCP.
//!
//! Needs `/usr/bin/python3` and the `cloud-init` Debian package.

use std::process::Command;

use kvm_agent::config::StaticAddresses;
use kvm_agent::guest::network_config::{StaticNetwork, network_config};
use serde_json::Value;

const ORACLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/network_config_oracle.py"
);

/// What cloud-init makes of `document` as a seed's `network-config`.
fn judge(document: &str) -> Value {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("meta-data"), "instance-id: oracle\n").unwrap();
    std::fs::write(dir.path().join("user-data"), "#cloud-config\n").unwrap();
    std::fs::write(dir.path().join("network-config"), document).unwrap();
    let out = Command::new("/usr/bin/python3")
        .arg(ORACLE)
        .arg(dir.path())
        .output()
        .expect("/usr/bin/python3 runs (Debian packages python3 and cloud-init)");
    assert!(
        out.status.success(),
        "cloud-init refused the document:\n{document}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn block(
    first: &str,
    last: &str,
    prefix: u8,
    gateway: Option<&str>,
    dns: &[&str],
) -> StaticAddresses {
    StaticAddresses {
        first: first.parse().unwrap(),
        last: last.parse().unwrap(),
        prefix_length: prefix,
        gateway: gateway.map(|g| g.parse().unwrap()),
        dns: dns.iter().map(|d| d.parse().unwrap()).collect(),
    }
}

#[test]
fn cloud_init_configures_the_static_ipv4_address_route_and_dns_on_the_nic_with_the_mac() {
    let block = block(
        "192.0.2.10",
        "192.0.2.20",
        24,
        Some("192.0.2.1"),
        &["192.0.2.53", "198.51.100.53"],
    );
    let mac = "76:6b:0a:0b:0c:0d";
    let document = network_config(&StaticNetwork {
        mac,
        address: "192.0.2.12".parse().unwrap(),
        block: &block,
    });
    let seen = judge(&document);
    assert_eq!(
        seen["physdevs"],
        serde_json::json!([[mac, "eth0"]]),
        "{seen}"
    );
    let eth = &seen["interfaces"]["eth0"];
    assert_eq!(eth["mac_address"], mac);
    let subnets = eth["subnets"].as_array().unwrap();
    assert_eq!(subnets.len(), 1, "one static subnet, no DHCP: {seen}");
    let subnet = &subnets[0];
    assert_eq!(subnet["type"], "static");
    assert_eq!(subnet["address"], "192.0.2.12");
    assert_eq!(subnet["prefix"], 24);
    assert_eq!(
        subnet["dns_nameservers"],
        serde_json::json!(["192.0.2.53", "198.51.100.53"])
    );
    let route = &subnet["routes"][0];
    assert_eq!(
        (&route["network"], &route["prefix"], &route["gateway"]),
        (&"0.0.0.0".into(), &0.into(), &"192.0.2.1".into()),
        "{seen}"
    );
    let eni = seen["eni"].as_str().unwrap();
    assert!(eni.contains("iface eth0 inet static\n"), "{eni}");
    assert!(eni.contains("address 192.0.2.12/24"), "{eni}");
    assert!(eni.contains("route add default gw 192.0.2.1"), "{eni}");
    assert!(!eni.contains("dhcp"), "{eni}");
}

#[test]
fn cloud_init_configures_a_static_ipv6_address_without_a_gateway_or_dns() {
    let block = block("2001:db8::10", "2001:db8::1f", 64, None, &[]);
    let document = network_config(&StaticNetwork {
        mac: "76:6b:0a:0b:0c:0e",
        address: "2001:db8::11".parse().unwrap(),
        block: &block,
    });
    let seen = judge(&document);
    let subnets = seen["interfaces"]["eth0"]["subnets"].as_array().unwrap();
    assert_eq!(subnets.len(), 1, "{seen}");
    assert_eq!(subnets[0]["type"], "static");
    assert_eq!(subnets[0]["address"], "2001:db8::11");
    assert_eq!(subnets[0]["prefix"], 64);
    assert_eq!(subnets[0]["routes"], serde_json::json!([]));
    let eni = seen["eni"].as_str().unwrap();
    assert!(eni.contains("iface eth0 inet6 static"), "{eni}");
    assert!(!eni.contains("dhcp") && !eni.contains("route add"), "{eni}");
}
