//! Host key verification is on unless a host's config turns it off by name: an SSH host
//! written without `knownHosts` and without `insecureSkipHostKeyVerification` is a
//! config error naming `knownHosts`, and even a pool built from such a config without
//! validation never completes a connection to a real sshd.
//!
//! The refusals of unknown and changed keys themselves are in `ssh_transport.rs`.
//!
//! Needs root (a private sshd) and `integration/tools/install-system-packages.sh`.

mod common;

use std::time::Duration;

use common::*;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::config::Config;
use kvm_agent::error::{Error, ErrorClass, TransportError};
use kvm_agent::transport::pool::Pool;

/// A config as a user would write it, with no word about host keys.
fn config_without_host_key_settings(sshd: &Sshd, dir: &std::path::Path) -> String {
    format!(
        "hosts:\n\
         - name: hv-default\n  \
           ssh:\n    address: \"{}\"\n    user: {}\n    privateKey: {}\n  \
           libvirtSocket: {}\n\
         machineTypes:\n  small: {{vcpus: 1, memoryMiB: 512, diskGiB: 4}}\n\
         images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
        sshd.address(),
        sshd.user(),
        sshd.client_key().display(),
        dir.join("libvirt-sock").display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_keys_are_verified_unless_turned_off_by_name() {
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = config_without_host_key_settings(&sshd, dir.path());

    let path = dir.path().join("config.yaml");
    std::fs::write(&path, &text).unwrap();
    let problems = kvm_agent::startup::load_config(&path)
        .unwrap_err()
        .to_string();
    assert!(
        problems.contains("hosts[0].ssh.knownHosts") && problems.contains("missing"),
        "{problems}"
    );

    let parsed = Config::parse(&text).unwrap();
    let ssh = parsed.hosts[0].ssh.as_ref().unwrap();
    assert!(!ssh.insecure_skip_host_key_verification);
    assert_eq!(ssh.known_hosts, None);

    // Without validation, the pool still verifies (against no keys at all) and refuses.
    let mut unvalidated = parsed;
    unvalidated.transport = test_transport();
    let pool = Pool::new(&unvalidated).unwrap();
    let refused = pool
        .host("hv-default")
        .unwrap()
        .lib_version(deadline_in(Duration::from_secs(20)))
        .await;
    let error = Error::from(refused.expect_err("connected to a host whose key was never checked"));
    assert!(
        matches!(
            error,
            Error::Transport(TransportError::HostKeyUnknown { .. })
        ),
        "{error:?}"
    );
    assert_eq!(error.class(), ErrorClass::Permanent);
    assert!(error.to_string().contains("hv-default"), "{error}");
}
