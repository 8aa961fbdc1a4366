//! Address identities' DHCP reservations against libvirt's `test:///default` driver,
//! which keeps a network's host list as libvirtd does (`virNetworkUpdate`, live and
//! config): an identity's reservation is made once and found again, two identities get
//! two addresses, the sweep removes exactly the reservations no domain of the agent
//! holds (also the one a Delete interrupted between the undefine and the sweep leaves),
//! never another's, and an identity whose reservation was removed gets its address back.
//! A network whose DHCP range is reserved full refuses the next identity
//! (`ADDRESSES_EXHAUSTED`, quota: retried later) and takes nothing from the identities
//! that hold addresses. Identities racing for a range with one free address each, all
//! choosing the same address first, all get one and no two the same; an identity whose
//! choice another reservation takes between its read and its update chooses again as
//! often as that happens, and running out of addresses that way is
//! `ADDRESSES_EXHAUSTED`, not libvirt's refusal.
//!
//! Every connection in the process shares the driver's state: the test uses a network of
//! its own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Barrier;

use kvm_agent::config::{Attachment, Firmware};
use kvm_agent::libvirt::domains::delete_instance;
use kvm_agent::libvirt::identity_mac::mac_for_identity;
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::reservations::{self, identity_reservations, reserve, reserve_with, sweep};
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::libvirt::xml::network::{DhcpFacts, host_xml};
use virt::connect::Connect;
use virt::sys;

const NETWORK: &str = "resv-test";

fn connect() -> Connect {
    virt::error::clear_error_callback();
    Connect::open(Some("test:///default")).expect("test:///default opens")
}

fn network(conn: &Connect) {
    let xml = format!(
        "<network><name>{NETWORK}</name><bridge name='resvbr0'/>\
         <ip address='10.77.0.1' netmask='255.255.255.0'><dhcp>\
         <range start='10.77.0.10' end='10.77.0.200'/>\
         <host mac='52:54:00:aa:bb:cc' ip='10.77.0.50'/>\
         </dhcp></ip></network>"
    );
    let net = conn.define_network_xml(&xml).unwrap();
    net.create().unwrap();
}

