//! Static addresses of a bridge host against libvirt's `test:///default` driver, with
//! Create's own steps for them: what the host's domains hold is read back from their
//! metadata ([`held_addresses`]), the address chosen ([`choose_static_address`]) and
//! recorded by defining the domain, as Create does under the host's allocation lock.
//!
//! Shown here: an identity's address is kept and comes back after its instance is
//! deleted; two identities never share one; a requested address in the range and free
//! is granted, one outside is not in range, one held is taken; a full range is
//! exhausted; a new connection (an agent restarted) reads every allocation back from
//! the domains; a Delete releases the address; and Get's answer names the static address
//! first once the domain runs.
//!
//! Every connection in the process shares the driver's state: each test uses a range of
//! its own and domain names of its own, and the tests take turns ([`one_at_a_time`]): a
//! domain another test deletes while this one reads the table makes the table unreadable,
//! as it should (the choice then fails rather than miss an address).

use std::collections::BTreeMap;
use std::net::IpAddr;

use kvm_agent::config::{Attachment, Firmware, StaticAddresses};
use kvm_agent::libvirt::domains::{NicKind, delete_instance, read_instance};
use kvm_agent::libvirt::identity_mac::static_nic_mac;
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::static_addresses::{StaticChoice, choose_static_address, held_addresses};
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::provider::state::to_contract_instance;
use virt::connect::Connect;

/// Serialises the tests of this file (see the module docs).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn connect() -> Connect {
    virt::error::clear_error_callback();
    Connect::open(Some("test:///default")).expect("test:///default opens")
}

