//! A throw-away system account for the agent's SSH login, as `docs/kvm-agent.md`'s
//! "Preparing a hypervisor" creates one, under a name unique to this run so that
//! concurrent tests (which use the documented name) are not disturbed.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

/// A system user with a home directory and one authorised key; deleted on drop.
#[derive(Debug)]
pub struct SystemUser {
    name: String,
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("run {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Whether an account named `name` exists.
pub fn user_exists(name: &str) -> bool {
    Command::new("getent")
        .args(["passwd", name])
        .output()
        .is_ok_and(|out| out.status.success())
}

impl SystemUser {
    /// Creates `name` in the `libvirt` group, with `public_key` in its
    /// `~/.ssh/authorized_keys`.
    pub fn create(name: &str, public_key: &Path) -> anyhow::Result<Self> {
        if user_exists(name) {
            bail!("user {name} already exists: pick another name or remove it (userdel -r {name})");
        }
        run(
            "useradd",
            &[
                "--system",
                "--create-home",
                "--shell",
                "/bin/sh",
                "--groups",
                "libvirt",
                name,
            ],
        )?;
        let user = Self {
            name: name.to_owned(),
        };
        let ssh = Path::new("/home").join(name).join(".ssh");
        std::fs::create_dir_all(&ssh)?;
        std::fs::copy(public_key, ssh.join("authorized_keys"))?;
        run(
            "chown",
            &["-R", &format!("{name}:"), &ssh.display().to_string()],
        )?;
        run("chmod", &["700", &ssh.display().to_string()])?;
        Ok(user)
    }

    /// The account's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for SystemUser {
    fn drop(&mut self) {
        // Exit status 12 only means there was no mail spool to remove.
        let _ = Command::new("userdel").args(["-r", &self.name]).output();
        let _ = Command::new("groupdel").arg(&self.name).output();
    }
}
