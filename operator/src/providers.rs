//! The configured providers: names mapped to gRPC endpoints, with TLS or mTLS and
//! per-call deadlines, loaded from a YAML file (mounted from a ConfigMap).
//!
//! ```yaml
//! providers:
//!   kvm:
//!     endpoint: https://kvm-agent.egressproxy.svc:50051
//!     callTimeout: 30s          # default 30s
//!     tls:                      # required for https endpoints
//!       ca: /etc/egressproxy/provider-tls/ca.crt
//!       cert: /etc/egressproxy/provider-tls/tls.crt   # with key: mutual TLS
//!       key: /etc/egressproxy/provider-tls/tls.key
//!       serverName: kvm-agent   # default: the endpoint's host
//! ```
//!
//! Guarantees:
//! 1. Before first use, a provider is asked for `GetPluginInfo` and `GetCapabilities`;
//!    a different contract major version is refused with a clear error, and the
//!    answer is cached until it fails.
//! 2. When a TLS file changes on disk (a renewed certificate), the next call builds a
//!    new client with it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use egressproxy_provider::client::{Client, ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::{CONTRACT_VERSION, ProviderError, pb};
use serde::Deserialize;

use crate::error::{Error, Result};

/// The provider config file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProvidersConfig {
    /// Provider name (what `spec.provider` says) to its settings.
    pub providers: BTreeMap<String, ProviderConfig>,
}

/// How to reach one provider.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProviderConfig {
    /// `http://host:port` or `https://host:port`.
    pub endpoint: String,
    /// Deadline of each call.
    #[serde(default = "default_call_timeout", with = "humantime_serde")]
    pub call_timeout: Duration,
    /// TLS settings (required for `https://`).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
}

/// TLS files for one provider.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TlsConfig {
    /// CA bundle that signed the provider's certificate.
    pub ca: PathBuf,
    /// Client certificate (mutual TLS; needs `key`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Client key (mutual TLS; needs `cert`).
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// Name to verify in the provider's certificate.
    #[serde(default)]
    pub server_name: Option<String>,
}

fn default_call_timeout() -> Duration {
    Duration::from_secs(30)
}

mod humantime_serde {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

impl ProvidersConfig {
    /// Parses and checks a config file's text; errors name the field.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let config: ProvidersConfig = serde_yaml::from_str(text)?;
        for (name, provider) in &config.providers {
            let https = provider.endpoint.starts_with("https://");
            if !https && !provider.endpoint.starts_with("http://") {
                anyhow::bail!(
                    "providers.{name}.endpoint: {:?} must start with http:// or https://",
                    provider.endpoint
                );
            }
            if https && provider.tls.is_none() {
                anyhow::bail!(
                    "providers.{name}.tls: required for an https:// endpoint (set tls.ca)"
                );
            }
            if let Some(tls) = &provider.tls
                && tls.cert.is_some() != tls.key.is_some()
            {
                anyhow::bail!(
                    "providers.{name}.tls: set both cert and key for mutual TLS, or neither"
                );
            }
            if provider.call_timeout.is_zero() {
                anyhow::bail!("providers.{name}.callTimeout: must be more than 0s");
            }
        }
        Ok(config)
    }

    /// Reads and parses a config file.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|error| {
            anyhow::anyhow!("cannot read provider config {}: {error}", path.display())
        })?;
        Self::parse(&text)
            .map_err(|error| anyhow::anyhow!("provider config {}: {error}", path.display()))
    }
}

/// What a provider told us about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginInfo {
    /// Its self-reported name.
    pub name: String,
    /// Its version.
    pub vendor_version: String,
    /// The contract version it implements.
    pub contract_version: String,
    /// Its optional capabilities.
    pub capabilities: Vec<pb::Capability>,
}

/// One configured provider.
#[derive(Debug)]
pub struct Provider {
    name: String,
    config: ProviderConfig,
    state: Mutex<ClientState>,
}

#[derive(Debug, Default)]
struct ClientState {
    client: Option<Client>,
    tls_mtimes: Vec<Option<SystemTime>>,
    info: Option<PluginInfo>,
}

impl Provider {
    fn new(name: String, config: ProviderConfig) -> Self {
        Provider {
            name,
            config,
            state: Mutex::default(),
        }
    }

