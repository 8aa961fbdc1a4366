//! Hostile values in every field a caller controls, over gRPC, against both the
//! reference provider and `kvm-agent serve` as processes: XML metacharacters, `/`,
//! `..`, NUL and other controls, right-to-left marks, 1 MiB strings, and non-UTF-8
//! bytes in user-data and vendor-data.
//!
//! Each value gets INVALID_ARGUMENT with a BadRequest violation naming its field, or is
//! accepted and kept exactly: the reference provider returns it unchanged, and for the
//! agent (whose configured host has no libvirt, so an accepted Create stops at the
//! connection) the same request is planned in-process and its domain defined on
//! libvirt's `test:///default` driver, where the domain and volume names are the
//! agent's fixed `[A-Za-z0-9._-]` names and the metadata reads back equal. Neither
//! process crashes.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::time::Duration;

use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_provider::pb;
use egressproxy_provider::pb::provider_client::ProviderClient;
use kvm_agent::config::Config;
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, METADATA_NAMESPACE, PlacementRecord};
use kvm_agent::provider::plan::plan_create;
use tonic::transport::Channel;
use tonic_types::StatusExt;

const AGENT_CONFIG: &str = "hosts:\n- name: hv1\n  local: true\n  libvirtSocket: /nonexistent/libvirt-sock\n\
     machineTypes:\n  small: {vcpus: 1, memoryMiB: 512, diskGiB: 1}\n\
     images:\n  debian-12: {url: 'http://127.0.0.1:9/d.qcow2', guestAgent: preinstalled}\n";

/// `kvm-agent serve` on a loopback port, killed on drop.
struct Agent {
    served: ServedAgent,
    _dir: tempfile::TempDir,
}

impl Agent {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("agent.yaml");
        std::fs::write(&config, AGENT_CONFIG).unwrap();
        let served = ServedAgent::start_with(&config, "127.0.0.1:0", |command| {
            command
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .stderr(Stdio::null());
        })
        .unwrap();
        Agent { served, _dir: dir }
    }
}

/// The hostile strings, by what they attack.
fn hostile_strings() -> Vec<(&'static str, String)> {
    vec![
        ("xml", r#"<x a="1">&amp;</x>'"]]><!--"#.to_owned()),
        ("slash", "ns/name/../x".to_owned()),
        ("dotdot", "..".to_owned()),
        ("traversal", "../../../etc/passwd".to_owned()),
        ("nul", "a\0b".to_owned()),
        ("controls", "a\u{1}\u{1b}[31m\r\n\u{85}b".to_owned()),
        ("rtl", "\u{202e}gnp.exe\u{200f}".to_owned()),
        ("megabyte", "\u{202e}<&>/".repeat(1 << 18)),
    ]
}

/// Every field a caller sets, with a setter putting `value` there.
type Setter = fn(&mut pb::CreateInstanceRequest, &str);

const STRING_FIELDS: &[(&str, Setter)] = &[
    ("key", |r, v| r.key = v.to_owned()),
    ("name", |r, v| r.name = v.to_owned()),
    ("tags", |r, v| {
        r.tags.insert(v.to_owned(), "v".to_owned());
    }),
    ("tags", |r, v| {
        r.tags.insert("k".to_owned(), v.to_owned());
    }),
    ("placement.machine_type", |r, v| {
        r.placement.as_mut().unwrap().machine_type = v.to_owned();
    }),
    ("placement.image", |r, v| {
        r.placement.as_mut().unwrap().image = v.to_owned();
    }),
    ("placement.host", |r, v| {
        r.placement.as_mut().unwrap().location = Some(pb::placement::Location::Host(v.to_owned()));
    }),
    ("placement.zone", |r, v| {
        r.placement.as_mut().unwrap().location = Some(pb::placement::Location::Zone(v.to_owned()));
    }),
    ("cloud_init.user_data", |r, v| {
        r.cloud_init.as_mut().unwrap().user_data = v.as_bytes().to_vec();
    }),
    ("cloud_init.vendor_data", |r, v| {
        r.cloud_init.as_mut().unwrap().vendor_data = Some(v.as_bytes().to_vec());
    }),
];

/// Non-UTF-8 documents, as user-data and as vendor-data.
fn hostile_documents() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("latin1", b"#cloud-config\nhostname: caf\xe9\n".to_vec()),
        ("invalid-utf8", b"\xff\xfe\xfd#!/bin/sh\n\x80\x00".to_vec()),
        ("gzip-magic", b"\x1f\x8b\x08\x00garbage\xff".to_vec()),
        (
            "mime-binary",
            b"MIME-Version: 1.0\nContent-Type: text/plain\n\n\xc3\x28\x00".to_vec(),
        ),
        ("megabyte", vec![0xff; 1 << 20]),
    ]
}

