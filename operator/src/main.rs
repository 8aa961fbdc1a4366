//! `egressproxy-operator`: reconciles Proxy resources through the configured providers.
//!
//! 1. Start-up: check every flag (durations within [`limits`]), load the provider
//!    config (fail fast on a bad file), serve `/metrics`, `/healthz` and `/readyz`.
//! 2. Wait for the leader lease.
//! 3. As leader: run the Proxy and ProxyPool controllers, the garbage collector and the
//!    provider config reload until SIGTERM or until leadership is lost, and the allocator
//!    trim beside them (it hands back memory freed by deleted Proxies).
//! 4. On SIGTERM: let running reconciles finish, then release the lease so another
//!    replica takes over at once, and exit 0. On lost leadership: exit non-zero so the
//!    replica restarts as a candidate.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use egressproxy_operator::context::{
    Context, DEFAULT_MAX_CONCURRENT_RECONCILES, DEFAULT_MAX_CONCURRENT_SERVICE_SYNCS,
};
use egressproxy_operator::k8s::leader::{self, LeaseConfig};
use egressproxy_operator::k8s::proxy_cache::ProxyCache;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::reload;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::liveness::Liveness;
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_operator::{
    k8s::client, k8s::cluster_name, pool, proxy::controller, proxy::gc, shared::http,
    shared::limits, uninstall_check,
};
use egressproxy_provider::{server::shutdown_signal, telemetry};

/// How long running reconciles may take to finish after SIGTERM before they are
/// cancelled (dropping them stops them): within Kubernetes' default 30 s grace period.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

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
    /// Default: the UID of the kube-system namespace (unique per cluster).
    #[arg(long, env = "EGRESSPROXY_CLUSTER_NAME")]
    cluster_name: Option<String>,
    /// Watch Proxies in these namespaces only (default: all namespaces). Repeat the
    /// flag or separate names with commas.
    #[arg(
        long = "namespace",
        env = "EGRESSPROXY_WATCH_NAMESPACE",
        value_delimiter = ','
    )]
    namespaces: Vec<String>,
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
    /// How long a leader's lease lasts without renewal (3s to 10m).
    #[arg(long, default_value = "15s", value_parser = |text: &str| limits::LEASE_DURATION.parse(text))]
    lease_duration: Duration,
    /// Interval between garbage-collection sweeps (1s to 24h).
    #[arg(long, default_value = "5m", value_parser = |text: &str| limits::GC_INTERVAL.parse(text))]
    gc_interval: Duration,
    /// Minimum age of an orphaned instance before it is deleted (1m to 30 days).
    #[arg(long, default_value = "10m", value_parser = |text: &str| limits::GC_GRACE.parse(text))]
    gc_grace: Duration,
    /// Most reconciles running at once (1 to 1000). Each waits mostly on its provider
    /// and the apiserver; the bound keeps a provider config change, which reconciles
    /// every Proxy, from sending a call per Proxy at once.
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_RECONCILES,
        value_parser = clap::value_parser!(u16).range(1..=1000))]
    max_concurrent_reconciles: u16,
    /// Most Proxy Services and EndpointSlices written at once (1 to 1000), in a queue
    /// apart from the reconciles: a burst of new Proxies' Services then waits there
    /// instead of holding back the work that makes other Proxies Ready.
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_SERVICE_SYNCS,
        value_parser = clap::value_parser!(u16).range(1..=1000))]
    max_concurrent_service_syncs: u16,
    /// How often the provider config file is checked for changes (100ms to 1h).
    #[arg(long, default_value = "10s", value_parser = |text: &str| limits::RELOAD_INTERVAL.parse(text))]
    providers_reload_interval: Duration,
    /// More logging (-v debug, -vv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Option<Subcommand>,
}

