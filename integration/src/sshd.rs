//! A private OpenSSH server on loopback with generated keys.
//!
//! [`Sshd::start`] creates, in its own temporary directory:
//! 1. an ed25519 host key, and a second one ([`Sshd::other_host_key_known_hosts`]) that a
//!    client must reject as a changed key;
//! 2. client keys: ed25519 and RSA, both authorised for `root`, and one ed25519 key that is
//!    not ([`Sshd::unauthorized_key`]);
//! 3. a `known_hosts` file with the host key under `[127.0.0.1]:PORT`;
//! 4. an `sshd_config` that listens on 127.0.0.1 only, allows public keys only, and sets
//!    `AllowTcpForwarding local`, without which OpenSSH refuses `direct-streamlocal`
//!    channels (the libvirt socket forward).
//!
//! [`Sshd::start_with`] changes that configuration for one test ([`SshdOptions`]): another
//! global `AllowTcpForwarding`, logins of system accounts, and lines appended last (a
//! `Match` block).
//!
//! The server keeps its port across [`Sshd::restart`], so the same `known_hosts` stays valid.
//! [`Sshd::restart_with_other_host_key`] restarts it presenting the second host key (a
//! reinstalled hypervisor, or a man in the middle, to a client that knows the first);
//! [`Sshd::restart_with_own_host_key`] goes back to the first.
//! It runs as root (tests run as root) and is stopped on drop.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use std::io::Read;

use crate::process::{Daemon, wait_until};

const SSHD: &str = "/usr/sbin/sshd";

/// What [`Sshd::start_with`] changes in [`Sshd::start`]'s configuration.
#[derive(Debug, Clone, Default)]
pub struct SshdOptions {
    /// The global `AllowTcpForwarding` (`local` when `None`).
    pub allow_tcp_forwarding: Option<String>,
    /// Let local accounts log in as a stock Debian sshd does: `UsePAM yes` (without PAM,
    /// OpenSSH refuses accounts whose password is locked, as `useradd --system` leaves it)
    /// and keys also from each user's `~/.ssh/authorized_keys`.
    pub system_users: bool,
    /// Appended to `sshd_config` after everything else (a `Match` block goes here).
    pub extra_config: String,
}

/// A running private sshd. See the module docs.
#[derive(Debug)]
pub struct Sshd {
    dir: tempfile::TempDir,
    port: u16,
    daemon: Option<Daemon>,
}