fn base_request(key: &str, host: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.to_owned(),
        name: "ns/proxy".into(),
        tags: HashMap::from([("cluster".to_owned(), "hostile".to_owned())]),
        placement: Some(pb::Placement {
            location: Some(pb::placement::Location::Host(host.to_owned())),
            machine_type: "small".into(),
            image: "debian-12".into(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}

/// A refusal must be INVALID_ARGUMENT naming `field` (a tag as `tags[...]`).
fn assert_names_field(status: &tonic::Status, field: &str, case: &str) {
    assert_eq!(
        status.code(),
        tonic::Code::InvalidArgument,
        "{case}: {status:?}"
    );
    let details = status.get_error_details();
    let fields: Vec<&str> = details
        .bad_request()
        .map(|b| {
            b.field_violations
                .iter()
                .map(|v| v.field.as_str())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        fields
            .iter()
            .any(|f| *f == field || f.starts_with(&format!("{field}["))),
        "{case}: {field} not among {fields:?}"
    );
    assert!(
        status.message().len() + status.details().len() < 16 * 1024,
        "{case}: an oversized status"
    );
}

async fn client(endpoint: String) -> ProviderClient<Channel> {
    ProviderClient::connect(endpoint)
        .await
        .unwrap()
        .max_decoding_message_size(16 << 20)
}

async fn create(
    client: &mut ProviderClient<Channel>,
    request: pb::CreateInstanceRequest,
) -> Result<pb::Instance, tonic::Status> {
    let mut request = tonic::Request::new(request);
    request.set_timeout(Duration::from_secs(20));
    client
        .create_instance(request)
        .await
        .map(|r| r.into_inner().instance.expect("an instance"))
}

/// What the agent would define for `request`: planned exactly as `serve` plans it, the
/// domain XML built as Create builds it, defined on `test:///default` and read back.
fn define_on_test_driver(config: &Config, request: &pb::CreateInstanceRequest, case: &str) {
    let plan = plan_create(config, request).unwrap_or_else(|e| panic!("{case}: {e}"));
    for name in [
        &plan.names.domain,
        &plan.names.overlay_volume,
        &plan.names.seed_volume,
    ] {
        assert!(
            name.starts_with("egressproxy-")
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
            "{case}: {name:?}"
        );
    }
    let spec = DomainSpec {
        name: plan.names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: plan.machine_type.1.vcpus,
        memory_mib: plan.machine_type.1.memory_mib,
        firmware: plan.image.1.firmware,
        overlay_path: format!("/var/lib/libvirt/images/{}", plan.names.overlay_volume).into(),
        seed_path: format!("/var/lib/libvirt/images/{}", plan.names.seed_volume).into(),
        attachment: plan.candidates[0].attachment(),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: None,
            static_address: None,
            key: request.key.clone(),
            name: request.name.clone(),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: request.proxy_port,
            spec_sha256: plan.spec_sha256.clone(),
            placement: PlacementRecord {
                zone: None,
                host: plan.candidates[0].name.clone(),
                machine_type: plan.machine_type.0.clone(),
                image: plan.image.0.clone(),
                base_volume: format!("egressproxy-base-{}.img", "cd".repeat(32)),
            },
            tags: request
                .tags
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
        },
    };
    let xml = spec.to_xml().unwrap();
    virt::error::clear_error_callback();
    let conn = virt::connect::Connect::open(Some("test:///default")).unwrap();
    let domain = conn.define_domain_xml(&xml).unwrap();
    let name = domain.name().unwrap();
    let element = domain
        .metadata(
            virt::sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(METADATA_NAMESPACE),
            0,
        )
        .unwrap();
    domain.undefine().unwrap();
    assert_eq!(name, plan.names.domain, "{case}");
    assert_eq!(
        InstanceMetadata::parse(&element).unwrap(),
        spec.metadata,
        "{case}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_values_are_refused_naming_their_field_or_kept_exactly() {
    let reference = ReferenceProvider::start(&["--provisioning-delay", "0s"]).unwrap();
    let mut agent = Agent::start();
    let mut reference_client = client(reference.endpoint().to_owned()).await;
    let mut agent_client = client(agent.served.endpoint()).await;
    let config = Config::parse(AGENT_CONFIG).unwrap();

    let mut cases: Vec<(
        String,
        &str,
        pb::CreateInstanceRequest,
        pb::CreateInstanceRequest,
    )> = Vec::new();
    let mut n = 0;
    for (value_name, value) in hostile_strings() {
        for (field, set) in STRING_FIELDS {
            n += 1;
            let key = format!("hostile-{n}");
            let mut for_reference = base_request(&key, "local");
            let mut for_agent = base_request(&key, "hv1");
            set(&mut for_reference, &value);
            set(&mut for_agent, &value);
            cases.push((
                format!("{value_name} in {field}"),
                field,
                for_reference,
                for_agent,
            ));
        }
    }
    for (document_name, document) in hostile_documents() {
        for (field, vendor) in [
            ("cloud_init.user_data", false),
            ("cloud_init.vendor_data", true),
        ] {
            n += 1;
            let key = format!("hostile-{n}");
            let mut requests = [base_request(&key, "local"), base_request(&key, "hv1")];
            for request in &mut requests {
                let cloud_init = request.cloud_init.as_mut().unwrap();
                if vendor {
                    cloud_init.vendor_data = Some(document.clone());
                } else {
                    cloud_init.user_data = document.clone();
                }
            }
            let [for_reference, for_agent] = requests;
            cases.push((
                format!("{document_name} in {field}"),
                field,
                for_reference,
                for_agent,
            ));
        }
    }

    let (mut refused, mut kept) = (0, 0);
    let mut table = format!("{:<40} {:<18} {:<18}\n", "case", "reference", "kvm-agent");
    for (case, field, for_reference, for_agent) in &cases {
        table.push_str(&format!("{case:<40} "));
        match create(&mut reference_client, for_reference.clone()).await {
            Err(status) => {
                assert_names_field(&status, field, &format!("reference: {case}"));
                refused += 1;
                table.push_str(&format!("{:<18} ", "INVALID_ARGUMENT"));
            }
            Ok(instance) => {
                assert_eq!(instance.key, for_reference.key, "reference: {case}");
                assert_eq!(instance.name, for_reference.name, "reference: {case}");
                assert_eq!(instance.tags, for_reference.tags, "reference: {case}");
                reference_client
                    .delete_instance(pb::DeleteInstanceRequest { id: instance.id })
                    .await
                    .unwrap();
                kept += 1;
                table.push_str(&format!("{:<18} ", "kept"));
            }
        }
        match create(&mut agent_client, for_agent.clone()).await {
            Err(status) if status.code() == tonic::Code::InvalidArgument => {
                assert_names_field(&status, field, &format!("kvm-agent: {case}"));
                refused += 1;
                table.push_str("INVALID_ARGUMENT\n");
            }
            // Past every check: the configured host has no libvirt. What Create would
            // have defined is checked on the test driver instead.
            Err(status) => {
                assert_eq!(
                    status.code(),
                    tonic::Code::Unavailable,
                    "kvm-agent: {case}: {status:?}"
                );
                define_on_test_driver(&config, for_agent, case);
                kept += 1;
                table.push_str("kept (escaped)\n");
            }
            Ok(instance) => panic!("kvm-agent: {case}: created without libvirt: {instance:?}"),
        }
    }

    // Hostile instance ids: refused naming `id`, not found, or (the agent) on a host it
    // does not have.
    for (value_name, value) in hostile_strings() {
        for id in [
            value.clone(),
            format!("hv1/{value}"),
            format!("local/{value}"),
        ] {
            for (provider, client) in [
                ("reference", &mut reference_client),
                ("kvm-agent", &mut agent_client),
            ] {
                let got = client
                    .get_instance(pb::GetInstanceRequest { id: id.clone() })
                    .await
                    .unwrap_err();
                match got.code() {
                    tonic::Code::InvalidArgument => {
                        assert_names_field(&got, "id", &format!("{provider}: {value_name} id"));
                    }
                    // The part before the last `/` names a host the agent does not have.
                    tonic::Code::FailedPrecondition if provider == "kvm-agent" => {
                        let details = got.get_error_details();
                        let reason = details.error_info().map(|i| i.reason.as_str());
                        assert_eq!(reason, Some("HOST_NOT_CONFIGURED"), "{value_name} id");
                    }
                    // A valid key on the agent's host (`hv1/..`): looked up in libvirt,
                    // which this agent's host does not have.
                    tonic::Code::Unavailable
                        if provider == "kvm-agent" && InstanceNames::for_key(&value).is_ok() => {}
                    code => assert_eq!(
                        code,
                        tonic::Code::NotFound,
                        "{provider}: {value_name} id: {got:?}"
                    ),
                }
            }
        }
    }

    // Both are still up and answering.
    assert!(
        agent.served.try_wait().unwrap().is_none(),
        "kvm-agent exited"
    );
    for client in [&mut reference_client, &mut agent_client] {
        client
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .unwrap();
    }
    println!("{table}");
    println!(
        "{} hostile requests: {refused} refused naming their field, {kept} kept exactly",
        2 * cases.len()
    );
}
