//! Prometheus metrics of the agent, served on `/metrics` by `kvm-agent serve
//! --metrics-listen`:
//!
//! - `kvm_agent_grpc_request_duration_seconds{method,code}`: every gRPC call by method
//!   (its path) and status (its `_count` is the calls by method and result);
//! - `kvm_agent_libvirt_call_duration_seconds{host,op,result}`: every libvirt call by
//!   API (`virDomainCreate`, ...) and `ok` or `error`;
//! - `kvm_agent_image_cache_lookups_total{host,result}`: base image checks: `hit` (the
//!   base was complete on the host), `downloaded` (fetched and uploaded), `failed`;
//! - `kvm_agent_image_downloaded_bytes_total{host}`: bytes fetched into the cache;
//! - `kvm_agent_image_cache_bytes{host}` and `kvm_agent_image_cache_images{host}`: what
//!   the cache holds on the host (the bytes its complete bases take, and how many there
//!   are), as the watch sweep last measured it (every 30 s); a host that did not answer
//!   has no sample until it does;
//! - `kvm_agent_ssh_sessions{host}`: SSH sessions open now;
//! - `kvm_agent_ssh_connects_total{host,result}`: SSH connections, `ok` or `error`.
//!
//! One registry for the process ([`global`]), like the tracing subscriber: each layer
//! records where its work happens (the call wrapper, the image download, the SSH
//! session) without a handle threaded through every constructor. A shared leaf: it
//! imports no layer. Label values are names from the configuration and the code (hosts,
//! libvirt APIs, gRPC methods), never from requests, so their number stays bounded.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GrpcLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LibvirtLabels {
    host: String,
    op: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostResultLabels {
    host: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostLabels {
    host: String,
}

/// Seconds from 1 ms to about 33 s (libvirt calls, gRPC calls up to their deadline).
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Every metric, and the registry that encodes them.
#[derive(Debug)]
pub struct AgentMetrics {
    registry: Registry,
    grpc_calls: Family<GrpcLabels, Histogram, fn() -> Histogram>,
    libvirt_calls: Family<LibvirtLabels, Histogram, fn() -> Histogram>,
    image_lookups: Family<HostResultLabels, Counter>,
    image_bytes: Family<HostLabels, Counter>,
    cache_bytes: Family<HostLabels, Gauge>,
    cache_images: Family<HostLabels, Gauge>,
    ssh_sessions: Family<HostLabels, Gauge>,
    ssh_connects: Family<HostResultLabels, Counter>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let metrics = AgentMetrics {
            registry: Registry::default(),
            grpc_calls: Family::new_with_constructor(latency_histogram),
            libvirt_calls: Family::new_with_constructor(latency_histogram),
            image_lookups: Family::default(),
            image_bytes: Family::default(),
            cache_bytes: Family::default(),
            cache_images: Family::default(),
            ssh_sessions: Family::default(),
            ssh_connects: Family::default(),
        };
        let mut registry = Registry::with_prefix("kvm_agent");
        registry.register(
            "grpc_request_duration_seconds",
            "gRPC calls by method and status code",
            metrics.grpc_calls.clone(),
        );
        registry.register(
            "libvirt_call_duration_seconds",
            "libvirt calls by host, API and result",
            metrics.libvirt_calls.clone(),
        );
        registry.register(
            "image_cache_lookups",
            "Base image checks by host and result: hit, downloaded, failed",
            metrics.image_lookups.clone(),
        );
        registry.register(
            "image_downloaded_bytes",
            "Bytes of images fetched into the cache, by host",
            metrics.image_bytes.clone(),
        );
        registry.register(
            "image_cache_bytes",
            "Bytes the complete base images of the cache take, by host",
            metrics.cache_bytes.clone(),
        );
        registry.register(
            "image_cache_images",
            "Complete base images in the cache, by host",
            metrics.cache_images.clone(),
        );
        registry.register(
            "ssh_sessions",
            "SSH sessions open, by host",
            metrics.ssh_sessions.clone(),
        );
        registry.register(
            "ssh_connects",
            "SSH connections by host and result",
            metrics.ssh_connects.clone(),
        );
        AgentMetrics {
            registry,
            ..metrics
        }
    }
}

/// The process's metrics.
pub fn global() -> &'static AgentMetrics {
    static METRICS: LazyLock<AgentMetrics> = LazyLock::new(AgentMetrics::default);
    &METRICS
}

fn result(ok: bool) -> String {
    if ok { "ok" } else { "error" }.to_owned()
}

