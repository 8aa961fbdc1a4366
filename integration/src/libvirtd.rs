//! A private libvirtd that no other test or system daemon can reach by accident.
//!
//! [`Libvirtd::start`]:
//! 1. creates a temporary directory with `run/`, `lib/`, `etc/`, `cache/`, `log/`;
//! 2. writes `etc/libvirtd.conf` and `etc/qemu.conf` (`namespaces = [ ]`, no security
//!    driver, QEMU output to files so no virtlogd is needed);
//! 3. runs `unshare --mount --propagation private -- tini -s -- sh -c '...'`: in its own
//!    mount namespace the script bind-mounts those directories over `/run/libvirt`,
//!    `/var/lib/libvirt`, `/etc/libvirt`, `/var/cache/libvirt` and `/var/log/libvirt`, masks
//!    `/dev/kvm` with an unreadable empty file, mounted read-only (here a nested KVM hangs
//!    guests, and a `/dev/kvm` whose group libvirt cannot map makes it re-probe QEMU on
//!    every call; root passes the permission check of a mode-000 file, so without the
//!    read-only mount libvirt still finds KVM "usable now", re-probes QEMU on every define
//!    (5-11 s each) and fails again), and execs `libvirtd`. `tini -s` reaps the
//!    short-lived QEMU capability probes;
//! 4. waits until `socket()` accepts connections.
//!
//! [`Libvirtd::start_in_new_netns`] also runs the daemon (and so its NAT networks, dnsmasq
//! and guests) in a network namespace of its own, `ip netns add`ed for the test, with only
//! `lo` up; [`Libvirtd::netns_command`] runs a client in it. Test traffic to guests stays
//! inside that namespace. It is deleted on drop.
//!
//! [`Libvirtd::start_with_socket_group`] gives the read-write socket to a group (mode
//! 0770, as Debian's `libvirt` group) and lets every user traverse the directory to it, so
//! a non-root member of that group can connect.
//!
//! Clients reach it only through `qemu+unix:///system?socket=<socket()>` ([`Libvirtd::uri`]).
//! The socket lives on the shared filesystem, so processes outside the namespace (sshd, the
//! agent) reach it. [`Libvirtd::pause`]/[`Libvirtd::resume`] SIGSTOP/SIGCONT the daemon and
//! its children; drop (also on panic) stops it and removes the directory.
//!
//! [`Libvirtd::restart`] stops the whole tree, guests included. [`Libvirtd::restart_daemon`]
//! is what a restart of libvirtd on a hypervisor does: only libvirtd stops; its guests and
//! dnsmasq keep running (re-parented to this process, which reaps them: see
//! [`crate::process::Adopted`]), and the new libvirtd, with the same directories, finds
//! them in its state directory and reconnects to them. Drop stops those guests too.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::netns::NetworkNamespace;
use crate::process::{Adopted, Daemon, process_tree, wait_until};

/// The prefix of the network namespaces [`Libvirtd::start_in_new_netns`] makes.
const NETNS_PREFIX: &str = "eptest";

/// Where libvirtd's private directories are mounted inside its namespace.
const MOUNTS: [(&str, &str); 5] = [
    ("run", "/run/libvirt"),
    ("lib", "/var/lib/libvirt"),
    ("etc", "/etc/libvirt"),
    ("cache", "/var/cache/libvirt"),
    ("log", "/var/log/libvirt"),
];

/// A running private libvirtd. See the module docs.
#[derive(Debug)]
pub struct Libvirtd {
    // Declared first so the daemon stops before its namespace and directory go.
    daemon: Option<Daemon>,
    /// Guests and dnsmasq that outlived an earlier libvirtd ([`Libvirtd::restart_daemon`]).
    adopted: Adopted,
    netns: Option<NetworkNamespace>,
    dir: tempfile::TempDir,
}

