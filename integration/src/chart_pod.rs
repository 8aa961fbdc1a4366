//! A binary of this workspace run out of cluster exactly as an installed release's
//! Deployment would run it, for tests of the chart (the test apiserver runs no pods):
//!
//! 1. With a ServiceAccount: a kubeconfig with a token the apiserver issued for it, so
//!    the chart's RBAC applies as it would to the pod.
//! 2. The container's volumes materialised under a private root directory: the providers
//!    ConfigMap and every Secret or projected Secret volume (the TLS files), with the
//!    items and paths the Deployment names.
//! 3. The container's args and plain env values, with every path under a mount moved
//!    under that root, `--listen`/`--http-listen` on a free loopback port and
//!    `--metrics-listen` on another; `POD_NAME` and `POD_NAMESPACE` as the downward API
//!    sets them.
//!
//! The process (its output in a log file) is stopped with its whole process tree when the
//! [`ChartPod`] is dropped. [`ChartPod::run_probe`] runs the container's exec probes the
//! way the kubelet does, inside that stand-in filesystem; [`run_pod_to_completion`] runs
//! a Pod the chart makes as a hook (`helm test`, pre-delete) once, the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, KeyToPath, PodSpec, Secret, ServiceAccount, Volume,
};
use kube::api::{Api, PostParams};
use kube::config::Kubeconfig;

use crate::kube_env::KubeTestEnv;
use crate::process::Daemon;
use crate::reference_provider::workspace_binary;

/// A running process started from an installed release's Deployment.
#[derive(Debug)]
pub struct ChartPod {
    // Declared first: the process stops before its files go.
    daemon: Daemon,
    files: PodFiles,
    listen: std::net::SocketAddr,
    metrics_listen: std::net::SocketAddr,
    // Boxed: a container spec is large, and pods are held in enums beside small things.
    container: Box<Container>,
}

/// Which exec probe of the container [`ChartPod::run_probe`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// `readinessProbe`.
    Readiness,
    /// `livenessProbe`.
    Liveness,
}

/// A container's volumes materialised under a private root, and the rewriting of the
/// paths under its mounts to that root.
#[derive(Debug)]
struct PodFiles {
    root: tempfile::TempDir,
    /// Mount paths, longest first.
    mounts: Vec<String>,
}

impl PodFiles {
    /// Writes every volume `container` mounts under a new root directory, and moves the
    /// paths that config files name.
    async fn materialise(
        env: &KubeTestEnv,
        namespace: &str,
        pod: &PodSpec,
        container: &Container,
    ) -> anyhow::Result<Self> {
        let root = tempfile::tempdir().context("pod root directory")?;
        let volumes: BTreeMap<&str, &Volume> = pod
            .volumes
            .iter()
            .flatten()
            .map(|volume| (volume.name.as_str(), volume))
            .collect();
        let mut mounts = Vec::new();
        for mount in container.volume_mounts.iter().flatten() {
            let volume = volumes
                .get(mount.name.as_str())
                .with_context(|| format!("volumeMount {} names no volume", mount.name))?;
            let target = root.path().join(mount.mount_path.trim_start_matches('/'));
            materialise(env, namespace, volume, mount.sub_path.as_deref(), &target).await?;
            mounts.push(mount.mount_path.clone());
        }
        // Longest first, through placeholders, so that neither a mount inside another nor
        // one whose path starts with another's (hv1, hv10) is moved twice.
        mounts.sort_by_key(|path| std::cmp::Reverse(path.len()));
        let files = PodFiles { root, mounts };
        // Config files name paths under other mounts (TLS files): move those too, in a
        // file mounted alone (subPath) and in the files of a mounted directory (a
        // ConfigMap or Secret volume). Files that are not text (keys in DER) stay.
        for mount in &files.mounts {
            let path = files.root.path().join(mount.trim_start_matches('/'));
            for file in files_at(&path)? {
                if let Ok(text) = std::fs::read_to_string(&file) {
                    std::fs::write(&file, files.relocate(&text))?;
                }
            }
        }
        Ok(files)
    }

    /// `text` with every path under a mount moved under the root.
    fn relocate(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for (index, mount) in self.mounts.iter().enumerate() {
            text = text.replace(mount.as_str(), &format!("\u{0}{index}\u{0}"));
        }
        for (index, mount) in self.mounts.iter().enumerate() {
            let moved = self.root.path().join(mount.trim_start_matches('/'));
            text = text.replace(&format!("\u{0}{index}\u{0}"), &moved.display().to_string());
        }
        text
    }

