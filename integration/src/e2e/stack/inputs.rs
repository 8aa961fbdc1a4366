//! What the input-fault cases of `make faults` add to a running [`Stack`]: an image or a
//! host in the agent's configuration (the agent is restarted to read it), a storage
//! pool on a small tmpfs that a test fills and grows, and another provider in the
//! operator's configuration (which the operator re-reads on its own).
//!
//! Only for a stack whose agent runs from the config files written here (not the chart).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use super::{HOST, OPERATOR_STARTED, Stack};
use crate::e2e::wait_for;
use crate::relay::LoopbackRelay;

/// The operator's log line after it re-read its provider config.
const PROVIDERS_RELOADED: &str = "provider config reloaded";

impl Stack {
    /// Adds image `name` at `url` (qcow2, UEFI, guest agent preinstalled, no `sha256`:
    /// its base is named by the URL) to the agent's configuration; restarts the agent.
    pub async fn add_agent_image(&mut self, name: &str, url: &str) -> anyhow::Result<()> {
        let image = format!(
            "  {name}:\n    url: {url}\n    format: qcow2\n    firmware: uefi\n    \
             guestAgent: preinstalled\n"
        );
        self.insert_into_agent_config("transport:\n", &image)?;
        self.restart_agent().await
    }

    /// Adds host `name`: the same hypervisor, account and keys as [`HOST`], with the
    /// storage pool `pool`; restarts the agent.
    pub async fn add_agent_host(&mut self, name: &str, pool: &str) -> anyhow::Result<()> {
        let config = std::fs::read_to_string(self.agent_config())?;
        let first = config
            .split("machineTypes:\n")
            .next()
            .and_then(|hosts| hosts.split_once(&format!("- name: {HOST}\n")))
            .map(|(_, rest)| rest.to_owned())
            .context("the agent's config has no first host")?;
        let host = format!("- name: {name}\n{first}  storagePool: {pool}\n");
        self.insert_into_agent_config("machineTypes:\n", &host)?;
        self.restart_agent().await
    }

    /// SIGKILLs the agent, starts it again (it reads its configuration anew) and waits
    /// until the new one listens.
    pub async fn restart_agent(&mut self) -> anyhow::Result<()> {
        let log = self.dir().join("kvm-agent.log");
        let written = std::fs::read(&log).map(|text| text.len()).unwrap_or(0);
        self.kill_agent();
        self.start_agent().await?;
        // The log is appended to: the old agent's "listening on" is already in it.
        wait_for_log_line(
            &log,
            written,
            "listening on",
            "the restarted agent to listen",
        )
        .await;
        Ok(())
    }

    fn insert_into_agent_config(&self, before: &str, text: &str) -> anyhow::Result<()> {
        if self.release.is_some() {
            bail!("the chart's agent reads its config from the release, not from a file here");
        }
        let path = self.agent_config();
        let config = std::fs::read_to_string(&path)?;
        let at = config
            .find(before)
            .with_context(|| format!("no {before:?} in the agent's config"))?;
        std::fs::write(&path, format!("{}{text}{}", &config[..at], &config[at..]))?;
        Ok(())
    }

    /// A libvirt dir pool `name` on a tmpfs of `size_mib` MiB, inside libvirtd's
    /// directory and mounted in libvirtd's own mount namespace (where its volumes are
    /// written); unmounted when the returned [`TmpfsPool`] drops.
    pub fn add_tmpfs_pool(&self, name: &str, size_mib: u64) -> anyhow::Result<TmpfsPool> {
        let dir = self.libvirtd.dir().join(name);
        std::fs::create_dir_all(&dir)?;
        let pool = TmpfsPool {
            libvirtd: self.libvirtd.libvirtd_pid()?,
            dir: dir.clone(),
            name: name.to_owned(),
        };
        run(pool
            .in_namespace("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_mib}m,mode=0755")])
            .arg(format!("tmpfs-{name}"))
            .arg(&dir))?;
        let target = dir.display().to_string();
        self.virsh(&["pool-define-as", name, "dir", "--target", &target])?;
        self.virsh(&["pool-start", name])?;
        Ok(pool)
    }

    /// Adds provider `name` at `127.0.0.1:port` (relayed into the namespace) to the
    /// operator's configuration, and waits until the operator has re-read it.
    pub async fn add_provider(&mut self, name: &str, port: u16) -> anyhow::Result<()> {
        let handle = self
            .runtime
            .as_ref()
            .context("the stack's runtime")?
            .handle()
            .clone();
        self.relays
            .push(LoopbackRelay::start(&handle, self.netns(), port)?);
        // An operator that has not read its config yet would take the new text as its
        // first and never log a reload: wait until the latest one has started.
        let log = self.dir().join("operator.log");
        wait_for_log_line(
            &log,
            self.operator_log_from,
            OPERATOR_STARTED,
            "the operator to read its provider config",
        )
        .await;
        let path = self.providers_config();
        let mut config = std::fs::read_to_string(&path)?;
        config.push_str(&format!(
            "  {name}:\n    endpoint: http://127.0.0.1:{port}\n    callTimeout: 60s\n"
        ));
        std::fs::write(&path, config)?;
        let quoted = format!("\"{name}\"");
        wait_for(
            &format!("the operator to read provider {name}"),
            Duration::from_secs(60),
            || {
                std::fs::read_to_string(&log).is_ok_and(|text| {
                    text.lines()
                        .any(|l| l.contains(PROVIDERS_RELOADED) && l.contains(&quoted))
                })
            },
        )
        .await;
        Ok(())
    }
}

/// Waits (up to 2 minutes) until `log`, past its first `from` bytes (what earlier
/// processes appended), contains `line`.
async fn wait_for_log_line(log: &Path, from: usize, line: &str, what: &str) {
    wait_for(what, Duration::from_secs(120), || {
        std::fs::read(log).is_ok_and(|text| {
            String::from_utf8_lossy(text.get(from..).unwrap_or_default()).contains(line)
        })
    })
    .await;
}

/// A storage pool on its own tmpfs; see [`Stack::add_tmpfs_pool`].
#[derive(Debug)]
pub struct TmpfsPool {
    libvirtd: u32,
    dir: PathBuf,
    name: String,
}

impl TmpfsPool {
    /// The pool's directory as libvirtd sees it (through `/proc/PID/root`: the tmpfs
    /// is mounted in libvirtd's mount namespace only).
    pub fn dir(&self) -> PathBuf {
        Path::new(&format!("/proc/{}/root", self.libvirtd))
            .join(self.dir.strip_prefix("/").unwrap_or(&self.dir))
    }

    /// The pool's libvirt name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Resizes the tmpfs to `size_mib` MiB (`mount -o remount,size=`).
    pub fn resize(&self, size_mib: u64) -> anyhow::Result<()> {
        run(self
            .in_namespace("mount")
            .args(["-o", &format!("remount,size={size_mib}m")])
            .arg(&self.dir))
    }

    /// `program` in libvirtd's mount namespace.
    fn in_namespace(&self, program: &str) -> Command {
        let mut command = Command::new("nsenter");
        command
            .args(["-t", &self.libvirtd.to_string(), "-m", "--"])
            .arg(program);
        command
    }
}

impl Drop for TmpfsPool {
    fn drop(&mut self) {
        // The pool stays defined (an empty directory once unmounted), so the agent's
        // host check still passes; libvirtd's tear-down removes both.
        let _ = run(self.in_namespace("umount").arg("--lazy").arg(&self.dir));
    }
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let out = command.output()?;
    if !out.status.success() {
        bail!(
            "{command:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
