//! A real kube-apiserver (with an embedded etcd) run by the `kube-harness` test tool.
//!
//! `integration/tools/install-go-tools.sh` builds `kube-harness` from
//! `integration/kube-harness/` (k8s.io/kubernetes at a pinned release); this module starts
//! it and hands out clients. See `docs/testing/kube-apiserver.md`.
//!
//! Guarantees:
//! 1. [`shared`] starts at most one apiserver per test process and every test shares it
//!    (each test isolates itself in its own namespace: see [`crate::kube_env`]).
//! 2. Nothing outlives the test process: the harness reads its stdin, whose only writer is
//!    the pipe held here, and shuts down and removes its directory when that pipe closes.
//!    The kernel closes it when the test process exits for any reason (normal exit, a
//!    panic, `abort`, SIGKILL), so no exit hook is needed. [`KubeApiserver`]s from
//!    [`KubeApiserver::start`] also stop when dropped.
//! 3. When `EGRESSPROXY_TEST_KUBECONFIG` names a kubeconfig (for example one printed by
//!    `integration/tools/kube-up.sh`), [`shared`] uses that cluster instead of starting
//!    one: useful with `cargo nextest`, which runs every test in a process of its own.
//! 4. A harness that fails to start is reported with the tail of its log, which says what
//!    to do (port in use, no tool built, ...).
//! 5. [`KubeApiserver::restart`] crashes the harness and starts it again on the same port
//!    with the same `--dir`: etcd keeps its data and the harness keeps its certificates,
//!    so every client, kubeconfig and relay of the run before keeps working.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::Deserialize;

use crate::tools;

/// Environment variable naming the kubeconfig of an already running cluster to use
/// instead of starting one.
pub const KUBECONFIG_ENV: &str = "EGRESSPROXY_TEST_KUBECONFIG";
/// Environment variable naming a file to which the harness's log is appended.
pub const HARNESS_LOG_ENV: &str = "EGRESSPROXY_KUBE_HARNESS_LOG";

/// How long a start may take: etcd, the apiserver's post-start hooks and RBAC bootstrap
/// take a few seconds, more on a loaded 2-core CI machine.
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long [`Drop`] waits for the harness to stop the apiserver and clean up.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Lines of the harness's log kept for error messages.
const LOG_TAIL_LINES: usize = 40;

/// Options for [`KubeApiserver::start`].
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Loopback port for the apiserver; `None` lets the harness pick a free one.
    pub port: Option<u16>,
    /// The `kube-harness` binary; `None` uses the one in the tools cache.
    pub harness: Option<PathBuf>,
}

/// A running kube-apiserver: its kubeconfig and address, and the harness process if
/// this process started it.
#[derive(Debug)]
pub struct KubeApiserver {
    kubeconfig: PathBuf,
    server: String,
    /// The harness's `--dir` (certificates, etcd's data); `None` for an external cluster.
    dir: Option<PathBuf>,
    /// Behind a lock so that [`KubeApiserver::restart`] works on the [`shared`] one.
    harness: Mutex<Option<Harness>>,
}

#[derive(Debug)]
struct Harness {
    child: Child,
    /// Held open for the harness's lifetime: closing it is the stop signal.
    stdin: Option<ChildStdin>,
    log_tail: LogTail,
}

/// The readiness line `kube-harness` prints on stdout.
#[derive(Debug, Deserialize)]
struct Readiness {
    ready: bool,
    kubeconfig: PathBuf,
    server: String,
    dir: PathBuf,
}

/// The apiserver shared by every test of this process, started on first use.
///
/// Blocks while it starts (seconds); from async code call it through
/// `tokio::task::spawn_blocking` (as [`crate::kube_env::KubeTestEnv::new`] does).
pub fn shared() -> anyhow::Result<&'static KubeApiserver> {
    static SHARED: OnceLock<Result<KubeApiserver, String>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let started = match std::env::var_os(KUBECONFIG_ENV) {
                Some(path) => KubeApiserver::external(PathBuf::from(path)),
                None => KubeApiserver::start(&StartOptions::default()),
            };
            started.map_err(|err| format!("{err:#}"))
        })
        .as_ref()
        .map_err(|err| anyhow!("the shared kube-apiserver did not start: {err}"))
}

