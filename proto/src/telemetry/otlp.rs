//! The OTLP span exporter the standard `OTEL_*` variables ask for.
//!
//! Each setting is read from its traces-specific variable first
//! (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`), then the generic one
//! (`OTEL_EXPORTER_OTLP_PROTOCOL`):
//!
//! | setting | variable suffix | values |
//! |---|---|---|
//! | protocol | `PROTOCOL` | `grpc` (default), `http/protobuf`, `http/json` |
//! | CA of the collector's certificate (else the system's) | `CERTIFICATE` | PEM file |
//! | client certificate and key (mutual TLS) | `CLIENT_CERTIFICATE`, `CLIENT_KEY` | PEM files |
//!
//! The endpoint, headers, timeout and compression are read by `opentelemetry-otlp`
//! itself. A value this module cannot honour (an unknown protocol, an unreadable CA, a
//! client certificate without its key) is an error naming the variable, never a silent
//! fallback: a binary then refuses to start rather than export nothing.
//!
//! TLS is rustls with the `ring` provider for both transports. The HTTP exporter uses a
//! blocking reqwest client because the SDK's batch processor exports from a thread of
//! its own, outside any async runtime.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig, WithHttpConfig};
use opentelemetry_otlp::{WithTonicConfig, tonic_types};

/// How long one HTTP export may take (the specification's default).
const HTTP_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The OTLP transport and encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (usually port 4317).
    Grpc,
    /// OTLP/HTTP with protobuf bodies (usually port 4318, path `/v1/traces`).
    HttpProtobuf,
    /// OTLP/HTTP with JSON bodies.
    HttpJson,
}

/// What the `OTEL_*` variables say about the exporter's protocol and TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpSettings {
    /// The transport.
    pub protocol: OtlpProtocol,
    /// Whether the endpoint is `https://`.
    pub https: bool,
    /// PEM CA bundle that signed the collector's certificate (default: the system's).
    pub ca: Option<PathBuf>,
    /// PEM client certificate and key, for a collector that asks for one.
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

/// The traces-specific variable, else the generic one, ignoring blank values.
fn setting(env: &impl Fn(&str) -> Option<String>, suffix: &str) -> Option<(String, String)> {
    [
        format!("OTEL_EXPORTER_OTLP_TRACES_{suffix}"),
        format!("OTEL_EXPORTER_OTLP_{suffix}"),
    ]
    .into_iter()
    .find_map(|name| {
        let value = env(&name)?.trim().to_owned();
        (!value.is_empty()).then_some((name, value))
    })
}

impl OtlpSettings {
    /// Reads the settings from `env`; an unsupported or incomplete one is an error
    /// naming its variable.
    pub fn from_env(env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let protocol = match setting(&env, "PROTOCOL") {
            None => OtlpProtocol::Grpc,
            Some((name, value)) => match value.to_ascii_lowercase().as_str() {
                "grpc" => OtlpProtocol::Grpc,
                "http/protobuf" => OtlpProtocol::HttpProtobuf,
                "http/json" => OtlpProtocol::HttpJson,
                _ => anyhow::bail!(
                    "{name}={value:?} is not an OTLP protocol: use grpc, http/protobuf or http/json"
                ),
            },
        };
        let https = setting(&env, "ENDPOINT")
            .is_some_and(|(_, endpoint)| endpoint.to_ascii_lowercase().starts_with("https://"));
        let ca = setting(&env, "CERTIFICATE").map(|(_, path)| PathBuf::from(path));
        let client_identity = match (
            setting(&env, "CLIENT_CERTIFICATE"),
            setting(&env, "CLIENT_KEY"),
        ) {
            (Some((_, cert)), Some((_, key))) => Some((cert.into(), key.into())),
            (None, None) => None,
            (Some((name, _)), None) | (None, Some((name, _))) => anyhow::bail!(
                "{name} is set without its pair: set both OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE \
                 and OTEL_EXPORTER_OTLP_CLIENT_KEY for mutual TLS with the collector, or neither"
            ),
        };
        Ok(OtlpSettings {
            protocol,
            https,
            ca,
            client_identity,
        })
    }

