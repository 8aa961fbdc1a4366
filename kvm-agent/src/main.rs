//! The `kvm-agent` command.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvm_agent::config::Config;
use kvm_agent::pool::Pool;

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

#[derive(Debug, Subcommand)]
enum Command {
    /// Parse and validate the configuration file (keys and known_hosts included).
    CheckConfig {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
    },
    /// Validate the configuration, then make one libvirt call on every host.
    CheckHosts {
        /// The agent's YAML configuration.
        #[arg(long, env = "KVM_AGENT_CONFIG")]
        config: PathBuf,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvm-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check_config(path: &Path) -> Result<(), kvm_agent::Error> {
    let config = Config::load(path)?;
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
    let config = Config::load(path)?;
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
    failed.map_or(Ok(()), Err)
}