/// Defines the agent's domain for `key` with `identity`'s MAC and metadata.
fn define(conn: &Connect, key: &str, identity: &str) -> InstanceNames {
    let names = InstanceNames::for_key(key).unwrap();
    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 512,
        firmware: Firmware::Bios,
        overlay_path: format!("/var/lib/libvirt/images/{}", names.overlay_volume).into(),
        seed_path: format!("/var/lib/libvirt/images/{}", names.seed_volume).into(),
        attachment: Attachment::Network(NETWORK.into()),
        mac: Some(mac_for_identity(identity)),
        metadata: InstanceMetadata {
            key: key.into(),
            name: key.into(),
            created: "2026-12-02T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "ab".repeat(32),
            address_identity: Some(identity.into()),
            static_address: None,
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
    names
}

fn host_list(conn: &Connect) -> Vec<(Option<String>, Option<Ipv4Addr>)> {
    let net = conn.lookup_network_by_name(NETWORK).unwrap();
    let mut hosts: Vec<_> = DhcpFacts::parse(&net.xml_desc(0).unwrap())
        .unwrap()
        .hosts
        .into_iter()
        .map(|h| (h.mac, h.ip))
        .collect();
    hosts.sort();
    hosts
}

#[test]
fn reservations_follow_the_domains_of_their_identities() {
    let conn = connect();
    network(&conn);
    let before = host_list(&conn);

    // An identity's reservation, made once, found again.
    let a = define(&conn, "resv-a1", "identity-a");
    let first = reserve(&conn, NETWORK, "identity-a").unwrap();
    assert!(first.created);
    assert_eq!(first.mac, mac_for_identity("identity-a"));
    let again = reserve(&conn, NETWORK, "identity-a").unwrap();
    assert_eq!((again.ip, again.created), (first.ip, false));
    assert!(host_list(&conn).contains(&(Some(first.mac.clone()), Some(first.ip))));
    let in_range = u32::from(first.ip) >= u32::from(Ipv4Addr::new(10, 77, 0, 10))
        && u32::from(first.ip) <= u32::from(Ipv4Addr::new(10, 77, 0, 200));
    assert!(in_range, "{}", first.ip);

    // Another identity: another address.
    let _b = define(&conn, "resv-b1", "identity-b");
    let other = reserve(&conn, NETWORK, "identity-b").unwrap();
    assert_ne!(other.ip, first.ip);
    assert_ne!(
        other.ip,
        Ipv4Addr::new(10, 77, 0, 50),
        "the foreign host's address"
    );

    // Create's check: who holds the identity.
    let holders = reservations::holders_of(&conn, "identity-a").unwrap();
    assert_eq!(holders.keys, ["resv-a1"]);
    assert_eq!(holders.mac_shared_with, None);

    // While the domains exist, the sweep keeps both reservations.
    assert!(sweep(&conn, NETWORK).unwrap().is_empty());

    // A's last instance is deleted: the sweep removes its reservation, and only it (the
    // foreign entry for a libvirt MAC stays).
    delete_instance(&conn, &a, "no-such-pool").unwrap();
    assert_eq!(
        sweep(&conn, NETWORK).unwrap(),
        std::slice::from_ref(&first.mac)
    );
    let left: Vec<_> = identity_reservations(&conn, NETWORK).unwrap();
    assert_eq!(left, [(other.mac.clone(), Some(other.ip))]);
    assert!(host_list(&conn).contains(&(
        Some("52:54:00:aa:bb:cc".into()),
        Some("10.77.0.50".parse().unwrap())
    )));

    // The identity's next instance gets its address back while it is free.
    let a2 = define(&conn, "resv-a2", "identity-a");
    let back = reserve(&conn, NETWORK, "identity-a").unwrap();
    assert_eq!((back.ip, back.created), (first.ip, true));

    // A Delete killed between the undefine and the sweep leaves a reservation without a
    // domain: the next sweep (of any Create or Delete on the host) removes it.
    conn.lookup_domain_by_name(&a2.domain)
        .unwrap()
        .undefine()
        .unwrap();
    assert_eq!(identity_reservations(&conn, NETWORK).unwrap().len(), 2);
    assert_eq!(
        sweep(&conn, NETWORK).unwrap(),
        std::slice::from_ref(&first.mac)
    );

    // The last one goes: the host list is back to what it was.
    delete_instance(
        &conn,
        &InstanceNames::for_key("resv-b1").unwrap(),
        "no-such-pool",
    )
    .unwrap();
    sweep(&conn, NETWORK).unwrap();
    assert_eq!(host_list(&conn), before);

    // A network that does not exist holds no reservations to sweep.
    assert!(sweep(&conn, "no-such-network").unwrap().is_empty());
}

#[test]
fn a_network_without_dhcp_cannot_give_an_identity_an_address() {
    let conn = connect();
    let net = conn
        .define_network_xml(
            "<network><name>resv-nodhcp</name><bridge name='resvbr1'/>\
             <ip address='10.78.0.1' netmask='255.255.255.0'/></network>",
        )
        .unwrap();
    net.create().unwrap();
    let error = match reserve(&conn, "resv-nodhcp", "identity-x") {
        Err(kvm_agent::transport::call::CallFailure::Agent(error)) => error,
        other => panic!("{other:?}"),
    };
    assert_eq!(error.classify().reason, "NETWORK_WITHOUT_DHCP", "{error}");
}

#[test]
fn a_network_whose_range_is_reserved_full_refuses_the_next_identity() {
    let conn = connect();
    // A range of two addresses, one of them reserved for a machine that is not ours.
    let net = conn
        .define_network_xml(
            "<network><name>resv-full</name><bridge name='resvbr2'/>\
             <ip address='10.79.0.1' netmask='255.255.255.0'><dhcp>\
             <range start='10.79.0.10' end='10.79.0.11'/>\
             <host mac='52:54:00:aa:bb:01' ip='10.79.0.10'/>\
             </dhcp></ip></network>",
        )
        .unwrap();
    net.create().unwrap();

    let granted = reserve(&conn, "resv-full", "identity-full-a").unwrap();
    assert_eq!(granted.ip, Ipv4Addr::new(10, 79, 0, 11));

    let error = match reserve(&conn, "resv-full", "identity-full-b") {
        Err(kvm_agent::transport::call::CallFailure::Agent(error)) => error,
        other => panic!("a third address out of a range of two: {other:?}"),
    };
    let classification = error.classify();
    assert_eq!(classification.reason, "ADDRESSES_EXHAUSTED", "{error}");
    assert_eq!(
        classification.class,
        egressproxy_provider::ErrorClass::QuotaExhausted,
        "a full network is quota, retried later, not a bug in the request"
    );
    assert!(classification.retry_after.is_some(), "{classification:?}");
    assert!(error.to_string().contains("resv-full"), "{error}");

    // The identity that holds an address keeps it: the refusal took nothing away.
    let again = reserve(&conn, "resv-full", "identity-full-a").unwrap();
    assert_eq!((again.ip, again.created), (granted.ip, false));
}

/// `count` identities whose MACs all start the search at index `start` of a range of
/// `range_size` addresses (see `reservations::choose_address`): racing, they all choose
/// the same address first.
fn identities_starting_at(start: u64, range_size: u64, count: usize) -> Vec<String> {
    let seed = |mac: &str| {
        mac.split(':').skip(2).fold(0u64, |acc, octet| {
            acc << 8 | u64::from_str_radix(octet, 16).unwrap()
        })
    };
    (0..)
        .map(|i| format!("identity-race-{i}"))
        .filter(|identity| seed(&mac_for_identity(identity)) % range_size == start)
        .take(count)
        .collect()
}

/// The identities' reservations on `network`, made at once, each on a connection of its
/// own as agents on one hypervisor have. Every racer has chosen its first address before
/// any asks libvirt for it.
fn race(network: &str, identities: &[String]) -> Vec<reservations::Reservation> {
    let all_chosen = Barrier::new(identities.len());
    std::thread::scope(|scope| {
        let racers: Vec<_> = identities
            .iter()
            .map(|identity| {
                let all_chosen = &all_chosen;
                scope.spawn(move || {
                    let conn = connect();
                    let mut first = true;
                    reserve_with(&conn, network, identity, &mut |_| {
                        if std::mem::take(&mut first) {
                            all_chosen.wait();
                        }
                    })
                })
            })
            .collect();
        racers
            .into_iter()
            .zip(identities)
            .map(|(racer, identity)| {
                racer
                    .join()
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{identity}: {e:?}"))
            })
            .collect()
    })
}

#[test]
fn racing_identities_never_share_an_address() {
    const RACERS: usize = 8;
    // A range of RACERS + 1 addresses, its first reserved for a machine that is not ours:
    // exactly RACERS free.
    let conn = connect();
    let net = conn
        .define_network_xml(
            "<network><name>resv-race</name><bridge name='resvbr3'/>\
             <ip address='10.80.0.1' netmask='255.255.255.0'><dhcp>\
             <range start='10.80.0.10' end='10.80.0.18'/>\
             <host mac='52:54:00:aa:bb:02' ip='10.80.0.10'/>\
             </dhcp></ip></network>",
        )
        .unwrap();
    net.create().unwrap();
    // Every racer's search starts at 10.80.0.11 and all read the same host list, so all
    // choose it first: one gets it, the others lose that choice and choose again.
    let identities = identities_starting_at(1, RACERS as u64 + 1, RACERS);

    let granted = race("resv-race", &identities);
    let addresses: BTreeSet<_> = granted.iter().map(|r| r.ip).collect();
    assert_eq!(addresses.len(), RACERS, "{granted:?}");
    assert!(
        !addresses.contains(&Ipv4Addr::new(10, 80, 0, 10)),
        "{granted:?}"
    );
    assert!(granted.iter().all(|r| r.created), "{granted:?}");
    let lost: u64 = granted.iter().map(|r| r.lost_choices).sum();
    assert!(lost >= RACERS as u64 - 1, "{granted:?}");

    // The race filled the range: one more identity finds no address.
    let error = match reserve(&conn, "resv-race", "identity-race-late") {
        Err(kvm_agent::transport::call::CallFailure::Agent(error)) => error,
        other => panic!("an address out of a full range: {other:?}"),
    };
    assert_eq!(error.classify().reason, "ADDRESSES_EXHAUSTED", "{error}");
}

#[test]
fn an_identity_whose_choices_are_taken_chooses_again_until_the_range_is_full() {
    let conn = connect();
    let net = conn
        .define_network_xml(
            "<network><name>resv-lose</name><bridge name='resvbr4'/>\
             <ip address='10.81.0.1' netmask='255.255.255.0'><dhcp>\
             <range start='10.81.0.10' end='10.81.0.15'/>\
             </dhcp></ip></network>",
        )
        .unwrap();
    net.create().unwrap();
    // Another agent's Create reserves the address this one chose, between its read of
    // the host list and its update.
    let mut rivals = 0;
    let mut rival_takes = |ip: Ipv4Addr| {
        rivals += 1;
        let host = host_xml(
            &mac_for_identity(&format!("identity-rival-{rivals}")),
            Some(ip),
        );
        net.update(
            sys::VIR_NETWORK_UPDATE_COMMAND_ADD_LAST,
            sys::VIR_NETWORK_SECTION_IP_DHCP_HOST,
            -1,
            &host.unwrap(),
            sys::VIR_NETWORK_UPDATE_AFFECT_LIVE | sys::VIR_NETWORK_UPDATE_AFFECT_CONFIG,
        )
        .unwrap();
    };

    // Four choices lost in a row (more than the two retries there once were), the fifth
    // is granted, and no two entries hold one address.
    let mut taken = 0;
    let granted = reserve_with(&conn, "resv-lose", "identity-loser", &mut |ip| {
        if taken < 4 {
            taken += 1;
            rival_takes(ip);
        }
    })
    .unwrap();
    assert_eq!((granted.created, granted.lost_choices), (true, 4));
    let held: Vec<_> = DhcpFacts::parse(&net.xml_desc(0).unwrap())
        .unwrap()
        .hosts
        .into_iter()
        .filter_map(|h| h.ip)
        .collect();
    assert_eq!(held.len(), 5, "{held:?}");
    assert_eq!(held.iter().collect::<BTreeSet<_>>().len(), 5, "{held:?}");
    assert!(held.contains(&granted.ip), "{held:?}");

    // Losing the last free address is running out of addresses, not libvirt's refusal.
    let error = match reserve_with(&conn, "resv-lose", "identity-loser-2", &mut rival_takes) {
        Err(kvm_agent::transport::call::CallFailure::Agent(error)) => error,
        other => panic!("the range's last address was taken: {other:?}"),
    };
    assert_eq!(error.classify().reason, "ADDRESSES_EXHAUSTED", "{error}");
}