impl Sshd {
    /// Generates keys and configuration, starts sshd, and waits until it sends its banner.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(&SshdOptions::default())
    }

    /// Like [`Sshd::start`], with `options` applied to the configuration.
    pub fn start_with(options: &SshdOptions) -> anyhow::Result<Self> {
        if !Path::new(SSHD).exists() {
            bail!("{SSHD} not found: run integration/tools/install-system-packages.sh");
        }
        // sshd's privilege separation needs this directory; Debian creates it at boot only.
        std::fs::create_dir_all("/run/sshd").context("create /run/sshd")?;
        let dir = tempfile::Builder::new().prefix("sshd-").tempdir()?;
        let d = dir.path();
        keygen(&d.join("host_ed25519"), "ed25519")?;
        keygen(&d.join("other_host_ed25519"), "ed25519")?;
        keygen(&d.join("client_ed25519"), "ed25519")?;
        keygen(&d.join("client_rsa"), "rsa")?;
        keygen(&d.join("unauthorized_ed25519"), "ed25519")?;
        let authorized = [
            read_pub(&d.join("client_ed25519"))?,
            read_pub(&d.join("client_rsa"))?,
        ]
        .join("\n");
        std::fs::write(d.join("authorized_keys"), authorized + "\n")?;

        let port = free_port()?;
        let host_pub = read_pub(&d.join("host_ed25519"))?;
        let other_pub = read_pub(&d.join("other_host_ed25519"))?;
        std::fs::write(d.join("known_hosts"), known_hosts_line(port, &host_pub))?;
        std::fs::write(
            d.join("other_known_hosts"),
            known_hosts_line(port, &other_pub),
        )?;
        std::fs::write(d.join("empty_known_hosts"), "")?;

        let mut config = format!(
            "Port {port}\n\
             ListenAddress 127.0.0.1\n\
             HostKey {host_key}\n\
             PidFile {pid}\n\
             AuthorizedKeysFile {authorized}{user_keys}\n\
             StrictModes no\n\
             UsePAM {use_pam}\n\
             PermitRootLogin prohibit-password\n\
             PubkeyAuthentication yes\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             AllowTcpForwarding {tcp_forwarding}\n\
             AllowStreamLocalForwarding local\n\
             MaxStartups 100\n\
             LogLevel VERBOSE\n",
            host_key = d.join("host_ed25519").display(),
            pid = d.join("sshd.pid").display(),
            authorized = d.join("authorized_keys").display(),
            user_keys = if options.system_users {
                " .ssh/authorized_keys"
            } else {
                ""
            },
            use_pam = if options.system_users { "yes" } else { "no" },
            tcp_forwarding = options.allow_tcp_forwarding.as_deref().unwrap_or("local"),
        );
        // OpenSSH 9.8+ penalises sources that fail repeatedly; tests fail on purpose.
        if accepts_option("PerSourcePenalties no")? {
            config.push_str("PerSourcePenalties no\n");
        }
        // Last: a `Match` block applies to every line after it.
        config.push_str(&options.extra_config);
        if !config.ends_with('\n') {
            config.push('\n');
        }
        std::fs::write(d.join("sshd_config"), config)?;

        let mut sshd = Self {
            dir,
            port,
            daemon: None,
        };
        sshd.spawn()?;
        Ok(sshd)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let mut command = Command::new(SSHD);
        command
            .arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(self.path("sshd_config"));
        let mut daemon = Daemon::spawn("sshd", command, &self.path("sshd.log"))?;
        let port = self.port;
        wait_until("sshd banner", Duration::from_secs(10), || {
            daemon.ensure_running()?;
            Ok(banner(port).is_some())
        })?;
        self.daemon = Some(daemon);
        Ok(())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn daemon(&mut self) -> anyhow::Result<&mut Daemon> {
        self.daemon.as_mut().context("sshd is not running")
    }

    /// Accepts `public_key` (an `authorized_keys` line) for every user from now on, as
    /// adding a key to a hypervisor's account does: sshd reads the file at each login.
    pub fn authorize(&self, public_key: &str) -> anyhow::Result<()> {
        use std::io::Write as _;
        let path = self.path("authorized_keys");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        writeln!(file, "{}", public_key.trim())
            .with_context(|| format!("append to {}", path.display()))
    }

    /// The listener's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Daemon::pid)
    }

    /// The loopback port sshd listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The user the client keys are authorised for.
    pub fn user(&self) -> &'static str {
        "root"
    }

    /// Authorised ed25519 client private key.
    pub fn client_key(&self) -> PathBuf {
        self.path("client_ed25519")
    }

    /// Authorised RSA client private key (for rsa-sha2-256/512 authentication).
    pub fn client_rsa_key(&self) -> PathBuf {
        self.path("client_rsa")
    }

    /// A valid ed25519 private key that sshd does not accept.
    pub fn unauthorized_key(&self) -> PathBuf {
        self.path("unauthorized_ed25519")
    }

    /// `known_hosts` that lists this server's host key.
    pub fn known_hosts(&self) -> PathBuf {
        self.path("known_hosts")
    }

    /// `known_hosts` that lists a different ed25519 key for this server (a changed key).
    pub fn other_host_key_known_hosts(&self) -> PathBuf {
        self.path("other_known_hosts")
    }

    /// An empty `known_hosts` (the server is unknown).
    pub fn empty_known_hosts(&self) -> PathBuf {
        self.path("empty_known_hosts")
    }

    /// The SHA256 fingerprint of the host key as OpenSSH prints it (`SHA256:...`).
    pub fn host_key_fingerprint(&self) -> anyhow::Result<String> {
        let out = Command::new("ssh-keygen")
            .arg("-l")
            .arg("-f")
            .arg(self.path("host_ed25519.pub"))
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        text.split_whitespace()
            .nth(1)
            .map(str::to_owned)
            .context("ssh-keygen -l printed no fingerprint")
    }

    /// OpenSSH client options that reach this server with the ed25519 client key and
    /// strict host key checking against [`Sshd::known_hosts`].
    pub fn ssh_client_args(&self) -> Vec<String> {
        vec![
            "-p".into(),
            self.port.to_string(),
            "-i".into(),
            self.client_key().display().to_string(),
            "-o".into(),
            format!("UserKnownHostsFile={}", self.known_hosts().display()),
            "-o".into(),
            "StrictHostKeyChecking=yes".into(),
            "-o".into(),
            "BatchMode=yes".into(),
            "-o".into(),
            "IdentitiesOnly=yes".into(),
            "-l".into(),
            self.user().into(),
        ]
    }

    /// sshd's log (connection and forwarding decisions at VERBOSE level).
    pub fn log(&self) -> PathBuf {
        self.path("sshd.log")
    }

    /// SIGSTOPs sshd and every per-connection sshd it forked: established sessions hang.
    pub fn pause(&mut self) -> anyhow::Result<()> {
        self.daemon()?.pause()
    }

    /// SIGCONTs what [`Sshd::pause`] stopped.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        self.daemon()?.resume()
    }

    /// Like [`Sshd::restart`], presenting the host key of
    /// [`Sshd::other_host_key_known_hosts`] from now on.
    pub fn restart_with_other_host_key(&mut self) -> anyhow::Result<()> {
        self.restart_with_host_key("other_host_ed25519")
    }

    /// Like [`Sshd::restart`], presenting the host key of [`Sshd::known_hosts`] again.
    pub fn restart_with_own_host_key(&mut self) -> anyhow::Result<()> {
        self.restart_with_host_key("host_ed25519")
    }

    fn restart_with_host_key(&mut self, name: &str) -> anyhow::Result<()> {
        let config = std::fs::read_to_string(self.path("sshd_config"))?;
        let host_key = format!("HostKey {}", self.path(name).display());
        let config: Vec<String> = config
            .lines()
            .map(|line| {
                if line.starts_with("HostKey ") {
                    host_key.clone()
                } else {
                    line.to_owned()
                }
            })
            .collect();
        std::fs::write(self.path("sshd_config"), config.join("\n") + "\n")?;
        self.restart()
    }

    /// Kills sshd and all its sessions, then starts it again on the same port and keys.
    /// No session of the old sshd outlives it (one it accepted during the restart would
    /// log in with the old host key after the restart, to the new one's log).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(mut daemon) = self.daemon.take() {
            daemon.kill_frozen();
        }
        self.spawn()
    }
}

