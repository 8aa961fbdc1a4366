//! The `reference-provider` binary as a user meets it: fault injection (its
//! `egressproxy.reference.v1.ControlService`) is served only with `--fault-injection`,
//! so an example provider left running cannot be broken by anyone who reaches its port.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use egressproxy_provider::pb::reference::v1::{
    ClearFaultsRequest, control_service_client::ControlServiceClient,
};

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the binary with `args`; returns it and its `http://` endpoint.
fn start(args: &[&str]) -> (Running, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_reference-provider"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let address = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_owned();
    (Running(child), format!("http://{address}"))
}

async fn clear_faults(endpoint: String) -> Result<(), tonic::Status> {
    let mut control = ControlServiceClient::connect(endpoint).await.unwrap();
    control
        .clear_faults(ClearFaultsRequest {})
        .await
        .map(|_| ())
}

#[tokio::test]
async fn fault_injection_is_off_unless_asked_for() {
    let (_plain, endpoint) = start(&[]);
    let status = clear_faults(endpoint).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");

    let (_testing, endpoint) = start(&["--fault-injection"]);
    clear_faults(endpoint).await.unwrap();
}
