//! Provider connections over mutual TLS, and certificate rotation: when the files the
//! provider config names change on disk, the next call uses the new ones.

use std::path::Path;
use std::sync::Arc;

use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::reference::{MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::{ProviderServer, ServerTls};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// Writes a fresh CA plus server and client certificates signed by it into `dir`.
fn issue(dir: &Path) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    for (name, san) in [("server", "localhost"), ("client", "operator")] {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem()).unwrap();
    }
}

/// A provider served until [`Served::stop`].
struct Served {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Served {
    /// Stops serving and waits until the listener is closed (its port free again).
    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.task.await.unwrap();
    }
}

/// Serves the reference provider with mTLS from `dir` on `port`.
async fn serve(dir: &Path, port: u16) -> Served {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let tls = ServerTls {
        cert: dir.join("server.pem"),
        key: dir.join("server-key.pem"),
        client_ca: Some(dir.join("ca.pem")),
    };
    let server =
        ProviderServer::new(MemoryProvider::new(ReferenceConfig::default())).with_tls(Some(tls));
    let task = tokio::spawn(async move {
        let _ = server
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await;
    });
    Served { stop, task }
}

#[tokio::test]
async fn rotated_certificates_are_used_on_the_next_call() {
    let server_dir = tempfile::tempdir().unwrap();
    let operator_dir = tempfile::tempdir().unwrap();
    issue(server_dir.path());
    for file in ["ca.pem", "client.pem", "client-key.pem"] {
        std::fs::copy(server_dir.path().join(file), operator_dir.path().join(file)).unwrap();
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let served = serve(server_dir.path(), port).await;

    let dir = operator_dir.path().display();
    let config = ProvidersConfig::parse(&format!(
        "providers:\n  secure:\n    endpoint: https://localhost:{port}\n    callTimeout: 5s\n    tls:\n      ca: {dir}/ca.pem\n      cert: {dir}/client.pem\n      key: {dir}/client-key.pem\n"
    ))
    .unwrap();
    let providers = Providers::new(config, Arc::new(Metrics::default()));
    let provider = providers.get("secure").unwrap();
    let info = provider.handshake().await.expect("mutual TLS handshake");
    assert_eq!(info.name, "reference.egressproxy.dev");
    assert!(provider.list(&Default::default()).await.unwrap().is_empty());

    // The provider comes back with certificates from a new CA: the old files fail.
    served.stop().await;
    issue(server_dir.path());
    let _stop = serve(server_dir.path(), port).await;
    let error = provider.list(&Default::default()).await.unwrap_err();
    assert!(error.to_string().contains("ListInstances"), "{error}");

    // The operator's mounted Secret is updated: the next call reconnects with it.
    for file in ["ca.pem", "client.pem", "client-key.pem"] {
        std::fs::copy(server_dir.path().join(file), operator_dir.path().join(file)).unwrap();
    }
    provider
        .list(&Default::default())
        .await
        .expect("the rotated certificates are used");
}
