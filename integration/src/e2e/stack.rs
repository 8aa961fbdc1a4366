//! The whole real path on one machine: a Proxy becomes a VM that proxies.
//!
//! [`Stack::start`] brings up, in this order:
//! 1. the guest image ([`super::guest_image`]; cached by its recipe);
//! 2. a private libvirtd in a new network namespace, its socket owned by the `libvirt`
//!    group, with a `default` dir pool and a `default` NAT network with DHCP
//!    ([`GATEWAY`]/24); guests boot with OVMF;
//! 3. a system user with a name unique to this run, and a private sshd that refuses
//!    forwarding except through the `Match` block of `docs/kvm-agent.md` for that user;
//! 4. an HTTP server with the image, an OTLP span receiver, and the shared real
//!    kube-apiserver with the Proxy CRD and a namespace of this run;
//! 5. `kvm-agent serve` on loopback, reaching libvirtd through the sshd;
//! 6. the operator inside the network namespace (its health check reaches the guests
//!    there), with loopback relays to the apiserver, the agent and the span receiver;
//! 7. a target HTTP server on the gateway address, for requests through the proxies.
//!
//! Dropping the stack (also while a test unwinds) stops the operator and the agent,
//! then the servers, sshd and libvirtd with its guests, deletes the namespace and the
//! user, and removes every directory. [`Stack::footprint`] then lists what is still there.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use super::guest_image::guest_image;
use super::http_servers::{ImageServer, TargetServer};
use super::netns::command_in;
use super::otlp::SpanReceiver;
use super::relay::LoopbackRelay;
use super::system_user::{SystemUser, user_exists};
use crate::kube_env::{KubeTestEnv, apply_crds_yaml};
use crate::libvirtd::Libvirtd;
use crate::process::{Daemon, process_tree, wait_until};
use crate::reference_provider::workspace_binary;
use crate::sshd::{Sshd, SshdOptions, free_port};

/// The NAT network's gateway, inside the namespace.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 168, 123, 1);
/// The provider name Proxies use.
pub const PROVIDER: &str = "kvm";
/// The agent's image and machine type names.
pub const IMAGE: &str = "debian-e2e";
/// See [`IMAGE`].
pub const MACHINE_TYPE: &str = "small";
/// The agent's host name.
pub const HOST: &str = "hv1";

const CRD: &str = include_str!("../../../charts/egressproxy/files/proxies.egressproxy.dev.yaml");
const KVM_AGENT_DOC: &str = include_str!("../../../docs/kvm-agent.md");
/// The file in [`Stack::dir`] with every span received, one JSON object a line.
pub const SPANS_FILE: &str = "spans.jsonl";
/// How long `kvm-agent serve` may take to listen (it checks its hosts first).
const AGENT_START: Duration = Duration::from_secs(120);

/// The running stack. See the module docs.
pub struct Stack {
    operator: Option<Daemon>,
    agent: Option<Daemon>,
    agent_port: u16,
    relays: Vec<LoopbackRelay>,
    /// The target of proxied requests.
    pub target: TargetServer,
    /// The image mirror.
    pub images: ImageServer,
    /// Spans of the operator and the agent.
    pub spans: SpanReceiver,
    /// The Kubernetes side: client and this run's namespace.
    pub kube: KubeTestEnv,
    sshd: Sshd,
    libvirtd: Libvirtd,
    user: SystemUser,
    dir: tempfile::TempDir,
    image: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("netns", &self.netns())
            .field("namespace", &self.kube.namespace)
            .field("user", &self.user.name())
            .finish_non_exhaustive()
    }
}

/// What a finished run may have left behind.
#[derive(Debug, Clone)]
pub struct Footprint {
    netns: String,
    user: String,
    paths: Vec<PathBuf>,
    pids: Vec<u32>,
}

/// What [`Stack::start_with`] changes.
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    /// Serve the image no faster than this (bytes per second).
    pub image_bytes_per_second: Option<u64>,
}