impl KubeApiserver {
    /// Starts a new apiserver with its own etcd and waits until it is ready.
    pub fn start(options: &StartOptions) -> anyhow::Result<Self> {
        let (harness, readiness) = Harness::start(options, None)?;
        Ok(Self {
            kubeconfig: readiness.kubeconfig,
            server: readiness.server,
            dir: Some(readiness.dir),
            harness: Mutex::new(Some(harness)),
        })
    }

    /// Restarts the apiserver in place, as a crashed control plane comes back: SIGKILLs
    /// the harness (so it removes nothing), then starts it again on the same port with the
    /// same `--dir`, where etcd finds its data and the harness its certificates. Requests
    /// and watches of clients fail until it is ready again (seconds); then the same
    /// kubeconfig works.
    ///
    /// On the [`shared`] apiserver this disturbs every test of the process: call it only
    /// from a test binary that runs a single test (as `e2e_faults`).
    pub fn restart(&self) -> anyhow::Result<()> {
        let dir = self
            .dir
            .clone()
            .context("an external cluster cannot be restarted from here")?;
        let port = self.port()?;
        let mut harness = self
            .harness
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let ca = std::fs::read(dir.join("pki/ca.crt")).context("read the harness's CA")?;
        if let Some(mut old) = harness.take() {
            old.kill();
        }
        let options = StartOptions {
            port: Some(port),
            harness: None,
        };
        let (started, readiness) = Harness::start(&options, Some(&dir))?;
        *harness = Some(started);
        if std::fs::read(dir.join("pki/ca.crt")).ok().as_ref() != Some(&ca) {
            bail!(
                "the restarted kube-harness made new certificates, so no client of the run \
                 before can reach it: it predates keeping them; rebuild it with \
                 `integration/tools/install-go-tools.sh kube-harness`"
            );
        }
        if readiness.server != self.server || readiness.kubeconfig != self.kubeconfig {
            bail!(
                "the restarted apiserver moved: {} and {} instead of {} and {}",
                readiness.server,
                readiness.kubeconfig.display(),
                self.server,
                self.kubeconfig.display()
            );
        }
        Ok(())
    }

    /// Uses a cluster that something else runs, described by `kubeconfig`.
    pub fn external(kubeconfig: PathBuf) -> anyhow::Result<Self> {
        let config = Kubeconfig::read_from(&kubeconfig)
            .with_context(|| format!("read kubeconfig {}", kubeconfig.display()))?;
        let server = config
            .clusters
            .first()
            .and_then(|cluster| cluster.cluster.as_ref())
            .and_then(|cluster| cluster.server.clone())
            .with_context(|| format!("kubeconfig {} names no server", kubeconfig.display()))?;
        Ok(Self {
            kubeconfig,
            server,
            dir: None,
            harness: Mutex::new(None),
        })
    }

    /// Whether this is an external cluster's apiserver, not one this process started.
    pub fn is_external(&self) -> bool {
        self.dir.is_none()
    }

    /// The admin kubeconfig (client certificate in group `system:masters`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The apiserver's URL, `https://127.0.0.1:<port>`.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The apiserver's port on loopback.
    pub fn port(&self) -> anyhow::Result<u16> {
        port_of(&self.server)
    }

    /// The process id of the harness, when this process started it.
    pub fn harness_pid(&self) -> Option<u32> {
        self.harness
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .map(|harness| harness.child.id())
    }

    /// A client configuration for the admin.
    pub async fn admin_config(&self) -> anyhow::Result<kube::Config> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .with_context(|| format!("read kubeconfig {}", self.kubeconfig.display()))?;
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .context("kube client configuration from the harness kubeconfig")
    }

    /// A client for the admin. Make one per test: a client lives on the Tokio runtime
    /// that created it, and every `#[tokio::test]` has its own runtime.
    pub async fn admin_client(&self) -> anyhow::Result<kube::Client> {
        kube::Client::try_from(self.admin_config().await?).context("build kube client")
    }
}

impl Drop for KubeApiserver {
    fn drop(&mut self) {
        let harness = self
            .harness
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(harness) = harness {
            harness.stop();
        }
    }
}

