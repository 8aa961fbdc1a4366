//! A server binary says `listening on ADDRESS` only once a SIGTERM would stop it
//! gracefully: a SIGTERM sent the moment the line appears ends it with status 0 (calls
//! drained, spans flushed), never by the signal's default action. Kubernetes sends one
//! whenever it stops a pod, however soon after the start. Every server binary of the
//! workspace is tried: the reference provider, `kvm-agent serve` and `kube-provider`.

use std::path::Path;
use std::process::{Command, Stdio};

use egressproxy_integration::process::spawn_listening;
use egressproxy_integration::reference_provider::workspace_binary;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How many starts are stopped at once: one start can miss the window by luck.
const STARTS: usize = 20;

/// Starts the server `command` makes [`STARTS`] times, each time SIGTERMed as soon as it
/// prints `listening on`, and asserts that each start ended with status 0.
fn a_sigterm_right_after_listening_on_stops(what: &str, command: impl Fn() -> Command) {
    for start in 1..=STARTS {
        let mut command = command();
        command.stdin(Stdio::null()).stderr(Stdio::null());
        let (mut child, _address) = spawn_listening(&mut command, what).unwrap();
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        kill(pid, Signal::SIGTERM).unwrap();
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "start {start} of {STARTS}: a SIGTERM just after `listening on` ended {what} with \
             {status}"
        );
    }
}

#[test]
fn a_sigterm_right_after_listening_on_stops_the_reference_provider_gracefully() {
    let binary = workspace_binary("reference-provider").unwrap();
    a_sigterm_right_after_listening_on_stops("reference-provider", || {
        let mut command = Command::new(&binary);
        command.args(["--listen", "127.0.0.1:0"]);
        command
    });
}

#[test]
fn a_sigterm_right_after_listening_on_stops_kvm_agent_serve_gracefully() {
    let binary = workspace_binary("kvm-agent").unwrap();
    let dir = tempfile::tempdir().unwrap();
    // A host whose libvirt is never reached: serving needs no hypervisor until a call.
    let config = write(
        dir.path(),
        "kvm-agent.yaml",
        "hosts:\n- name: hv1\n  local: true\n  libvirtSocket: /nonexistent/libvirt-sock\n\
         machineTypes:\n  small: {vcpus: 1, memoryMiB: 512, diskGiB: 1}\n\
         images:\n  debian-12: {url: 'http://127.0.0.1:9/d.qcow2', guestAgent: preinstalled}\n",
    );
    a_sigterm_right_after_listening_on_stops("kvm-agent serve", || {
        let mut command = Command::new(&binary);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config);
        command
    });
}

#[test]
fn a_sigterm_right_after_listening_on_stops_kube_provider_gracefully() {
    let binary = workspace_binary("kube-provider").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        dir.path(),
        "kube-provider.yaml",
        "namespace: egress\n\
         node_selector: {egressproxy.dev/egress: 'true'}\n\
         machine_types: {small: {requests: {cpu: 100m}}}\n\
         images: {squid: {image: 'localhost/squid:6'}}\n",
    );
    // The client is made from the kubeconfig without a request: no apiserver is needed
    // until a call.
    let kubeconfig = write(
        dir.path(),
        "kubeconfig",
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
         clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n\
         users: [{name: u, user: {token: t}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u}}]\n",
    );
    a_sigterm_right_after_listening_on_stops("kube-provider", || {
        let mut command = Command::new(&binary);
        command
            .arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0"])
            .env("KUBECONFIG", &kubeconfig);
        command
    });
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}
