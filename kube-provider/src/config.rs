//! The provider's YAML configuration: where its pods live, which nodes may run them,
//! and what the contract's names (machine type, image) mean on a cluster.
//!
//! - A **machine type** is a container's resource requests and limits.
//! - An **image** is a container image plus how the proxy port reaches it (an
//!   environment variable), since a pod has no cloud-init to write a config file.
//! - A **zone** is a value of the node label [`Config::zone_label`]; a **host** is a
//!   node's name. Only nodes matching [`Config::node_selector`] are offered.
//!
//! Parsing rejects unknown fields, so a typo fails at start-up with its line and column
//! instead of being ignored; [`Config::validate`] then checks the file's own meaning.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::Deserialize;

/// The default node label whose value names a node's zone.
pub const DEFAULT_ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The default environment variable the proxy port is passed in.
pub const DEFAULT_PORT_ENV: &str = "PROXY_PORT";

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The namespace the proxy pods are created in; the provider's RBAC needs pods
    /// there and nothing else but listing nodes, and pods of every namespace (for the
    /// host ports they hold).
    pub namespace: String,
    /// The node label whose values are the zones a placement may name.
    #[serde(default = "default_zone_label")]
    pub zone_label: String,
    /// Labels a node must carry to run proxies (the egress nodes). Empty: every node.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations every proxy pod gets (egress nodes are often tainted).
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Machine types by name: a container's requests and limits.
    pub machine_types: BTreeMap<String, MachineType>,
    /// Images by name.
    pub images: BTreeMap<String, Image>,
}

/// A machine type: the proxy container's resources.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineType {
    /// Resource requests, e.g. `{cpu: 100m, memory: 64Mi}`.
    #[serde(default)]
    pub requests: BTreeMap<String, Quantity>,
    /// Resource limits, e.g. `{memory: 256Mi}`.
    #[serde(default)]
    pub limits: BTreeMap<String, Quantity>,
}

impl MachineType {
    /// As the pod spec states it.
    pub fn resources(&self) -> ResourceRequirements {
        let map = |m: &BTreeMap<String, Quantity>| (!m.is_empty()).then(|| m.clone());
        ResourceRequirements {
            requests: map(&self.requests),
            limits: map(&self.limits),
            ..ResourceRequirements::default()
        }
    }
}

/// An image: the proxy's container image and how its settings reach it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Image {
    /// The container image reference.
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never` (unset: the cluster's default).
    #[serde(default)]
    pub pull_policy: Option<String>,
    /// The container's command (unset: the image's entrypoint).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// The container's arguments (unset: the image's).
    #[serde(default)]
    pub args: Option<Vec<String>>,
    /// The environment variable that carries the instance's proxy port.
    #[serde(default = "default_port_env")]
    pub port_env: String,
}

fn default_zone_label() -> String {
    DEFAULT_ZONE_LABEL.into()
}

fn default_port_env() -> String {
    DEFAULT_PORT_ENV.into()
}

impl Config {
    /// Parses YAML text, refusing unknown fields.
    pub fn parse(text: &str) -> anyhow::Result<Config> {
        let config: Config = serde_norway::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what the file means, naming every field at fault at once.
    pub fn validate(&self) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        if self.namespace.is_empty() {
            problems.push("namespace: must name the namespace the proxy pods go to".to_owned());
        }
        if self.zone_label.is_empty() {
            problems.push("zone_label: must be a node label key".to_owned());
        }
        if self.machine_types.is_empty() {
            problems.push("machine_types: offer at least one".to_owned());
        }
        if self.images.is_empty() {
            problems.push("images: offer at least one".to_owned());
        }
        for (name, image) in &self.images {
            if image.image.is_empty() {
                problems.push(format!("images.{name}.image: must be a container image"));
            }
            if image.port_env.is_empty() {
                problems.push(format!("images.{name}.port_env: must not be empty"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("invalid configuration: {}", problems.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
namespace: egress
node_selector: {egressproxy.dev/egress: "true"}
machine_types:
  small: {requests: {cpu: 100m, memory: 64Mi}, limits: {memory: 128Mi}}
images:
  squid: {image: "localhost/squid:6", pull_policy: Never}
"#;

    #[test]
    fn an_example_parses_with_defaults() {
        let config = Config::parse(EXAMPLE).unwrap();
        assert_eq!(config.zone_label, DEFAULT_ZONE_LABEL);
        assert_eq!(config.images["squid"].port_env, DEFAULT_PORT_ENV);
        let resources = config.machine_types["small"].resources();
        assert_eq!(resources.requests.unwrap()["cpu"], Quantity("100m".into()));
    }

    #[test]
    fn the_deployed_example_parses() {
        let text = include_str!("../../deploy/kube-provider/config.yaml");
        let config = Config::parse(text).unwrap();
        assert_eq!(config.node_selector["egressproxy.dev/egress"], "true");
        assert_eq!(config.tolerations.len(), 1);
    }

    #[test]
    fn an_unknown_field_is_an_error() {
        let text = format!("{EXAMPLE}zone_lable: x\n");
        let error = Config::parse(&text).unwrap_err().to_string();
        assert!(error.contains("zone_lable"), "{error}");
    }

    #[test]
    fn every_problem_is_named_at_once() {
        let text = "namespace: ''\nmachine_types: {}\nimages: {x: {image: ''}}\n";
        let error = Config::parse(text).unwrap_err().to_string();
        for field in ["namespace", "machine_types", "images.x.image"] {
            assert!(error.contains(field), "{field} missing from {error}");
        }
    }
}