fn block(first: &str, last: &str) -> StaticAddresses {
    StaticAddresses {
        first: first.parse().unwrap(),
        last: last.parse().unwrap(),
        prefix_length: 24,
        gateway: None,
        dns: vec![],
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// Create's static-address steps for `key`: read what is held, choose, define the
/// domain that records the choice. The choice when it is not a grant.
fn create(
    conn: &Connect,
    block: &StaticAddresses,
    key: &str,
    identity: Option<&str>,
    requested: Option<&str>,
) -> Result<IpAddr, StaticChoice> {
    let held = held_addresses(conn).unwrap();
    let address = match choose_static_address(
        block,
        &held,
        identity,
        requested.map(|r| r.parse().unwrap()),
        key,
    ) {
        StaticChoice::Granted(address) => address,
        other => return Err(other),
    };
    let names = InstanceNames::for_key(key).unwrap();
    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 512,
        firmware: Firmware::Bios,
        overlay_path: format!("/var/lib/libvirt/images/{}", names.overlay_volume).into(),
        seed_path: format!("/var/lib/libvirt/images/{}", names.seed_volume).into(),
        attachment: Attachment::Bridge("br-static".into()),
        mac: Some(static_nic_mac(identity, key)),
        metadata: InstanceMetadata {
            key: key.into(),
            name: key.into(),
            created: "2026-12-02T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "ab".repeat(32),
            address_identity: identity.map(str::to_owned),
            static_address: Some(address),
            placement: PlacementRecord {
                host: "test".into(),
                zone: None,
                machine_type: "small".into(),
                image: "debian-12".into(),
                base_volume: "egressproxy-base-x.img".into(),
            },
            tags: BTreeMap::new(),
        },
    };
    conn.define_domain_xml(&spec.to_xml().unwrap()).unwrap();
    Ok(address)
}

fn delete(conn: &Connect, key: &str) {
    delete_instance(conn, &InstanceNames::for_key(key).unwrap(), "no-such-pool").unwrap();
}

/// The addresses of `range` the domains hold, by key.
fn table(conn: &Connect, range: &StaticAddresses) -> BTreeMap<String, IpAddr> {
    held_addresses(conn)
        .unwrap()
        .into_iter()
        .filter(|h| range.contains(h.address))
        .map(|h| (h.key, h.address))
        .collect()
}

#[test]
fn identities_keep_their_addresses_never_share_them_and_survive_a_restart() {
    let _turn = one_at_a_time();
    let conn = connect();
    let range = block("192.0.2.10", "192.0.2.13");

    let a = create(&conn, &range, "st-a1", Some("identity-a"), None).unwrap();
    assert!(range.contains(a), "{a}");
    let b = create(&conn, &range, "st-b1", Some("identity-b"), None).unwrap();
    let anonymous = create(&conn, &range, "st-n1", None, None).unwrap();
    assert_ne!(a, b);
    assert!(![a, b].contains(&anonymous));

    // A restarted agent (a new connection) reads the same allocation from the domains.
    let restarted = connect();
    assert_eq!(
        table(&restarted, &range),
        BTreeMap::from([
            ("st-a1".to_owned(), a),
            ("st-b1".to_owned(), b),
            ("st-n1".to_owned(), anonymous),
        ])
    );

    // The last address goes to a fourth identity; a fifth finds the range full.
    let d = create(&restarted, &range, "st-d1", Some("identity-d"), None).unwrap();
    assert!(![a, b, anonymous].contains(&d));
    assert_eq!(
        create(&restarted, &range, "st-e1", Some("identity-e"), None),
        Err(StaticChoice::Exhausted)
    );
    assert_eq!(
        create(&restarted, &range, "st-n2", None, None),
        Err(StaticChoice::Exhausted)
    );

    // Deleting A's and B's instances releases their addresses; A's next instance gets
    // its own back, not merely a free one.
    delete(&restarted, "st-a1");
    delete(&restarted, "st-b1");
    assert!(
        !table(&restarted, &range)
            .values()
            .any(|held| [a, b].contains(held))
    );
    let again = create(&restarted, &range, "st-a2", Some("identity-a"), None).unwrap();
    assert_eq!(again, a);

    for key in ["st-a2", "st-n1", "st-d1"] {
        delete(&restarted, key);
    }
    assert!(table(&restarted, &range).is_empty());
}

#[test]
fn a_requested_address_is_granted_in_range_and_free_only() {
    let _turn = one_at_a_time();
    let conn = connect();
    let range = block("192.0.2.20", "192.0.2.29");
    assert_eq!(
        create(&conn, &range, "rq-a1", Some("req-a"), Some("192.0.2.25")),
        Ok(ip("192.0.2.25"))
    );
    assert_eq!(
        create(&conn, &range, "rq-b1", Some("req-b"), Some("192.0.2.25")),
        Err(StaticChoice::Taken {
            holder: "rq-a1".into()
        })
    );
    assert_eq!(
        create(&conn, &range, "rq-b1", Some("req-b"), Some("192.0.2.30")),
        Err(StaticChoice::NotInRange)
    );
    // Once its holder is deleted, another identity may ask for it.
    delete(&conn, "rq-a1");
    assert_eq!(
        create(&conn, &range, "rq-b1", Some("req-b"), Some("192.0.2.25")),
        Ok(ip("192.0.2.25"))
    );
    delete(&conn, "rq-b1");
}

#[test]
fn get_names_the_static_address_first_once_the_domain_runs() {
    let _turn = one_at_a_time();
    let conn = connect();
    let range = block("192.0.2.40", "192.0.2.49");
    let address = create(&conn, &range, "st-get", Some("get-id"), Some("192.0.2.44")).unwrap();
    let names = InstanceNames::for_key("st-get").unwrap();
    let stopped = read_instance(&conn, &names, NicKind::Bridge)
        .unwrap()
        .unwrap();
    assert!(to_contract_instance("test", stopped).addresses.is_empty());
    conn.lookup_domain_by_name(&names.domain)
        .unwrap()
        .create()
        .unwrap();
    let running = read_instance(&conn, &names, NicKind::Bridge)
        .unwrap()
        .unwrap();
    let instance = to_contract_instance("test", running);
    assert_eq!(
        instance.addresses[0].address,
        address.to_string(),
        "{instance:?}"
    );
    assert_eq!(
        instance
            .addresses
            .iter()
            .filter(|a| a.address == address.to_string())
            .count(),
        1
    );
    conn.lookup_domain_by_name(&names.domain)
        .unwrap()
        .destroy()
        .unwrap();
    delete(&conn, "st-get");
}
