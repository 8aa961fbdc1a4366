//! `provider-conformance`: runs the contract's conformance suite against any provider
//! endpoint and exits non-zero when a check fails.

use std::time::Duration;

use clap::Parser;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::conformance::{self, Target};
use egressproxy_provider::pb;

/// Checks that a provider keeps the egressproxy Provider contract.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Provider endpoint, for example http://127.0.0.1:50051.
    #[arg(long)]
    endpoint: String,
    /// Host to place the test instances on (default: the provider chooses).
    #[arg(long)]
    host: Option<String>,
    /// Machine type of the test instances.
    #[arg(long)]
    machine_type: String,
    /// Image of the test instances.
    #[arg(long)]
    image: String,
    /// How long an instance may take to become RUNNING.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    running_timeout: Duration,
    /// Deadline of each call.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    call_timeout: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut options = ClientOptions::new(args.endpoint);
    options.call_timeout = args.call_timeout;
    let client = connect_lazy(&options)?;
    let placement = pb::Placement {
        location: args.host.map(pb::placement::Location::Host),
        machine_type: args.machine_type,
        image: args.image,
    };
    let mut target = Target::new(placement);
    target.running_timeout = args.running_timeout;
    let report = conformance::run(client, &target).await;
    println!("{report}");
    if !report.passed() {
        std::process::exit(1);
    }
    Ok(())
}
