//! Harnesses for tests that use the real components instead of mocks.
//!
//! - [`e2e`]: the whole real path (guest image, libvirtd, sshd, agent, operator) as one stack.
//! - [`tools`]: locates the pinned test tools (grpcurl, buf, helm, kube-harness, the
//!   Python virtualenv with grpcio).
//! - [`chart_pod`]: a binary run as an installed chart's Deployment would run it.
//! - [`alerts`]: the chart's PrometheusRule against the metrics the binaries export.
//! - [`certificates`]: a test CA with server and client certificates (openssl).
//! - [`chaos`]: a seeded random sequence for fault injection.
//! - [`helm`]: the project's chart through the real `helm` and `kubectl`.
//! - [`doc_commands`]: a document's shell blocks run as written, its site names filled in.
//! - [`http_server`]: an image server on loopback that answers as a test needs.
//! - [`kube_apiserver`]: a real kube-apiserver with embedded etcd, one per test process.
//! - [`kube_env`]: per-test client and namespace on it; applies CRDs.
//! - [`garbage_collector`]: Kubernetes' garbage collector beside that apiserver, for
//!   the tests that assert a cascade.
//! - [`libvirtd`]: a private libvirtd in its own mount namespace.
//! - [`sshd`]: a private sshd on loopback with generated host and client keys.
//! - [`reference_provider`]: the reference provider binary as a separate process.
//! - [`kvm_agent`]: `kvm-agent serve` as a separate process.
//! - [`otlp_http`]: an OTLP/HTTP trace receiver (protobuf or JSON, plain or TLS).
//! - [`process`]: daemons as process trees: pause, resume, stop on drop.
//! - [`cpu`]: the machine's and the guests' CPU time, for benchmarks.
//! - [`netns`]: network namespaces the tests make, and sockets and commands inside them.
//! - [`relay`]: TCP relays from a network namespace to the host's loopback.
//! - [`cluster`]: a single-node Kubernetes cluster (kubelet, containerd, kube-proxy,
//!   CoreDNS) on the shared kube-apiserver, its node networking in a namespace of its own.

#![forbid(unsafe_code)]

pub mod alerts;
pub mod certificates;
pub mod chaos;
pub mod chart_pod;
pub mod cluster;
pub mod cpu;
pub mod doc_commands;
pub mod e2e;
pub mod eventually;
pub mod garbage_collector;
pub mod helm;
pub mod http_server;
pub mod kube_apiserver;
pub mod kube_env;
pub mod kvm_agent;
pub mod libvirtd;
pub mod netns;
pub mod otlp_http;
pub mod process;
pub mod reference_provider;
pub mod relay;
pub mod sshd;
pub mod tools;