impl Harness {
    /// Starts `kube-harness` (in `dir` when given, else in a directory of its own) and
    /// waits until it reports ready.
    fn start(options: &StartOptions, dir: Option<&Path>) -> anyhow::Result<(Self, Readiness)> {
        let binary = match &options.harness {
            Some(path) => path.clone(),
            None => tools::bin("kube-harness")?,
        };
        let mut command = Command::new(&binary);
        command
            .arg("--exit-on-stdin-eof")
            .arg(format!("--port={}", options.port.unwrap_or(0)));
        if let Some(dir) = dir {
            command.arg("--dir").arg(dir);
        }
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .with_context(|| format!("spawn {}", binary.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("harness stdout")?;
        let stderr = child.stderr.take().context("harness stderr")?;
        let log_tail = LogTail::follow(stderr);
        let mut harness = Harness {
            child,
            stdin,
            log_tail,
        };
        match wait_ready(stdout, &mut harness) {
            Ok(readiness) => Ok((harness, readiness)),
            Err(err) => {
                let tail = harness.log_tail.text();
                harness.stop();
                Err(err.context(format!("kube-harness log (last lines):\n{tail}")))
            }
        }
    }

    /// SIGKILLs the harness: no clean-up of its own runs, so its directory stays.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes stdin (the harness then stops the apiserver and removes its directory),
    /// waits for it, and kills it if it does not exit in time.
    fn stop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => break,
            }
        }
        tracing::warn!(
            pid = self.child.id(),
            "kube-harness did not stop in time; killing it"
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port of a server URL such as `https://127.0.0.1:6443`.
fn port_of(server: &str) -> anyhow::Result<u16> {
    server
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .with_context(|| format!("no port in apiserver address {server}"))
}

/// Reads stdout until the readiness line, the harness exits, or the timeout passes.
fn wait_ready(
    stdout: impl Read + Send + 'static,
    harness: &mut Harness,
) -> anyhow::Result<Readiness> {
    let (lines_tx, lines_rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("kube-harness-stdout".into())
        .spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        })
        .context("spawn stdout reader")?;

    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match lines_rx.recv_timeout(remaining.min(Duration::from_millis(200))) {
            Ok(line) => {
                if let Ok(readiness) = serde_json::from_str::<Readiness>(&line)
                    && readiness.ready
                {
                    return Ok(readiness);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = harness.child.wait().context("wait for kube-harness")?;
                bail!("kube-harness exited before the apiserver was ready ({status})");
            }
        }
        if let Some(status) = harness.child.try_wait().context("poll kube-harness")? {
            bail!("kube-harness exited before the apiserver was ready ({status})");
        }
        if Instant::now() >= deadline {
            bail!("kube-apiserver was not ready after {READY_TIMEOUT:?}");
        }
    }
}

/// The last lines of the harness's stderr, kept for error messages, and copied to the
/// file named by [`HARNESS_LOG_ENV`] when it is set.
#[derive(Debug, Clone)]
struct LogTail {
    lines: Arc<Mutex<VecDeque<String>>>,
}

impl LogTail {
    fn follow(stderr: impl Read + Send + 'static) -> Self {
        let tail = Self {
            lines: Arc::new(Mutex::new(VecDeque::with_capacity(LOG_TAIL_LINES))),
        };
        let lines = Arc::clone(&tail.lines);
        let mut copy = std::env::var_os(HARNESS_LOG_ENV).and_then(|path| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .ok()
        });
        let spawned = std::thread::Builder::new()
            .name("kube-harness-log".into())
            .spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if let Some(file) = &mut copy {
                        use std::io::Write as _;
                        let _ = writeln!(file, "{line}");
                    }
                    let mut lines = lines
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                    if lines.len() == LOG_TAIL_LINES {
                        lines.pop_front();
                    }
                    lines.push_back(line);
                }
            });
        if let Err(err) = spawned {
            tracing::warn!(%err, "cannot follow the kube-harness log");
        }
        tail
    }

    fn text(&self) -> String {
        // The reader thread may still be taking the last lines of a harness that just exited.
        std::thread::sleep(Duration::from_millis(100));
        let lines = self
            .lines
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        lines.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}
