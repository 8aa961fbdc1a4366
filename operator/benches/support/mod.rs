//! What the operator benchmarks share: the operator binary started against a real
//! kube-apiserver and the reference provider, its `/metrics`, its CPU time and memory
//! from `/proc`, and a listener that answers every health check.
//!
//! Every `BENCH_OPERATOR_ENV_<NAME>` variable of the benchmark is handed to the
//! operator as `<NAME>`: a profiler that is loaded by the dynamic linker can watch it
//! in place, with the benchmark still reading the operator's own memory. For heaptrack,
//! with a benchmark that starts the operator once (a restarted operator would write to
//! a pipe no one reads any more):
//!
//! ```text
//! mkfifo /tmp/ht
//! /usr/lib/heaptrack/libexec/heaptrack_interpret < /tmp/ht | gzip > ht.gz &
//! BENCH_OPERATOR_ENV_LD_PRELOAD=/usr/lib/heaptrack/libheaptrack_preload.so \
//!   BENCH_OPERATOR_ENV_DUMP_HEAPTRACK_OUTPUT=/tmp/ht \
//!   cargo bench -p egressproxy-operator --bench scale
//! heaptrack_print -f ht.gz --print-leaks 1
//! ```
//!
//! The last command lists what was live when the operator was stopped, by call site.

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};

use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::reference_provider::{ReferenceProvider, workspace_binary};
use egressproxy_operator::crd::Proxy;

const CRD: &str = include_str!("../../../charts/egressproxy/files/crds.yaml");

/// The apiserver, the reference provider (zero provisioning delay) and the operator.
pub(crate) struct Stack {
    pub(crate) env: KubeTestEnv,
    pub(crate) provider: ReferenceProvider,
    pub(crate) operator: Child,
    pub(crate) metrics_address: std::net::SocketAddr,
    /// The port every Proxy's health check reaches.
    pub(crate) proxy_port: u16,
    name: String,
    provider_args: Vec<String>,
    _providers: tempfile::NamedTempFile,
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Instances are RUNNING at once.
const PROVIDER_ARGS: [&str; 2] = ["--provisioning-delay", "0s"];

fn spawn_operator(
    env: &KubeTestEnv,
    name: &str,
    providers: &std::path::Path,
    metrics_address: std::net::SocketAddr,
) -> anyhow::Result<Child> {
    Ok(Command::new(workspace_binary("egressproxy-operator")?)
        .env("KUBECONFIG", env.apiserver().kubeconfig_path())
        .env("RUST_LOG", "warn")
        .envs(std::env::vars_os().filter_map(|(k, v)| {
            let k = k.to_str()?.strip_prefix("BENCH_OPERATOR_ENV_")?.to_owned();
            Some((k, v))
        }))
        .args([
            "--cluster-name",
            name,
            "--namespace",
            &env.namespace,
            "--lease-namespace",
            &env.namespace,
        ])
        .arg("--providers")
        .arg(providers)
        .args([
            "--http-listen",
            &metrics_address.to_string(),
            "--gc-interval",
            "1h",
        ])
        .stdin(Stdio::null())
        .spawn()?)
}

impl Stack {
    pub(crate) async fn start(name: &str) -> anyhow::Result<Stack> {
        Stack::start_with(name, &[]).await
    }

    /// Like [`Stack::start`], with `extra` arguments for the reference provider.
    pub(crate) async fn start_with(name: &str, extra: &[&str]) -> anyhow::Result<Stack> {
        let env = KubeTestEnv::new(name).await?;
        apply_crds_yaml(&env.client, CRD).await?;
        let provider_args: Vec<String> = PROVIDER_ARGS
            .iter()
            .chain(extra)
            .map(|arg| (*arg).to_owned())
            .collect();
        let provider = ReferenceProvider::start(&as_strs(&provider_args))?;
        let providers = tempfile::NamedTempFile::new()?;
        std::fs::write(
            providers.path(),
            format!(
                "providers:\n  reference:\n    endpoint: {}\n",
                provider.endpoint()
            ),
        )?;
        let http = std::net::TcpListener::bind("127.0.0.1:0")?;
        let metrics_address = http.local_addr()?;
        drop(http);
        let operator = spawn_operator(&env, name, providers.path(), metrics_address)?;
        // Every instance reports 127.0.0.1: one listener answers every health check.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let proxy_port = listener.local_addr()?.port();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        Ok(Stack {
            env,
            provider,
            operator,
            metrics_address,
            proxy_port,
            name: name.to_owned(),
            provider_args,
            _providers: providers,
        })
    }

    /// SIGKILLs the operator and starts a new one with the same flags.
    pub(crate) fn restart_operator(&mut self) -> anyhow::Result<()> {
        let _ = self.operator.kill();
        let _ = self.operator.wait();
        self.operator = spawn_operator(
            &self.env,
            &self.name,
            self._providers.path(),
            self.metrics_address,
        )?;
        Ok(())
    }

    /// SIGKILLs the reference provider (its instances live in its memory and go with
    /// it) and starts a new one on the same address.
    pub(crate) fn restart_provider(&mut self) -> anyhow::Result<()> {
        let address = self.provider.address().to_owned();
        self.provider.kill();
        self.provider = ReferenceProvider::start_at(&address, &as_strs(&self.provider_args))?;
        Ok(())
    }

    /// The operator's `/metrics` text.
    pub(crate) async fn metrics(&self) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.metrics_address).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n")
            .await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        Ok(text)
    }

    /// The sum of metric `name` over its labels.
    pub(crate) async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        Ok(sum_metric(&self.metrics().await?, name))
    }

    /// The operator's `/proc/<pid>/status` field `field` (kB).
    pub(crate) fn memory_kib(&self, field: &str) -> anyhow::Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.operator.id()))?;
        let line = status
            .lines()
            .find(|l| l.starts_with(field))
            .ok_or_else(|| anyhow::anyhow!("no {field}"))?;
        Ok(line.split_whitespace().nth(1).unwrap_or("0").parse()?)
    }

    /// The operator's CPU time (user + system) so far, in seconds.
    pub(crate) fn cpu_seconds(&self) -> anyhow::Result<f64> {
        cpu_seconds_of(self.operator.id())
    }

    /// CPU time so far (seconds) of each process of the stack, and of the benchmark
    /// itself: where the machine's cores went.
    pub(crate) fn cpu_by_process(&self) -> anyhow::Result<Vec<(&'static str, f64)>> {
        let mut processes = vec![
            ("operator", self.operator.id()),
            ("reference provider", self.provider.pid()),
            ("benchmark (client)", std::process::id()),
        ];
        if let Some(pid) = self.env.apiserver().harness_pid() {
            processes.push(("kube-apiserver and etcd", pid));
        }
        processes
            .into_iter()
            .map(|(name, pid)| Ok((name, cpu_seconds_of(pid)?)))
            .collect()
    }

    pub(crate) fn stop(self) {
        drop(self);
    }
}

