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
//!    kube-apiserver with the Proxy CRD (the chart's, with
//!    [`StackOptions::through_chart`]) and a namespace of this run;
//! 5. `kvm-agent serve` on loopback, reaching libvirtd through the sshd;
//! 6. the operator inside the network namespace (its health check reaches the guests
//!    there), with loopback relays to the apiserver, the agent and the span receiver;
//! 7. a target HTTP server on the gateway address, for requests through the proxies.
//!
//! With [`StackOptions::through_chart`], steps 5 and 6 are what users do instead
//! (`stack/in_cluster.rs`): a single-node cluster ([`crate::cluster`]) whose node routes
//! to the hypervisor's network, and `helm install` of the chart into it; the operator
//! and the agent run as its pods, from the images built from `deploy/docker/`. The
//! libvirt network is then routed (`<forward mode='route'/>`), not NATed, so the node
//! reaches the guests; sshd, the image mirror and the span receiver are reached at the
//! gateway's address, as a cluster reaches a hypervisor's services.
//!
//! Every guest's serial console is recorded under [`CONSOLES_DIR`]
//! (`stack/consoles.rs`), and [`Stack::log_tails`] shows its last lines when a test fails.
//!
//! Dropping the stack (also while a test unwinds) stops the operator and the agent,
//! then the servers, sshd and libvirtd with its guests, deletes the namespace and the
//! user, and removes every directory. [`Stack::footprint`] then lists what is still there.
//!
//! Faults that restart or hang a part in place (libvirtd alone, the apiserver, sshd with
//! another host key) are methods in `stack/restarts.rs`: [`Stack::restart_libvirtd`],
//! [`Stack::pause_libvirtd`], [`Stack::restart_apiserver`],
//! [`Stack::restart_sshd_with_other_host_key`].

mod consoles;
mod footprint;
mod in_cluster;
mod inspect;
mod restarts;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use self::consoles::ConsoleRecorder;
use super::guest_image::guest_image;
use super::http_servers::{ImageServer, TargetServer};
use super::otlp::SpanReceiver;
use super::release::Release;
use super::system_user::SystemUser;
use crate::cluster::Cluster;
use crate::kube_env::{KubeTestEnv, apply_crds_yaml};
use crate::libvirtd::Libvirtd;
use crate::netns::command_in;
use crate::process::{Daemon, wait_until};
use crate::reference_provider::workspace_binary;
use crate::relay::LoopbackRelay;
use crate::sshd::{Sshd, SshdOptions, free_port};

mod inputs;
pub use footprint::Footprint;
pub use inputs::TmpfsPool;

/// The guests' network's gateway, inside the namespace.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(192, 168, 123, 1);
/// The guests' network (DHCP from libvirt's dnsmasq).
pub const GUEST_NETWORK: &str = "192.168.123.0/24";
/// The provider name Proxies use.
pub const PROVIDER: &str = "kvm";
/// The agent's image and machine type names. The image ships qemu-guest-agent
/// (`guestAgent: preinstalled`: the bootstrap only starts it).
pub const IMAGE: &str = "debian-e2e";
/// The same image declared `guestAgent: install`: the bootstrap also lists the package.
pub const IMAGE_INSTALLING_THE_AGENT: &str = "debian-e2e-install";
/// See [`IMAGE`].
pub const MACHINE_TYPE: &str = "small";
/// The agent's host name.
pub const HOST: &str = "hv1";

const CRD: &str = include_str!("../../../charts/egressproxy/files/crds.yaml");
const KVM_AGENT_DOC: &str = include_str!("../../../docs/kvm-agent.md");
/// The file in [`Stack::dir`] with every span received, one JSON object a line.
pub const SPANS_FILE: &str = "spans.jsonl";

/// The operator's log line once it has read its provider config and leads.
pub const OPERATOR_STARTED: &str = "egressproxy operator started";

/// The folder of [`Stack::dir`] with each guest's serial console, `<domain>.log`.
pub const CONSOLES_DIR: &str = "consoles";
/// How long `kvm-agent serve` may take to listen (it checks its hosts first).
const AGENT_START: Duration = Duration::from_secs(120);

