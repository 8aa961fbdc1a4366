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
//!    a different contract major version is refused with a clear error. The answer
//!    is cached until a call finds the provider unavailable (it may come back as
//!    another version).
//! 2. When a TLS file changes on disk (a renewed certificate), the next call builds a
//!    new client with it.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use egressproxy_provider::client::{Client, ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::{CONTRACT_VERSION, ErrorClass, ProviderError, pb};
use serde::Deserialize;
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::metrics::Metrics;

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

/// The contract's gRPC service, as client spans name it.
const PROVIDER_SERVICE: &str = "egressproxy.provider.v1.Provider";

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
    metrics: Arc<Metrics>,
}

#[derive(Debug, Default)]
struct ClientState {
    client: Option<Client>,
    tls_mtimes: Vec<Option<SystemTime>>,
    info: Option<PluginInfo>,
}

impl Provider {
    fn new(name: String, config: ProviderConfig, metrics: Arc<Metrics>) -> Self {
        Provider {
            name,
            config,
            state: Mutex::default(),
            metrics,
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
    fn client(&self) -> Result<Client> {
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

    /// Runs one call inside a client span, timing it into the metrics and classifying
    /// its error. The span is current while the request is built, so the trace context
    /// the provider receives names it as the parent of the provider's own spans.
    async fn call<T, F, Fut>(&self, op: &'static str, call: F) -> Result<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client()?;
        let span = tracing::info_span!(
            "provider.call",
            otel.name = %format!("{PROVIDER_SERVICE}/{op}"),
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = PROVIDER_SERVICE,
            rpc.method = op,
            provider = %self.name,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let started = Instant::now();
        let result = call(client).instrument(span.clone()).await;
        let code = result
            .as_ref()
            .map_or_else(tonic::Status::code, |_| tonic::Code::Ok);
        span.record("rpc.grpc.status_code", code as i32);
        self.metrics
            .provider_call(&self.name, op, code, started.elapsed());
        result
            .map(tonic::Response::into_inner)
            .map_err(|status| Error::Provider {
                provider: self.name.clone(),
                op,
                source: Box::new(ProviderError::from(status)),
            })
    }

    /// CreateInstance.
    pub async fn create(&self, request: pb::CreateInstanceRequest) -> Result<pb::Instance> {
        let answer = self
            .call("CreateInstance", |mut c| async move {
                c.create_instance(request).await
            })
            .await?;
        Ok(answer.instance.unwrap_or_default())
    }

    /// GetInstance; `None` when the instance does not exist.
    pub async fn get(&self, id: &str) -> Result<Option<pb::Instance>> {
        let request = pb::GetInstanceRequest { id: id.to_owned() };
        match self
            .call("GetInstance", |mut c| async move {
                c.get_instance(request).await
            })
            .await
        {
            Ok(answer) => self.instance_in(answer.instance, "GetInstance").map(Some),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// The instance an answer must carry; a provider that omits it (or its id) is
    /// broken, which is reported and retried rather than recorded as an empty id.
    fn instance_in(
        &self,
        instance: Option<pb::Instance>,
        op: &'static str,
    ) -> Result<pb::Instance> {
        match instance {
            Some(instance) if !instance.id.is_empty() => Ok(instance),
            _ => Err(Error::Provider {
                provider: self.name.clone(),
                op,
                source: Box::new(
                    ProviderError::transient(
                        "the provider answered without an instance id (a provider bug)",
                    )
                    .with_reason("MALFORMED_RESPONSE"),
                ),
            }),
        }
    }

    /// DeleteInstance; a missing instance is success.
    pub async fn delete(&self, id: &str) -> Result<()> {
        let request = pb::DeleteInstanceRequest { id: id.to_owned() };
        match self
            .call("DeleteInstance", |mut c| async move {
                c.delete_instance(request).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::NotFound => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// Every instance whose tags contain `selector`, across pages.
    pub async fn list(&self, selector: &HashMap<String, String>) -> Result<Vec<pb::Instance>> {
        let mut instances = Vec::new();
        let mut page_token = String::new();
        loop {
            let request = pb::ListInstancesRequest {
                tag_selector: selector.clone(),
                page_size: None,
                page_token: page_token.clone(),
            };
            let page = self
                .call("ListInstances", |mut c| async move {
                    c.list_instances(request).await
                })
                .await?;
            instances.extend(page.instances);
            if page.next_page_token.is_empty() {
                return Ok(instances);
            }
            if page.next_page_token == page_token {
                let error = ProviderError::transient(
                    "ListInstances returned the same page token again (a provider bug)",
                );
                return Err(Error::Provider {
                    provider: self.name.clone(),
                    op: "ListInstances",
                    source: Box::new(error),
                });
            }
            page_token = page.next_page_token;
        }
    }

    /// ValidatePlacement when the provider supports it; `Ok(())` when it does not.
    pub async fn validate_placement(&self, placement: pb::Placement) -> Result<()> {
        let info = self.handshake().await?;
        if !info
            .capabilities
            .contains(&pb::Capability::ValidatePlacement)
        {
            return Ok(());
        }
        let request = pb::ValidatePlacementRequest {
            placement: Some(placement),
        };
        match self
            .call("ValidatePlacement", |mut c| async move {
                c.validate_placement(request).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::Unimplemented => {
                Ok(())
            }
            Err(error) => Err(error),
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
        let info = self
            .call("GetPluginInfo", |mut c| async move {
                c.get_plugin_info(pb::GetPluginInfoRequest {}).await
            })
            .await?;
        let expected = major(CONTRACT_VERSION);
        if major(&info.contract_version) != expected {
            return Err(Error::IncompatibleProvider {
                provider: self.name.clone(),
                found: info.contract_version,
                expected: expected.to_owned(),
            });
        }
        let capabilities = match self
            .call("GetCapabilities", |mut c| async move {
                c.get_capabilities(pb::GetCapabilitiesRequest {}).await
            })
            .await
        {
            Ok(answer) => answer.capabilities().collect(),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::Unimplemented => {
                Vec::new()
            }
            Err(error) => return Err(error),
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
    /// Providers from a parsed config, reporting calls to `metrics`.
    pub fn new(config: ProvidersConfig, metrics: Arc<Metrics>) -> Self {
        let providers = config.providers.into_iter();
        Providers {
            providers: providers
                .map(|(name, c)| (name.clone(), Provider::new(name, c, metrics.clone())))
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