    /// The command of an exec in `container` (an image path such as
    /// `/usr/local/bin/kvm-agent`, then its args): the workspace binary of that name, the
    /// args relocated and with each `(from, to)` of `rewrite` replaced.
    fn exec_command(
        &self,
        argv: &[String],
        rewrite: &[(String, String)],
    ) -> anyhow::Result<Command> {
        let (program, args) = argv.split_first().context("an exec without a command")?;
        let name = Path::new(program)
            .file_name()
            .context("a command without a file name")?
            .to_string_lossy();
        let mut command = Command::new(workspace_binary(&name)?);
        for arg in args {
            let mut arg = self.relocate(arg);
            for (from, to) in rewrite {
                arg = arg.replace(from, to);
            }
            command.arg(arg);
        }
        Ok(command)
    }
}

/// How a [`ChartPod`] runs beyond what the Deployment says.
#[derive(Debug, Clone, Default)]
pub struct PodOptions {
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// Where stdout and stderr go (default: `<binary>.log` in the pod's root).
    pub log: Option<PathBuf>,
    /// The address of the `--listen`/`--http-listen` flags (default: a free loopback
    /// port).
    pub listen: Option<std::net::SocketAddr>,
}

impl ChartPod {
    /// Starts workspace binary `binary` as the first container of Deployment
    /// `deployment` in `namespace` runs it, as ServiceAccount `service_account` of that
    /// namespace when given.
    pub async fn start(
        env: &KubeTestEnv,
        namespace: &str,
        deployment: &str,
        binary: &str,
        service_account: Option<&str>,
    ) -> anyhow::Result<Self> {
        let options = PodOptions::default();
        Self::start_with(
            env,
            namespace,
            deployment,
            binary,
            service_account,
            &options,
        )
        .await
    }

    /// Like [`ChartPod::start`], with `options`.
    pub async fn start_with(
        env: &KubeTestEnv,
        namespace: &str,
        deployment: &str,
        binary: &str,
        service_account: Option<&str>,
        options: &PodOptions,
    ) -> anyhow::Result<Self> {
        let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), namespace);
        let deployment = deployments
            .get(deployment)
            .await
            .with_context(|| format!("read Deployment {namespace}/{deployment}"))?;
        let pod = deployment
            .spec
            .template
            .spec
            .context("Deployment without a pod spec")?;
        let container = pod
            .containers
            .first()
            .context("pod without containers")?
            .clone();
        let files = PodFiles::materialise(env, namespace, &pod, &container).await?;
        let kubeconfig = match service_account {
            Some(account) => {
                Some(service_account_kubeconfig(env, namespace, account, files.root.path()).await?)
            }
            None => None,
        };
        let relocate = |text: &str| files.relocate(text);

        let listen = match options.listen {
            Some(listen) => listen,
            None => std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?,
        };
        // A free port picked here, on the listen address's host (which may be inside a
        // network namespace this process cannot bind in).
        let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let metrics_listen = std::net::SocketAddr::new(listen.ip(), metrics_port);
        let args: Vec<String> = container
            .args
            .iter()
            .flatten()
            .map(|arg| match arg.split_once('=') {
                Some((flag @ ("--listen" | "--http-listen"), _)) => format!("{flag}={listen}"),
                Some(("--metrics-listen", _)) => format!("--metrics-listen={metrics_listen}"),
                _ => relocate(arg),
            })
            .collect();
        let program = workspace_binary(binary)?;
        let mut command = match &options.netns {
            Some(netns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", netns]).arg(program);
                command
            }
            None => Command::new(program),
        };
        command.args(&args).env("RUST_LOG", "info,kube=warn");
        // The container's own variables win, RUST_LOG from `extraEnv` included.
        for var in container.env.iter().flatten() {
            if let Some(value) = &var.value {
                command.env(&var.name, relocate(value));
            }
        }
        if let Some(kubeconfig) = &kubeconfig {
            command.env("KUBECONFIG", kubeconfig);
        }
        command
            .env(
                "POD_NAME",
                format!("{}-0", deployment.metadata.name.unwrap_or_default()),
            )
            .env("POD_NAMESPACE", namespace);
        let log = options
            .log
            .clone()
            .unwrap_or_else(|| files.root.path().join(format!("{binary}.log")));
        let daemon = Daemon::spawn(binary, command, &log)?;
        Ok(Self {
            daemon,
            files,
            listen,
            metrics_listen,
            container: Box::new(container),
        })
    }

    /// The process's pid (the binary itself: `ip netns exec` execs it).
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// Stops the process (and its process tree); its files stay until the drop.
    pub fn stop(&mut self) {
        self.daemon.stop();
    }

    /// Fails with the log's tail if the process has exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.daemon.ensure_running()
    }

    /// The directory standing in for the pod's filesystem.
    pub fn root(&self) -> &Path {
        self.files.root.path()
    }

    /// Runs the container's exec `probe` as the kubelet would: its command with the
    /// image's binary replaced by the workspace's, paths moved into the pod's files, and
    /// `127.0.0.1:<containerPort>` pointed at where this process listens. Fails when
    /// the container has no such exec probe.
    pub fn run_probe(&self, probe: Probe) -> anyhow::Result<std::process::Output> {
        let spec = match probe {
            Probe::Readiness => &self.container.readiness_probe,
            Probe::Liveness => &self.container.liveness_probe,
        };
        let argv = spec
            .as_ref()
            .and_then(|spec| spec.exec.as_ref())
            .and_then(|exec| exec.command.clone())
            .with_context(|| format!("the container has no exec {probe:?} probe"))?;
        let rewrite: Vec<(String, String)> = self
            .container
            .ports
            .iter()
            .flatten()
            .map(|port| {
                (
                    format!("127.0.0.1:{}", port.container_port),
                    self.listen.to_string(),
                )
            })
            .collect();
        let mut command = self.files.exec_command(&argv, &rewrite)?;
        command.output().context("run the probe")
    }

    /// The address given to the container's `--metrics-listen` flag, if it has one.
    pub fn metrics_listen(&self) -> std::net::SocketAddr {
        self.metrics_listen
    }

    /// The loopback address given to the container's `--listen`/`--http-listen` flag.
    pub fn listen(&self) -> std::net::SocketAddr {
        self.listen
    }
}

