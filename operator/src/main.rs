//! `egressproxy-operator`: reconciles Proxy resources through the configured providers.
//!
//! Start-up: load the provider config (fail fast on a bad file), serve `/metrics`,
//! `/healthz` and `/readyz`, wait for the leader lease, then run the controller and the
//! garbage collector until SIGTERM or until leadership is lost (then exit non-zero so
//! the replica restarts as a candidate).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use egressproxy_operator::context::Context;
use egressproxy_operator::leader::{self, LeaseConfig};
use egressproxy_operator::metrics::Metrics;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::{controller, gc, http};
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
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8080")]
    http_listen: SocketAddr,
    /// Namespace of the leader election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the leader election Lease.
    #[arg(long, default_value = "egressproxy-operator")]
    lease_name: String,
    /// This replica's identity in the Lease (default: the pod name, else host and pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long a leader's lease lasts without renewal.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,
    /// Interval between garbage-collection sweeps.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    gc_interval: Duration,
    /// Minimum age of an orphaned instance before it is deleted.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    gc_grace: Duration,
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
    let metrics = Arc::new(Metrics::default());
    let listener = tokio::net::TcpListener::bind(args.http_listen)
        .await
        .map_err(|error| {
            anyhow::anyhow!(
                "cannot listen on {} (--http-listen): {error}",
                args.http_listen
            )
        })?;
    tracing::info!(address = %listener.local_addr()?, "serving /metrics, /healthz, /readyz");
    tokio::spawn(http::serve(listener, metrics.clone(), client.clone()));

    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let lease = LeaseConfig {
        name: args.lease_name.clone(),
        namespace: args.lease_namespace.clone(),
        identity,
        duration: args.lease_duration,
        renew_every: args.lease_duration / 3,
    };
    let mut leadership = tokio::select! {
        leadership = leader::acquire(client.clone(), lease) => leadership,
        () = shutdown_signal() => return Ok(()),
    };
    metrics.set_leader(true);

    let proxies = match &args.namespace {
        Some(namespace) => kube::Api::namespaced(client.clone(), namespace),
        None => kube::Api::all(client.clone()),
    };
    let providers = Providers::new(config, metrics.clone());
    let ctx = Arc::new(Context::new(
        client,
        providers,
        args.cluster_name.clone(),
        metrics.clone(),
    ));
    tracing::info!(
        namespace = args.namespace.as_deref().unwrap_or("(all)"),
        "egressproxy operator started"
    );
    let collector = gc::run(
        &ctx,
        proxies.clone(),
        args.namespace.as_deref(),
        args.gc_interval,
        args.gc_grace,
    );
    tokio::select! {
        () = controller::run(ctx.clone(), proxies, shutdown_signal()) => Ok(()),
        () = collector => Ok(()),
        () = leadership.lost() => {
            metrics.set_leader(false);
            anyhow::bail!("lost the leader lease: exiting so this replica restarts as a candidate")
        }
    }
}
