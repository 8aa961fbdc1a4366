//! `kube-provider`: an egressproxy Provider whose instances are proxy pods on a
//! Kubernetes cluster's egress nodes, for users whose partners allow-list the
//! addresses of a few labelled nodes.
//!
//! How a Create becomes a proxy:
//! 1. [`request`] checks it: the contract's limits, then what a pod cannot be (no
//!    cloud-init, no address identities) and the names [`config`] offers;
//! 2. [`placement`] picks an egress node (a host is a node's name, a zone a node
//!    label's value) where no pod holds the proxy port yet and the pod's requests fit
//!    ([`node_room`]), one Create of a port at a time ([`port_lock`]);
//! 3. [`pod_spec`] builds the pod: host network (the egress address is the node's),
//!    bound to the node, the machine type's resources, the image's port variable;
//! 4. [`record`] names the pod after the key and keeps the rest of the instance in an
//!    annotation, so the cluster alone holds the provider's state;
//! 5. [`instance`] reads a pod back as the contract's instance, and [`provider`] runs
//!    each call against the apiserver, with its failures classified in [`kube_errors`].
//!
//! Imports point one way: `service` → `provider` → the pure modules (`request`,
//! `placement` → `node_room`, `pod_spec`, `instance`, `record`, `kube_errors`) and
//! `port_lock` → `config`; `tests/layer_rule.rs` checks it.

#![forbid(unsafe_code)]

pub mod config;
pub mod instance;
pub mod kube_errors;
pub mod node_room;
pub mod placement;
pub mod pod_spec;
pub mod pod_watch;
pub mod port_lock;
pub mod provider;
pub mod record;
pub mod request;
mod service;

pub use config::Config;
pub use provider::KubeProvider;
