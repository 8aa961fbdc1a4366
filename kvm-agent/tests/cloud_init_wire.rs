//! A bad `#cloud-config` as a gRPC client sees it: `kvm-agent serve` as a process, a
//! plain tonic client over TCP, and the error details decoded from the wire with
//! `tonic-types`, not with the project's own mapping. The reason is the one
//! docs/kvm-agent.md documents, `INVALID_CLOUD_CONFIG`, and the field at fault is
//! `cloud_init.user_data`. The request fails before any hypervisor is reached, so the
//! configured host needs no libvirt.

use std::time::Duration;

use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::pb;
use egressproxy_provider::pb::provider_client::ProviderClient;
use tonic_types::StatusExt;

/// `kvm-agent serve` on a loopback port, killed on drop.
struct Served {
    agent: ServedAgent,
    _dir: tempfile::TempDir,
}

impl Served {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("agent.yaml");
        std::fs::write(
            &config,
            format!(
                "hosts:\n- name: hv1\n  local: true\n  libvirtSocket: {}/no-libvirt-sock\n\
                 machineTypes:\n  small: {{vcpus: 1, memoryMiB: 512, diskGiB: 1}}\n\
                 images:\n  debian-12: {{url: 'http://127.0.0.1:9/d.qcow2', guestAgent: preinstalled}}\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let agent = ServedAgent::start_with(&config, "127.0.0.1:0", |command| {
            command
                .env_remove("RUST_LOG")
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
        })
        .unwrap();
        Served { agent, _dir: dir }
    }
}

fn create_request(user_data: &[u8]) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: "wire-cloud-init".into(),
        name: "ns/proxy".into(),
        tags: Default::default(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "small".into(),
            image: "debian-12".into(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: user_data.to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_bad_cloud_config_reaches_the_wire_with_its_documented_reason() {
    let served = Served::start();
    let mut client = ProviderClient::connect(served.agent.endpoint())
        .await
        .unwrap();
    for user_data in [
        &b"#cloud-config\n- password: hunter2\n"[..],
        b"#cloud-config\npackages: hunter2\n",
        b"#cloud-config\nruncmd:\n",
        b"#cloud-config\nhunter2: [\n",
    ] {
        let mut request = tonic::Request::new(create_request(user_data));
        request.set_timeout(Duration::from_secs(20));
        let status = client.create_instance(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        let details = status.get_error_details();
        let info = details.error_info().expect("ErrorInfo on the wire");
        assert_eq!(info.reason, "INVALID_CLOUD_CONFIG", "{status:?}");
        let bad_request = details.bad_request().expect("BadRequest on the wire");
        let fields: Vec<&str> = bad_request
            .field_violations
            .iter()
            .map(|v| v.field.as_str())
            .collect();
        assert_eq!(fields, ["cloud_init.user_data"], "{status:?}");
        assert!(!status.message().contains("hunter2"), "{status:?}");
        assert!(!format!("{details:?}").contains("hunter2"), "{details:?}");
    }
}
