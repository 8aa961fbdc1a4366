//! The conformance suite: the contract's guarantees, checked against a live provider
//! (like CSI's `csi-sanity`). Every provider runs it in its tests; the
//! `provider-conformance` binary runs it against any endpoint.
//!
//! How a run goes:
//! 1. [`CHECKS`] lists every check with its name, why callers need it, and the
//!    contract text it enforces; [`Selection`] picks some by name.
//! 2. Each check runs under its own deadline ([`Target::check_timeout`]) and every call
//!    under the client's deadline, so a provider that hangs or loops fails a check and
//!    never hangs the suite. Page walks stop after [`MAX_PAGES`] pages.
//! 3. Every instance the suite creates carries the tag `egressproxy.dev/conformance=<run
//!    id>` and is recorded in a [`Ledger`]. At the end (also after a failed check, and
//!    from the binary on Ctrl-C) [`Ledger::cleanup`] deletes the recorded instances and
//!    any others carrying this run's tag, and nothing else.
//! 4. A check passes, fails with what was expected and what came back, or is skipped
//!    with the reason (for example a capability the provider does not declare).

mod checks;
mod describe;
mod ledger;
pub mod raw_call;
mod report;
mod walk;

use std::time::{Duration, Instant};

pub use ledger::Ledger;
pub use report::{CheckReport, Outcome, REPORT_SCHEMA, Report};

use crate::client::{ClientOptions, ConnectError, connect_lazy, raw_channel};
use crate::pb;

/// Tag key that marks the suite's instances; the value is the run id.
pub const TAG: &str = "egressproxy.dev/conformance";
/// Most pages any one list walk reads before it calls the provider's paging broken.
pub const MAX_PAGES: usize = 200;

/// What the suite needs to know about the provider under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// A placement the provider accepts.
    pub placement: pb::Placement,
    /// User-data for the instances (a minimal `#cloud-config` by default).
    pub user_data: Vec<u8>,
    /// Whether the provider's platform runs cloud-init (true by default). False for a
    /// provider without it (`docs/contract.md`, "Cloud-init on platforms without it"):
    /// the suite then sends no user-data where it checks something else, and checks
    /// that user-data is refused as the contract says.
    pub cloud_init: bool,
    /// How long an instance may take to become RUNNING with an address, and a
    /// deleted one to be gone.
    pub running_timeout: Duration,
    /// Deadline of one whole check.
    pub check_timeout: Duration,
    /// How many Creates the concurrency check sends at once.
    pub concurrent_creates: usize,
}

impl Target {
    /// A target with a placement and defaults for the rest.
    pub fn new(placement: pb::Placement) -> Self {
        Target {
            placement,
            user_data: b"#cloud-config\n{}\n".to_vec(),
            cloud_init: true,
            running_timeout: Duration::from_secs(120),
            check_timeout: Duration::from_secs(300),
            concurrent_creates: 10,
        }
    }
}

/// Which checks to run, by name.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Run only these (all when empty).
    pub run: Vec<String>,
    /// Never run these.
    pub skip: Vec<String>,
}

impl Selection {
    fn wants(&self, name: &str) -> bool {
        (self.run.is_empty() || self.run.iter().any(|n| n == name))
            && !self.skip.iter().any(|n| n == name)
    }

    /// Names given that are not checks, so a typo is an error, not a silent no-op.
    pub fn unknown_names(&self) -> Vec<String> {
        self.run
            .iter()
            .chain(&self.skip)
            .filter(|name| !CHECKS.iter().any(|check| check.name == name.as_str()))
            .cloned()
            .collect()
    }
}

/// One check of the suite.
#[derive(Debug, Clone, Copy)]
pub struct Check {
    /// Stable name, for `--run`/`--skip` and the JSON report.
    pub name: &'static str,
    /// Why callers need the guarantee, in one line.
    pub why: &'static str,
    /// Where the contract states it.
    pub rule: &'static str,
}

pub use checks::CHECKS;

/// Runs every check against the provider at `options`.
pub async fn run(options: &ClientOptions, target: &Target) -> Result<Report, ConnectError> {
    let ledger = Ledger::new(connect_lazy(options)?);
    Ok(run_with(options, target, &Selection::default(), &ledger).await)
}

/// Runs the selected checks, recording what they create in `ledger` (which the caller
/// keeps to clean up on Ctrl-C), and cleans up at the end.
pub async fn run_with(
    options: &ClientOptions,
    target: &Target,
    selection: &Selection,
    ledger: &Ledger,
) -> Report {
    let started = Instant::now();
    let mut report = Report {
        endpoint: options.endpoint.clone(),
        run_id: ledger.run_id().to_owned(),
        ..Report::default()
    };
    let channel = match raw_channel(options) {
        Ok(channel) => channel,
        Err(error) => {
            report.setup_error = Some(error.to_string());
            return report;
        }
    };
    let mut suite = checks::Suite::new(ledger.clone(), channel, target, &options.endpoint);
    if selection.wants("foreign-instance-survives") {
        suite.plant_bystander().await;
    }
    for check in CHECKS {
        if !selection.wants(check.name) {
            continue;
        }
        let check_started = Instant::now();
        let outcome = match tokio::time::timeout(target.check_timeout, suite.run(check.name)).await
        {
            Ok(outcome) => outcome,
            Err(_) => Outcome::fail(
                format!(
                    "the check finishes within {}",
                    humantime::format_duration(target.check_timeout)
                ),
                "it was still waiting for the provider (a call, a state or a page walk)",
            ),
        };
        report.checks.push(CheckReport {
            check: *check,
            outcome,
            duration: check_started.elapsed(),
        });
    }
    report.cleanup_failures = ledger.cleanup().await;
    report.duration = started.elapsed();
    report
}
