//! The configuration layer's error: every problem of the file, each with its field.

use std::fmt;

use crate::classification::{Classification, ErrorClass};

/// One problem in the configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The field's path, e.g. `hosts[0].ssh.privateKey` (or a line/column for syntax errors).
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

impl ConfigProblem {
    /// A problem with `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// The configuration file is unreadable or invalid; all problems are listed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n{}", list(.problems))]
pub struct ConfigError {
    /// Each problem with its field.
    pub problems: Vec<ConfigProblem>,
}

impl ConfigError {
    /// A configuration error with `problems`.
    pub fn new(problems: Vec<ConfigProblem>) -> Self {
        Self { problems }
    }

    /// Retrying cannot help until the file is fixed.
    pub fn classify(&self) -> Classification {
        Classification::new(ErrorClass::Permanent, "AGENT_CONFIG_INVALID")
    }
}

fn list(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}
