//! The server scaffold re-reads its TLS files when they change: a certificate renewed
//! on disk (here the way the kubelet updates a mounted Secret: a new directory, then
//! an atomic swap of the `..data` symlink the file names point through) is served to
//! the next connection, without a restart, while connections and calls already running
//! go on. Files that do not load leave the previous certificate in place.

use std::path::Path;
use std::time::Duration;

use egressproxy_provider::client::{Client, ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::pb;
use egressproxy_provider::reference::{Fault, FaultEffect, MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::{ProviderServer, ServerTls};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// A CA with a server certificate for `localhost` and a client certificate, as PEM:
/// (`ca.crt`, `tls.crt`, `tls.key`, `client.crt`, `client.key`) in `dir`.
fn issue(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
    for (cert, key, san) in [
        ("tls.crt", "tls.key", "localhost"),
        ("client.crt", "client.key", "operator"),
    ] {
        let key_pair = KeyPair::generate().unwrap();
        let signed = CertificateParams::new(vec![san.to_owned()])
            .unwrap()
            .signed_by(&key_pair, &ca)
            .unwrap();
        std::fs::write(dir.join(cert), signed.pem()).unwrap();
        std::fs::write(dir.join(key), key_pair.serialize_pem()).unwrap();
    }
}

/// A mounted-Secret layout in `mount`: `ca.crt`, `tls.crt`, `tls.key` are symlinks
/// through `..data`, which points at the directory of the current version.
fn mount_version(mount: &Path, version: &str) {
    let data = mount.join("..data");
    let staged = mount.join("..data_tmp");
    std::os::unix::fs::symlink(version, &staged).unwrap();
    // rename(2) replaces the old link atomically, as the kubelet's writer does.
    std::fs::rename(&staged, &data).unwrap();
    for file in ["ca.crt", "tls.crt", "tls.key"] {
        let link = mount.join(file);
        if !link.exists() {
            std::os::unix::fs::symlink(Path::new("..data").join(file), &link).unwrap();
        }
    }
}

fn client(address: std::net::SocketAddr, version: &Path) -> Client {
    let mut options = ClientOptions::new(format!("https://localhost:{}", address.port()));
    options.call_timeout = Duration::from_secs(10);
    options.tls = Some(ClientTls {
        ca: version.join("ca.crt"),
        domain: None,
        identity: Some((version.join("client.crt"), version.join("client.key"))),
    });
    connect_lazy(&options).unwrap()
}

async fn plugin_name(client: &Client) -> Result<String, tonic::Status> {
    client
        .clone()
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .map(|answer| answer.into_inner().name)
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart_or_a_dropped_call() {
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("tls");
    std::fs::create_dir(&mount).unwrap();
    let (first, second) = (mount.join("..v1"), mount.join("..v2"));
    issue(&first);
    issue(&second);
    mount_version(&mount, "..v1");

    let provider = MemoryProvider::new(ReferenceConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = ProviderServer::new(provider.clone()).with_tls(Some(ServerTls {
        cert: mount.join("tls.crt"),
        key: mount.join("tls.key"),
        client_ca: Some(mount.join("ca.crt")),
    }));
    let served = tokio::spawn(async move {
        server
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
    });

    let before = client(address, &first);
    assert_eq!(
        plugin_name(&before).await.unwrap(),
        "reference.egressproxy.dev"
    );
    // A call that is still running when the files change.
    provider.faults().inject(Fault {
        method: Some("ListInstances".into()),
        remaining: Some(1),
        effect: FaultEffect::Latency(Duration::from_millis(500)),
        message: String::new(),
        retry_after: None,
    });
    let in_flight = tokio::spawn({
        let mut client = before.clone();
        async move {
            client
                .list_instances(pb::ListInstancesRequest::default())
                .await
        }
    });

    // Renewed, from a new CA (the hardest case: every old certificate stops verifying).
    mount_version(&mount, "..v2");
    let after = client(address, &second);
    assert_eq!(
        plugin_name(&after).await.unwrap(),
        "reference.egressproxy.dev",
        "a client of the renewed CA is served without a restart"
    );
    let stale = client(address, &first);
    let refused = plugin_name(&stale).await.unwrap_err();
    assert!(
        format!("{refused:?}").contains("transport"),
        "a new connection gets the renewed certificate, which the old CA does not sign: {refused:?}"
    );
    in_flight
        .await
        .unwrap()
        .expect("the call running during the renewal finishes");
    assert_eq!(
        plugin_name(&before).await.unwrap(),
        "reference.egressproxy.dev",
        "the connection made before the renewal is not dropped"
    );

    // A renewal that does not load (a key of another certificate) keeps the last good
    // one: new clients of the second CA are still served.
    let broken = mount.join("..v3");
    std::fs::create_dir(&broken).unwrap();
    std::fs::copy(second.join("ca.crt"), broken.join("ca.crt")).unwrap();
    std::fs::copy(second.join("tls.crt"), broken.join("tls.crt")).unwrap();
    std::fs::copy(first.join("tls.key"), broken.join("tls.key")).unwrap();
    mount_version(&mount, "..v3");
    let fresh = client(address, &second);
    assert_eq!(
        plugin_name(&fresh).await.unwrap(),
        "reference.egressproxy.dev",
        "a broken renewal leaves the previous certificate in service"
    );

    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_bad_tls_file_at_start_up_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    issue(dir.path());
    std::fs::write(dir.path().join("tls.key"), "not a key\n").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let error = ProviderServer::new(MemoryProvider::new(ReferenceConfig::default()))
        .with_tls(Some(ServerTls {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            client_ca: None,
        }))
        .serve(listener, std::future::pending())
        .await
        .unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("tls.key") && message.contains("private key"),
        "{message}"
    );
}