impl Drop for Stack {
    /// Also on an early error return: no operator outlives its benchmark.
    fn drop(&mut self) {
        let _ = self.operator.kill();
        let _ = self.operator.wait();
    }
}

/// The CPU time (user + system) of process `pid` so far, in seconds.
fn cpu_seconds_of(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at state.
    let rest = stat
        .rsplit_once(')')
        .ok_or_else(|| anyhow::anyhow!("bad stat"))?
        .1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(ticks as f64 / clock_ticks() as f64)
}

fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// The sum of metric `name` over its labels in a Prometheus text.
pub(crate) fn sum_metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Proxy number `i` of a wave, with the health check on `port`.
pub(crate) fn proxy(name: &str, port: u16) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": port,
        },
    }))
    .expect("valid Proxy")
}

/// The value of every sample of metric `name` in a Prometheus text, by its labels.
pub(crate) fn samples(text: &str, name: &str) -> Vec<(String, i64)> {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with('{'))
        .filter_map(|line| {
            let (labels, value) = line.rsplit_once(' ')?;
            Some((labels[name.len()..].to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// `label=value` pairs of per-Proxy map sizes, for a table row.
pub(crate) fn describe(maps: &[(String, i64)]) -> String {
    maps.iter()
        .map(|(labels, n)| format!("{}={n}", labels.trim_matches(['{', '}'])))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Creates Proxies `<prefix>-0000` … for one wave, 32 requests in flight.
pub(crate) async fn create_wave(
    proxies: &kube::Api<Proxy>,
    prefix: &str,
    size: usize,
    port: u16,
) -> anyhow::Result<()> {
    use futures::{StreamExt, TryStreamExt};
    futures::stream::iter(0..size)
        .map(|i| {
            let proxies = proxies.clone();
            async move {
                let proxy = proxy(&format!("{prefix}-{i:04}"), port);
                proxies
                    .create(&kube::api::PostParams::default(), &proxy)
                    .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Waits until `size` Proxies are Ready (the namespace holds only the wave's), polling
/// the list: a wave's hundreds of status changes are cheaper to count than to watch.
pub(crate) async fn wait_all_ready(
    proxies: &kube::Api<Proxy>,
    wave: u64,
    size: usize,
    within: std::time::Duration,
) -> anyhow::Result<()> {
    use egressproxy_operator::crd::Phase;
    let deadline = std::time::Instant::now() + within;
    loop {
        let list = proxies.list(&kube::api::ListParams::default()).await?;
        let ready = list
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready))
            .count();
        if ready == size {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "wave {wave}: only {ready} of {size} Ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Waits until no Proxy is left in the namespace.
pub(crate) async fn wait_all_gone(
    proxies: &kube::Api<Proxy>,
    wave: u64,
    within: std::time::Duration,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = proxies
            .list_metadata(&kube::api::ListParams::default())
            .await?
            .items
            .len();
        if left == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "wave {wave}: {left} Proxies not deleted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Waits until `check` holds for the Proxies of the namespace, as one watch of them sees
/// them: at thousands of Proxies, listing them every fraction of a second would load
/// the apiserver the benchmark measures.
pub(crate) async fn watch_until(
    proxies: &kube::Api<Proxy>,
    what: &str,
    within: std::time::Duration,
    check: impl Fn(&[std::sync::Arc<Proxy>]) -> bool,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let (store, writer) = reflector::store();
    let mut events = watcher(proxies.clone(), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .boxed();
    let wait = async {
        let mut listed = false;
        while let Some(event) = events.next().await {
            listed |= matches!(event, Ok(watcher::Event::InitDone));
            if listed && check(&store.state()) {
                return true;
            }
        }
        false
    };
    match tokio::time::timeout(within, wait).await {
        Ok(true) => Ok(()),
        Ok(false) => anyhow::bail!("the watch of Proxies ended while waiting for {what}"),
        Err(_) => anyhow::bail!("{what}: not within {within:?}"),
    }
}

/// Whether every one of `proxies` is Ready.
pub(crate) fn all_ready(proxies: &[std::sync::Arc<Proxy>]) -> bool {
    use egressproxy_operator::crd::Phase;
    proxies
        .iter()
        .all(|p| p.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready))
}