/// The running stack. See the module docs.
pub struct Stack {
    operator: Option<Daemon>,
    /// The length of `operator.log` when the latest operator was started: it logs
    /// [`OPERATOR_STARTED`] after that offset once it has read its provider config.
    operator_log_from: usize,
    agent: Option<Daemon>,
    release: Option<Release>,
    /// The single-node cluster the chart is installed into (with
    /// [`StackOptions::through_chart`]).
    cluster: Option<Cluster>,
    agent_port: u16,
    call_timeout: Duration,
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
    /// Held for its drop, which stops recording before libvirtd goes.
    _consoles: ConsoleRecorder,
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

/// What [`Stack::start_with`] changes.
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    /// Serve the image no faster than this (bytes per second).
    pub image_bytes_per_second: Option<u64>,
    /// Install the operator and the agent with the Helm chart ([`super::release`]) into
    /// a single-node cluster, where they run as pods, instead of starting them as
    /// processes from config files written here.
    pub through_chart: bool,
    /// The deadline of each call: the operator's `callTimeout` to the agent and the
    /// agent's `transport.defaultCallTimeout` ([`DEFAULT_CALL_TIMEOUT`] when `None`).
    pub call_timeout: Option<Duration>,
}

/// See [`StackOptions::call_timeout`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// SIGKILLs `daemon` (no clean-up of its own runs), then reaps its tree.
fn kill(daemon: Daemon) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(daemon.pid()).unwrap_or(0)),
        nix::sys::signal::Signal::SIGKILL,
    );
    drop(daemon);
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
        // Through the chart, `helm install` brings the CRD, as it does for users.
        if !options.through_chart {
            apply_crds_yaml(&kube.client, CRD).await?;
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("e2e-stack")
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();

        let routed = options.through_chart;
        let (libvirtd, sshd, user) =
            tokio::task::spawn_blocking(move || start_hypervisor(routed)).await??;
        let netns = libvirtd
            .netns()
            .context("libvirtd runs in a network namespace")?
            .to_owned();
        let images = ImageServer::start(&handle, &image, options.image_bytes_per_second)?;
        let dir = tempfile::Builder::new().prefix("e2e-").tempdir()?;
        let spans = SpanReceiver::start(&handle, Some(dir.path().join(SPANS_FILE)))?;
        let target = TargetServer::start(&handle, &netns, GATEWAY)?;
        let consoles = ConsoleRecorder::start(libvirtd.uri(), dir.path().join(CONSOLES_DIR))?;

        let mut stack = Self {
            operator: None,
            operator_log_from: 0,
            agent: None,
            release: None,
            cluster: None,
            agent_port: free_port()?,
            call_timeout: options.call_timeout.unwrap_or(DEFAULT_CALL_TIMEOUT),
            relays: Vec::new(),
            target,
            images,
            spans,
            kube,
            sshd,
            _consoles: consoles,
            libvirtd,
            user,
            dir,
            image,
            runtime: Some(runtime),
        };
        if options.through_chart {
            stack.install_in_cluster(&handle).await?;
            return Ok(stack);
        }
        stack.write_configs()?;
        stack.start_agent().await?;
        let apiserver_port = stack.kube.apiserver().port()?;
        for port in [apiserver_port, stack.agent_port, stack.spans.port()] {
            stack
                .relays
                .push(LoopbackRelay::start(&handle, &netns, port)?);
        }
        stack.start_operator().await?;
        Ok(stack)
    }

    /// The agent's hosts, machine types, images and transport, indented by `indent`
    /// spaces; `ssh_files` adds the key and known_hosts paths (the chart fills them in
    /// from its Secret). `hypervisor` is the address at which the agent reaches sshd and
    /// the image mirror: the host's loopback, or (in the cluster) the gateway's address,
    /// relayed there.
    fn agent_settings(
        &self,
        indent: usize,
        ssh_files: bool,
        hypervisor: Ipv4Addr,
    ) -> anyhow::Result<String> {
        let sha256 = sha256_file(&self.image)?;
        let files = if ssh_files {
            format!(
                "\n    privateKey: {key}\n    knownHosts: {known_hosts}",
                key = self.sshd.client_key().display(),
                known_hosts = self.sshd.known_hosts().display(),
            )
        } else {
            String::new()
        };
        let config = format!(
            "hosts:\n\
             - name: {HOST}\n\
             \x20 ssh:\n\
             \x20   address: \"{hypervisor}:{port}\"\n\
             \x20   user: {user}{files}\n\
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
             \x20   guestAgent: preinstalled\n\
             \x20 {IMAGE_INSTALLING_THE_AGENT}:\n\
             \x20   url: {url}\n\
             \x20   sha256: {sha256}\n\
             \x20   format: qcow2\n\
             \x20   firmware: uefi\n\
             \x20   guestAgent: install\n\
             transport:\n\
             \x20 defaultCallTimeout: {call_timeout}s\n",
            port = self.sshd.port(),
            user = self.user.name(),
            socket = self.libvirtd.socket().display(),
            url = self
                .images
                .url()
                .replace("@127.0.0.1:", &format!("@{hypervisor}:")),
            call_timeout = self.call_timeout.as_secs(),
        );
        let pad = " ".repeat(indent);
        Ok(config.lines().map(|l| format!("{pad}{l}\n")).collect())
    }

    fn write_configs(&self) -> anyhow::Result<()> {
        let config = self.agent_settings(0, true, Ipv4Addr::LOCALHOST)?;
        std::fs::write(self.agent_config(), config)?;
        std::fs::write(
            self.providers_config(),
            format!(
                "providers:\n  {PROVIDER}:\n    endpoint: http://127.0.0.1:{}\n    callTimeout: {}s\n",
                self.agent_port,
                self.call_timeout.as_secs()
            ),
        )?;
        Ok(())
    }

    /// The agent's configuration file (with the chart: a copy of what its pod reads).
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

    /// Starts `kvm-agent serve` and waits until it listens (not with the chart: the
    /// release's pod is the agent).
    pub async fn start_agent(&mut self) -> anyhow::Result<()> {
        if self.release.is_some() {
            bail!("the chart's agent runs as a pod of the release, not as a process here");
        }
        let log = self.dir.path().join("kvm-agent.log");
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
        let mut agent = Daemon::spawn("kvm-agent", command, &log)?;
        let listening = tokio::task::spawn_blocking(move || {
            wait_until("kvm-agent to listen", AGENT_START, || {
                agent.ensure_running()?;
                Ok(std::fs::read_to_string(&log)?.contains("listening on"))
            })
            .map(|()| agent)
        });
        self.agent = Some(listening.await??);
        Ok(())
    }

    /// Starts the operator inside the network namespace (not with the chart: the
    /// release's pod is the operator).
    pub async fn start_operator(&mut self) -> anyhow::Result<()> {
        if self.release.is_some() {
            bail!("the chart's operator runs as a pod of the release, not as a process here");
        }
        let log = self.dir.path().join("operator.log");
        self.operator_log_from = std::fs::read(&log).map_or(0, |text| text.len());
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
        self.operator = Some(Daemon::spawn("operator", command, &log)?);
        Ok(())
    }

    /// SIGKILLs the agent (no clean-up of its own runs).
    pub fn kill_agent(&mut self) {
        if let Some(agent) = self.agent.take() {
            kill(agent);
        }
    }

    /// Kills sshd with every session through it (the agent's libvirt connection drops)
    /// and starts it again with the same port and keys.
    pub fn restart_sshd(&mut self) -> anyhow::Result<()> {
        self.sshd.restart()
    }

    /// SIGKILLs the operator.
    pub fn kill_operator(&mut self) {
        if let Some(operator) = self.operator.take() {
            kill(operator);
        }
    }

    /// The agent's pid, while it runs.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(Daemon::pid)
    }

    /// The deadline of each call of the operator and the agent
    /// ([`StackOptions::call_timeout`]).
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
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
}