impl Stack {
    /// Starts everything; `name` goes into the namespace, user and cluster names.
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        Self::start_with(name, &StackOptions::default()).await
    }

    /// Like [`Stack::start`], with `options`.
    pub async fn start_with(name: &str, options: &StackOptions) -> anyhow::Result<Self> {
        let image = tokio::task::spawn_blocking(guest_image).await??;
        let kube = KubeTestEnv::new(name).await?;
        apply_crds_yaml(&kube.client, CRD).await?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("e2e-stack")
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();

        let (libvirtd, sshd, user) = tokio::task::spawn_blocking(start_hypervisor).await??;
        let netns = libvirtd
            .netns()
            .context("libvirtd runs in a network namespace")?
            .to_owned();
        let images = ImageServer::start(&handle, &image, options.image_bytes_per_second)?;
        let dir = tempfile::Builder::new().prefix("e2e-").tempdir()?;
        let spans = SpanReceiver::start(&handle, Some(dir.path().join(SPANS_FILE)))?;
        let target = TargetServer::start(&handle, &netns, GATEWAY)?;

        let mut stack = Self {
            operator: None,
            agent: None,
            agent_port: free_port()?,
            relays: Vec::new(),
            target,
            images,
            spans,
            kube,
            sshd,
            libvirtd,
            user,
            dir,
            image,
            runtime: Some(runtime),
        };
        stack.write_configs()?;
        stack.start_agent()?;
        let apiserver_port = port_of(stack.kube.apiserver().server())?;
        for port in [apiserver_port, stack.agent_port, stack.spans.port()] {
            stack
                .relays
                .push(LoopbackRelay::start(&handle, &netns, port)?);
        }
        stack.start_operator()?;
        Ok(stack)
    }

    fn write_configs(&self) -> anyhow::Result<()> {
        let sha256 = sha256_file(&self.image)?;
        let config = format!(
            "hosts:\n\
             - name: {HOST}\n\
             \x20 ssh:\n\
             \x20   address: \"{address}\"\n\
             \x20   user: {user}\n\
             \x20   privateKey: {key}\n\
             \x20   knownHosts: {known_hosts}\n\
             \x20 libvirtSocket: {socket}\n\
             \x20 domainType: qemu\n\
             machineTypes:\n\
             \x20 {MACHINE_TYPE}: {{vcpus: 2, memoryMiB: 1024, diskGiB: 3}}\n\
             images:\n\
             \x20 {IMAGE}:\n\
             \x20   url: {url}\n\
             \x20   sha256: {sha256}\n\
             \x20   format: qcow2\n\
             \x20   firmware: uefi\n\
             transport:\n\
             \x20 defaultCallTimeout: 60s\n",
            address = self.sshd.address(),
            user = self.user.name(),
            key = self.sshd.client_key().display(),
            known_hosts = self.sshd.known_hosts().display(),
            socket = self.libvirtd.socket().display(),
            url = self.images.url(),
        );
        std::fs::write(self.agent_config(), config)?;
        std::fs::write(
            self.providers_config(),
            format!(
                "providers:\n  {PROVIDER}:\n    endpoint: http://127.0.0.1:{}\n    callTimeout: 60s\n",
                self.agent_port
            ),
        )?;
        Ok(())
    }

    /// The agent's configuration file.
    pub fn agent_config(&self) -> PathBuf {
        self.dir.path().join("kvm-agent.yaml")
    }

    /// The operator's provider configuration file.
    pub fn providers_config(&self) -> PathBuf {
        self.dir.path().join("providers.yaml")
    }

    fn otel_env(&self, command: &mut Command) {
        command
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", self.spans.endpoint())
            // Export soon after a span ends, so a test sees a trace within a second.
            .env("OTEL_BSP_SCHEDULE_DELAY", "200");
    }

    /// Starts `kvm-agent serve` and waits until it listens.
    pub fn start_agent(&mut self) -> anyhow::Result<()> {
        let mut command = Command::new(binary("kvm-agent")?);
        command
            .args(["serve", "--config"])
            .arg(self.agent_config())
            .args(["--listen", &format!("127.0.0.1:{}", self.agent_port)])
            // Debug for the agent's own code: a secret must not leak at any level.
            .env(
                "RUST_LOG",
                "info,kvm_agent=debug,egressproxy_provider=debug",
            )
            .env("KVM_AGENT_RUNTIME_DIR", self.dir.path());
        self.otel_env(&mut command);
        let log = self.dir.path().join("kvm-agent.log");
        let mut agent = Daemon::spawn("kvm-agent", command, &log)?;
        wait_until("kvm-agent to listen", AGENT_START, || {
            agent.ensure_running()?;
            Ok(std::fs::read_to_string(&log)?.contains("listening on"))
        })?;
        self.agent = Some(agent);
        Ok(())
    }

    /// Starts the operator inside the network namespace.
    pub fn start_operator(&mut self) -> anyhow::Result<()> {
        let mut command = command_in(self.netns(), binary("egressproxy-operator")?);
        let namespace = &self.kube.namespace;
        command
            .env("KUBECONFIG", self.kube.apiserver().kubeconfig_path())
            .env("RUST_LOG", "info,kube=warn,egressproxy_operator=debug")
            .args(["--cluster-name", &format!("e2e-{namespace}")])
            .args(["--namespace", namespace, "--lease-namespace", namespace])
            .arg("--providers")
            .arg(self.providers_config())
            .args(["--http-listen", "127.0.0.1:8080", "--gc-interval", "1h"]);
        self.otel_env(&mut command);
        let log = self.dir.path().join("operator.log");
        self.operator = Some(Daemon::spawn("operator", command, &log)?);
        Ok(())
    }

    /// SIGKILLs the agent (no clean-up of its own runs).
    pub fn kill_agent(&mut self) {
        kill_daemon(self.agent.take());
    }

    /// SIGKILLs the operator.
    pub fn kill_operator(&mut self) {
        kill_daemon(self.operator.take());
    }

    /// The agent's pid, while it runs.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(Daemon::pid)
    }

    /// The agent's port on loopback.
    pub fn agent_port(&self) -> u16 {
        self.agent_port
    }

    /// The network namespace that holds libvirtd, its guests and the operator.
    pub fn netns(&self) -> &str {
        self.libvirtd.netns().unwrap_or_default()
    }

    /// `qemu+unix:///system?socket=...` of the private libvirtd.
    pub fn libvirt_uri(&self) -> String {
        self.libvirtd.uri()
    }

    /// The storage pool's directory (base images, overlays, seeds).
    pub fn pool_dir(&self) -> PathBuf {
        self.libvirtd.dir().join("images")
    }

    /// libvirt's NVRAM directory for UEFI guests.
    pub fn nvram_dir(&self) -> PathBuf {
        self.libvirtd.dir().join("lib/qemu/nvram")
    }

    /// The guest image the agent downloads.
    pub fn image(&self) -> &Path {
        &self.image
    }

    /// The stack's own directory: configs and the agent's and operator's logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The kubeconfig of the apiserver.
    pub fn kubeconfig(&self) -> &Path {
        self.kube.apiserver().kubeconfig_path()
    }

    /// `kubectl ARGS` against the apiserver, in this run's namespace.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(["--namespace", &self.kube.namespace])
            .args(args)
            .output()
            .context("run kubectl")?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// `kubectl apply -f -` of `manifest`.
    pub fn kubectl_apply(&self, manifest: &str) -> anyhow::Result<()> {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(["--namespace", &self.kube.namespace, "apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .context("kubectl stdin")?
            .write_all(manifest.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl apply: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// `virsh ARGS` against the private libvirtd.
    pub fn virsh(&self, args: &[&str]) -> anyhow::Result<String> {
        virsh(&self.libvirtd, args)
    }

    /// Names of every domain (defined or running), sorted.
    pub fn domains(&self) -> anyhow::Result<Vec<String>> {
        let mut names: Vec<String> = self
            .virsh(&["list", "--all", "--name"])?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        names.sort();
        Ok(names)
    }

    /// Names of the files in `dir`, sorted (none when it does not exist).
    pub fn files_in(dir: &Path) -> Vec<String> {
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
    }

    /// `curl ARGS` run inside the network namespace: stdout, or the error.
    pub fn curl_in_netns(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = command_in(self.netns(), "curl").args(args).output()?;
        if !out.status.success() {
            bail!(
                "curl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// What to look for after the stack is dropped.
    pub fn footprint(&self) -> Footprint {
        let mut pids = Vec::new();
        for daemon in [&self.operator, &self.agent].into_iter().flatten() {
            pids.extend(process_tree(daemon.pid()));
        }
        if let Ok(pid) = self.libvirtd.libvirtd_pid() {
            pids.extend(process_tree(pid));
        }
        Footprint {
            netns: self.netns().to_owned(),
            user: self.user.name().to_owned(),
            paths: vec![
                self.dir.path().to_owned(),
                self.libvirtd.dir().to_owned(),
                self.sshd
                    .log()
                    .parent()
                    .map(Path::to_owned)
                    .unwrap_or_default(),
                Path::new("/home").join(self.user.name()),
            ],
            pids,
        }
    }
}

impl Footprint {
    /// Everything of the run that still exists: processes, the namespace, the user,
    /// directories. Empty after a clean tear-down.
    pub fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        for pid in &self.pids {
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                left.push(format!("process {pid}: {}", stat.trim()));
            }
        }
        let netns = Command::new("ip").args(["netns", "list"]).output();
        if let Ok(out) = netns
            && String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .any(|n| n == self.netns)
        {
            left.push(format!("network namespace {}", self.netns));
        }
        if user_exists(&self.user) {
            left.push(format!("user {}", self.user));
        }
        let by_user = Command::new("pgrep").args(["-u", &self.user]).output();
        if let Ok(out) = by_user
            && !out.stdout.is_empty()
        {
            left.push(format!("processes of {}", self.user));
        }
        for path in &self.paths {
            if path.exists() {
                left.push(format!("path {}", path.display()));
            }
        }
        left
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // The operator first, so nothing acts while the rest goes.
        drop(self.operator.take());
        drop(self.agent.take());
        self.relays.clear();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        // The remaining fields drop in order: servers, sshd, libvirtd (its guests and
        // namespace), the user, the directory.
    }
}

fn kill_daemon(daemon: Option<Daemon>) {
    if let Some(mut daemon) = daemon {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(daemon.pid()).unwrap_or(0)),
            nix::sys::signal::Signal::SIGKILL,
        );
        daemon.stop();
    }
}

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    workspace_binary(name)
}

fn port_of(server: &str) -> anyhow::Result<u16> {
    server
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in apiserver address {server}"))
}

fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    let text = String::from_utf8(out.stdout)?;
    Ok(text
        .split_whitespace()
        .next()
        .context("sha256sum printed nothing")?
        .to_owned())
}

