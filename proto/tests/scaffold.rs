//! The server scaffold and client helper over real TCP: reflection-free checks of
//! health, deadlines, graceful shutdown, trace context and (m)TLS. The conformance
//! suite's own tests are in `conformance_suite.rs`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use egressproxy_provider::client::{Client, ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::pb;
use egressproxy_provider::reference::control::ControlService;
use egressproxy_provider::reference::{Fault, FaultEffect, MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::{ProviderServer, ServerTls};
use egressproxy_provider::{ErrorClass, ProviderError};
use tokio::sync::oneshot;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

struct Running {
    address: SocketAddr,
    provider: MemoryProvider,
    shutdown: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn start(tls: Option<ServerTls>) -> Running {
        let provider = MemoryProvider::new(ReferenceConfig {
            provisioning_delay: Duration::from_millis(100),
            ..ReferenceConfig::default()
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (shutdown, stop) = oneshot::channel::<()>();
        let server = ProviderServer::new(provider.clone())
            .with_service(ControlService::new(provider.clone()).into_server())
            .with_tls(tls);
        let server = tokio::spawn(async move {
            server
                .serve(listener, async { stop.await.unwrap_or(()) })
                .await
                .unwrap();
        });
        Running {
            address,
            provider,
            shutdown: Some(shutdown),
            server,
        }
    }

    fn client(&self) -> Client {
        connect_lazy(&ClientOptions::new(format!("http://{}", self.address))).unwrap()
    }
}

fn placement() -> pb::Placement {
    pb::Placement {
        location: None,
        machine_type: "small".into(),
        image: "debian-12".into(),
    }
}

#[tokio::test]
async fn a_hung_call_fails_at_the_client_deadline() {
    let server = Running::start(None).await;
    server.provider.faults().inject(Fault {
        method: Some("GetPluginInfo".into()),
        remaining: Some(1),
        effect: FaultEffect::Hang,
        message: String::new(),
        retry_after: None,
    });
    let mut options = ClientOptions::new(format!("http://{}", server.address));
    options.call_timeout = Duration::from_millis(300);
    let mut client = connect_lazy(&options).unwrap();
    let started = Instant::now();
    let status = client
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(
        ProviderError::from(status).class,
        ErrorClass::DeadlineExceeded
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    // The fault was used up: the next call answers.
    client
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap();
}

#[tokio::test]
async fn shutdown_flips_health_and_drains_in_flight_calls() {
    let mut server = Running::start(None).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let service = "egressproxy.provider.v1.Provider".to_string();
    let status = health
        .check(HealthCheckRequest {
            service: service.clone(),
        })
        .await
        .unwrap();
    assert_eq!(status.into_inner().status(), ServingStatus::Serving);
    let mut watch = health
        .watch(HealthCheckRequest { service })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        watch.message().await.unwrap().unwrap().status(),
        ServingStatus::Serving
    );

    server.provider.faults().inject(Fault {
        method: Some("GetCapabilities".into()),
        remaining: Some(1),
        effect: FaultEffect::Latency(Duration::from_millis(500)),
        message: String::new(),
        retry_after: None,
    });
    let mut client = server.client();
    let in_flight =
        tokio::spawn(async move { client.get_capabilities(pb::GetCapabilitiesRequest {}).await });
    // Shut down only once the call is being served.
    while !server
        .provider
        .call_counts()
        .contains_key("GetCapabilities")
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown.take().unwrap().send(()).unwrap();

    assert_eq!(
        watch.message().await.unwrap().unwrap().status(),
        ServingStatus::NotServing
    );
    let answer = in_flight
        .await
        .unwrap()
        .expect("an in-flight call completes during shutdown");
    assert!(!answer.into_inner().capabilities.is_empty());
    // A server drains open streams before it stops: close the watch.
    drop((watch, health));
    tokio::time::timeout(Duration::from_secs(5), &mut server.server)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn control_service_forces_state_and_counts_calls() {
    use pb::reference::v1::{self as control, control_service_client::ControlServiceClient};
    let server = Running::start(None).await;
    let mut client = server.client();
    let request = pb::CreateInstanceRequest {
        key: "k1".into(),
        placement: Some(placement()),
        proxy_port: 3128,
        ..Default::default()
    };
    let id = client
        .create_instance(request)
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap()
        .id;
    let mut control = ControlServiceClient::connect(format!("http://{}", server.address))
        .await
        .unwrap();
    control
        .set_instance_state(control::SetInstanceStateRequest {
            id: id.clone(),
            state: pb::InstanceState::Stopped.into(),
        })
        .await
        .unwrap();
    let instance = client
        .get_instance(pb::GetInstanceRequest { id })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    assert_eq!(instance.state(), pb::InstanceState::Stopped);
    assert!(instance.addresses.is_empty());
    let counts = control
        .get_call_counts(control::GetCallCountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .counts;
    assert_eq!(counts.get("CreateInstance"), Some(&1));
    assert_eq!(counts.get("GetInstance"), Some(&1));

    control
        .inject_fault(control::InjectFaultRequest {
            method: "GetPluginInfo".into(),
            count: Some(1),
            effect: Some(control::inject_fault_request::Effect::Fail(
                control::ErrorClass::QuotaExhausted.into(),
            )),
            message: "no capacity".into(),
            retry_after: None,
        })
        .await
        .unwrap();
    let error = ProviderError::from(
        client
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (error.class, error.message.as_str()),
        (ErrorClass::QuotaExhausted, "no capacity")
    );
}

#[tokio::test(flavor = "current_thread")]
async fn server_spans_continue_the_callers_trace() {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = Running::start(None).await;
    let mut client = server.client();
    let reconcile = tracing::info_span!("reconcile");
    {
        use tracing::Instrument;
        async {
            client
                .get_plugin_info(pb::GetPluginInfoRequest {})
                .await
                .unwrap()
        }
        .instrument(reconcile.clone())
        .await;
    }
    drop(reconcile);
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let caller = spans
        .iter()
        .find(|s| s.name == "reconcile")
        .expect("caller span exported");
    let handled = spans
        .iter()
        .find(|s| s.name == "grpc.request")
        .unwrap_or_else(|| {
            panic!(
                "server span exported: {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    assert_eq!(
        handled.span_context.trace_id(),
        caller.span_context.trace_id()
    );
    assert_eq!(handled.parent_span_id, caller.span_context.span_id());
}

struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// A CA, a server certificate for 127.0.0.1/localhost and a client certificate.
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        for (name, sans) in [
            (
                "server",
                vec!["localhost".to_string(), "127.0.0.1".to_string()],
            ),
            ("client", vec!["operator".to_string()]),
        ] {
            let key = KeyPair::generate().unwrap();
            let cert = CertificateParams::new(sans)
                .unwrap()
                .signed_by(&key, &ca)
                .unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(
                dir.path().join(format!("{name}-key.pem")),
                key.serialize_pem(),
            )
            .unwrap();
        }
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

async fn tls_client(
    server: &Running,
    pki: &Pki,
    with_identity: bool,
) -> Result<pb::GetPluginInfoResponse, tonic::Status> {
    let mut options = ClientOptions::new(format!("https://localhost:{}", server.address.port()));
    options.tls = Some(ClientTls {
        ca: pki.path("ca.pem"),
        domain: None,
        identity: with_identity.then(|| (pki.path("client.pem"), pki.path("client-key.pem"))),
    });
    let mut client = connect_lazy(&options).unwrap();
    client
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .map(|r| r.into_inner())
}

#[tokio::test]
async fn mutual_tls_admits_only_clients_with_a_certificate() {
    let pki = Pki::new();
    let server = Running::start(Some(ServerTls {
        cert: pki.path("server.pem"),
        key: pki.path("server-key.pem"),
        client_ca: Some(pki.path("ca.pem")),
    }))
    .await;
    let info = tls_client(&server, &pki, true)
        .await
        .expect("a client with a certificate is admitted");
    assert_eq!(
        info.contract_version,
        egressproxy_provider::CONTRACT_VERSION
    );
    assert!(
        tls_client(&server, &pki, false).await.is_err(),
        "a client without a certificate must be refused"
    );
    let mut plaintext = server.client();
    assert!(
        plaintext
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .is_err(),
        "plaintext must be refused"
    );
}

#[tokio::test]
async fn server_tls_without_client_ca_admits_any_client() {
    let pki = Pki::new();
    let server = Running::start(Some(ServerTls {
        cert: pki.path("server.pem"),
        key: pki.path("server-key.pem"),
        client_ca: None,
    }))
    .await;
    tls_client(&server, &pki, false)
        .await
        .expect("server-only TLS admits clients without certificates");
}

/// The conformance suite over mutual TLS: health and reflection go through the same
/// TLS channel; only the bare-HTTP/2 deadline check is skipped, with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suite_runs_over_mutual_tls() {
    use egressproxy_provider::conformance::{self, Outcome, Target};
    let pki = Pki::new();
    let server = Running::start(Some(ServerTls {
        cert: pki.path("server.pem"),
        key: pki.path("server-key.pem"),
        client_ca: Some(pki.path("ca.pem")),
    }))
    .await;
    let mut options = ClientOptions::new(format!("https://localhost:{}", server.address.port()));
    options.tls = Some(ClientTls {
        ca: pki.path("ca.pem"),
        domain: None,
        identity: Some((pki.path("client.pem"), pki.path("client-key.pem"))),
    });
    let mut target = Target::new(placement());
    target.running_timeout = Duration::from_secs(10);
    let report = conformance::run(&options, &target).await.unwrap();
    assert!(report.passed(), "{}", report.failures().join("\n"));
    for check in &report.checks {
        match &check.outcome {
            Outcome::Skip(reason) => {
                assert_eq!(check.check.name, "server-deadline");
                assert!(reason.contains("plaintext"), "{reason}");
            }
            outcome => assert_eq!(outcome, &Outcome::Pass, "{}", check.check.name),
        }
    }
}
