//! `e2e-stack`: runs the end-to-end stack for `make demo` and keeps it up.
//!
//! 1. Starts [`Stack`] with the chart installed as users install it (guest image,
//!    libvirtd in a network namespace, sshd, a span receiver, and a single-node cluster
//!    on the kube-apiserver into which `helm install` puts the operator and kvm-agent).
//! 2. Applies the sample Proxy `docs/examples/proxy-squid.yaml` (health-checked
//!    against the stack's target server) and waits until it is Ready.
//! 3. Writes what to try to `<state dir>/README` and stdout, then waits.
//! 4. On SIGTERM or SIGINT (`make demo-down`) tears everything down and exits.
//!
//! Usage: `e2e-stack --state-dir DIR` (its pid goes to `DIR/pid`).

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use egressproxy_integration::cluster::TOOLBOX_IMAGE;
use egressproxy_integration::e2e::release::{AGENT, OPERATOR};
use egressproxy_integration::e2e::stack::{
    CONSOLES_DIR, HOST, IMAGE, MACHINE_TYPE, PROVIDER, SPANS_FILE, Stack, StackOptions,
};

const SAMPLE: &str = include_str!("../../../docs/examples/proxy-squid.yaml");
const READY_WITHIN: Duration = Duration::from_secs(900);

fn state_dir() -> anyhow::Result<PathBuf> {
    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next()) {
        (Some("--state-dir"), Some(dir)) => Ok(PathBuf::from(dir)),
        _ => anyhow::bail!("usage: e2e-stack --state-dir DIR"),
    }
}

fn sample_proxy(stack: &Stack) -> anyhow::Result<(String, String)> {
    let mut proxy: serde_norway::Value = serde_norway::from_str(SAMPLE)?;
    let name = proxy["metadata"]["name"]
        .as_str()
        .context("the sample has a name")?
        .to_owned();
    proxy["spec"]["provider"] = PROVIDER.into();
    proxy["spec"]["placement"]["host"] = HOST.into();
    proxy["spec"]["placement"]["machineType"] = MACHINE_TYPE.into();
    proxy["spec"]["placement"]["image"] = IMAGE.into();
    proxy["spec"]["healthCheck"]["url"] = stack.target.url().into();
    Ok((serde_norway::to_string(&proxy)?, name))
}

fn jsonpath(stack: &Stack, name: &str, path: &str) -> String {
    stack
        .kubectl(&["get", "proxy", name, "-o", &format!("jsonpath={path}")])
        .unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let state = state_dir()?;
    std::fs::create_dir_all(&state)?;
    std::fs::write(state.join("pid"), std::process::id().to_string())?;
    let started = Instant::now();
    eprintln!("e2e-stack: starting (a cold run builds the guest image first: about 2 minutes)");
    let options = StackOptions {
        through_chart: true,
        ..StackOptions::default()
    };
    let stack = Stack::start_with("demo", &options).await?;
    eprintln!(
        "e2e-stack: stack up in {:.0} s; applying the sample Proxy",
        started.elapsed().as_secs_f64()
    );
    let (manifest, name) = sample_proxy(&stack)?;
    stack.kubectl_apply(&manifest)?;
    let applied = Instant::now();
    while jsonpath(&stack, &name, "{.status.phase}") != "Ready" {
        anyhow::ensure!(
            applied.elapsed() < READY_WITHIN,
            "the sample Proxy was not Ready within {READY_WITHIN:?}; the logs:\n{}",
            stack.log_tails()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let address = jsonpath(&stack, &name, "{.status.addresses[0].address}");
    let help = format!(
        "The egress proxy demo is running: Proxy {name} became a VM (Ready {ready:.0} s after apply, \
         {total:.0} s after start).\n\
         \n\
         export KUBECONFIG={kubeconfig}\n\
         kubectl -n {namespace} get proxies -w\n\
         kubectl -n {namespace} get events --field-selector involvedObject.name={name}\n\
         \n\
         # the release's pods and their logs:\n\
         kubectl -n {release} get pods -o wide\n\
         kubectl -n {release} logs deploy/{OPERATOR}\n\
         kubectl -n {release} logs deploy/{AGENT}\n\
         \n\
         # a request through the proxy's Service, from a pod:\n\
         kubectl -n {namespace} run client --rm -i --restart=Never --image={toolbox} \\\n\
         \x20 --image-pull-policy=Never --env=http_proxy=http://{name}.{namespace}.svc:3128 -- wget -qO- {target}\n\
         # and from the hypervisor's network namespace, at the VM's address:\n\
         ip netns exec {netns} curl -i -x http://{address}:3128 {target}\n\
         \n\
         # the agent's gRPC API (server reflection) over its mutual TLS, as the chart's notes say:\n\
         export PATH={tools}:$PATH\n\
         helm get notes egressproxy -n {release}\n\
         \n\
         # the VM, through the private libvirtd:\n\
         virsh -c '{libvirt}' list --all\n\
         \n\
         traces (one JSON span a line): {dir}/{SPANS_FILE}\n\
         the VM's serial console: {dir}/{CONSOLES_DIR}/\n\
         stop and remove everything: make demo-down\n",
        ready = applied.elapsed().as_secs_f64(),
        total = started.elapsed().as_secs_f64(),
        kubeconfig = stack.kubeconfig().display(),
        namespace = stack.kube.namespace,
        release = stack.release_namespace().unwrap_or_default(),
        tools = egressproxy_integration::tools::bin_dir()
            .map_or_else(|_| String::new(), |dir| dir.display().to_string()),
        netns = stack.netns(),
        target = stack.target.url(),
        toolbox = egressproxy_integration::tools::image_archive(TOOLBOX_IMAGE)
            .map_or_else(|_| "toolbox".to_owned(), |image| image.name),
        libvirt = stack.libvirt_uri(),
        dir = stack.dir().display(),
    );
    std::fs::write(state.join("README"), &help)?;
    println!("{help}");

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    eprintln!("e2e-stack: stopping");
    tokio::task::spawn_blocking(move || drop(stack)).await?;
    let _ = std::fs::remove_dir_all(&state);
    Ok(())
}