fn virsh(libvirtd: &Libvirtd, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("virsh")
        .args(["-c", &libvirtd.uri()])
        .args(args)
        .output()
        .context("run virsh (libvirt-clients)")?;
    if !out.status.success() {
        bail!(
            "virsh {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `Match` block of "Preparing a hypervisor" in `docs/kvm-agent.md`, for `user`.
fn documented_match_block(user: &str) -> anyhow::Result<String> {
    let mut lines = KVM_AGENT_DOC
        .lines()
        .skip_while(|l| l.trim() != "Match User egressproxy");
    let first = lines
        .next()
        .context("docs/kvm-agent.md has no `Match User egressproxy` block")?;
    let mut block = format!("{}\n", first.trim().replace("egressproxy", user));
    for line in lines.take_while(|l| l.starts_with("       ") && !l.trim().starts_with("```")) {
        block.push_str(line.trim_start());
        block.push('\n');
    }
    Ok(block)
}

fn start_hypervisor() -> anyhow::Result<(Libvirtd, Sshd, SystemUser)> {
    let libvirtd = Libvirtd::start_in_new_netns_with_socket_group("libvirt")?;
    let pool = libvirtd.dir().join("images");
    std::fs::create_dir_all(&pool)?;
    virsh(
        &libvirtd,
        &[
            "pool-define-as",
            "default",
            "dir",
            "--target",
            &pool.display().to_string(),
        ],
    )?;
    virsh(&libvirtd, &["pool-start", "default"])?;
    let network = libvirtd.dir().join("network.xml");
    std::fs::write(
        &network,
        format!(
            "<network><name>default</name><forward mode='nat'/><bridge name='virbr-e2e'/>\
             <ip address='{GATEWAY}' netmask='255.255.255.0'>\
             <dhcp><range start='192.168.123.10' end='192.168.123.250'/></dhcp>\
             </ip></network>"
        ),
    )?;
    virsh(&libvirtd, &["net-define", &network.display().to_string()])?;
    virsh(&libvirtd, &["net-start", "default"])?;

    let user_name = format!("ep-e2e-{}", std::process::id());
    let sshd_options = |user: &str| -> anyhow::Result<SshdOptions> {
        Ok(SshdOptions {
            allow_tcp_forwarding: Some("no".into()),
            system_users: true,
            extra_config: documented_match_block(user)?,
        })
    };
    let sshd = Sshd::start_with(&sshd_options(&user_name)?)?;
    let mut public_key = sshd.client_key().into_os_string();
    public_key.push(".pub");
    let user = SystemUser::create(&user_name, Path::new(&public_key))?;
    Ok((libvirtd, sshd, user))
}