    /// The configured name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn tls_files(&self) -> Vec<PathBuf> {
        let Some(tls) = &self.config.tls else {
            return Vec::new();
        };
        [Some(tls.ca.clone()), tls.cert.clone(), tls.key.clone()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// A client, rebuilt when a TLS file changed since the last one was built.
    pub fn client(&self) -> Result<Client> {
        let mtimes: Vec<_> = self
            .tls_files()
            .iter()
            .map(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
            .collect();
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(client) = &state.client
            && state.tls_mtimes == mtimes
        {
            return Ok(client.clone());
        }
        if state.client.is_some() {
            tracing::info!(provider = %self.name, "TLS files changed: reconnecting with the new ones");
        }
        let mut options = ClientOptions::new(self.config.endpoint.clone());
        options.call_timeout = self.config.call_timeout;
        options.tls = self.config.tls.as_ref().map(|tls| ClientTls {
            ca: tls.ca.clone(),
            domain: tls.server_name.clone(),
            identity: tls.cert.clone().zip(tls.key.clone()),
        });
        let client = connect_lazy(&options).map_err(|source| Error::Connect {
            provider: self.name.clone(),
            source,
        })?;
        state.client = Some(client.clone());
        state.tls_mtimes = mtimes;
        Ok(client)
    }

    /// Maps a failed call to the operator's error.
    pub fn call_error(&self, op: &'static str) -> impl FnOnce(tonic::Status) -> Error + '_ {
        move |status| Error::Provider {
            provider: self.name.clone(),
            op,
            source: Box::new(ProviderError::from(status)),
        }
    }

    /// Plugin info and capabilities, asked once and cached; refuses another major
    /// contract version.
    pub async fn handshake(&self) -> Result<PluginInfo> {
        if let Some(info) = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .info
            .clone()
        {
            return Ok(info);
        }
        let mut client = self.client()?;
        let info = client
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .map_err(self.call_error("GetPluginInfo"))?;
        let info = info.into_inner();
        let expected = major(CONTRACT_VERSION);
        if major(&info.contract_version) != expected {
            return Err(Error::IncompatibleProvider {
                provider: self.name.clone(),
                found: info.contract_version,
                expected: expected.to_owned(),
            });
        }
        let capabilities = match client.get_capabilities(pb::GetCapabilitiesRequest {}).await {
            Ok(answer) => answer.into_inner().capabilities().collect(),
            Err(status) if status.code() == tonic::Code::Unimplemented => Vec::new(),
            Err(status) => return Err(self.call_error("GetCapabilities")(status)),
        };
        let info = PluginInfo {
            name: info.name,
            vendor_version: info.vendor_version,
            contract_version: info.contract_version,
            capabilities,
        };
        tracing::info!(provider = %self.name, plugin = %info.name, version = %info.vendor_version,
            contract = %info.contract_version, "provider handshake done");
        self.state.lock().unwrap_or_else(|p| p.into_inner()).info = Some(info.clone());
        Ok(info)
    }

    /// Forgets the cached handshake (after the provider became unreachable, it may
    /// come back as another version).
    pub fn forget_handshake(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).info = None;
    }
}

fn major(version: &str) -> &str {
    version.split('.').next().unwrap_or_default()
}

/// Every configured provider.
#[derive(Debug, Default)]
pub struct Providers {
    providers: BTreeMap<String, Provider>,
}

impl Providers {
    /// Providers from a parsed config.
    pub fn new(config: ProvidersConfig) -> Self {
        Providers {
            providers: config
                .providers
                .into_iter()
                .map(|(name, c)| (name.clone(), Provider::new(name, c)))
                .collect(),
        }
    }

    /// The provider called `name`.
    pub fn get(&self, name: &str) -> Result<&Provider> {
        self.providers
            .get(name)
            .ok_or_else(|| Error::ProviderNotConfigured(name.to_owned()))
    }

    /// Every provider.
    pub fn iter(&self) -> impl Iterator<Item = &Provider> {
        self.providers.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_config_parses_with_defaults() {
        let config = ProvidersConfig::parse(
            "providers:\n  kvm:\n    endpoint: http://127.0.0.1:50051\n  cloud:\n    endpoint: https://p:443\n    callTimeout: 5s\n    tls: {ca: /ca.pem, cert: /c.pem, key: /k.pem}\n",
        )
        .unwrap();
        assert_eq!(
            config.providers["kvm"].call_timeout,
            Duration::from_secs(30)
        );
        assert_eq!(
            config.providers["cloud"].call_timeout,
            Duration::from_secs(5)
        );
        assert_eq!(
            config.providers["cloud"].tls.as_ref().unwrap().cert,
            Some("/c.pem".into())
        );
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases = [
            (
                "providers:\n  a:\n    endpoint: tcp://x\n",
                "providers.a.endpoint",
            ),
            (
                "providers:\n  a:\n    endpoint: https://x\n",
                "providers.a.tls",
            ),
            (
                "providers:\n  a:\n    endpoint: http://x\n    tls: {ca: /ca, cert: /c}\n",
                "providers.a.tls",
            ),
            (
                "providers:\n  a:\n    endpoint: http://x\n    callTimeout: 0s\n",
                "providers.a.callTimeout",
            ),
            (
                "providers:\n  a:\n    endpoint: http://x\n    timeout: 5s\n",
                "unknown field `timeout`",
            ),
        ];
        for (text, expected) in cases {
            let error = ProvidersConfig::parse(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected} not in {error}");
        }
    }
}
