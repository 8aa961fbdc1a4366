//! Logging and tracing set-up shared by the operator, providers and tools.
//!
//! - Logs go to stderr through `tracing-subscriber`; `RUST_LOG` wins over the
//!   verbosity the binary passes (its `-v` count).
//! - Spans are exported with OTLP when the standard variables configure it
//!   (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), over gRPC
//!   or HTTP (protobuf or JSON) as `OTEL_EXPORTER_OTLP_PROTOCOL` says, to plain or TLS
//!   collectors ([`otlp`]: the protocol and TLS variables; the exporter reads the rest
//!   of `OTEL_*` itself). Export is off when no endpoint is set, when
//!   `OTEL_TRACES_EXPORTER=none`, or when `OTEL_SDK_DISABLED=true`.
//! - The W3C trace-context propagator is installed globally.

pub mod otlp;

use std::io::IsTerminal;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Flushes and shuts down span export when dropped; keep it alive in `main`.
#[derive(Debug)]
#[must_use = "dropping the guard stops span export"]
pub struct TelemetryGuard {
    tracer_provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.tracer_provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("flushing spans failed: {error}");
        }
    }
}

/// The default log filter for a `-v` count: 0 info, 1 debug, 2+ trace.
pub fn filter_for_verbosity(verbosity: u8) -> &'static str {
    match verbosity {
        0 => "info",
        1 => "debug",
        _ => "trace",
    }
}

/// Whether the `OTEL_*` environment asks for OTLP span export.
pub fn otlp_export_enabled(env: impl Fn(&str) -> Option<String>) -> bool {
    let set = |name: &str| env(name).is_some_and(|value| !value.trim().is_empty());
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let exporter_none =
        env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
    !disabled
        && !exporter_none
        && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Installs logging and, when configured, OTLP span export for `service_name`.
pub fn init(service_name: &'static str, verbosity: u8) -> anyhow::Result<TelemetryGuard> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(filter_for_verbosity(verbosity)));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());

    let settings = otlp_export_enabled(|name| std::env::var(name).ok())
        .then(|| otlp::OtlpSettings::from_env(|name| std::env::var(name).ok()))
        .transpose()?;
    let tracer_provider = if let Some(settings) = &settings {
        let exporter = settings.span_exporter()?;
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(Resource::builder().with_service_name(service_name).build())
                .build(),
        )
    } else {
        None
    };
    let otel = tracer_provider
        .as_ref()
        .map(|provider| tracing_opentelemetry::layer().with_tracer(provider.tracer(service_name)));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()?;
    if let Some(settings) = &settings {
        tracing::info!(protocol = ?settings.protocol, tls = settings.https, "exporting spans with OTLP");
    }
    Ok(TelemetryGuard { tracer_provider })
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
    fn export_is_off_unless_an_endpoint_is_set() {
        assert!(!otlp_export_enabled(env(&[])));
        assert!(otlp_export_enabled(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://x:4317"
        )])));
        assert!(otlp_export_enabled(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://x"
        )])));
        assert!(!otlp_export_enabled(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            " "
        )])));
    }

    #[test]
    fn export_can_be_switched_off_explicitly() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:4317");
        assert!(!otlp_export_enabled(env(&[
            endpoint,
            ("OTEL_SDK_DISABLED", "true")
        ])));
        assert!(!otlp_export_enabled(env(&[
            endpoint,
            ("OTEL_TRACES_EXPORTER", "none")
        ])));
    }
}
