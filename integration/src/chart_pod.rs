//! A binary of this workspace run out of cluster exactly as an installed release's
//! Deployment would run it, for tests of the chart (the test apiserver runs no pods):
//!
//! 1. With a ServiceAccount: a kubeconfig with a token the apiserver issued for it, so
//!    the chart's RBAC applies as it would to the pod.
//! 2. The container's volumes materialised under a private root directory: the providers
//!    ConfigMap and every Secret or projected Secret volume (the TLS files), with the
//!    items and paths the Deployment names.
//! 3. The container's args and plain env values, with every path under a mount moved
//!    under that root and `--listen`/`--http-listen` on a free loopback port; `POD_NAME`
//!    and `POD_NAMESPACE` as the downward API sets them.
//!
//! The process (its output in a log file) is stopped with its whole process tree when the
//! [`ChartPod`] is dropped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, KeyToPath, Secret, ServiceAccount, Volume};
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
    root: tempfile::TempDir,
    listen: std::net::SocketAddr,
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
        let root = tempfile::tempdir().context("pod root directory")?;
        let kubeconfig = match service_account {
            Some(account) => {
                Some(service_account_kubeconfig(env, namespace, account, root.path()).await?)
            }
            None => None,
        };
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
        let container = pod.containers.first().context("pod without containers")?;
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
        let relocate = |text: &str| -> String {
            let mut text = text.to_owned();
            for (index, mount) in mounts.iter().enumerate() {
                text = text.replace(mount.as_str(), &format!("\u{0}{index}\u{0}"));
            }
            for (index, mount) in mounts.iter().enumerate() {
                let moved = root.path().join(mount.trim_start_matches('/'));
                text = text.replace(&format!("\u{0}{index}\u{0}"), &moved.display().to_string());
            }
            text
        };
        // Config files name paths under other mounts (TLS files): move those too.
        for mount in &mounts {
            let file = root.path().join(mount.trim_start_matches('/'));
            if file.is_file() {
                let text = std::fs::read_to_string(&file)?;
                std::fs::write(&file, relocate(&text))?;
            }
        }

        let listen = match options.listen {
            Some(listen) => listen,
            None => std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?,
        };
        let args: Vec<String> = container
            .args
            .iter()
            .flatten()
            .map(|arg| match arg.split_once('=') {
                Some((flag @ ("--listen" | "--http-listen"), _)) => format!("{flag}={listen}"),
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
            .unwrap_or_else(|| root.path().join(format!("{binary}.log")));
        let daemon = Daemon::spawn(binary, command, &log)?;
        Ok(Self {
            daemon,
            root,
            listen,
        })
    }

    /// The process's pid (the binary itself: `ip netns exec` execs it).
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// Fails with the log's tail if the process has exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.daemon.ensure_running()
    }

    /// The directory standing in for the pod's filesystem.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// The loopback address given to the container's `--listen`/`--http-listen` flag.
    pub fn listen(&self) -> std::net::SocketAddr {
        self.listen
    }
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
