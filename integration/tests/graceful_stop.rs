//! A server binary says `listening on ADDRESS` only once a SIGTERM would stop it
//! gracefully: a SIGTERM sent the moment the line appears ends it with status 0 (calls
//! drained, spans flushed), never by the signal's default action. Kubernetes sends one
//! whenever it stops a pod, however soon after the start.

use std::process::{Command, Stdio};

use egressproxy_integration::process::spawn_listening;
use egressproxy_integration::reference_provider::workspace_binary;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How many starts are stopped at once: one start can miss the window by luck.
const STARTS: usize = 20;

#[test]
fn a_sigterm_right_after_listening_on_stops_the_reference_provider_gracefully() {
    for start in 1..=STARTS {
        let mut command = Command::new(workspace_binary("reference-provider").unwrap());
        command
            .args(["--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        let (mut child, _address) = spawn_listening(&mut command, "reference-provider").unwrap();
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        kill(pid, Signal::SIGTERM).unwrap();
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "start {start} of {STARTS}: a SIGTERM just after `listening on` ended the provider \
             with {status}"
        );
    }
}
