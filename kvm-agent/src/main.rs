//! The `kvm-agent` command.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvm_agent::startup::load_config;
use kvm_agent::transport::pool::Pool;

/// egressproxy provider for libvirt/KVM hypervisors reached over SSH.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// More logging (-v: debug, shows every libvirt call; -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

// The variants are the subcommands' names (`check-config`, `check-host`, ...).
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Parse and validate the configuration file (keys and known_hosts included).
    CheckConfig {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
    },
    /// Verify hypervisors before anything is created: libvirt, storage pool, network or
    /// bridge, UEFI firmware, KVM (or TCG), confinement. Exits non-zero when one is not
    /// ready.
    CheckHost {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
        /// Only this host (default: every configured host).
        host: Option<String>,
    },
    /// Validate the configuration, then make one libvirt call on every host.
    CheckHosts {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
    },
    /// Serve the egressproxy Provider gRPC service (with health and reflection) until
    /// SIGTERM or SIGINT, then drain in-flight calls.
    Serve {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
        /// Address to listen on (port 0 picks a free port; the chosen address is printed).
        #[arg(long, default_value = "127.0.0.1:50051", env = "KVM_AGENT_LISTEN")]
        listen: std::net::SocketAddr,
        /// PEM certificate to serve TLS with (needs --tls-key).
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// PEM CA bundle: require client certificates signed by it (mutual TLS).
        #[arg(long, requires = "tls_cert")]
        client_ca: Option<PathBuf>,
        /// Serve Prometheus metrics on `/metrics` at this address (plain HTTP; off
        /// without it).
        #[arg(long, env = "KVM_AGENT_METRICS_LISTEN")]
        metrics_listen: Option<std::net::SocketAddr>,
    },
    /// Ask a running agent's gRPC health (exit 0 when SERVING), over TLS or mutual TLS as
    /// it serves: the exec probe of the chart's Deployment (the kubelet's own gRPC probe
    /// speaks no TLS) and of `helm test`.
    Probe {
        /// The agent's `host:port`.
        #[arg(long, default_value = "127.0.0.1:50051")]
        address: String,
        /// PEM CA that signed the agent's certificate: connect with TLS (else plaintext).
        #[arg(long)]
        ca: Option<PathBuf>,
        /// Name to verify in the agent's certificate (default: the host of --address).
        #[arg(long, requires = "ca")]
        server_name: Option<String>,
        /// PEM client certificate, for an agent that requires mutual TLS (needs --key).
        #[arg(long, requires_all = ["key", "ca"])]
        cert: Option<PathBuf>,
        /// PEM private key of --cert.
        #[arg(long, requires = "cert")]
        key: Option<PathBuf>,
        /// Deadline of each call, e.g. `5s`.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// Also list the agent's instances (id, name, state, address).
        #[arg(long)]
        list_instances: bool,
        /// Keep asking, with a growing pause, while the agent does not answer SERVING,
        /// for up to this long (e.g. `60s`; default: ask once). For `helm test` right
        /// after an install, when the agent's Service may not route yet.
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
    },
    /// Delete base image volumes (and their markers) that no volume in the host's storage
    /// pool uses as its backing file. Never deletes a base an overlay uses.
    EvictImages {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
        /// Only this host (default: every configured host).
        host: Option<String>,
        /// Keep bases written more recently than this (another agent may be uploading
        /// one, or a Create be about to put an overlay on it), e.g. `15m`, `0s`.
        #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
        min_age: std::time::Duration,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // A probe runs every few seconds: no span export, no log set-up, one line of output.
    if let Command::Probe {
        address,
        ca,
        server_name,
        cert,
        key,
        timeout,
        list_instances,
        wait,
    } = cli.command
    {
        let options =
            egressproxy_provider::probe::options(&address, ca, server_name, cert.zip(key), timeout);
        return probe(&options, list_instances, wait).await;
    }
    let _telemetry = match egressproxy_provider::telemetry::init("kvm-agent", cli.verbose) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvm-agent: cannot set up logging: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::CheckConfig { config } => check_config(&config),
        Command::CheckHosts { config } => check_hosts(&config).await,
        Command::CheckHost { config, host } => match check_host(&config, host.as_deref()).await {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::Serve {
            config,
            listen,
            tls_cert,
            tls_key,
            client_ca,
            metrics_listen,
        } => {
            let tls = match (tls_cert, tls_key) {
                (Some(cert), Some(key)) => Some(egressproxy_provider::server::ServerTls {
                    cert,
                    key,
                    client_ca,
                }),
                _ => None,
            };
            match serve(&config, listen, tls, metrics_listen).await {
                Ok(()) => Ok(()),
                Err(e) => {
                    eprintln!("kvm-agent: {e:#}");
                    return ExitCode::FAILURE;
                }
            }
        }
        Command::EvictImages {
            config,
            host,
            min_age,
        } => evict_images(&config, host.as_deref(), min_age).await,
        Command::Probe { .. } => unreachable!("answered before logging is set up"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvm-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `kvm-agent probe`: `SERVING` (and the instances) on stdout and exit 0, or the reason
/// on stderr and exit 1.
/// Asks the agent's health until it is SERVING or `wait` has passed (zero: once), the
/// pause between tries growing from 200 ms to 2 s; each failed try is reported on stderr.
async fn health_within(
    options: &egressproxy_provider::client::ClientOptions,
    wait: std::time::Duration,
) -> Result<(), String> {
    use backon::BackoffBuilder;
    use std::time::Duration;

    let give_up = tokio::time::Instant::now() + wait;
    let mut pauses = backon::ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(2))
        .without_max_times()
        .build();
    loop {
        let problem = match egressproxy_provider::probe::check_health(options).await {
            Ok(()) => return Ok(()),
            Err(problem) => problem,
        };
        let pause = pauses.next().unwrap_or(Duration::from_secs(2));
        if tokio::time::Instant::now() + pause > give_up {
            return Err(problem);
        }
        eprintln!("kvm-agent probe: {problem}; asking again in {pause:?}");
        tokio::time::sleep(pause).await;
    }
}

async fn probe(
    options: &egressproxy_provider::client::ClientOptions,
    list: bool,
    wait: std::time::Duration,
) -> ExitCode {
    use egressproxy_provider::probe;

    if let Err(problem) = health_within(options, wait).await {
        eprintln!("kvm-agent probe: {problem}");
        return ExitCode::FAILURE;
    }
    println!("{}: SERVING", options.endpoint);
    if !list {
        return ExitCode::SUCCESS;
    }
    match probe::list_instances(options).await {
        Ok(instances) => {
            println!("{} instances", instances.len());
            for instance in instances {
                let state = egressproxy_provider::pb::InstanceState::try_from(instance.state)
                    .map_or("UNKNOWN", |state| state.as_str_name());
                println!(
                    "{}\t{}\t{}\t{}",
                    instance.id,
                    instance.name,
                    state,
                    instance
                        .addresses
                        .iter()
                        .map(|address| address.address.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                );
            }
            ExitCode::SUCCESS
        }
        Err(problem) => {
            eprintln!("kvm-agent probe: {problem}");
            ExitCode::FAILURE
        }
    }
}

/// `kvm-agent serve`: prints `listening on ADDR` once it accepts connections.
async fn serve(
    path: &Path,
    listen: std::net::SocketAddr,
    tls: Option<egressproxy_provider::server::ServerTls>,
    metrics_listen: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    use egressproxy_provider::server::{ProviderServer, shutdown_signal};
    use kvm_agent::provider::instances::Instances;
    use kvm_agent::provider::service::KvmProvider;
    use std::sync::Arc;

    let config = Arc::new(load_config(path)?);
    let pool = Arc::new(Pool::new(&config)?);
    let provider = KvmProvider::new(Instances::new(config.clone(), pool));
    tokio::spawn({
        let provider = provider.clone();
        async move {
            provider
                .sweep_forever(kvm_agent::provider::watch::SWEEP_INTERVAL)
                .await;
        }
    });
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        anyhow::anyhow!(
            "cannot listen on {listen}: {e} (is the port in use? pick another with --listen)"
        )
    })?;
    let address = listener.local_addr()?;
    if let Some(metrics_listen) = metrics_listen {
        let metrics = tokio::net::TcpListener::bind(metrics_listen)
            .await
            .map_err(|e| {
                anyhow::anyhow!("cannot listen on {metrics_listen} (--metrics-listen): {e}")
            })?;
        let metrics_address = metrics.local_addr()?;
        tracing::info!(address = %metrics_address, "serving /metrics");
        tokio::spawn(serve_metrics(metrics));
    }
    let stop = shutdown_signal();
    println!("listening on {address}");
    tracing::info!(%address, hosts = config.hosts.len(), "kvm-agent serving");
    ProviderServer::new(provider)
        .with_call_observer(kvm_agent::metrics::call_observer())
        .with_tls(tls)
        .serve(listener, stop)
        .await?;
    Ok(())
}

/// `/metrics` in Prometheus' text format, until the process ends.
async fn serve_metrics(listener: tokio::net::TcpListener) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(|| async {
            (
                [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
                kvm_agent::metrics::global().encode(),
            )
        }),
    );
    if let Err(error) = axum::serve(listener, app).await {
        tracing::error!(%error, "the metrics endpoint stopped");
    }
}