impl Libvirtd {
    /// Starts libvirtd and waits (up to 30 s) until its socket accepts connections.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(None, None)
    }

    /// Like [`Libvirtd::start`], inside a new network namespace (for guest networking).
    pub fn start_in_new_netns() -> anyhow::Result<Self> {
        Self::start_with(Some(NetworkNamespace::create(NETNS_PREFIX)?), None)
    }

    /// Like [`Libvirtd::start`], with the read-write socket owned by `group` (mode 0770,
    /// `unix_sock_group`) and its directory path traversable (not listable) by every user.
    pub fn start_with_socket_group(group: &str) -> anyhow::Result<Self> {
        Self::start_with(None, Some(group))
    }

    /// Both: in a new network namespace, with the socket owned by `group`.
    pub fn start_in_new_netns_with_socket_group(group: &str) -> anyhow::Result<Self> {
        Self::start_with(Some(NetworkNamespace::create(NETNS_PREFIX)?), Some(group))
    }

    fn start_with(
        netns: Option<NetworkNamespace>,
        socket_group: Option<&str>,
    ) -> anyhow::Result<Self> {
        for tool in ["/usr/sbin/libvirtd", "/usr/bin/tini", "/usr/bin/unshare"] {
            if !Path::new(tool).exists() {
                bail!("{tool} not found: run integration/tools/install-system-packages.sh");
            }
        }
        // Short prefix: unix socket paths are limited to 108 bytes.
        let dir = tempfile::Builder::new().prefix("lv-").tempdir()?;
        let d = dir.path();
        for (name, _) in MOUNTS {
            std::fs::create_dir_all(d.join(name))?;
        }
        let mut libvirtd_conf = String::from(
            "unix_sock_rw_perms = \"0770\"\n\
             auth_unix_rw = \"none\"\n\
             auth_unix_ro = \"none\"\n\
             keepalive_interval = 5\n\
             keepalive_count = 5\n\
             max_clients = 200\n\
             max_workers = 20\n",
        );
        if let Some(group) = socket_group {
            libvirtd_conf.push_str(&format!("unix_sock_group = \"{group}\"\n"));
            // The temporary directory is 0700.
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711))?;
            std::fs::set_permissions(d.join("run"), std::fs::Permissions::from_mode(0o711))?;
        }
        std::fs::write(d.join("etc/libvirtd.conf"), libvirtd_conf)?;
        std::fs::write(
            d.join("etc/qemu.conf"),
            "namespaces = [ ]\n\
             security_driver = \"none\"\n\
             stdio_handler = \"file\"\n\
             user = \"root\"\n\
             group = \"root\"\n",
        )?;
        let masked_kvm = d.join("kvm-masked");
        std::fs::write(&masked_kvm, "")?;
        std::fs::set_permissions(&masked_kvm, std::fs::Permissions::from_mode(0o000))?;

        let mut libvirtd = Self {
            daemon: None,
            adopted: Adopted::default(),
            netns,
            dir,
        };
        libvirtd.spawn()?;
        Ok(libvirtd)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let d = self.dir.path();
        let _ = std::fs::remove_file(self.socket());
        let _ = std::fs::remove_file(self.pid_file());
        let mut script = String::from("set -e\n");
        for (name, target) in MOUNTS {
            script.push_str(&format!(
                "mkdir -p {target}\nmount --bind {} {target}\n",
                d.join(name).display()
            ));
        }
        script.push_str(&format!(
            "if [ -e /dev/kvm ]; then mount --bind {} /dev/kvm; mount -o remount,bind,ro /dev/kvm; fi\n\
             exec /usr/sbin/libvirtd --pid-file {}\n",
            d.join("kvm-masked").display(),
            self.pid_file().display(),
        ));
        let mut command = match &self.netns {
            Some(netns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", netns.name(), "/usr/bin/unshare"]);
                c
            }
            None => Command::new("/usr/bin/unshare"),
        };
        command
            .args(["--mount", "--propagation", "private", "--"])
            .args(["/usr/bin/tini", "-s", "-g", "--", "/bin/sh", "-c"])
            .arg(script);
        let mut daemon = Daemon::spawn("libvirtd", command, &d.join("libvirtd.log"))?;
        let socket = self.socket();
        wait_until("libvirtd socket", Duration::from_secs(30), || {
            daemon.ensure_running()?;
            Ok(UnixStream::connect(&socket).is_ok())
        })?;
        self.daemon = Some(daemon);
        Ok(())
    }

    fn pid_file(&self) -> PathBuf {
        self.dir.path().join("libvirtd.pid")
    }

    /// The read-write libvirt socket, reachable from outside the daemon's namespace.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("run/libvirt-sock")
    }

    /// `qemu+unix:///system?socket=...`: the only way to reach this daemon.
    pub fn uri(&self) -> String {
        format!("qemu+unix:///system?socket={}", self.socket().display())
    }

    /// The daemon's private directory (its `/var/lib/libvirt` is `dir()/lib`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// libvirtd's stderr log.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("libvirtd.log")
    }

    /// The network namespace's name, when started with [`Libvirtd::start_in_new_netns`].
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_ref().map(NetworkNamespace::name)
    }

    /// `program` to run inside the daemon's network namespace (or as is without one).
    pub fn netns_command(&self, program: &str) -> Command {
        match &self.netns {
            Some(netns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", netns.name(), program]);
                c
            }
            None => Command::new(program),
        }
    }

    /// The pid of libvirtd itself (not of its tini/unshare parents).
    pub fn libvirtd_pid(&self) -> anyhow::Result<u32> {
        let text = std::fs::read_to_string(self.pid_file()).context("read libvirtd pid file")?;
        text.trim().parse().context("parse libvirtd pid file")
    }

    /// SIGSTOPs libvirtd and its children: connections are accepted but never answered.
    /// Guests adopted from an earlier daemon ([`Libvirtd::restart_daemon`]) keep running.
    pub fn pause(&mut self) -> anyhow::Result<()> {
        self.daemon
            .as_mut()
            .context("libvirtd is not running")?
            .pause()
    }

    /// SIGCONTs what [`Libvirtd::pause`] stopped.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        self.daemon
            .as_mut()
            .context("libvirtd is not running")?
            .resume()
    }

    /// Stops libvirtd and starts it again with the same directories (state persists).
    /// Its guests stop too; see [`Libvirtd::restart_daemon`] for a restart that keeps them.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(mut daemon) = self.daemon.take() {
            daemon.stop();
        }
        self.spawn()
    }

    /// Stops libvirtd alone (SIGTERM, as `systemctl restart libvirtd` does) and starts it
    /// again with the same directories; the guests keep running and the new daemon
    /// reconnects to them. See the module docs.
    pub fn restart_daemon(&mut self) -> anyhow::Result<()> {
        let libvirtd = self.libvirtd_pid()?;
        let daemon = self.daemon.as_mut().context("libvirtd is not running")?;
        let root = daemon.pid();
        let before = process_tree(root);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(libvirtd)?),
            nix::sys::signal::Signal::SIGTERM,
        )
        .context("SIGTERM to libvirtd")?;
        // tini exits once libvirtd has; what it leaves is re-parented to this process.
        daemon.wait_for_exit(Duration::from_secs(60))?;
        self.daemon = None;
        let survivors: Vec<u32> = before
            .into_iter()
            .filter(|pid| *pid != root && *pid != libvirtd)
            .collect();
        self.adopted.adopt(&survivors);
        self.spawn()
    }

    /// Processes that outlived an earlier libvirtd and still run (its guests, dnsmasq).
    pub fn adopted(&self) -> Vec<u32> {
        self.adopted.running()
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        // Guests of an earlier daemon first, as `Daemon::stop` stops a daemon's guests
        // before the daemon; then the daemon, before the namespace and directory go.
        self.adopted.stop();
        drop(self.daemon.take());
    }
}
