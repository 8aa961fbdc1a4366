//! Prints the CRDs (Proxy, then ProxyPool) as one YAML stream. Its output is checked in
//! at `charts/egressproxy/files/crds.yaml`; `make generate-check` fails on drift.

#![forbid(unsafe_code)]

use egressproxy_operator::crd::{Proxy, ProxyPool};
use kube::CustomResourceExt;

fn main() -> anyhow::Result<()> {
    print!("{}", serde_norway::to_string(&Proxy::crd())?);
    print!("---\n{}", serde_norway::to_string(&ProxyPool::crd())?);
    Ok(())
}
