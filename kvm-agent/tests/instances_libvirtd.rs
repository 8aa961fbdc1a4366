//! Get, List and Delete against a real private libvirtd (local mode, domain type qemu):
//! a UEFI domain built by the agent's XML, with a qcow2 overlay on a base volume and an
//! uploaded seed, is read, listed by tags and deleted with everything it owns.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_provider::{ErrorClass, pb};
use kvm_agent::config::{Attachment, Firmware, ImageFormat};
use kvm_agent::guest::cloud_init::{GuestAgent, seed_documents};
use kvm_agent::guest::seed::build_seed;
use kvm_agent::libvirt::naming::{InstanceNames, base_volume};
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::libvirt::xml::volume::{overlay_volume, raw_volume};
use kvm_agent::provider::instances::Instances;
use kvm_agent::transport::bulk::upload_volume;
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::Pool;

const GENEROUS: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_list_and_delete_a_uefi_domain_with_its_volumes() {
    let libvirtd = Libvirtd::start().unwrap();
    let config = Arc::new(config(vec![local_host("here", &libvirtd.socket())]));
    let pool = Arc::new(Pool::new(&config).unwrap());
    let host = pool.host("here").unwrap();
    let instances = Instances::new(config.clone(), pool.clone());

    // A dir pool named like the host's storagePool, a base volume, an overlay on it and
    // the seed: what Create will make.
    let images = libvirtd.dir().join("images");
    std::fs::create_dir(&images).unwrap();
    let key = "uid-get-list-delete";
    let names = InstanceNames::for_key(key).unwrap();
    let base = base_volume(&"ab".repeat(32)).unwrap();
    let pool_xml = format!(
        "<pool type='dir'><name>default</name><target><path>{}</path></target></pool>",
        images.display()
    );
    let (base_name, overlay_name, seed_name) = (
        base.clone(),
        names.overlay_volume.clone(),
        names.seed_volume.clone(),
    );
    let seed = build_seed(
        &seed_documents(b"#cloud-config\n", None, GuestAgent::Install).unwrap(),
        key,
        "egressproxy-uid",
        None,
    );
    let seed_len = seed.len() as u64;
    let (overlay_path, seed_path) = host
        .call::<_, kvm_agent::TransportError, _>(
            LibvirtOp::new("virStoragePoolCreateXML"),
            deadline_in(GENEROUS),
            move |c| {
                let pool = c.create_storage_pool_xml(&pool_xml, 0)?;
                let base = virt::storage_vol::StorageVol::create_xml(
                    &pool,
                    &raw_volume(&base_name, 1 << 20).unwrap(),
                    0,
                )?;
                let overlay = virt::storage_vol::StorageVol::create_xml(
                    &pool,
                    &overlay_volume(
                        &overlay_name,
                        1 << 30,
                        std::path::Path::new(&base.path()?),
                        ImageFormat::Raw,
                    )
                    .unwrap(),
                    0,
                )?;
                let seed = virt::storage_vol::StorageVol::create_xml(
                    &pool,
                    &raw_volume(&seed_name, seed_len).unwrap(),
                    0,
                )?;
                Ok((overlay.path()?, seed.path()?))
            },
        )
        .await
        .unwrap();
    upload_volume(
        &host,
        "default",
        &names.seed_volume,
        std::io::Cursor::new(seed),
        seed_len,
        deadline_in(GENEROUS),
    )
    .await
    .unwrap();
    // qemu-img made a real qcow2 overlay whose backing file is the base.
    let info = std::process::Command::new("qemu-img")
        .args(["info", "-U", &overlay_path])
        .output()
        .unwrap();
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains("file format: qcow2"), "{info}");
    assert!(info.contains(&base), "{info}");

    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 256,
        firmware: Firmware::Uefi,
        overlay_path: overlay_path.into(),
        seed_path: seed_path.into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: None,
            static_address: None,
            key: key.into(),
            name: "ns/proxy".into(),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "cd".repeat(32),
            placement: PlacementRecord {
                zone: None,
                host: "here".into(),
                machine_type: "small".into(),
                image: "debian-12".into(),
                base_volume: base.clone(),
            },
            tags: [
                ("cluster".to_string(), "it".to_string()),
                ("uid".to_string(), key.to_string()),
            ]
            .into(),
        },
    };
    let xml = spec.to_xml().unwrap();
    host.call::<_, kvm_agent::TransportError, _>(
        LibvirtOp::new("virDomainDefineXML"),
        deadline_in(Duration::from_secs(180)),
        move |c| {
            c.define_domain_xml(&xml)?;
            Ok(())
        },
    )
    .await
    .unwrap();

    let id = format!("here/{key}");
    let instance = instances.get(&id, deadline_in(GENEROUS)).await.unwrap();
    assert_eq!(instance.id, id);
    assert_eq!(instance.key, key);
    assert_eq!(instance.name, "ns/proxy");
    assert_eq!(instance.state(), pb::InstanceState::Stopped);
    assert_eq!(instance.proxy_port, 3128);
    assert_eq!(instance.tags["cluster"], "it");
    assert_eq!(
        instance.create_time.unwrap().seconds,
        "2026-11-30T01:02:03Z"
            .parse::<prost_types::Timestamp>()
            .unwrap()
            .seconds
    );
    assert_eq!(instance.placement.unwrap().machine_type, "small");

    let select = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<Vec<_>>()
    };
    let listed = instances
        .list(&select(&[("cluster", "it")]), deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
        [id.as_str()]
    );
    assert!(
        instances
            .list(&select(&[("cluster", "other")]), deadline_in(GENEROUS))
            .await
            .unwrap()
            .is_empty()
    );

    instances.delete(&id, deadline_in(GENEROUS)).await.unwrap();
    let err = instances
        .get(&id, deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .to_provider_error();
    assert_eq!(err.class, ErrorClass::NotFound, "{err}");
    instances.delete(&id, deadline_in(GENEROUS)).await.unwrap();
    let left: Vec<String> = std::fs::read_dir(&images)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, [base], "overlay and seed deleted, the base kept");

    // Ids: one this provider cannot have returned names no instance (Get NOT_FOUND,
    // Delete succeeds); a host no longer configured is permanent (an endless retry would pin the finalizer), for Get
    // and Delete alike.
    let err = instances
        .get("no-slash", deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .to_provider_error();
    assert_eq!(err.class, ErrorClass::NotFound, "{err}");
    instances
        .delete("no-slash", deadline_in(GENEROUS))
        .await
        .unwrap();
    for result in [
        instances
            .get("gone/uid", deadline_in(GENEROUS))
            .await
            .map(drop),
        instances.delete("gone/uid", deadline_in(GENEROUS)).await,
    ] {
        let err = result.unwrap_err().to_provider_error();
        assert_eq!(err.class, ErrorClass::Permanent, "{err}");
        assert_eq!(err.reason, "HOST_NOT_CONFIGURED");
    }
}
