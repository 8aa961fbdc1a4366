//! `kvm-agent serve` SIGKILLed between an address identity's DHCP reservation and the
//! domain's start, against a private libvirtd reached over real SSH: the moment the
//! reservation shows in the network, libvirtd is frozen and the agent is killed. A start
//! the agent had already sent would still run once libvirtd continues, so an attempt
//! counts only when the domain is still shut off and QEMU was never launched for it
//! (libvirt writes the domain's QEMU log at launch); otherwise another identity is tried.
//! Once restarted, the agent's ListInstances and the network's reservations agree (the
//! instance that holds the reservation is listed, defined and not started, with its
//! identity, and no other reservation appeared), the Create retried converges on the reserved address (the iPXE guest's
//! DHCP lease), and the Delete gives the reservation back.

mod guest_env;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use egressproxy_integration::eventually::eventually;
use egressproxy_integration::http_server::HttpServer;
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::client::{Client, ClientOptions, connect_lazy};
use egressproxy_provider::pb;
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};
use kvm_agent::libvirt::identity_mac::mac_for_identity;
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::network::DhcpFacts;

const GENEROUS: Duration = Duration::from_secs(120);

fn client(agent: &ServedAgent) -> Client {
    let mut options = ClientOptions::new(agent.endpoint());
    options.call_timeout = GENEROUS;
    connect_lazy(&options).unwrap()
}