#[derive(Debug, clap::Subcommand)]
enum Subcommand {
    /// The chart's pre-delete hook: exit 1, naming them and saying what to do, while
    /// Proxies exist in the operator's scope (`--namespace`); exit 0 when none do.
    UninstallCheck,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let scope = WatchScope::from_flags(&args.namespaces).map_err(|error| anyhow::anyhow!(error))?;
    if let Some(Subcommand::UninstallCheck) = args.command {
        let client = kube::Client::try_default().await?;
        if let Err(refusal) = uninstall_check::check(&client, &scope).await? {
            eprintln!("{refusal}");
            std::process::exit(1);
        }
        println!("no Proxies left: the uninstall may go on");
        return Ok(());
    }
    let _telemetry = telemetry::init("egressproxy-operator", args.verbose)?;
    let stopping = listen_for_shutdown();
    let config_text = std::fs::read_to_string(&args.providers).map_err(|error| {
        anyhow::anyhow!(
            "cannot read provider config {}: {error}",
            args.providers.display()
        )
    })?;
    let config = ProvidersConfig::parse(&config_text).map_err(|error| {
        anyhow::anyhow!("provider config {}: {error}", args.providers.display())
    })?;
    let client = client::from_environment(
        args.max_concurrent_reconciles + args.max_concurrent_service_syncs,
    )
    .await?;
    let (cluster_name, named_by) =
        cluster_name::resolve(args.cluster_name.as_deref(), &client).await?;
    tracing::info!(cluster = %cluster_name, from = ?named_by,
        "instances are tagged egressproxy.dev/cluster={cluster_name}");
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
    let liveness = Arc::new(Liveness::default());
    tokio::spawn(http::serve(
        listener,
        metrics.clone(),
        client.clone(),
        liveness.clone(),
    ));

    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let lease = LeaseConfig::new(
        args.lease_name.clone(),
        args.lease_namespace.clone(),
        identity,
        args.lease_duration,
    );
    let Some(mut leadership) =
        leader::acquire_unless_stopped(client.clone(), lease, stopping()).await
    else {
        return Ok(());
    };
    metrics.set_leader(true);
    liveness.start_controlling();

    let providers = Providers::new(config, metrics.clone());
    let mut ctx =
        Context::new(client, providers, cluster_name, metrics.clone()).with_liveness(liveness);
    ctx.max_concurrent_reconciles = args.max_concurrent_reconciles;
    ctx.max_concurrent_service_syncs = args.max_concurrent_service_syncs;
    let ctx = Arc::new(ctx);
    // The trimmer's task only waits and trims: it needs no stopping of its own.
    tokio::spawn({
        let ctx = ctx.clone();
        async move { ctx.trimmer.run().await }
    });
    tracing::info!(
        namespaces = %scope,
        "egressproxy operator started"
    );
    let (cache, cache_writer) = ProxyCache::new(scope.clone());
    let collector = gc::run(&ctx, &cache, args.gc_interval, args.gc_grace);
    let reloader = reload::watch_file(
        &ctx.providers,
        &args.providers,
        config_text,
        args.providers_reload_interval,
        metrics.clone(),
    );
    let stopped_in_time = async {
        stopping().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "reconciles did not finish in time: cancelling them");
    };
    // Both controllers stop on SIGTERM once their running reconciles finish.
    let controllers = async {
        tokio::join!(
            controller::run_with_cache(ctx.clone(), cache.clone(), cache_writer, stopping()),
            pool::run(ctx.clone(), scope.clone(), stopping()),
        );
    };
    let lost = tokio::select! {
        () = controllers => false,
        () = stopped_in_time => false,
        () = collector => false,
        () = reloader => false,
        () = leadership.lost() => true,
    };
    metrics.set_leader(false);
    if lost {
        anyhow::bail!("lost the leader lease: exiting so this replica restarts as a candidate");
    }
    // The controller has stopped acting: hand the lease over instead of letting the
    // successor wait for it to expire.
    leadership.release().await;
    Ok(())
}

/// Starts listening for SIGTERM and SIGINT at once and for the whole run, and returns
/// a maker of futures that complete once one arrived. A listener made only when it is
/// needed would miss a signal that came in between (and the process would run on).
fn listen_for_shutdown() -> impl Fn() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send + Sync>> {
    let (tell, told) = tokio::sync::watch::channel(false);
    let signalled = shutdown_signal();
    tokio::spawn(async move {
        signalled.await;
        tracing::info!("shutting down: finishing running reconciles");
        let _ = tell.send(true);
    });
    move || {
        let mut told = told.clone();
        Box::pin(async move {
            let _ = told.wait_for(|stop| *stop).await;
        })
    }
}
