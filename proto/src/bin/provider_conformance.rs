//! `provider-conformance`: runs the contract's conformance suite against any provider
//! endpoint and exits non-zero when a check fails. On Ctrl-C (or SIGTERM) it stops,
//! deletes what the run created, and exits 130.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use egressproxy_provider::client::{ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::conformance::{self, CHECKS, Ledger, Selection, Target};
use egressproxy_provider::pb;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Output {
    /// One line per check; failures say why, what was expected, what came back, and the rule.
    Text,
    /// One JSON document (schema in docs/conformance.md).
    Json,
}

/// Checks that a provider keeps the egressproxy Provider contract.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Provider endpoint, for example http://127.0.0.1:50051 or https://provider:50051.
    #[arg(long, required_unless_present = "list")]
    endpoint: Option<String>,
    /// PEM CA bundle that signed the provider's certificate (https endpoints).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Name to verify in the provider's certificate (default: the endpoint's host).
    #[arg(long)]
    tls_domain: Option<String>,
    /// PEM client certificate, for mutual TLS (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM client key, for mutual TLS (needs --tls-cert).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Host to place the test instances on (default: the provider chooses).
    #[arg(long, conflicts_with = "zone")]
    host: Option<String>,
    /// Zone to place the test instances in.
    #[arg(long)]
    zone: Option<String>,
    /// Machine type of the test instances.
    #[arg(long, required_unless_present = "list")]
    machine_type: Option<String>,
    /// Image of the test instances.
    #[arg(long, required_unless_present = "list")]
    image: Option<String>,
    /// The provider's platform has no cloud-init (docs/contract.md, "Cloud-init on
    /// platforms without it"): send no user-data, and check that it is refused.
    #[arg(long)]
    without_cloud_init: bool,
    /// How long an instance may take to become RUNNING, and a deleted one to go.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    running_timeout: Duration,
    /// Deadline of each call.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    call_timeout: Duration,
    /// Deadline of each check.
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    check_timeout: Duration,
    /// How many Creates the concurrency check sends at once.
    #[arg(long, default_value_t = 10)]
    concurrent_creates: usize,
    /// Run only this check (repeatable; see --list).
    #[arg(long = "run", value_name = "CHECK")]
    run: Vec<String>,
    /// Do not run this check (repeatable).
    #[arg(long = "skip", value_name = "CHECK")]
    skip: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    output: Output,
    /// List the checks (name, why, rule) and exit.
    #[arg(long)]
    list: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.list {
        for check in CHECKS {
            println!(
                "{}\n    why:  {}\n    rule: {}",
                check.name, check.why, check.rule
            );
        }
        return Ok(());
    }
    let selection = Selection {
        run: args.run,
        skip: args.skip,
    };
    let unknown = selection.unknown_names();
    if !unknown.is_empty() {
        anyhow::bail!(
            "unknown check name(s) {}: see --list for the names",
            unknown.join(", ")
        );
    }
    let endpoint = args.endpoint.expect("clap requires --endpoint");
    let mut options = ClientOptions::new(endpoint);
    options.call_timeout = args.call_timeout;
    options.tls = args.tls_ca.map(|ca| ClientTls {
        ca,
        domain: args.tls_domain,
        identity: args.tls_cert.zip(args.tls_key),
    });
    let location = match (args.host, args.zone) {
        (Some(host), _) => Some(pb::placement::Location::Host(host)),
        (None, Some(zone)) => Some(pb::placement::Location::Zone(zone)),
        (None, None) => None,
    };
    let mut target = Target::new(pb::Placement {
        location,
        machine_type: args.machine_type.expect("clap requires --machine-type"),
        image: args.image.expect("clap requires --image"),
    });
    target.running_timeout = args.running_timeout;
    if args.without_cloud_init {
        target.cloud_init = false;
        target.user_data.clear();
    }
    target.check_timeout = args.check_timeout;
    target.concurrent_creates = args.concurrent_creates;

    let ledger = Ledger::new(connect_lazy(&options)?);
    let run = conformance::run_with(&options, &target, &selection, &ledger);
    let report = tokio::select! {
        report = run => report,
        () = egressproxy_provider::server::shutdown_signal() => {
            eprintln!("interrupted: deleting the instances of run {}", ledger.run_id());
            for failure in ledger.cleanup().await {
                eprintln!("cleanup failed: {failure}");
            }
            std::process::exit(130);
        }
    };
    match args.output {
        Output::Text => println!("{report}"),
        Output::Json => println!("{}", serde_json::to_string_pretty(&report.to_json())?),
    }
    if !report.passed() {
        std::process::exit(1);
    }
    Ok(())
}
