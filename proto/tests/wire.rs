//! The contract on the wire, over real TCP with a plain tonic client (no deadline
//! helper, no client-side timer): the server scaffold answers an expired
//! `grpc-timeout` with DEADLINE_EXCEEDED and ErrorInfo, and every reason in the
//! registry of `docs/contract.md` is the reason the reference provider sends.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use egressproxy_provider::conformance::raw_call;
use egressproxy_provider::error::ERROR_DOMAIN;
use egressproxy_provider::pb;
use egressproxy_provider::pb::provider_client::ProviderClient;
use egressproxy_provider::reference::{
    AddressRange, Fault, FaultEffect, MemoryProvider, ReferenceConfig,
};
use egressproxy_provider::server::ProviderServer;
use egressproxy_provider::{ErrorClass, ProviderError};
use prost::Message;
use tonic::transport::Channel;
use tonic_types::StatusExt;

fn config() -> ReferenceConfig {
    ReferenceConfig {
        provisioning_delay: Duration::from_millis(100),
        deleting_delay: Duration::from_secs(60),
        hosts: vec!["local".into(), "full".into()],
        max_instances: [("full".to_string(), 0)].into(),
        ..ReferenceConfig::default()
    }
}

async fn start() -> (SocketAddr, MemoryProvider) {
    start_with(config()).await
}

async fn start_with(config: ReferenceConfig) -> (SocketAddr, MemoryProvider) {
    let provider = MemoryProvider::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = ProviderServer::new(provider.clone());
    tokio::spawn(async move {
        server
            .serve(listener, std::future::pending::<()>())
            .await
            .unwrap()
    });
    (address, provider)
}

async fn plain_client(address: SocketAddr) -> ProviderClient<Channel> {
    let channel = Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    ProviderClient::new(channel)
}

/// `message` sent to `method` over a bare HTTP/2 connection with only a raw
/// `grpc-timeout`: tonic's own channel would enforce the header on the client side.
async fn raw_call(
    address: SocketAddr,
    method: &str,
    message: &[u8],
    timeout: &str,
) -> tonic::Status {
    raw_call::unary(
        &address.to_string(),
        &format!("/egressproxy.provider.v1.Provider/{method}"),
        message,
        timeout,
        Duration::from_secs(10),
    )
    .await
    .expect("the server answers by the deadline")
}

fn error_info(status: &tonic::Status) -> (String, String) {
    let details = status.get_error_details();
    let info = details
        .error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    (info.domain.clone(), info.reason.clone())
}

#[tokio::test]
async fn an_expired_grpc_timeout_answers_deadline_exceeded_with_error_info() {
    let (address, provider) = start().await;
    provider.faults().inject(Fault {
        method: Some("GetInstance".into()),
        remaining: Some(1),
        effect: FaultEffect::Hang,
        message: String::new(),
        retry_after: None,
    });
    let started = Instant::now();
    let request = pb::GetInstanceRequest { id: "x".into() }.encode_to_vec();
    let status = raw_call(address, "GetInstance", &request, "300m").await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        error_info(&status),
        (ERROR_DOMAIN.to_owned(), "DEADLINE_EXCEEDED".to_owned())
    );
    assert!(status.message().contains("300ms"), "{}", status.message());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_one_millisecond_deadline_is_never_cancelled() {
    let (address, _provider) = start().await;
    let request = pb::GetPluginInfoRequest {}.encode_to_vec();
    for _ in 0..50 {
        let status = raw_call(address, "GetPluginInfo", &request, "1m").await;
        if status.code() != tonic::Code::Ok {
            assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
            assert_eq!(error_info(&status).1, "DEADLINE_EXCEEDED");
        }
    }
}

/// The reason registry of `docs/contract.md`: reason → the reference provider's
/// column ("yes" when it sends that reason).
fn documented_reasons() -> Vec<(String, String, bool)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/contract.md"))
        .unwrap();
    let section = doc
        .split("\n### ")
        .find(|s| s.starts_with("Reasons"))
        .expect("docs/contract.md has a \"Reasons\" section");
    section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let reason = cells[1].trim_matches('`').to_owned();
            let class = cells[2].to_owned();
            (reason, class, cells[4] == "yes")
        })
        .collect()
}

