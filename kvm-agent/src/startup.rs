//! Start-up: the configuration read from its file and checked against the machine the
//! agent runs on, before any layer uses it.
//!
//! [`load_config`], in order:
//! 1. read the file (a missing or unreadable file names its path);
//! 2. [`Config::parse`]: syntax and unknown fields, with line and column;
//! 3. [`check_config`]: [`Config::validate`] (the file alone) and the checks that read the
//!    machine: each SSH host's private key loads, its `known_hosts` file lists the host,
//!    and the image spool directory takes a file. Every problem is reported together,
//!    each with its field, so a bad path fails now and not at the first Create.
//!
//! This sits above the layers, beside [`crate::provider`]: the machine checks borrow the
//! transport's key and `known_hosts` readers, and [`crate::config`] stays a leaf that
//! every layer may read.

use std::path::Path;

use crate::config::Config;
use crate::config::error::{ConfigError, ConfigProblem};
use crate::transport::ssh::{keys, known_hosts};

/// Reads, parses and checks the configuration file at `path` (see the module docs).
pub fn load_config(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::new(vec![ConfigProblem::new(
            "",
            format!(
                "cannot read config file {}: {e}; pass the path of the agent's YAML config",
                path.display()
            ),
        )])
    })?;
    let config = Config::parse(&text)?;
    check_config(&config)?;
    Ok(config)
}

/// [`Config::validate`] and the checks that read the machine, all problems together.
pub fn check_config(config: &Config) -> Result<(), ConfigError> {
    let mut problems = match config.validate() {
        Ok(()) => Vec::new(),
        Err(ConfigError { problems }) => problems,
    };
    problems.extend(machine_problems(config));
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::new(problems))
    }
}

/// What the files the configuration names say about it: keys, `known_hosts`, spool dir.
fn machine_problems(config: &Config) -> Vec<ConfigProblem> {
    let mut problems = Vec::new();
    for (i, host) in config.hosts.iter().enumerate() {
        let Some(ssh) = &host.ssh else {
            continue;
        };
        let at = format!("hosts[{i}].ssh");
        if let Err(e) = keys::load_private_key(&ssh.private_key) {
            problems.push(ConfigProblem::new(format!("{at}.privateKey"), e));
        }
        let Some(path) = ssh
            .known_hosts
            .as_ref()
            .filter(|_| !ssh.insecure_skip_host_key_verification)
        else {
            // Both set, or neither: `Config::validate` names that.
            continue;
        };
        let checked = match ssh.host_and_port() {
            Ok((host, port)) => known_hosts::check_file_lists_host(path, &host, port),
            // The address is reported by `Config::validate`; the file can still be read.
            Err(_) => std::fs::read(path)
                .map(drop)
                .map_err(|e| format!("cannot read known_hosts {}: {e}", path.display())),
        };
        if let Err(e) = checked {
            problems.push(ConfigProblem::new(format!("{at}.knownHosts"), e));
        }
    }
    if let Err(message) = check_spool_dir(config.transport.image_spool_dir.as_deref()) {
        problems.push(ConfigProblem::new("transport.imageSpoolDir", message));
    }
    problems
}

/// The spool directory (`configured`, else the system temp dir) must take a file: an image
/// served without `Content-Length` is staged there, and on a read-only root filesystem
/// without a writable `TMPDIR` every such download would fail.
fn check_spool_dir(configured: Option<&Path>) -> Result<(), String> {
    let (dir, what) = match configured {
        Some(dir) => (dir.to_owned(), String::new()),
        None => (
            std::env::temp_dir(),
            " (the default: the system temp dir, TMPDIR)".to_owned(),
        ),
    };
    // The same unnamed file a download spools to; gone when closed.
    tempfile::tempfile_in(&dir).map(drop).map_err(|e| {
        format!(
            "cannot create a file in {}{what}: {e}; images served without Content-Length are \
             staged there: point transport.imageSpoolDir at a writable directory (e.g. a \
             mounted scratch volume) with room for one image",
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_machine_problems_are_reported_together_with_their_field() {
        let config = Config::parse(
            "hosts:\n\
             - name: a\n  local: true\n  network: n\n  bridge: b\n\
             - name: c\n  ssh: {address: 'c:99999', user: u, privateKey: /nonexistent/key, knownHosts: /nonexistent/kh}\n\
             - name: d\n  ssh: {address: 'd', user: u, privateKey: /nonexistent/key2, knownHosts: /nonexistent/kh2}\n",
        )
        .unwrap();
        // The file alone says nothing about the files it names.
        let alone = config.validate().unwrap_err().to_string();
        assert!(!alone.contains("/nonexistent"), "{alone}");

        let err = check_config(&config).unwrap_err().to_string();
        for field in [
            "hosts[0].bridge",
            "hosts[1].ssh.address",
            "hosts[1].ssh.privateKey",
            "hosts[1].ssh.knownHosts",
            "hosts[2].ssh.privateKey",
            "hosts[2].ssh.knownHosts",
        ] {
            assert!(err.contains(field), "{field} missing from:\n{err}");
        }
        assert!(err.contains("/nonexistent/key"), "{err}");
        assert!(
            err.contains("cannot read known_hosts /nonexistent/kh2"),
            "{err}"
        );
    }

    #[test]
    fn a_spool_dir_that_cannot_take_a_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let config = Config::parse(&format!(
            "hosts: [{{name: here, local: true}}]\ntransport: {{imageSpoolDir: {}}}\n",
            file.join("spool").display()
        ))
        .unwrap();
        config.validate().unwrap();
        let err = check_config(&config).unwrap_err().to_string();
        assert!(err.contains("transport.imageSpoolDir"), "{err}");
        assert!(err.contains("writable directory"), "{err}");
        check_spool_dir(Some(dir.path())).unwrap();
    }

    #[test]
    fn an_unreadable_file_names_its_path() {
        let err = load_config(Path::new("/nonexistent/agent.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot read config file /nonexistent/agent.yaml"),
            "{err}"
        );
    }
}