fn keygen(path: &Path, kind: &str) -> anyhow::Result<()> {
    let mut command = Command::new("ssh-keygen");
    command.args(["-q", "-N", "", "-C", "egressproxy-test", "-t", kind]);
    if kind == "rsa" {
        command.args(["-b", "3072"]);
    }
    let out = command
        .arg("-f")
        .arg(path)
        .output()
        .context("run ssh-keygen")?;
    if !out.status.success() {
        bail!(
            "ssh-keygen -t {kind} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn read_pub(private: &Path) -> anyhow::Result<String> {
    let path = private.with_extension("pub");
    let path = if path.exists() {
        path
    } else {
        PathBuf::from(format!("{}.pub", private.display()))
    };
    Ok(std::fs::read_to_string(&path)
        .with_context(|| format!("read {}", path.display()))?
        .trim()
        .to_owned())
}

fn known_hosts_line(port: u16, public_key_line: &str) -> String {
    let mut fields = public_key_line.split_whitespace();
    let kind = fields.next().unwrap_or_default();
    let key = fields.next().unwrap_or_default();
    format!("[127.0.0.1]:{port} {kind} {key}\n")
}

fn accepts_option(option: &str) -> anyhow::Result<bool> {
    let out = Command::new(SSHD)
        .args(["-t", "-f", "/dev/null", "-o", option])
        .output()
        .context("run sshd -t")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    Ok(!stderr.contains("Bad configuration option") && !stderr.contains("unsupported option"))
}

/// A port that was free a moment ago (sshd binds it right after).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn banner(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    let mut buf = [0u8; 64];
    let n = stream.read(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    text.starts_with("SSH-").then_some(text)
}
