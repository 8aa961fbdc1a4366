//! `reference-provider`: the in-memory reference provider as a gRPC server.
//!
//! Serves `egressproxy.provider.v1.Provider`, health and reflection, and with
//! `--fault-injection` its test controls (`egressproxy.reference.v1.ControlService`:
//! injected faults, forced states, call counts; off by default, so a user who runs it
//! as an example gets no way to break it over the network). Prints `listening on ADDR`
//! once it accepts connections (useful with `--listen 127.0.0.1:0`).

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use egressproxy_provider::reference::{
    AddressRange, MemoryProvider, Misbehaviour, ReferenceConfig, control::ControlService,
};
use egressproxy_provider::server::{ProviderServer, ServerTls, shutdown_signal};
use egressproxy_provider::telemetry;

/// In-memory egressproxy provider for tests, demos and as an example to copy.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(
        long,
        default_value = "127.0.0.1:50051",
        env = "REFERENCE_PROVIDER_LISTEN"
    )]
    listen: SocketAddr,
    /// Time from Create until an instance is RUNNING (for example 2s, 500ms, 0s).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    provisioning_delay: Duration,
    /// Time from Delete until an instance is gone; it is DELETING meanwhile.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    deleting_delay: Duration,
    /// Also serve egressproxy.reference.v1.ControlService (fault injection, forced
    /// states, call counts) on the same port: for tests, never for anything reachable
    /// by others.
    #[arg(long)]
    fault_injection: bool,
    /// Address every running instance created without an address identity reports.
    #[arg(long, default_value = "127.0.0.1")]
    instance_address: IpAddr,
    /// The address instances on a host report instead of --instance-address, as
    /// HOST=ADDRESS (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = host_setting::<IpAddr>)]
    host_address: Vec<(String, IpAddr)>,
    /// Offer no address identities: declare neither capability, and refuse
    /// `address_identity` and `requested_address` as INVALID_ARGUMENT.
    #[arg(long)]
    no_address_identities: bool,
    /// Offer no UpdateInstanceTags: do not declare CAPABILITY_UPDATE_TAGS, and answer
    /// the call UNIMPLEMENTED (as a provider of a contract before 1.5.0).
    #[arg(long)]
    no_update_tags: bool,
    /// First address of the range instances with an address identity get theirs from.
    #[arg(long, default_value_t = AddressRange::DEFAULT.first)]
    identity_range_first: Ipv4Addr,
    /// Last address of that range.
    #[arg(long, default_value_t = AddressRange::DEFAULT.last)]
    identity_range_last: Ipv4Addr,
    /// Valid host names (comma-separated); the first is the default placement.
    #[arg(long, value_delimiter = ',', default_value = "local")]
    hosts: Vec<String>,
    /// Valid zone names (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "local-zone")]
    zones: Vec<String>,
    /// The zone of a host, as HOST=ZONE (comma-separated); a host not named is in no zone.
    #[arg(long, value_delimiter = ',', value_parser = host_setting::<String>, default_value = "local=local-zone")]
    host_zone: Vec<(String, String)>,
    /// The most instances a host holds, as HOST=N (comma-separated); a host not named
    /// holds 1000. A Create on a host without room answers RESOURCE_EXHAUSTED.
    #[arg(long, value_delimiter = ',', value_parser = host_setting::<u32>)]
    max_instances: Vec<(String, u32)>,
    /// Valid machine type names (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "small,medium")]
    machine_types: Vec<String>,
    /// Valid image names (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "debian-12")]
    images: Vec<String>,
    /// Contract version to report (only to test callers' version checks).
    #[arg(long, hide = true, default_value = egressproxy_provider::CONTRACT_VERSION)]
    contract_version: String,
    /// Break one contract rule on purpose, to test the conformance suite (never in
    /// production).
    #[arg(long, value_enum)]
    misbehave: Option<Misbehaviour>,
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

/// `HOST=VALUE`, for the per-host options.
fn host_setting<T: std::str::FromStr>(text: &str) -> Result<(String, T), String>
where
    T::Err: std::fmt::Display,
{
    let (host, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected HOST=VALUE"))?;
    let value = value
        .parse()
        .map_err(|e| format!("{text:?}: the value after '=': {e}"))?;
    Ok((host.to_owned(), value))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = telemetry::init("reference-provider", args.verbose)?;
    if args.identity_range_last < args.identity_range_first {
        anyhow::bail!(
            "--identity-range-last {} comes before --identity-range-first {}",
            args.identity_range_last,
            args.identity_range_first
        );
    }
    let provider = MemoryProvider::new(ReferenceConfig {
        provisioning_delay: args.provisioning_delay,
        deleting_delay: args.deleting_delay,
        address: args.instance_address,
        host_addresses: args.host_address.into_iter().collect(),
        address_identities: !args.no_address_identities,
        update_tags: !args.no_update_tags,
        identity_addresses: AddressRange {
            first: args.identity_range_first,
            last: args.identity_range_last,
        },
        hosts: args.hosts,
        zones: args.zones,
        host_zones: args.host_zone.into_iter().collect(),
        max_instances: args.max_instances.into_iter().collect(),
        machine_types: args.machine_types,
        images: args.images,
        contract_version: args.contract_version,
        misbehave: args.misbehave,
    });
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
        .map_err(|error| {
            anyhow::anyhow!(
                "cannot listen on {}: {error} (is the port in use? pick another with --listen)",
                args.listen
            )
        })?;
    let address = listener.local_addr()?;
    let mut server = ProviderServer::new(provider.clone())
        .with_tls(tls)
        .with_misbehaviour(args.misbehave);
    if args.fault_injection {
        tracing::warn!(
            "serving egressproxy.reference.v1.ControlService: any client can inject faults"
        );
        server = server.with_service(ControlService::new(provider).into_server());
    }
    let stop = shutdown_signal();
    println!("listening on {address}");
    tracing::info!(%address, "reference provider serving");
    server.serve(listener, stop).await?;
    Ok(())
}
