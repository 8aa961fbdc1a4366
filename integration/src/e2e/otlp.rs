//! A span receiver: the OTLP/gRPC trace service, keeping every span it is sent.
//!
//! The operator and the agent export with their standard `OTEL_*` configuration to
//! [`SpanReceiver::endpoint`]; a test then reads whole traces back ([`SpanReceiver::spans`])
//! and checks how the spans of both processes link up.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use tokio::task::JoinHandle;

/// One received span, flattened.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReceivedSpan {
    /// `service.name` of the exporting process.
    pub service: String,
    /// Hex trace id.
    pub trace_id: String,
    /// Hex span id.
    pub span_id: String,
    /// Hex parent span id; empty for a root span.
    pub parent_span_id: String,
    /// The span's name.
    pub name: String,
    /// Start, nanoseconds since the Unix epoch.
    pub start_unix_nano: u64,
    /// End, nanoseconds since the Unix epoch.
    pub end_unix_nano: u64,
    /// Attributes whose values are strings, numbers or booleans, as text.
    pub attributes: BTreeMap<String, String>,
    /// The span's events (a `tracing` event inside a span becomes one), in order.
    pub events: Vec<ReceivedEvent>,
}

/// One event of a [`ReceivedSpan`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReceivedEvent {
    /// The event's name (for a `tracing` event: its message).
    pub name: String,
    /// Attributes as in [`ReceivedSpan::attributes`].
    pub attributes: BTreeMap<String, String>,
}

#[derive(Debug, Default, Clone)]
struct Store {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    /// Where each span is also appended as a JSON line, when set.
    file: Option<PathBuf>,
}

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let received = flatten(request.into_inner());
        if let Some(path) = &self.file {
            let mut lines = String::new();
            for span in &received {
                lines.push_str(&serde_json::to_string(span).unwrap_or_default());
                lines.push('\n');
            }
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut file| file.write_all(lines.as_bytes()));
            if let Err(error) = appended {
                tracing::warn!(path = %path.display(), %error, "cannot append spans");
            }
        }
        self.spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(received);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// Every span of an export request, flattened (for any transport that received it).
pub(crate) fn flatten(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(value_text)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.push(ReceivedSpan {
                    service: service.clone(),
                    trace_id: hex::encode(&span.trace_id),
                    span_id: hex::encode(&span.span_id),
                    parent_span_id: hex::encode(&span.parent_span_id),
                    name: span.name,
                    start_unix_nano: span.start_time_unix_nano,
                    end_unix_nano: span.end_time_unix_nano,
                    attributes: attributes_text(&span.attributes),
                    events: span
                        .events
                        .iter()
                        .map(|event| ReceivedEvent {
                            name: event.name.clone(),
                            attributes: attributes_text(&event.attributes),
                        })
                        .collect(),
                });
            }
        }
    }
    received
}

fn attributes_text(attributes: &[KeyValue]) -> BTreeMap<String, String> {
    attributes
        .iter()
        .filter_map(|kv| Some((kv.key.clone(), value_text(kv.value.as_ref()?))))
        .collect()
}

fn value_text(value: &AnyValue) -> String {
    match &value.value {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

/// A running receiver on a loopback port; stops when dropped.
#[derive(Debug)]
pub struct SpanReceiver {
    addr: SocketAddr,
    store: Store,
    task: JoinHandle<()>,
}

impl SpanReceiver {
    /// Starts the receiver on a free loopback port, on `runtime`; with `file`, every
    /// span is also appended to it as a JSON line.
    pub fn start(runtime: &tokio::runtime::Handle, file: Option<PathBuf>) -> anyhow::Result<Self> {
        Self::start_with_tls(runtime, file, None)
    }

    /// Like [`SpanReceiver::start`], serving TLS with `tls` when given.
    pub fn start_with_tls(
        runtime: &tokio::runtime::Handle,
        file: Option<PathBuf>,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let store = Store {
            spans: Arc::default(),
            file,
        };
        let service = TraceServiceServer::new(store.clone());
        let task = runtime.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let mut builder = tonic::transport::Server::builder();
            if let Some(tls) = tls {
                let Ok(with_tls) = builder.tls_config(tls) else {
                    return;
                };
                builder = with_tls;
            }
            let _ = builder
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        Ok(Self { addr, store, task })
    }

    /// `http://127.0.0.1:PORT`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The receiver's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.store
            .spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for SpanReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