impl AgentMetrics {
    /// The text exposition format, for `/metrics`.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!(%error, "encoding the metrics failed");
        }
        text
    }

    /// Records one libvirt call.
    pub fn libvirt_call(&self, host: &str, op: &str, ok: bool, took: Duration) {
        let labels = LibvirtLabels {
            host: host.to_owned(),
            op: op.to_owned(),
            result: result(ok),
        };
        self.libvirt_calls
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// Records one base image check on `host`: `hit`, `downloaded` or `failed`.
    pub fn image_lookup(&self, host: &str, outcome: &str) {
        let labels = HostResultLabels {
            host: host.to_owned(),
            result: outcome.to_owned(),
        };
        self.image_lookups.get_or_create(&labels).inc();
    }

    /// Counts `bytes` fetched into the cache for `host`.
    pub fn image_downloaded(&self, host: &str, bytes: u64) {
        let labels = HostLabels {
            host: host.to_owned(),
        };
        self.image_bytes.get_or_create(&labels).inc_by(bytes);
    }

    /// Records what the image cache holds on `host`: `Some((images, bytes))`, or `None`
    /// when it could not be measured (the host's samples go until it can be).
    pub fn image_cache_held(&self, host: &str, held: Option<(u64, u64)>) {
        let labels = HostLabels {
            host: host.to_owned(),
        };
        match held {
            Some((images, bytes)) => {
                let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                self.cache_images.get_or_create(&labels).set(gauge(images));
                self.cache_bytes.get_or_create(&labels).set(gauge(bytes));
            }
            None => {
                self.cache_images.remove(&labels);
                self.cache_bytes.remove(&labels);
            }
        }
    }

    /// Records one SSH connection attempt to `host`.
    pub fn ssh_connect(&self, host: &str, ok: bool) {
        let labels = HostResultLabels {
            host: host.to_owned(),
            result: result(ok),
        };
        self.ssh_connects.get_or_create(&labels).inc();
    }

    /// Counts an SSH session to `host` as open until the returned guard is dropped.
    pub fn ssh_session_opened(&self, host: &str) -> OpenSession {
        let gauge = self
            .ssh_sessions
            .get_or_create(&HostLabels {
                host: host.to_owned(),
            })
            .clone();
        gauge.inc();
        OpenSession { gauge }
    }
}

impl egressproxy_provider::server::CallObserver for AgentMetrics {
    fn observe(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        let labels = GrpcLabels {
            method: method.to_owned(),
            code: format!("{code:?}"),
        };
        self.grpc_calls
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
    }
}

/// An open SSH session, counted in `kvm_agent_ssh_sessions` while it lives.
#[derive(Debug)]
pub struct OpenSession {
    gauge: Gauge,
}

impl Drop for OpenSession {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// The process's metrics as a call observer for the gRPC server.
pub fn call_observer() -> Arc<dyn egressproxy_provider::server::CallObserver> {
    struct Global;
    impl egressproxy_provider::server::CallObserver for Global {
        fn observe(&self, method: &str, code: tonic::Code, elapsed: Duration) {
            egressproxy_provider::server::CallObserver::observe(global(), method, code, elapsed);
        }
    }
    Arc::new(Global)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_metric_is_encoded_with_its_labels() {
        let metrics = AgentMetrics::default();
        metrics.libvirt_call("hv1", "virDomainCreate", true, Duration::from_millis(3));
        metrics.image_lookup("hv1", "hit");
        metrics.image_downloaded("hv1", 1024);
        metrics.image_cache_held("hv1", Some((2, 4096)));
        metrics.image_cache_held("hv2", Some((1, 10)));
        metrics.image_cache_held("hv2", None);
        metrics.ssh_connect("hv1", false);
        let session = metrics.ssh_session_opened("hv1");
        egressproxy_provider::server::CallObserver::observe(
            &metrics,
            "/egressproxy.provider.v1.Provider/ListInstances",
            tonic::Code::Unavailable,
            Duration::from_millis(5),
        );
        let text = metrics.encode();
        for expected in [
            "kvm_agent_libvirt_call_duration_seconds_count{host=\"hv1\",op=\"virDomainCreate\",result=\"ok\"} 1",
            "kvm_agent_image_cache_lookups_total{host=\"hv1\",result=\"hit\"} 1",
            "kvm_agent_image_downloaded_bytes_total{host=\"hv1\"} 1024",
            "kvm_agent_image_cache_bytes{host=\"hv1\"} 4096",
            "kvm_agent_image_cache_images{host=\"hv1\"} 2",
            "kvm_agent_ssh_connects_total{host=\"hv1\",result=\"error\"} 1",
            "kvm_agent_ssh_sessions{host=\"hv1\"} 1",
            "kvm_agent_grpc_request_duration_seconds_count{method=\"/egressproxy.provider.v1.Provider/ListInstances\",code=\"Unavailable\"} 1",
        ] {
            assert!(text.contains(expected), "{expected} not in\n{text}");
        }
        assert!(
            !text.contains("host=\"hv2\""),
            "a host not measured has no sample:\n{text}"
        );
        drop(session);
        assert!(
            metrics
                .encode()
                .contains("kvm_agent_ssh_sessions{host=\"hv1\"} 0")
        );
    }
}
