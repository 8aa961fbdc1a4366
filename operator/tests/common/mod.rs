//! What the operator's integration tests share: the CRD, one way to run the
//! controller in-process, the operator binary as a process, and waits that watch the
//! apiserver for the awaited change instead of sleeping ([`eventually`] for the few
//! conditions that are no object the apiserver serves).

#![allow(dead_code, unreachable_pub)] // Each test file uses its own part of this module.

pub mod egress;
pub mod fixtures;
pub mod freezing_relay;
pub mod pool_harness;
pub mod request_log;
pub mod stand_in;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::reference_provider::workspace_binary;
use egressproxy_operator::context::Context;
use egressproxy_operator::k8s::proxy_cache::ProxyCache;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::metrics::Metrics;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::runtime::wait::{Condition, await_condition};
use tokio::process::{Child, Command};

pub use egressproxy_integration::eventually::eventually;

/// The CRD as the chart ships it.
pub const CRD: &str = include_str!("../../../charts/egressproxy/files/crds.yaml");
/// The longest any wait for a change takes before the test fails.
pub const WAIT: Duration = Duration::from_secs(60);
/// Debian's libfaketime, which shifts a process's wall clock.
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
/// The Lease the operator binary elects its leader on.
pub const LEASE: &str = "egressproxy-operator";

/// A new test namespace on the shared apiserver, with the CRD applied.
pub async fn env_with_crd(test: &str) -> KubeTestEnv {
    let env = KubeTestEnv::new(test).await.unwrap();
    apply_crds_yaml(&env.client, CRD).await.unwrap();
    env
}

/// The shared state a controller runs with: `client`, the providers of
/// `providers_yaml`, instances tagged with `cluster`, metrics of its own.
pub fn context(client: kube::Client, providers_yaml: &str, cluster: &str) -> Context {
    let config = ProvidersConfig::parse(providers_yaml).unwrap();
    let metrics = Arc::new(Metrics::default());
    Context::new(
        client,
        Providers::new(config, metrics.clone()),
        cluster.to_owned(),
        metrics,
    )
}

/// The controller running in-process on one namespace, stopped when dropped.
pub struct Controller {
    /// Its shared state (metrics, providers).
    pub ctx: Arc<Context>,
    /// Its cache of Proxies.
    pub cache: ProxyCache,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    stop_pools: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Controller {
    /// Runs the controller on the Proxies of `env`'s namespace with the providers of
    /// `providers_yaml`, tagging instances with `cluster`.
    pub fn start(env: &KubeTestEnv, providers_yaml: &str, cluster: &str) -> Controller {
        let scope = WatchScope::Namespaces(vec![env.namespace.clone()]);
        Self::start_in(env, scope, providers_yaml, cluster)
    }

    /// Runs the controller on the Proxies in `scope`, as [`Controller::start`] does.
    pub fn start_in(
        env: &KubeTestEnv,
        scope: WatchScope,
        providers_yaml: &str,
        cluster: &str,
    ) -> Controller {
        Self::start_configured(env, scope, providers_yaml, cluster, |_| {})
    }

    /// Runs the controller as [`Controller::start_in`] does, with its context changed by
    /// `configure` first (backoff settings, for example).
    pub fn start_configured(
        env: &KubeTestEnv,
        scope: WatchScope,
        providers_yaml: &str,
        cluster: &str,
        configure: impl FnOnce(&mut Context),
    ) -> Controller {
        let mut ctx = context(env.client.clone(), providers_yaml, cluster);
        configure(&mut ctx);
        let ctx = Arc::new(ctx);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (cache, writer) = ProxyCache::new(scope);
        tokio::spawn(egressproxy_operator::proxy::controller::run_with_cache(
            ctx.clone(),
            cache.clone(),
            writer,
            async {
                let _ = stopped.await;
            },
        ));
        Controller {
            ctx,
            cache,
            stop: Some(stop),
            stop_pools: None,
        }
    }

    /// Also runs the ProxyPool controller, on the pools of `env`'s namespace, with the
    /// same context.
    pub fn with_pools(mut self, env: &KubeTestEnv) -> Controller {
        let scope = WatchScope::Namespaces(vec![env.namespace.clone()]);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(egressproxy_operator::pool::run(
            self.ctx.clone(),
            scope,
            async {
                let _ = stopped.await;
            },
        ));
        self.stop_pools = Some(stop);
        self
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        for stop in [self.stop.take(), self.stop_pools.take()]
            .into_iter()
            .flatten()
        {
            let _ = stop.send(());
        }
    }
}

/// A cache of the Proxies in `scope` with no controller behind it (for garbage
/// collection on its own), once every namespace has been listed.
pub async fn follow(client: &kube::Client, scope: WatchScope) -> ProxyCache {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let (cache, writer) = ProxyCache::new(scope);
    let stream = cache.scope().watch(
        client,
        watcher::Config::default(),
        cache.health().clone(),
        cache.store().clone(),
    );
    tokio::spawn(stream.reflect(writer).for_each(|_| async {}));
    tokio::time::timeout(WAIT, cache.wait_until_listed())
        .await
        .expect("the Proxies were never listed");
    cache
}

/// Provider config text with one provider, `reference`, at `endpoint`.
pub fn reference_config(endpoint: &str, call_timeout: &str) -> String {
    format!("providers:\n  reference:\n    endpoint: {endpoint}\n    callTimeout: {call_timeout}\n")
}

/// Waits (watching, not polling) until object `name` satisfies `condition`; panics
/// with `what` after [`WAIT`].
pub async fn wait_until<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    condition: impl Condition<K>,
) -> Option<K>
where
    K: Clone + std::fmt::Debug + Send + serde::de::DeserializeOwned + kube::Resource + 'static,
{
    tokio::time::timeout(WAIT, await_condition(api.clone(), name, condition))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap()
}

