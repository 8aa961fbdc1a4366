//! `egressproxy-operator`: reconciles Proxy resources through the configured providers.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use egressproxy_operator::context::Context;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_provider::{server::shutdown_signal, telemetry};

/// Kubernetes operator for egress-proxy VMs.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Provider config file (YAML, usually mounted from a ConfigMap).
    #[arg(
        long,
        env = "EGRESSPROXY_PROVIDERS",
        default_value = "/etc/egressproxy/providers.yaml"
    )]
    providers: PathBuf,
    /// Value of the egressproxy.dev/cluster tag on every instance; garbage collection
    /// only ever touches instances with this tag. Unique per cluster sharing a provider.
    #[arg(long, env = "EGRESSPROXY_CLUSTER_NAME")]
    cluster_name: String,
    /// Watch Proxies in this namespace only (default: all namespaces).
    #[arg(long, env = "EGRESSPROXY_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// More logging (-v debug, -vv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = telemetry::init("egressproxy-operator", args.verbose)?;
    let config = ProvidersConfig::load(&args.providers)?;
    let client = kube::Client::try_default().await?;
    let proxies = match &args.namespace {
        Some(namespace) => kube::Api::namespaced(client.clone(), namespace),
        None => kube::Api::all(client.clone()),
    };
    let ctx = Arc::new(Context::new(
        client,
        Providers::new(config),
        args.cluster_name,
    ));
    tracing::info!(
        namespace = args.namespace.as_deref().unwrap_or("(all)"),
        "egressproxy operator started"
    );
    egressproxy_operator::controller::run(ctx, proxies, shutdown_signal()).await;
    Ok(())
}
