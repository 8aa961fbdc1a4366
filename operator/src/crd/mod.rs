//! The custom resources (`egressproxy.dev/v1alpha1`): [`Proxy`], one egress proxy VM,
//! and [`ProxyPool`], a set of interchangeable Proxies behind one Service.

mod pool;
mod proxy;

pub use pool::*;
pub use proxy::*;
