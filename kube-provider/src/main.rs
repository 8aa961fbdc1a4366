//! The `kube-provider` command: serves the Provider contract with the shared scaffold
//! (health, reflection, TLS or mutual TLS, W3C trace context, deadlines, graceful
//! shutdown), reaching the apiserver as its pod's ServiceAccount or, outside a cluster,
//! through the kubeconfig. Prints `listening on ADDR` once it accepts connections.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use egressproxy_provider::server::{ProviderServer, ServerTls, shutdown_signal};
use egressproxy_provider::telemetry;
use kube_provider::{Config, KubeProvider};

/// egressproxy provider that runs proxies as pods on a cluster's egress nodes.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The provider's YAML configuration (namespace, node selector, machine types, images).
    #[arg(long, env = "KUBE_PROVIDER_CONFIG")]
    config: PathBuf,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051", env = "KUBE_PROVIDER_LISTEN")]
    listen: SocketAddr,
    /// PEM certificate to serve TLS with (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM CA bundle: require client certificates signed by it (mutual TLS).
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<PathBuf>,
    /// More logging (-v debug, -vv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = telemetry::init("kube-provider", args.verbose)?;
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("read {}", args.config.display()))?;
    let config = Config::parse(&text).with_context(|| format!("in {}", args.config.display()))?;
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes client: run in a pod, or set KUBECONFIG")?;
    let tls = match (args.tls_cert, args.tls_key) {
        (Some(cert), Some(key)) => Some(ServerTls {
            cert,
            key,
            client_ca: args.client_ca,
        }),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let address = listener.local_addr()?;
    let stop = shutdown_signal();
    println!("listening on {address}");
    tracing::info!(%address, namespace = %config.namespace, "kube provider serving");
    ProviderServer::new(KubeProvider::new(client, config))
        .with_tls(tls)
        .serve(listener, stop)
        .await?;
    Ok(())
}