fn check_config(path: &Path) -> Result<(), kvm_agent::Error> {
    let config = load_config(path)?;
    println!(
        "{}: ok ({} hosts, {} machine types, {} images)",
        path.display(),
        config.hosts.len(),
        config.machine_types.len(),
        config.images.len()
    );
    Ok(())
}

async fn check_hosts(path: &Path) -> Result<(), kvm_agent::Error> {
    let config = load_config(path)?;
    let pool = Pool::new(&config)?;
    let mut failed = None;
    for name in pool.host_names() {
        let host = pool.host(name)?;
        let started = std::time::Instant::now();
        match host.lib_version(pool.default_deadline()).await {
            Ok(version) => println!(
                "{name}: ok, libvirt {}.{}.{} ({:?})",
                version / 1_000_000,
                version / 1000 % 1000,
                version % 1000,
                started.elapsed()
            ),
            Err(e) => {
                println!("{name}: FAILED: {e}");
                failed = Some(e);
            }
        }
    }
    failed.map_or(Ok(()), |e| Err(e.into()))
}

/// Prints each host's report; `Ok(false)` when a host is not ready.
async fn check_host(path: &Path, only: Option<&str>) -> Result<bool, kvm_agent::Error> {
    use kvm_agent::config::Firmware;
    use kvm_agent::libvirt::host::capabilities::PROBE_TIMEOUT;
    use kvm_agent::transport::call::LibvirtOp;

    let config = load_config(path)?;
    let pool = Pool::new(&config)?;
    let needs_uefi = config.images.values().any(|i| i.firmware == Firmware::Uefi);
    let hosts: Vec<_> = match only {
        Some(name) => {
            vec![config.host(name).cloned().ok_or_else(|| {
                kvm_agent::TransportError::UnknownHost {
                    host: name.to_owned(),
                }
            })?]
        }
        None => config.hosts.clone(),
    };
    let mut ready = true;
    for host in hosts {
        let name = host.name.clone();
        let deadline = pool.default_deadline() + PROBE_TIMEOUT;
        let checked = pool
            .host(&name)?
            .call(LibvirtOp::new("check-host"), deadline, move |c| {
                kvm_agent::libvirt::host::check::check_host(c, &host, needs_uefi)
            })
            .await;
        match checked {
            Ok(report) => {
                print!("{report}");
                ready &= !report.failed();
            }
            Err(e) => {
                println!("{name}: NOT READY\n  [FAIL] libvirt: {e}");
                ready = false;
            }
        }
    }
    Ok(ready)
}

/// Evicts unused base images on one host or all; prints what was deleted and kept.
async fn evict_images(
    path: &Path,
    only: Option<&str>,
    min_age: std::time::Duration,
) -> Result<(), kvm_agent::Error> {
    use kvm_agent::images::cache::{ImageCache, ImageCacheOptions};

    let config = load_config(path)?;
    let pool = Pool::new(&config)?;
    let cache = ImageCache::new(ImageCacheOptions {
        eviction_min_age: min_age,
        ..ImageCacheOptions::from_transport(&config.transport)
    });
    let hosts: Vec<String> = match only {
        Some(name) => vec![pool.host(name)?.name().to_owned()],
        None => pool.host_names().map(str::to_owned).collect(),
    };
    let mut failed = None;
    for name in hosts {
        match cache
            .evict_unused(&pool.host(&name)?, pool.default_deadline())
            .await
        {
            Ok(report) => print!("{report}"),
            Err(e) => {
                println!("{name}: FAILED: {e}");
                failed = Some(e);
            }
        }
    }
    failed.map_or(Ok(()), |e| Err(e.into()))
}