/// Runs `pod` (a hook the chart makes: a `helm test` Pod, a pre-delete Job's pod
/// template) once, out of cluster, as its first container would run: volumes
/// materialised, its command with the image's binary replaced by the workspace's, paths
/// moved, each `(from, to)` of `rewrite` replaced in the args (a Service's name by where
/// the test's process listens), and as `service_account` when given (a token the
/// apiserver issued). Waits up to `within` for it to exit; its output either way.
pub async fn run_pod_to_completion(
    env: &KubeTestEnv,
    namespace: &str,
    pod: &PodSpec,
    service_account: Option<&str>,
    rewrite: &[(String, String)],
    within: std::time::Duration,
) -> anyhow::Result<std::process::Output> {
    let container = pod.containers.first().context("pod without containers")?;
    let files = PodFiles::materialise(env, namespace, pod, container).await?;
    let argv: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .cloned()
        .collect();
    let mut command = files.exec_command(&argv, rewrite)?;
    for var in container.env.iter().flatten() {
        if let Some(value) = &var.value {
            command.env(&var.name, files.relocate(value));
        }
    }
    if let Some(account) = service_account {
        let kubeconfig =
            service_account_kubeconfig(env, namespace, account, files.root.path()).await?;
        command.env("KUBECONFIG", kubeconfig);
    }
    command.env("POD_NAMESPACE", namespace);
    let child = command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("start the hook's process")?;
    let pid = child.id();
    let waited = tokio::time::timeout(
        within,
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await;
    match waited {
        Ok(output) => Ok(output.context("wait for the hook")??),
        Err(_) => {
            let _ = crate::process::signal_tree(pid, nix::sys::signal::Signal::SIGKILL);
            bail!("the hook's process ran longer than {within:?}")
        }
    }
}

/// The hook of `kind` named `name` in `hooks_yaml` (what `helm get hooks` prints), as
/// its pod spec: a Pod's own, a Job's template's. The document is read by `kubectl`
/// (Kubernetes' YAML rules: `defaultMode: 0440` is octal there, a string in YAML 1.2).
pub fn hook_pod_spec(
    kubectl: &crate::helm::Kubectl,
    hooks_yaml: &str,
    kind: &str,
    name: &str,
) -> anyhow::Result<PodSpec> {
    let mut documents = vec![String::new()];
    for line in hooks_yaml.lines() {
        if line.trim_end() == "---" {
            documents.push(String::new());
        } else if let Some(document) = documents.last_mut() {
            document.push_str(line);
            document.push('\n');
        }
    }
    for document in documents {
        let Ok(head) = serde_norway::from_str::<serde_norway::Value>(&document) else {
            continue;
        };
        if head["kind"] != kind || head["metadata"]["name"] != name {
            continue;
        }
        let json = kubectl.run(
            &["create", "--dry-run=client", "-o", "json", "-f", "-"],
            Some(&document),
        )?;
        let object: serde_json::Value = serde_json::from_str(&json)?;
        let spec = match kind {
            "Pod" => object["spec"].clone(),
            _ => object["spec"]["template"]["spec"].clone(),
        };
        return Ok(serde_json::from_value(spec)?);
    }
    bail!("no {kind} {name} among the release's hooks")
}

/// Writes what `volume` would show at `target` (or, with `sub_path`, the one file).
async fn materialise(
    env: &KubeTestEnv,
    namespace: &str,
    volume: &Volume,
    sub_path: Option<&str>,
    target: &Path,
) -> anyhow::Result<()> {
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    if let Some(config_map) = &volume.config_map {
        let api: Api<ConfigMap> = Api::namespaced(env.client.clone(), namespace);
        let data = api.get(&config_map.name).await?.data.unwrap_or_default();
        for (key, value) in data {
            files.insert(key, value.into_bytes());
        }
    } else if let Some(secret) = &volume.secret {
        let name = secret
            .secret_name
            .as_deref()
            .context("secret volume without a name")?;
        add_secret(env, namespace, name, secret.items.as_deref(), &mut files).await?;
    } else if let Some(projected) = &volume.projected {
        for source in projected.sources.iter().flatten() {
            let secret = source
                .secret
                .as_ref()
                .context("projected volume with a source other than a Secret")?;
            add_secret(
                env,
                namespace,
                &secret.name,
                secret.items.as_deref(),
                &mut files,
            )
            .await?;
        }
    } else {
        // emptyDir and the like: an empty directory.
        std::fs::create_dir_all(target)?;
        return Ok(());
    }
    match sub_path {
        Some(sub_path) => {
            let content = files
                .get(sub_path)
                .with_context(|| format!("volume {} has no {sub_path}", volume.name))?;
            std::fs::create_dir_all(target.parent().context("mount path without parent")?)?;
            std::fs::write(target, content)?;
        }
        None => {
            for (path, content) in files {
                let file = target.join(path);
                std::fs::create_dir_all(file.parent().context("file without parent")?)?;
                std::fs::write(file, content)?;
            }
        }
    }
    Ok(())
}

/// Adds Secret `name`'s keys (or only `items`, at their paths) to `files`; a missing
/// Secret or key is an error, as it keeps a pod from starting.
async fn add_secret(
    env: &KubeTestEnv,
    namespace: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    files: &mut BTreeMap<String, Vec<u8>>,
) -> anyhow::Result<()> {
    let api: Api<Secret> = Api::namespaced(env.client.clone(), namespace);
    let data = api
        .get(name)
        .await
        .with_context(|| format!("Secret {namespace}/{name}"))?
        .data
        .unwrap_or_default();
    match items {
        Some(items) => {
            for item in items {
                let Some(value) = data.get(&item.key) else {
                    bail!("Secret {namespace}/{name} has no key {}", item.key);
                };
                files.insert(item.path.clone(), value.0.clone());
            }
        }
        None => {
            for (key, value) in data {
                files.insert(key, value.0);
            }
        }
    }
    Ok(())
}

/// A kubeconfig that authenticates as ServiceAccount `namespace/name` with a token the
/// apiserver issued, as a pod running under that account would.
async fn service_account_kubeconfig(
    env: &KubeTestEnv,
    namespace: &str,
    name: &str,
    dir: &Path,
) -> anyhow::Result<PathBuf> {
    let accounts: Api<ServiceAccount> = Api::namespaced(env.client.clone(), namespace);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            // Longer than any test run: the kubeconfig holds this token as it is.
            expiration_seconds: Some(24 * 3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let token = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("request a token for ServiceAccount {namespace}/{name}"))?
        .status
        .and_then(|status| status.token)
        .context("the apiserver issued no token")?;
    let mut config = Kubeconfig::read_from(env.apiserver().kubeconfig_path())?;
    for user in &mut config.auth_infos {
        user.auth_info = Some(serde_json::from_value(
            serde_json::json!({ "token": token }),
        )?);
    }
    let path = dir.join("serviceaccount.kubeconfig");
    std::fs::write(&path, serde_norway::to_string(&config)?)?;
    Ok(path)
}

/// `path` if it is a file, or every file under it if it is a directory.
fn files_at(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    if path.is_dir() {
        for entry in std::fs::read_dir(path)? {
            files.extend(files_at(&entry?.path())?);
        }
    }
    Ok(files)
}
