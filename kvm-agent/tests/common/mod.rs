//! Shared set-up of the transport tests: fixtures to config, and span capture.
//!
//! Spans go to one process-wide in-memory exporter; every test tags its work with its own
//! W3C trace id (as a gRPC caller would send in `traceparent`) and reads back only the
//! spans of that trace, so tests running in parallel do not see each other's spans.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::config::{Config, DomainType, HostConfig, SshConfig, TransportConfig};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

struct Telemetry {
    exporter: InMemorySpanExporter,
    _provider: SdkTracerProvider,
}

static TELEMETRY: OnceLock<Telemetry> = OnceLock::new();

fn telemetry() -> &'static Telemetry {
    TELEMETRY.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let otel = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("kvm-agent-tests"))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
        // RUST_LOG=kvm_agent=debug shows the calls as `-v` would.
        let log = std::env::var("RUST_LOG").ok().map(|_| {
            tracing_subscriber::fmt::layer()
                .with_test_writer()
                .with_filter(tracing_subscriber::EnvFilter::from_default_env())
        });
        // Every event and span of the agent, at every level, as text: for tests that
        // check what never reaches a log.
        let captured = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::NEW)
            .with_writer(|| CapturedLog)
            .with_filter(tracing_subscriber::EnvFilter::new(
                "warn,kvm_agent=trace,egressproxy_provider=trace",
            ));
        let subscriber = tracing_subscriber::registry()
            .with(otel)
            .with(log)
            .with(captured);
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        Telemetry {
            exporter,
            _provider: provider,
        }
    })
}

static CAPTURED_LOG: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

/// Appends to [`CAPTURED_LOG`].
struct CapturedLog;

impl std::io::Write for CapturedLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURED_LOG
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything the agent logged in this process so far (every level, span fields
/// included), as text.
pub fn captured_log() -> String {
    telemetry();
    String::from_utf8_lossy(&CAPTURED_LOG.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
}

/// Every finished span of this process, whatever its trace.
pub fn all_spans() -> Vec<SpanData> {
    telemetry()
        .exporter
        .get_finished_spans()
        .expect("read spans")
}

/// A caller's trace: the request span and the trace id it continues.
pub struct CallerTrace {
    pub trace_id: TraceId,
    pub caller_span_id: SpanId,
    pub request_span: tracing::Span,
}

/// A gRPC-style request span whose parent comes from a W3C `traceparent` header.
pub fn caller_trace(name: &str) -> CallerTrace {
    telemetry();
    let trace_id = TraceId::from_bytes(rand_bytes::<16>());
    let caller_span_id = SpanId::from_bytes(rand_bytes::<8>());
    let header = format!("00-{trace_id}-{caller_span_id}-01");
    let carrier: HashMap<String, String> = [("traceparent".to_owned(), header)].into();
    let parent = TraceContextPropagator::new().extract(&carrier);
    let request_span = tracing::info_span!("grpc request", otel.name = name);
    request_span.set_parent(parent).expect("set remote parent");
    CallerTrace {
        trace_id,
        caller_span_id,
        request_span,
    }
}

fn rand_bytes<const N: usize>() -> [u8; N] {
    // Unique enough per test run: time, pid and a counter through a simple mixer.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed);
    let mut out = [0u8; N];
    for byte in out.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = x as u8;
    }
    out[0] |= 1;
    out
}

/// Finished spans of `trace_id`.
pub fn spans_of(trace_id: TraceId) -> Vec<SpanData> {
    telemetry()
        .exporter
        .get_finished_spans()
        .expect("read spans")
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace_id)
        .collect()
}

/// Finished spans of `trace_id` named `name`.
pub fn spans_named(trace_id: TraceId, name: &str) -> Vec<SpanData> {
    spans_of(trace_id)
        .into_iter()
        .filter(|s| s.name == name)
        .collect()
}

/// The string form of attribute `key` of `span`.
pub fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// Short timeouts so failure paths finish quickly in tests.
pub fn test_transport() -> TransportConfig {
    TransportConfig {
        ssh_handshake_timeout: Duration::from_secs(5),
        ssh_keepalive_interval: Duration::from_millis(500),
        ssh_keepalive_max: 3,
        libvirt_keepalive_interval: Duration::from_secs(1),
        libvirt_keepalive_count: 3,
        default_call_timeout: Duration::from_secs(10),
        ..TransportConfig::default()
    }
}

/// A host reached through `sshd` whose libvirt socket is `libvirtd`'s.
pub fn ssh_host(name: &str, sshd: &Sshd, libvirtd: &Libvirtd) -> HostConfig {
    HostConfig {
        name: name.to_owned(),
        ssh: Some(SshConfig {
            address: sshd.address(),
            user: sshd.user().to_owned(),
            private_key: sshd.client_key(),
            known_hosts: Some(sshd.known_hosts()),
            insecure_skip_host_key_verification: false,
        }),
        local: false,
        libvirt_socket: libvirtd.socket(),
        storage_pool: "default".to_owned(),
        network: None,
        bridge: None,
        static_addresses: None,
        domain_type: DomainType::Qemu,
        zone: None,
        capacity: Default::default(),
    }
}

/// A local-mode host on `socket`.
pub fn local_host(name: &str, socket: &Path) -> HostConfig {
    HostConfig {
        name: name.to_owned(),
        ssh: None,
        local: true,
        libvirt_socket: socket.to_owned(),
        storage_pool: "default".to_owned(),
        network: None,
        bridge: None,
        static_addresses: None,
        domain_type: DomainType::Qemu,
        zone: None,
        capacity: Default::default(),
    }
}

/// A config with `hosts` and the test transport settings.
pub fn config(hosts: Vec<HostConfig>) -> Config {
    Config {
        hosts,
        machine_types: Default::default(),
        images: Default::default(),
        transport: test_transport(),
    }
}

/// `now + d` as the deadline type the pool takes.
pub fn deadline_in(d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::now() + d
}

/// Runs the `kvm-agent` binary with `args` (no logging or OTLP from the environment):
/// whether it succeeded, its stdout and its stderr.
pub fn kvm_agent(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvm-agent"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
