//! Span export as the standard `OTEL_*` variables say, from a real binary (the reference
//! provider; the operator and kvm-agent share its telemetry set-up) to real receivers:
//! OTLP/HTTP with protobuf, OTLP/HTTP with JSON to a TLS collector whose CA is
//! `OTEL_EXPORTER_OTLP_CERTIFICATE`, and OTLP/gRPC to a TLS collector. The process
//! serves one call, is stopped with SIGTERM (which flushes its spans) and the receiver
//! must hold that call's `grpc.request` span. A protocol the binaries do not speak is
//! refused at start-up, naming the variable.

use std::path::Path;
use std::process::{Command, Stdio};

use egressproxy_integration::certificates::make_certificates;
use egressproxy_integration::e2e::otlp::{ReceivedSpan, SpanReceiver};
use egressproxy_integration::otlp_http::HttpSpanReceiver;
use egressproxy_integration::process::spawn_listening;
use egressproxy_integration::reference_provider::workspace_binary;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb;

/// Runs the reference provider with `env`, makes one call, stops it with SIGTERM and
/// waits until it has exited (its spans flushed).
async fn one_call_exported(env: &[(&str, String)]) {
    let mut command = Command::new(workspace_binary("reference-provider").unwrap());
    command
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    for (name, value) in env {
        command.env(name, value);
    }
    let (child, address) = spawn_listening(&mut command, "reference-provider").unwrap();
    let mut client = connect_lazy(&ClientOptions::new(format!("http://{address}"))).unwrap();
    client
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::task::spawn_blocking(move || {
        let mut child = child;
        child.wait()
    })
    .await
    .unwrap()
    .unwrap();
    assert!(status.success(), "the provider exited with {status}");
}

fn assert_call_span(spans: &[ReceivedSpan]) {
    assert!(
        spans.iter().any(|span| span.service == "reference-provider"
            && span.name == "grpc.request"
            && span.attributes.get("rpc.method").map(String::as_str)
                == Some("/egressproxy.provider.v1.Provider/GetPluginInfo")),
        "the call's span was not received: {spans:#?}"
    );
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap()
}

#[tokio::test]
async fn http_protobuf_reaches_an_otlp_http_collector() {
    let receiver = HttpSpanReceiver::start(None).unwrap();
    one_call_exported(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf".into()),
    ])
    .await;
    assert_call_span(&receiver.spans());
    assert!(
        receiver
            .content_types()
            .iter()
            .all(|kind| kind == "application/x-protobuf"),
        "{:?}",
        receiver.content_types()
    );
}

#[tokio::test]
async fn http_json_reaches_a_tls_collector_whose_ca_is_given() {
    let certs = tempfile::tempdir().unwrap();
    make_certificates(certs.path(), "localhost").unwrap();
    let receiver = HttpSpanReceiver::start(Some((
        read(certs.path(), "server.crt"),
        read(certs.path(), "server.key"),
    )))
    .unwrap();
    let ca = certs.path().join("ca.crt").display().to_string();
    one_call_exported(&[
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            format!("{}/v1/traces", receiver.endpoint()),
        ),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json".into()),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca),
    ])
    .await;
    assert_call_span(&receiver.spans());
    assert!(
        receiver
            .content_types()
            .iter()
            .all(|kind| kind == "application/json"),
        "{:?}",
        receiver.content_types()
    );
}

#[tokio::test]
async fn grpc_reaches_a_tls_collector_whose_ca_is_given() {
    use tonic::transport::{Identity, ServerTlsConfig};

    let certs = tempfile::tempdir().unwrap();
    make_certificates(certs.path(), "localhost").unwrap();
    let tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read(certs.path(), "server.crt"),
        read(certs.path(), "server.key"),
    ));
    let receiver =
        SpanReceiver::start_with_tls(&tokio::runtime::Handle::current(), None, Some(tls)).unwrap();
    let ca = certs.path().join("ca.crt").display().to_string();
    one_call_exported(&[
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("https://localhost:{}", receiver.port()),
        ),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca),
    ])
    .await;
    assert_call_span(&receiver.spans());
}

#[test]
fn a_protocol_the_binaries_do_not_speak_is_refused_naming_the_variable() {
    let child = Command::new(workspace_binary("reference-provider").unwrap())
        .args(["--listen", "127.0.0.1:0"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/thrift")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    let (done, outcome) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    // A binary that accepts the value serves on and never exits by itself.
    let Ok(output) = outcome.recv_timeout(std::time::Duration::from_secs(30)) else {
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        panic!("the provider started with OTEL_EXPORTER_OTLP_PROTOCOL=http/thrift");
    };
    let output = output.unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"http/thrift\""),
        "{stderr}"
    );
}