fn request(key: &str, identity: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("test/{key}"),
        tags: [("cluster".to_string(), "it".to_string())].into(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "tiny".into(),
            image: "ipxe".into(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
        address_identity: Some(identity.into()),
        ..Default::default()
    }
}

/// The network's DHCP reservations (MAC, address), sorted, read through its own
/// libvirt connection.
fn reservations(conn: &virt::connect::Connect) -> BTreeSet<(String, String)> {
    let network = conn.lookup_network_by_name("default").unwrap();
    let xml = network.xml_desc(0).unwrap();
    DhcpFacts::parse(&xml)
        .unwrap()
        .hosts
        .into_iter()
        .filter_map(|host| Some((host.mac?, host.ip?.to_string())))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_after_the_reservation_agrees_with_the_network_once_restarted() {
    let mut guest_host = GuestHost::start();
    let work = tempfile::tempdir().unwrap();
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let config = work.path().join("config.yaml");
    std::fs::write(
        &config,
        guest_host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha),
    )
    .unwrap();
    virt::error::clear_error_callback();
    let conn = virt::connect::Connect::open(Some(&guest_host.libvirtd.uri())).unwrap();
    let before = reservations(&conn);

    // Until the kill lands before the domain's start: the restarted agent then lists
    // the instance that holds the reservation, defined and never started. (The start
    // reaching libvirtd within the few milliseconds between the reservation and the
    // freeze is possible, only unlikely: then that instance is deleted and another
    // identity tried.)
    let mut agent = ServedAgent::start(&config).unwrap();
    let mut attempt = 0;
    let (identity, mac, holder) = loop {
        attempt += 1;
        assert!(
            attempt <= 5,
            "the kill never landed before the domain's start"
        );
        let identity = format!("identity-{attempt}");
        let mac = mac_for_identity(&identity);
        let mut creating = client(&agent);
        let first = request(&format!("killed-{attempt}"), &identity);
        let create = tokio::spawn(async move { creating.create_instance(first).await });
        // Looked at every 2 ms, not with `eventually` (10-100 ms between looks): the
        // agent starts the domain a few milliseconds after the reservation.
        let deadline = Instant::now() + GENEROUS;
        while !reservations(&conn).iter().any(|(m, _)| *m == mac) {
            assert!(Instant::now() < deadline, "no reservation for {identity}");
            if create.is_finished() {
                panic!(
                    "the Create ended before its reservation: {:?}",
                    create.await
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        guest_host.libvirtd.pause().unwrap();
        agent.kill();
        guest_host.libvirtd.resume().unwrap();
        assert!(
            create.await.unwrap().is_err(),
            "a killed agent answered the Create"
        );
        agent = ServedAgent::start(&config).unwrap();

        // The restarted agent lists the instance that holds the reservation.
        let listed = client(&agent)
            .list_instances(pb::ListInstancesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .instances;
        let mut holders: Vec<pb::Instance> = listed
            .iter()
            .filter(|i| i.address_identity.as_deref() == Some(identity.as_str()))
            .cloned()
            .collect();
        assert_eq!(holders.len(), 1, "{listed:#?}");
        let holder = holders.remove(0);
        let domain = InstanceNames::for_key(&holder.key).unwrap().domain;
        let state = conn
            .lookup_domain_by_name(&domain)
            .unwrap()
            .state()
            .unwrap()
            .0
            .to_raw();
        let qemu_log = guest_host
            .libvirtd
            .dir()
            .join(format!("log/qemu/{domain}.log"));
        if holder.state() == pb::InstanceState::Stopped
            && state == virt::sys::VIR_DOMAIN_SHUTOFF
            && !qemu_log.exists()
        {
            break (identity, mac, holder);
        }
        client(&agent)
            .delete_instance(pb::DeleteInstanceRequest { id: holder.id })
            .await
            .unwrap();
    };
    eprintln!("killed between the reservation and the start on attempt {attempt}");

    // Nothing else was reserved.
    let reserved: Vec<(String, String)> =
        reservations(&conn).difference(&before).cloned().collect();
    assert_eq!(reserved.len(), 1, "{reserved:?}");
    assert_eq!(reserved[0].0, mac);
    let address = reserved[0].1.clone();

    // The Create retried converges on the reserved address.
    let key = holder.key.clone();
    let created = client(&agent)
        .create_instance(request(&key, &identity))
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    let running = wait_running(&agent, &created.id).await;
    // Where the loop above looked for proof that QEMU was never launched.
    let domain = InstanceNames::for_key(&key).unwrap().domain;
    let qemu_log = guest_host
        .libvirtd
        .dir()
        .join(format!("log/qemu/{domain}.log"));
    assert!(qemu_log.exists(), "{} after the start", qemu_log.display());
    let addresses: Vec<&str> = running
        .addresses
        .iter()
        .map(|a| a.address.as_str())
        .collect();
    assert_eq!(addresses, [address.as_str()], "{running:#?}");

    // Another identity beside it gets another address, and its guest's lease is that
    // one: two instances never share an address.
    let other_identity = "identity-other";
    let other = client(&agent)
        .create_instance(request("other", other_identity))
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    let other_mac = mac_for_identity(other_identity);
    let other_reserved: Vec<String> = reservations(&conn)
        .into_iter()
        .filter(|(m, _)| *m == other_mac)
        .map(|(_, ip)| ip)
        .collect();
    assert_eq!(other_reserved.len(), 1, "{other_reserved:?}");
    assert_ne!(other_reserved[0], address);
    let other_running = wait_running(&agent, &other.id).await;
    let other_addresses: Vec<&str> = other_running
        .addresses
        .iter()
        .map(|a| a.address.as_str())
        .collect();
    assert_eq!(
        other_addresses,
        [other_reserved[0].as_str()],
        "{other_running:#?}"
    );

    // The Deletes give the reservations back.
    for id in [created.id, other.id] {
        client(&agent)
            .delete_instance(pb::DeleteInstanceRequest { id })
            .await
            .unwrap();
    }
    assert_eq!(reservations(&conn), before);
    assert!(
        guest_host.domains().is_empty(),
        "{:?}",
        guest_host.domains()
    );
}

/// Waits while the instance `id` is PROVISIONING until it is RUNNING (with an address,
/// as the agent reports it then) and returns it; any other state fails the test.
async fn wait_running(agent: &ServedAgent, id: &str) -> pb::Instance {
    eventually("the instance RUNNING with an address", GENEROUS, || {
        let mut asking = client(agent);
        let id = id.to_owned();
        async move {
            let instance = asking
                .get_instance(pb::GetInstanceRequest { id })
                .await
                .map_err(|e| e.to_string())?
                .into_inner()
                .instance
                .ok_or("no instance")?;
            match instance.state() {
                pb::InstanceState::Running => Ok(instance),
                pb::InstanceState::Provisioning => Err(instance.state_message),
                state => panic!("the instance went {state:?}, not RUNNING: {instance:#?}"),
            }
        }
    })
    .await
}