    /// The span exporter these settings describe.
    pub fn span_exporter(&self) -> anyhow::Result<SpanExporter> {
        let http = match self.protocol {
            OtlpProtocol::Grpc => {
                let mut builder = SpanExporter::builder().with_tonic();
                if self.https {
                    builder = builder.with_tls_config(self.tonic_tls()?);
                }
                return Ok(builder.build()?);
            }
            OtlpProtocol::HttpProtobuf => Protocol::HttpBinary,
            OtlpProtocol::HttpJson => Protocol::HttpJson,
        };
        Ok(SpanExporter::builder()
            .with_http()
            .with_protocol(http)
            .with_http_client(self.http_client()?)
            .build()?)
    }

    fn tonic_tls(&self) -> anyhow::Result<tonic_types::transport::ClientTlsConfig> {
        use tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
        let mut config = match &self.ca {
            Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        if let Some((cert, key)) = &self.client_identity {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        Ok(config)
    }

    /// A blocking reqwest client with these TLS settings. Built on a thread of its own:
    /// reqwest's blocking client refuses to be made inside an async runtime.
    fn http_client(&self) -> anyhow::Result<reqwest::blocking::Client> {
        let tls = self.rustls_config()?;
        std::thread::spawn(move || {
            reqwest::blocking::Client::builder()
                .tls_backend_preconfigured(tls)
                .timeout(HTTP_EXPORT_TIMEOUT)
                .build()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("building the OTLP/HTTP client panicked"))?
        .context("cannot build the OTLP/HTTP client")
    }

    fn rustls_config(&self) -> anyhow::Result<rustls::ClientConfig> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        use rustls_platform_verifier::BuilderVerifierExt;

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS for the OTLP collector")?;
        let builder = match &self.ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&read(ca)?) {
                    let cert = cert.map_err(|error| {
                        anyhow::anyhow!("OTEL_EXPORTER_OTLP_CERTIFICATE {}: {error}", ca.display())
                    })?;
                    roots.add(cert).with_context(|| {
                        format!("OTEL_EXPORTER_OTLP_CERTIFICATE {}", ca.display())
                    })?;
                }
                builder.with_root_certificates(roots)
            }
            None => builder
                .with_platform_verifier()
                .context("the system's CA certificates")?,
        };
        Ok(match &self.client_identity {
            Some((cert, key)) => {
                let chain = CertificateDer::pem_slice_iter(&read(cert)?)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| {
                        anyhow::anyhow!("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE: {error}")
                    })?;
                let key = PrivateKeyDer::from_pem_slice(&read(key)?)
                    .map_err(|error| anyhow::anyhow!("OTEL_EXPORTER_OTLP_CLIENT_KEY: {error}"))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .context("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and _KEY do not match")?
            }
            None => builder.with_no_client_auth(),
        })
    }
}

fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path)
        .with_context(|| format!("cannot read {} (an OTLP TLS file)", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_protocol_comes_from_the_traces_variable_then_the_generic_one() {
        let protocol = |vars: &[(&str, &str)]| OtlpSettings::from_env(env(vars)).unwrap().protocol;
        assert_eq!(protocol(&[]), OtlpProtocol::Grpc);
        assert_eq!(
            protocol(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]),
            OtlpProtocol::HttpProtobuf
        );
        assert_eq!(
            protocol(&[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
            ]),
            OtlpProtocol::HttpJson
        );
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_naming_the_variable() {
        let error = OtlpSettings::from_env(env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")]))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"thrift\""),
            "{error}"
        );
        let error =
            OtlpSettings::from_env(env(&[("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/k.pem")]))
                .unwrap_err()
                .to_string();
        assert!(
            error.contains("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY is set without its pair"),
            "{error}"
        );
    }
}