/// Waits (watching) until `check` holds for Proxy `name`; panics with `what` and the
/// Proxy's last status after [`WAIT`].
pub async fn wait_for_proxy(
    proxies: &Api<egressproxy_operator::crd::Proxy>,
    name: &str,
    what: &str,
    check: impl Fn(&egressproxy_operator::crd::Proxy) -> bool,
) -> egressproxy_operator::crd::Proxy {
    use egressproxy_operator::crd::Proxy;
    let last = std::cell::RefCell::new(None);
    let condition = |proxy: Option<&Proxy>| {
        *last.borrow_mut() = proxy.and_then(|p| p.status.clone());
        proxy.is_some_and(&check)
    };
    let outcome =
        tokio::time::timeout(WAIT, await_condition(proxies.clone(), name, condition)).await;
    match outcome {
        Ok(Ok(Some(proxy))) => proxy,
        _ => panic!("timed out waiting for {what}: {:#?}", last.borrow()),
    }
}

/// Waits (watching the namespace's objects of `api`) until `check` holds for all of
/// them; panics with `what` after [`WAIT`].
pub async fn wait_for_all<K>(api: &Api<K>, what: &str, check: impl Fn(&[K]) -> bool)
where
    K: Clone
        + std::fmt::Debug
        + Send
        + Sync
        + serde::de::DeserializeOwned
        + kube::Resource
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let (store, writer) = reflector::store();
    let mut events = watcher(api.clone(), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .boxed();
    let wait = async {
        loop {
            // The store changes as the watch's events pass through it; it holds the
            // whole picture once the first list is done.
            if let Some(Ok(watcher::Event::InitDone)) | None = events.next().await {
                break;
            }
        }
        loop {
            let all: Vec<K> = store.state().iter().map(|k| (**k).clone()).collect();
            if check(&all) {
                return;
            }
            events.next().await;
        }
    };
    tokio::time::timeout(WAIT, wait)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

/// Waits until Proxy `name` is Ready (phase and condition).
pub async fn wait_ready(
    proxies: &Api<egressproxy_operator::crd::Proxy>,
    name: &str,
) -> egressproxy_operator::crd::Proxy {
    use egressproxy_operator::crd::{Phase, Proxy};
    let what = format!("{name} to be Ready");
    wait_until(proxies, name, &what, |proxy: Option<&Proxy>| {
        proxy.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            s.phase == Some(Phase::Ready)
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
    })
    .await
    .unwrap()
}

/// The Lease's holder, as written.
pub fn holder(lease: Option<&Lease>) -> Option<String> {
    lease?
        .spec
        .as_ref()?
        .holder_identity
        .clone()
        .filter(|holder| !holder.is_empty())
}

/// Waits until `identity` holds the operator's Lease in `env`'s namespace.
pub async fn wait_for_holder(env: &KubeTestEnv, identity: &str) -> Lease {
    let leases: Api<Lease> = env.namespaced();
    let what = format!("{identity} to hold the Lease");
    wait_until(&leases, LEASE, &what, |lease: Option<&Lease>| {
        holder(lease).as_deref() == Some(identity)
    })
    .await
    .unwrap()
}

/// How an operator process is started.
pub struct OperatorOptions<'a> {
    /// Its Lease identity.
    pub identity: &'a str,
    /// Its provider config file.
    pub providers: &'a std::path::Path,
    /// `--lease-duration`.
    pub lease_duration: &'a str,
    /// Run with libfaketime and this offset (`-3m`): a replica whose wall clock is
    /// wrong. Only the wall clock is shifted; the monotonic clock stays true.
    pub clock_offset: Option<&'a str>,
    /// More flags.
    pub extra_args: &'a [&'a str],
}

