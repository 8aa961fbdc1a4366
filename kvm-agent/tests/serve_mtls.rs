//! Mutual TLS between the operator and `kvm-agent serve`, both ways refused when a
//! certificate does not verify:
//! - the agent (`--tls-cert --tls-key --client-ca`) refuses a client with no
//!   certificate, one from another CA, and one that does not speak TLS;
//! - the client the operator uses (`egressproxy_provider::client`, built from its
//!   provider config's `tls`) refuses an agent whose certificate is from another CA or
//!   names another host.
//!
//! The agent serves a local host whose socket nobody answers on: GetPluginInfo needs no
//! hypervisor, so the test needs neither libvirtd nor root.

use std::path::{Path, PathBuf};
use std::time::Duration;

use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::client::{ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::pb;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// A CA in `dir/NAME-ca.pem` with a server certificate for `server_name` and a client
/// certificate (`NAME-server.pem`, `NAME-client.pem` and their `-key.pem`).
fn issue(dir: &Path, name: &str, server_name: &str) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join(format!("{name}-ca.pem")), ca.pem()).unwrap();
    for (role, san) in [("server", server_name), ("client", "operator")] {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.join(format!("{name}-{role}.pem")), cert.pem()).unwrap();
        std::fs::write(
            dir.join(format!("{name}-{role}-key.pem")),
            key.serialize_pem(),
        )
        .unwrap();
    }
}

/// `kvm-agent serve` with the server certificate of CA `name`, trusting clients of
/// CA `client_ca`; killed on drop.
struct Served(ServedAgent);

impl Served {
    fn start(dir: &Path, name: &str, client_ca: &str) -> Self {
        let socket = dir.join("libvirt-sock");
        if !socket.exists() {
            std::os::unix::net::UnixListener::bind(&socket).unwrap();
        }
        let config = dir.join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "hosts:\n- name: here\n  local: true\n  libvirtSocket: {}\n\
                 machineTypes:\n  small: {{vcpus: 1, memoryMiB: 512, diskGiB: 4}}\n\
                 images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
                socket.display()
            ),
        )
        .unwrap();
        let agent = ServedAgent::start_with(&config, "127.0.0.1:0", |command| {
            command
                .arg("--tls-cert")
                .arg(dir.join(format!("{name}-server.pem")))
                .arg("--tls-key")
                .arg(dir.join(format!("{name}-server-key.pem")))
                .arg("--client-ca")
                .arg(dir.join(format!("{client_ca}-ca.pem")));
        })
        .unwrap();
        Self(agent)
    }

    fn port(&self) -> &str {
        self.0.address().rsplit_once(':').unwrap().1
    }
}

/// GetPluginInfo over `endpoint`, trusting `ca`, presenting `identity`: the plugin's
/// name, or the error as text.
async fn plugin_info(
    endpoint: String,
    ca: PathBuf,
    identity: Option<(PathBuf, PathBuf)>,
) -> Result<String, String> {
    let mut options = ClientOptions::new(endpoint);
    options.call_timeout = Duration::from_secs(10);
    if options.endpoint.starts_with("https://") {
        options.tls = Some(ClientTls {
            ca,
            domain: None,
            identity,
        });
    }
    let client = connect_lazy(&options).map_err(|e| e.to_string())?;
    client
        .clone()
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .map(|info| info.into_inner().name)
        .map_err(|status| format!("{status:?}"))
}

/// The call failed in the connection, not with an answer of the service: with TLS 1.3
/// the client may finish its side of the handshake before the server's alert arrives,
/// so the alert, a reset or a closed connection are all what a refusal looks like.
fn refused_by_tls(error: &str) -> bool {
    error.contains("tonic::transport::Error")
}

fn identity(dir: &Path, name: &str) -> Option<(PathBuf, PathBuf)> {
    Some((
        dir.join(format!("{name}-client.pem")),
        dir.join(format!("{name}-client-key.pem")),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_clients_without_a_valid_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    issue(dir, "trusted", "localhost");
    issue(dir, "other", "localhost");
    let agent = Served::start(dir, "trusted", "trusted");
    let https = format!("https://localhost:{}", agent.port());
    let ca = dir.join("trusted-ca.pem");

    let name = plugin_info(https.clone(), ca.clone(), identity(dir, "trusted"))
        .await
        .expect("a client with a certificate of the client CA is served");
    assert!(!name.is_empty());

    let error = plugin_info(https.clone(), ca.clone(), None)
        .await
        .expect_err("a client without a certificate was served");
    assert!(refused_by_tls(&error), "{error}");

    let error = plugin_info(https, ca.clone(), identity(dir, "other"))
        .await
        .expect_err("a client with a certificate of another CA was served");
    assert!(refused_by_tls(&error), "{error}");

    let error = plugin_info(format!("http://localhost:{}", agent.port()), ca, None)
        .await
        .expect_err("a plain-text client was served");
    assert!(refused_by_tls(&error), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_client_refuses_an_agent_whose_certificate_does_not_verify() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    issue(dir, "trusted", "localhost");
    issue(dir, "impostor", "localhost");
    issue(dir, "elsewhere", "agent.example.org");

    // An agent with a certificate from a CA the operator does not trust (it trusts the
    // operator's client certificate, so only the server's certificate is at fault).
    let impostor = Served::start(dir, "impostor", "trusted");
    let error = plugin_info(
        format!("https://localhost:{}", impostor.port()),
        dir.join("trusted-ca.pem"),
        identity(dir, "trusted"),
    )
    .await
    .expect_err("the client accepted a certificate from an unknown CA");
    assert!(
        error.contains("Unavailable") && error.contains("invalid peer certificate"),
        "{error}"
    );

    // A certificate from the trusted CA, but for another host.
    let elsewhere = Served::start(dir, "elsewhere", "elsewhere");
    let error = plugin_info(
        format!("https://localhost:{}", elsewhere.port()),
        dir.join("elsewhere-ca.pem"),
        identity(dir, "elsewhere"),
    )
    .await
    .expect_err("the client accepted a certificate for another name");
    assert!(
        error.contains("Unavailable") && error.contains("NotValidForName"),
        "{error}"
    );
}