impl Drop for Stack {
    fn drop(&mut self) {
        // The operator first, so nothing acts while the rest goes; the cluster with the
        // release's pods.
        drop(self.operator.take());
        drop(self.agent.take());
        drop(self.cluster.take());
        self.relays.clear();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        // The remaining fields drop in order: servers, sshd, the console recorder,
        // libvirtd (its guests and namespace), the user, the directory.
    }
}

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    workspace_binary(name)
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

/// libvirtd with its pool and network (routed when `routed`, else NAT), sshd and the
/// agent's user.
fn start_hypervisor(routed: bool) -> anyhow::Result<(Libvirtd, Sshd, SystemUser)> {
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
            "<network><name>default</name><forward mode='{mode}'/><bridge name='virbr-e2e'/>\
             <ip address='{GATEWAY}' netmask='255.255.255.0'>\
             <dhcp><range start='192.168.123.10' end='192.168.123.250'/></dhcp>\
             </ip></network>",
            mode = if routed { "route" } else { "nat" },
        ),
    )?;
    virsh(&libvirtd, &["net-define", &network.display().to_string()])?;
    virsh(&libvirtd, &["net-start", "default"])?;

    // Two stacks may run in one process (the fault matrix runs two side by side).
    static STACKS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let user_name = format!(
        "ep-e2e-{}-{}",
        std::process::id(),
        STACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
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