/// The operator binary as a process, killed when dropped.
pub struct OperatorProcess {
    child: Child,
    /// Address of its HTTP endpoints.
    pub http: std::net::SocketAddr,
}

impl OperatorProcess {
    /// Starts the operator on `env`'s namespace (Proxies and Lease).
    pub fn start(env: &KubeTestEnv, options: &OperatorOptions<'_>) -> OperatorProcess {
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let binary = workspace_binary("egressproxy-operator").unwrap();
        let mut command = Command::new(&binary);
        if let Some(offset) = options.clock_offset {
            // libfaketime preloaded into the operator itself (not the `faketime`
            // wrapper, which would stand between the test and the process it kills).
            assert!(
                std::path::Path::new(LIBFAKETIME).exists(),
                "{LIBFAKETIME} is missing: install Debian's faketime package"
            );
            command
                .env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME", offset)
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                .env("FAKETIME_NO_CACHE", "1");
        }
        let child = command
            .env("KUBECONFIG", env.apiserver().kubeconfig_path())
            .env("POD_NAME", options.identity)
            .env("RUST_LOG", "info,kube=warn")
            .args(["--cluster-name", &format!("test-{}", env.namespace)])
            .args([
                "--namespace",
                &env.namespace,
                "--lease-namespace",
                &env.namespace,
            ])
            .arg("--providers")
            .arg(options.providers)
            .args([
                "--http-listen",
                &http.to_string(),
                "--lease-duration",
                options.lease_duration,
                "--gc-interval",
                "1h",
            ])
            .args(options.extra_args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        OperatorProcess { child, http }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("the operator still runs")
    }

    /// Kills the process at once (SIGKILL), as a crash would.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// Asks the process to stop (SIGTERM), as Kubernetes does, and returns without
    /// waiting.
    pub fn terminate(&self) {
        let pid = self.child.id().expect("the operator still runs");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    }

    /// Waits for the process to exit; its exit status.
    pub async fn exit_status(mut self) -> std::process::ExitStatus {
        tokio::time::timeout(WAIT, self.child.wait())
            .await
            .expect("the operator did not exit")
            .unwrap()
    }

    /// GET `path` from the operator's HTTP endpoints: status code and body.
    pub async fn get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // The process may still be starting; nothing to watch until it listens.
        let mut stream = eventually("the operator's HTTP endpoints to listen", WAIT, || {
            tokio::net::TcpStream::connect(self.http)
        })
        .await;
        let request = format!("GET {path} HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let code = answer.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (code, body)
    }
}