#[tokio::test]
async fn every_documented_reason_is_the_reason_on_the_wire() {
    let (address, provider) = start().await;
    let mut client = plain_client(address).await;
    let request = |key: &str, port: u32| pb::CreateInstanceRequest {
        key: key.into(),
        name: "wire/reasons".into(),
        tags: HashMap::new(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "small".into(),
            image: "debian-12".into(),
        }),
        cloud_init: None,
        proxy_port: port,
        ..Default::default()
    };
    // A Create with an address identity (and a requested address), sent to a provider
    // of its own so that the instances of one trigger hold nothing another needs.
    let with_address = |key: &str, identity: &str, address: Option<&str>| {
        let mut create = request(key, 3128);
        create.address_identity = Some(identity.into());
        create.requested_address = address.map(Into::into);
        create
    };
    let fresh = |range: AddressRange| async move {
        let (address, _) = start_with(ReferenceConfig {
            identity_addresses: range,
            ..config()
        })
        .await;
        plain_client(address).await
    };
    let reasons = documented_reasons();
    assert!(reasons.len() >= 8, "{reasons:?}");
    let mut checked = 0;
    for (reason, class, sent_by_reference) in reasons {
        if !sent_by_reference {
            continue;
        }
        let status = match reason.as_str() {
            "INVALID_ARGUMENT" => client.create_instance(request("", 3128)).await.unwrap_err(),
            "NOT_FOUND" => client
                .get_instance(pb::GetInstanceRequest {
                    id: "missing".into(),
                })
                .await
                .unwrap_err(),
            "ALREADY_EXISTS" => {
                client
                    .create_instance(request("taken", 3128))
                    .await
                    .unwrap();
                client
                    .create_instance(request("taken", 3129))
                    .await
                    .unwrap_err()
            }
            "DEADLINE_EXCEEDED" => {
                provider.faults().inject(Fault {
                    method: Some("GetCapabilities".into()),
                    remaining: Some(1),
                    effect: FaultEffect::Hang,
                    message: String::new(),
                    retry_after: None,
                });
                let request = pb::GetCapabilitiesRequest {}.encode_to_vec();
                raw_call(address, "GetCapabilities", &request, "200m").await
            }
            "INVALID_PAGE_TOKEN" => client
                .list_instances(pb::ListInstancesRequest {
                    page_token: "not-a-page-token".into(),
                    ..Default::default()
                })
                .await
                .unwrap_err(),
            "KEY_BEING_DELETED" => {
                let made = client
                    .create_instance(request("deleted", 3128))
                    .await
                    .unwrap()
                    .into_inner()
                    .instance
                    .unwrap();
                client
                    .delete_instance(pb::DeleteInstanceRequest { id: made.id })
                    .await
                    .unwrap();
                client
                    .create_instance(request("deleted", 3128))
                    .await
                    .unwrap_err()
            }
            "INVALID_RESUME_TOKEN" => {
                match client
                    .watch_instances(pb::WatchInstancesRequest {
                        resume_token: "not-a-resume-token".into(),
                        ..Default::default()
                    })
                    .await
                {
                    Ok(_) => panic!("a made-up resume token opened a stream"),
                    Err(status) => status,
                }
            }
            "CAPACITY_EXHAUSTED" => {
                let mut on_full = request("no-room", 3128);
                if let Some(placement) = on_full.placement.as_mut() {
                    placement.location = Some(pb::placement::Location::Host("full".into()));
                }
                client.create_instance(on_full).await.unwrap_err()
            }
            "ADDRESS_IDENTITY_IN_USE" => {
                let mut client = fresh(AddressRange::DEFAULT).await;
                client
                    .create_instance(with_address("first", "uid-1", None))
                    .await
                    .unwrap();
                client
                    .create_instance(with_address("second", "uid-1", None))
                    .await
                    .unwrap_err()
            }
            "ADDRESS_NOT_IN_RANGE" => client
                .create_instance(with_address("far", "uid-1", Some("203.0.113.254")))
                .await
                .unwrap_err(),
            "ADDRESS_TAKEN" => {
                let mut client = fresh(AddressRange::DEFAULT).await;
                let held = AddressRange::DEFAULT.first.to_string();
                client
                    .create_instance(with_address("holder", "uid-1", Some(&held)))
                    .await
                    .unwrap();
                client
                    .create_instance(with_address("taker", "uid-2", Some(&held)))
                    .await
                    .unwrap_err()
            }
            "ADDRESSES_EXHAUSTED" => {
                let one = AddressRange {
                    first: AddressRange::DEFAULT.first,
                    last: AddressRange::DEFAULT.first,
                };
                let mut client = fresh(one).await;
                client
                    .create_instance(with_address("only", "uid-1", None))
                    .await
                    .unwrap();
                client
                    .create_instance(with_address("one-more", "uid-2", None))
                    .await
                    .unwrap_err()
            }
            "TAGS_CHANGED" | "INSTANCE_DELETING" => {
                let made = client
                    .create_instance(request(&reason.to_lowercase().replace('_', "-"), 3128))
                    .await
                    .unwrap()
                    .into_inner()
                    .instance
                    .unwrap();
                let spare = HashMap::from([("owner".to_string(), "spare".to_string())]);
                let update = pb::UpdateInstanceTagsRequest {
                    id: made.id.clone(),
                    expected_tags: spare.clone(),
                    tags: HashMap::from([("owner".to_string(), "proxy".to_string())]),
                };
                if reason == "INSTANCE_DELETING" {
                    client
                        .delete_instance(pb::DeleteInstanceRequest { id: made.id })
                        .await
                        .unwrap();
                }
                client.update_instance_tags(update).await.unwrap_err()
            }
            "INJECTED_FAULT" => {
                provider.faults().inject(Fault {
                    method: Some("GetPluginInfo".into()),
                    remaining: Some(1),
                    effect: FaultEffect::Fail(ErrorClass::Transient),
                    message: "injected".into(),
                    retry_after: None,
                });
                client
                    .get_plugin_info(pb::GetPluginInfoRequest {})
                    .await
                    .unwrap_err()
            }
            other => panic!(
                "the registry says the reference provider sends {other}: add its trigger here"
            ),
        };
        assert_eq!(
            error_info(&status),
            (ERROR_DOMAIN.to_owned(), reason.clone()),
            "{status:?}"
        );
        if class != "any" {
            let decoded = ProviderError::from(status);
            assert_eq!(decoded.class.to_string(), class, "{reason}");
        }
        checked += 1;
    }
    assert_eq!(
        checked, 15,
        "every reason the reference provider sends is checked"
    );
}
