//! A run's results, for people (`Display`) and for machines ([`Report::to_json`], whose
//! schema `docs/conformance.md` documents and [`REPORT_SCHEMA`] names).

use std::fmt;
use std::time::Duration;

use super::Check;

/// Identifies the JSON report's shape; changes only when the shape breaks.
pub const REPORT_SCHEMA: &str = "egressproxy.dev/conformance-report/v1";

/// How one check ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The provider kept the rule.
    Pass,
    /// The provider broke the rule.
    Fail {
        /// What the contract requires.
        expected: String,
        /// What the provider did instead.
        got: String,
    },
    /// Not applicable to this provider, and why.
    Skip(String),
}

impl Outcome {
    /// A failure: what was expected and what came back.
    pub fn fail(expected: impl Into<String>, got: impl Into<String>) -> Self {
        Outcome::Fail {
            expected: expected.into(),
            got: got.into(),
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail { .. } => "fail",
            Outcome::Skip(_) => "skip",
        }
    }
}

/// One check's result.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The check.
    pub check: Check,
    /// How it ended.
    pub outcome: Outcome,
    /// How long it took.
    pub duration: Duration,
}

/// Results of a run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The provider's endpoint.
    pub endpoint: String,
    /// The value of the run's tag on every instance it created.
    pub run_id: String,
    /// One entry per check run, in order.
    pub checks: Vec<CheckReport>,
    /// Instances the cleanup could not delete (each with the reason).
    pub cleanup_failures: Vec<String>,
    /// Why the run could not start at all.
    pub setup_error: Option<String>,
    /// Wall time of the whole run.
    pub duration: Duration,
}

impl Report {
    /// Whether every check passed or was skipped, and the cleanup left nothing behind.
    pub fn passed(&self) -> bool {
        self.setup_error.is_none()
            && self.cleanup_failures.is_empty()
            && self
                .checks
                .iter()
                .all(|c| !matches!(c.outcome, Outcome::Fail { .. }))
    }

    /// The failed checks, one line each: name, expected, got, rule.
    pub fn failures(&self) -> Vec<String> {
        let mut failures: Vec<String> = self
            .checks
            .iter()
            .filter_map(|c| match &c.outcome {
                Outcome::Fail { expected, got } => Some(format!(
                    "{}: expected {expected}; got {got} (rule: {})",
                    c.check.name, c.check.rule
                )),
                _ => None,
            })
            .collect();
        failures.extend(self.setup_error.iter().map(|e| format!("setup: {e}")));
        failures.extend(
            self.cleanup_failures
                .iter()
                .map(|e| format!("cleanup: {e}")),
        );
        failures
    }

    fn count(&self, label: &str) -> usize {
        self.checks
            .iter()
            .filter(|c| c.outcome.label() == label)
            .count()
    }

    /// The report as JSON (schema [`REPORT_SCHEMA`], documented in `docs/conformance.md`).
    pub fn to_json(&self) -> serde_json::Value {
        let checks: Vec<serde_json::Value> = self
            .checks
            .iter()
            .map(|c| {
                let mut entry = serde_json::json!({
                    "name": c.check.name,
                    "why": c.check.why,
                    "rule": c.check.rule,
                    "status": c.outcome.label(),
                    "duration_ms": c.duration.as_millis() as u64,
                });
                match &c.outcome {
                    Outcome::Fail { expected, got } => {
                        entry["expected"] = expected.clone().into();
                        entry["got"] = got.clone().into();
                    }
                    Outcome::Skip(reason) => entry["reason"] = reason.clone().into(),
                    Outcome::Pass => {}
                }
                entry
            })
            .collect();
        serde_json::json!({
            "schema": REPORT_SCHEMA,
            "endpoint": self.endpoint,
            "run_id": self.run_id,
            "passed": self.passed(),
            "duration_ms": self.duration.as_millis() as u64,
            "summary": {
                "pass": self.count("pass"),
                "fail": self.count("fail"),
                "skip": self.count("skip"),
            },
            "checks": checks,
            "cleanup_failures": self.cleanup_failures,
            "setup_error": self.setup_error,
        })
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(error) = &self.setup_error {
            writeln!(f, "SETUP FAILED: {error}")?;
        }
        for c in &self.checks {
            let millis = c.duration.as_millis();
            match &c.outcome {
                Outcome::Pass => writeln!(f, "PASS {} ({millis} ms)", c.check.name)?,
                Outcome::Skip(reason) => writeln!(f, "SKIP {}: {reason}", c.check.name)?,
                Outcome::Fail { expected, got } => {
                    writeln!(f, "FAIL {} ({millis} ms)", c.check.name)?;
                    writeln!(f, "     why:      {}", c.check.why)?;
                    writeln!(f, "     expected: {expected}")?;
                    writeln!(f, "     got:      {got}")?;
                    writeln!(f, "     rule:     {}", c.check.rule)?;
                }
            }
        }
        for failure in &self.cleanup_failures {
            writeln!(f, "CLEANUP FAILED: {failure}")?;
        }
        write!(
            f,
            "{} passed, {} failed, {} skipped in {:.1} s (run id {})",
            self.count("pass"),
            self.count("fail"),
            self.count("skip"),
            self.duration.as_secs_f64(),
            self.run_id
        )
    }
}
