//! W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata, so one
//! trace runs from the operator's reconcile through a provider to its infrastructure
//! calls. The W3C propagator is used directly, so propagation works whether or not a
//! global OpenTelemetry pipeline is installed.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|key| key.as_str()).collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// Makes `span` a child of the trace context found in `headers`, if any.
pub(crate) fn set_parent_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // Fails only when the span is disabled (filtered out); nothing to link then.
    let _ = span.set_parent(parent);
}

/// Writes the current span's trace context into outgoing request metadata.
pub(crate) fn inject_current(metadata: &mut MetadataMap) {
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(metadata));
}
