//! The provider config file (YAML, usually mounted from a ConfigMap):
//!
//! ```yaml
//! providers:
//!   kvm:
//!     endpoint: https://kvm-agent.egressproxy.svc:50051
//!     callTimeout: 30s          # default 30s, at most 10m
//!     tls:                      # required for https endpoints
//!       ca: /etc/egressproxy/provider-tls/ca.crt
//!       cert: /etc/egressproxy/provider-tls/tls.crt   # with key: mutual TLS
//!       key: /etc/egressproxy/provider-tls/tls.key
//!       serverName: kvm-agent   # default: the endpoint's host
//!     egressCheckUrl: https://api.ipify.org   # optional: see `status.egressAddress`
//! ```
//!
//! Every error names the field at fault.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::shared::limits;

/// The provider config file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProvidersConfig {
    /// Provider name (what `spec.provider` says) to its settings.
    pub providers: BTreeMap<String, ProviderConfig>,
}

/// How to reach one provider. Its `Debug` shows `egressCheckUrl` redacted.
#[derive(Clone, Deserialize, PartialEq)]
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
    /// An echo service that answers the caller's address alone, fetched through each
    /// of this provider's proxies to observe its egress address (a Proxy's
    /// `spec.egress.checkUrl` overrides it). It may carry credentials: they are never
    /// shown in messages.
    #[serde(default)]
    pub egress_check_url: Option<String>,
}

impl std::fmt::Debug for ProviderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let check_url = self
            .egress_check_url
            .as_deref()
            .map(crate::probe::egress_echo::redact_url);
        f.debug_struct("ProviderConfig")
            .field("endpoint", &self.endpoint)
            .field("call_timeout", &self.call_timeout)
            .field("tls", &self.tls)
            .field("egress_check_url", &check_url)
            .finish()
    }
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

impl ProvidersConfig {
    /// Parses and checks a config file's text; errors name the field.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let config: ProvidersConfig = serde_norway::from_str(text)?;
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
            if let Some(url) = &provider.egress_check_url {
                check_egress_url(url).map_err(|problem| {
                    anyhow::anyhow!("providers.{name}.egressCheckUrl: {problem}")
                })?;
            }
            limits::CALL_TIMEOUT
                .check(provider.call_timeout)
                .map_err(|problem| anyhow::anyhow!("providers.{name}.callTimeout: {problem}"))?;
        }
        Ok(config)
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|error| {
            anyhow::anyhow!("cannot read provider config {}: {error}", path.display())
        })?;
        Self::parse(&text)
            .map_err(|error| anyhow::anyhow!("provider config {}: {error}", path.display()))
    }
}

/// An echo service's URL must be an absolute http(s) URL; the problem never shows it
/// (it may carry credentials).
fn check_egress_url(url: &str) -> Result<(), String> {
    match reqwest::Url::parse(url) {
        Ok(parsed) if matches!(parsed.scheme(), "http" | "https") => Ok(()),
        Ok(_) => Err(format!(
            "{} must start with http:// or https://",
            crate::probe::egress_echo::redact_url(url)
        )),
        Err(error) => Err(format!("not a valid URL ({error})")),
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
    fn the_check_url_s_secrets_never_show_in_debug_output() {
        let config = ProvidersConfig::parse(
            "providers:\n  a:\n    endpoint: http://x\n    egressCheckUrl: https://u:s3cret@echo.example/?key=s3cret\n",
        )
        .unwrap();
        let shown = format!("{config:?}");
        assert!(
            !shown.contains("s3cret") && shown.contains("https://echo.example/?…"),
            "{shown}"
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
            (
                "providers:\n  a:\n    endpoint: http://x\n    egressCheckUrl: ftp://u:s3cret@echo/\n",
                "providers.a.egressCheckUrl: ftp://echo/ must start with http://",
            ),
            (
                "providers:\n  a:\n    endpoint: http://x\n    egressCheckUrl: echo.example\n",
                "providers.a.egressCheckUrl: not a valid URL",
            ),
        ];
        for (text, expected) in cases {
            let error = ProvidersConfig::parse(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected} not in {error}");
        }
    }

    #[test]
    fn an_absurd_call_timeout_is_refused_with_its_field_and_bound() {
        let error = ProvidersConfig::parse(
            "providers:\n  a:\n    endpoint: http://x\n    callTimeout: 1000h\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("providers.a.callTimeout") && error.contains("at most 10m"),
            "{error}"
        );
    }
}
