//! Child daemons for fixtures: spawn, signal a whole process tree, stop for good.
//!
//! Daemons such as sshd and libvirtd fork helpers (a per-connection sshd, QEMU probes) that
//! leave the daemon's process group, so pausing or killing only the daemon's pid would miss
//! them. [`Daemon`] walks `/proc` for every descendant of its child instead.
//!
//! Guarantees:
//! 1. Dropping a [`Daemon`] (also while unwinding from a panic) resumes the tree if it was
//!    paused, sends SIGTERM to the descendants and lets their parents reap them, then to
//!    the daemon, waits up to 5 s, SIGKILLs what is left and reaps the child. No zombies
//!    are left behind (PID 1 here does not reap orphans).
//! 2. [`Daemon::pause`] stops every process of the tree (SIGSTOP); [`Daemon::resume`] continues
//!    them. A paused daemon accepts TCP or unix connections in the kernel's backlog but never
//!    answers: exactly what a hung host looks like to a client.
//! 3. Processes a daemon leaves running when it exits on purpose (the guests of a libvirtd
//!    that is restarted alone) are re-parented to this process; [`Adopted`] reaps each the
//!    moment it exits (a zombie would look alive to whoever kills it, and libvirtd waits
//!    for a killed guest to vanish) and stops those still running when dropped.
//! 4. [`Daemon::kill_frozen`] stops the daemon (SIGSTOP) before it looks for descendants,
//!    so a listener cannot fork one more session between the walk and its own end, then
//!    SIGKILLs the frozen tree: nothing the old daemon accepted outlives it. A restart
//!    whose test reads the daemon's log needs that; the graceful [`Daemon::stop`] lets the
//!    root run while its descendants go.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A spawned daemon and its log file; stopped on drop.
#[derive(Debug)]
pub struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    paused: bool,
}

