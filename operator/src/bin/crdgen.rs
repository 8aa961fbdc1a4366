//! Prints the Proxy CRD as YAML. Its output is checked in at
//! `charts/egressproxy/files/proxies.egressproxy.dev.yaml`; `make generate-check` fails on drift.

use kube::CustomResourceExt;

fn main() -> anyhow::Result<()> {
    print!(
        "{}",
        serde_norway::to_string(&egressproxy_operator::crd::Proxy::crd())?
    );
    Ok(())
}
