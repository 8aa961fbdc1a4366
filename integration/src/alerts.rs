//! The chart's PrometheusRule against what the binaries export: every metric an alert
//! reads must be a family a binary declares in its `/metrics`, or the alert never fires.
//!
//! - [`rule_metrics`]: `(alert, metric)` for each metric of a prefix that an alert of the
//!   rendered rule reads (both components' groups);
//! - [`families`]: the families a scrape declares (`# TYPE`);
//! - [`exported`]: whether a series name belongs to one of them (`_total` of a counter,
//!   `_bucket`/`_count`/`_sum` of a histogram).

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::Context as _;
use serde::Deserialize as _;

use crate::helm::Helm;

/// Values that render the rule with both components' groups.
const VALUES: &str = "\
prometheusRule: { enabled: true }
kvmAgent:
  enabled: true
  ssh: { secretName: kvm-agent-ssh }
  config:
    hosts: [{ name: hv1, ssh: { address: hv1.example.org, user: egressproxy } }]
";

/// `(alert, metric)` for every metric starting with `prefix` that an alert reads.
pub fn rule_metrics(prefix: &str) -> anyhow::Result<Vec<(String, String)>> {
    let values = tempfile::NamedTempFile::new()?;
    std::fs::write(values.path(), VALUES)?;
    // `helm template` contacts no cluster.
    let rendered = Helm::new(Path::new("/nonexistent-kubeconfig"))?.template(
        "rel",
        "egressproxy",
        &[values.path()],
        &[],
    )?;
    let rule = serde_norway::Deserializer::from_str(&rendered)
        .filter_map(|document| serde_norway::Value::deserialize(document).ok())
        .find(|document| document["kind"] == "PrometheusRule")
        .context("the chart renders no PrometheusRule")?;
    let mut found = Vec::new();
    for group in rule["spec"]["groups"].as_sequence().context("groups")? {
        for alert in group["rules"].as_sequence().context("rules")? {
            let name = alert["alert"].as_str().unwrap_or_default();
            let expr = alert["expr"].as_str().context("an alert without expr")?;
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with(prefix) {
                    found.push((name.to_owned(), word.to_owned()));
                }
            }
        }
    }
    Ok(found)
}

/// The metric families a scrape declares (`# TYPE name kind`).
pub fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Whether series `name` belongs to one of `families`.
pub fn exported(name: &str, families: &BTreeSet<String>) -> bool {
    families.contains(name)
        || ["_total", "_bucket", "_count", "_sum"]
            .iter()
            .any(|suffix| {
                name.strip_suffix(suffix)
                    .is_some_and(|base| families.contains(base))
            })
}