impl Daemon {
    /// Spawns `command` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut command: Command, log: &Path) -> anyhow::Result<Self> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("open {name} log {}", log.display()))?;
        let err = out.try_clone()?;
        // Orphans of the daemon's tree are re-parented to this process instead of PID 1,
        // which does not reap them here, so `stop` can reap them.
        nix::sys::prctl::set_child_subreaper(true).context("become a child subreaper")?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = command
            .spawn()
            .with_context(|| format!("spawn {name} ({command:?})"))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
            log: log.to_owned(),
            paused: false,
        })
    }

    /// The pid of the spawned process (the root of the tree).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The daemon's log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Fails with the log's tail if the daemon has exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        let Some(child) = self.child.as_mut() else {
            bail!("{} was stopped", self.name);
        };
        if let Some(status) = child.try_wait()? {
            bail!(
                "{} exited with {status}; log {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail(30)
            );
        }
        Ok(())
    }

    /// SIGSTOPs the daemon and all its descendants.
    pub fn pause(&mut self) -> anyhow::Result<()> {
        signal_tree(self.pid(), Signal::SIGSTOP)?;
        self.paused = true;
        Ok(())
    }

    /// SIGCONTs the daemon and all its descendants.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        signal_tree(self.pid(), Signal::SIGCONT)?;
        self.paused = false;
        Ok(())
    }

    /// Waits up to `within` for the daemon to exit on its own (after a signal to one of its
    /// processes, say) and reaps it; its descendants are left alone (they are re-parented
    /// to this process). Fails, leaving the daemon to [`Daemon::stop`], when it still runs.
    pub fn wait_for_exit(&mut self, within: Duration) -> anyhow::Result<()> {
        let child = self.child.as_mut().context("the daemon was stopped")?;
        let deadline = Instant::now() + within;
        while child.try_wait()?.is_none() {
            if Instant::now() >= deadline {
                bail!("{} still runs after {within:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = None;
        Ok(())
    }

    /// Terminates the whole tree and reaps the child; idempotent.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        let tree = process_tree(pid);
        if self.paused {
            send_all(&tree, Signal::SIGCONT);
        }
        // Descendants first, deepest first, and wait until their parents have reaped them:
        // PID 1 on these machines does not reap orphans, so a child that outlives its
        // parent stays a zombie for good. libvirtd with running guests can take several
        // seconds to exit.
        let descendants: Vec<u32> = tree[1..].iter().rev().copied().collect();
        send_all(&descendants, Signal::SIGTERM);
        wait_until_reaped(&descendants, Duration::from_secs(10));
        send_all(&tree[..1], Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            reap_orphans(&descendants);
            if matches!(child.try_wait(), Ok(Some(_))) && tree[1..].iter().all(|p| !exists(*p)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Still the same order: SIGKILL the descendants and give their parents the chance to
        // reap them before the root goes.
        let mut rest: Vec<u32> = process_tree(pid)[1..].to_vec();
        rest.extend(&descendants);
        send_all(&rest, Signal::SIGKILL);
        wait_until_reaped(&rest, Duration::from_secs(2));
        send_all(&[pid], Signal::SIGKILL);
        let _ = child.wait();
        wait_until_reaped(&rest, Duration::from_secs(2));
    }
}

/// Processes this process adopted as their child subreaper; see the module docs.
#[derive(Debug, Default)]
pub struct Adopted {
    pids: Vec<u32>,
    reapers: Vec<std::thread::JoinHandle<()>>,
}

impl Adopted {
    /// Adopts those of `candidates` that run as children of this process (re-parented to
    /// it after their parent exited): each gets a thread that reaps it once it exits.
    pub fn adopt(&mut self, candidates: &[u32]) {
        let me = std::process::id();
        for pid in candidates {
            if parent_pid(*pid) != Some(me) {
                continue;
            }
            let Ok(target) = to_pid(*pid) else { continue };
            self.pids.push(*pid);
            self.reapers.push(std::thread::spawn(move || {
                let _ = nix::sys::wait::waitpid(target, None);
            }));
        }
    }

    /// The adopted processes that still run.
    pub fn running(&self) -> Vec<u32> {
        self.pids.iter().copied().filter(|p| exists(*p)).collect()
    }

    /// SIGTERMs every adopted process tree, SIGKILLs what is left after 10 s, and waits
    /// until each is reaped; idempotent.
    pub fn stop(&mut self) {
        let trees: Vec<u32> = self.pids.iter().flat_map(|p| process_tree(*p)).collect();
        send_all(&trees, Signal::SIGTERM);
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until && self.pids.iter().any(|p| exists(*p)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        send_all(&trees, Signal::SIGKILL);
        for reaper in self.reapers.drain(..) {
            let _ = reaper.join();
        }
        // Their own children (dnsmasq's lease helper) may have been orphaned to us too.
        wait_until_reaped(&trees, Duration::from_secs(5));
        self.pids.clear();
    }
}

impl Drop for Adopted {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reaps those of `pids` that were orphaned to this process (a child subreaper, see
/// `Daemon::spawn`) and have exited. `WNOHANG`: a pid that is not our child, or still
/// runs, is left alone at once.
fn reap_orphans(pids: &[u32]) {
    use nix::sys::wait::{WaitPidFlag, waitpid};
    for pid in pids {
        let _ = waitpid(Pid::from_raw(*pid as i32), Some(WaitPidFlag::WNOHANG));
    }
}

/// Waits up to `within` until none of `pids` (already signalled) is left, reaping those
/// that were orphaned to this process as they exit.
pub fn reap(pids: &[u32], within: Duration) {
    wait_until_reaped(pids, within);
}

/// Polls until none of `pids` has a `/proc` entry any more (reaping those orphaned to
/// this process), or `within` has passed.
fn wait_until_reaped(pids: &[u32], within: Duration) {
    let until = Instant::now() + within;
    loop {
        reap_orphans(pids);
        if Instant::now() >= until || !pids.iter().any(|p| exists(*p)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Daemon {
    /// Freezes the whole tree, the root first, and SIGKILLs it; reaps every process of
    /// it. Idempotent; see the module docs.
    pub fn kill_frozen(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        // A stopped root forks nothing more; each round stops the children found so far
        // and waits until they are stopped, so the next walk sees every fork they made.
        let mut tree = vec![pid];
        send_all(&tree, Signal::SIGSTOP);
        wait_until_stopped(&tree, Duration::from_secs(5));
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let walked = process_tree(pid);
            if walked == tree {
                break;
            }
            send_all(&walked, Signal::SIGSTOP);
            wait_until_stopped(&walked, Duration::from_secs(5));
            tree = walked;
            if Instant::now() >= until {
                // Still forking after that long: kill what the last walk found too.
                eprintln!(
                    "{}: its process tree did not settle; killing it as it is",
                    self.name
                );
                tree.extend(process_tree(pid));
                break;
            }
        }
        send_all(&tree, Signal::SIGKILL);
        let _ = child.wait();
        // The descendants were orphaned to this process (a child subreaper) as their
        // parents died.
        wait_until_reaped(&tree[1..], Duration::from_secs(5));
        self.paused = false;
    }
}

/// Polls until each of `pids` is stopped, a zombie or gone, or `within` has passed.
fn wait_until_stopped(pids: &[u32], within: Duration) {
    let until = Instant::now() + within;
    while Instant::now() < until && !pids.iter().all(|p| stopped_or_gone(*p)) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn stopped_or_gone(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // The state follows the parenthesised command name.
    let state = stat
        .rfind(')')
        .and_then(|end| stat[end + 1..].split_whitespace().next());
    matches!(state, None | Some("T" | "t" | "Z" | "X"))
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `pid` and all its descendants, parents first.
pub fn process_tree(pid: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(ppid) = parent_pid(child) {
                parent_of.push((child, ppid));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parent_of
                .iter()
                .filter(|(_, ppid)| *ppid == parent)
                .map(|(child, _)| *child),
        );
        i += 1;
    }
    tree
}

fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is parenthesised and may contain spaces or ')'.
    let after_name = &stat[stat.rfind(')')? + 2..];
    after_name.split(' ').nth(1)?.parse().ok()
}

fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Sends `signal` to `pid` and every descendant.
pub fn signal_tree(pid: u32, signal: Signal) -> anyhow::Result<()> {
    let tree = process_tree(pid);
    kill(to_pid(pid)?, signal).with_context(|| format!("{signal} to {pid}"))?;
    send_all(&tree[1..], signal);
    Ok(())
}

fn send_all(pids: &[u32], signal: Signal) {
    for pid in pids {
        if let Ok(pid) = to_pid(*pid) {
            // A descendant may have exited since the walk; that is fine.
            let _ = kill(pid, signal);
        }
    }
}

fn to_pid(pid: u32) -> anyhow::Result<Pid> {
    Ok(Pid::from_raw(
        i32::try_from(pid).context("pid out of range")?,
    ))
}

/// Polls `ready` every 20 ms until it returns `Ok(true)` or `timeout` passes.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Spawns a server `command` that prints `listening on ADDRESS` as its first stdout line
/// (the reference provider, `kvm-agent serve`, the Python example provider) and returns
/// the child with that address. A thread keeps draining stdout afterwards, so the
/// server never meets a closed pipe; the first line must come within 30 s, and a
/// server that prints anything else is killed and reported as `what`.
pub fn spawn_listening(command: &mut Command, what: &str) -> anyhow::Result<(Child, String)> {
    use std::io::{BufRead, BufReader};
    let mut child = command
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {what}"))?;
    let stdout = child.stdout.take().context("the server's stdout")?;
    let (first_line, line) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let _ = first_line.send(lines.next().and_then(Result::ok).unwrap_or_default());
        for _ in lines {}
    });
    let line = line
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_default();
    let Some(address) = line.trim().strip_prefix("listening on ") else {
        let _ = child.kill();
        let _ = child.wait();
        bail!("{what} did not start (first line: {line:?}); see its stderr above");
    };
    Ok((child, address.to_owned()))
}

/// The processes whose command line contains `path` (a fixture's directory): what of a
/// stopped fixture still runs.
pub fn processes_mentioning(path: &Path) -> Vec<(u32, String)> {
    let needle = path.display().to_string();
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if text.contains(&needle) {
            found.push((pid, text.trim().to_owned()));
        }
    }
    found
}
