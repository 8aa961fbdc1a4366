//! A user's first debugging session, with the real grpcurl against the real
//! reference-provider binary: list and describe through server reflection, check
//! health, and a Create/Get/Delete round trip.

use std::process::Output;

use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_integration::tools;

fn grpcurl(provider: &ReferenceProvider, args: &[&str]) -> Output {
    let grpcurl = tools::bin("grpcurl").expect("grpcurl installed");
    let mut command = std::process::Command::new(grpcurl);
    command.arg("-plaintext").arg("-max-time").arg("10");
    // Everything before the address is a flag; `-d` data and the method follow it.
    let (flags, rest) = match args.iter().position(|a| *a == "@ADDR") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    command.args(flags).arg(provider.address()).args(rest);
    command.output().expect("run grpcurl")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "grpcurl failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

#[test]
fn list_shows_provider_health_and_reflection_services() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let listed = stdout(&grpcurl(&provider, &["@ADDR", "list"]));
    let mut services: Vec<&str> = listed.lines().collect();
    services.sort();
    assert_eq!(
        services,
        [
            "egressproxy.provider.v1.Provider",
            "egressproxy.reference.v1.ControlService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    );
}

#[test]
fn describe_shows_methods_and_messages() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let service = stdout(&grpcurl(
        &provider,
        &["@ADDR", "describe", "egressproxy.provider.v1.Provider"],
    ));
    for method in [
        "GetPluginInfo",
        "GetCapabilities",
        "CreateInstance",
        "GetInstance",
        "DeleteInstance",
        "ListInstances",
        "ValidatePlacement",
    ] {
        assert!(
            service.contains(&format!("rpc {method} (")),
            "{method} missing from:\n{service}"
        );
    }
    let message = stdout(&grpcurl(
        &provider,
        &[
            "@ADDR",
            "describe",
            "egressproxy.provider.v1.CreateInstanceRequest",
        ],
    ));
    for field in [
        "string key = 1;",
        "map<string, string> tags = 3;",
        ".egressproxy.provider.v1.Placement placement = 4;",
        "uint32 proxy_port = 6;",
    ] {
        assert!(message.contains(field), "{field} missing from:\n{message}");
    }
}

#[test]
fn health_check_answers_serving() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let request = r#"{"service": "egressproxy.provider.v1.Provider"}"#;
    let answer = stdout(&grpcurl(
        &provider,
        &["-d", request, "@ADDR", "grpc.health.v1.Health/Check"],
    ));
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["status"], "SERVING");
}

#[test]
fn create_get_delete_round_trip() {
    let provider = ReferenceProvider::start(&["--provisioning-delay", "0s"]).unwrap();
    let create = r#"{
        "key": "grpcurl-round-trip",
        "name": "default/egress",
        "tags": {"egressproxy.dev/cluster": "test"},
        "placement": {"machineType": "small", "image": "debian-12"},
        "cloudInit": {"userData": "I2Nsb3VkLWNvbmZpZwo="},
        "proxyPort": 3128
    }"#;
    let created = stdout(&grpcurl(
        &provider,
        &[
            "-d",
            create,
            "@ADDR",
            "egressproxy.provider.v1.Provider/CreateInstance",
        ],
    ));
    let created: serde_json::Value = serde_json::from_str(&created).unwrap();
    let id = created["instance"]["id"]
        .as_str()
        .expect("created instance has an id")
        .to_owned();
    assert_eq!(created["instance"]["placement"]["host"], "local");

    let again = stdout(&grpcurl(
        &provider,
        &[
            "-d",
            create,
            "@ADDR",
            "egressproxy.provider.v1.Provider/CreateInstance",
        ],
    ));
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(
        again["instance"]["id"],
        id.as_str(),
        "create is idempotent on the key"
    );

    let get = format!(r#"{{"id": "{id}"}}"#);
    let got = stdout(&grpcurl(
        &provider,
        &[
            "-d",
            &get,
            "@ADDR",
            "egressproxy.provider.v1.Provider/GetInstance",
        ],
    ));
    let got: serde_json::Value = serde_json::from_str(&got).unwrap();
    assert_eq!(got["instance"]["state"], "INSTANCE_STATE_RUNNING");
    assert_eq!(got["instance"]["addresses"][0]["address"], "127.0.0.1");
    assert_eq!(got["instance"]["tags"]["egressproxy.dev/cluster"], "test");

    stdout(&grpcurl(
        &provider,
        &[
            "-d",
            &get,
            "@ADDR",
            "egressproxy.provider.v1.Provider/DeleteInstance",
        ],
    ));
    let missing = grpcurl(
        &provider,
        &[
            "-d",
            &get,
            "@ADDR",
            "egressproxy.provider.v1.Provider/GetInstance",
        ],
    );
    assert!(!missing.status.success());
    let error = String::from_utf8_lossy(&missing.stderr);
    assert!(error.contains("NotFound"), "{error}");
    stdout(&grpcurl(
        &provider,
        &[
            "-d",
            &get,
            "@ADDR",
            "egressproxy.provider.v1.Provider/DeleteInstance",
        ],
    ));
}

#[test]
fn an_invalid_create_names_the_field() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let create = r#"{"key": "k", "placement": {"machineType": "huge", "image": "debian-12"}, "proxyPort": 3128}"#;
    let output = grpcurl(
        &provider,
        &[
            "-d",
            create,
            "@ADDR",
            "egressproxy.provider.v1.Provider/CreateInstance",
        ],
    );
    assert!(!output.status.success());
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(error.contains("InvalidArgument"), "{error}");
    assert!(
        error.contains("placement.machine_type") && error.contains("small, medium"),
        "{error}"
    );
}

/// Reflection serves `google/rpc/error_details.proto`, so grpcurl decodes the error
/// details instead of printing "google.rpc.ErrorInfo is not recognized".
#[test]
fn error_details_show_the_reason_and_the_field_violations() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let create = r#"{"key": "k", "placement": {"machineType": "huge", "image": "debian-12"}, "proxyPort": 3128}"#;
    let output = grpcurl(
        &provider,
        &[
            "-d",
            create,
            "@ADDR",
            "egressproxy.provider.v1.Provider/CreateInstance",
        ],
    );
    assert!(!output.status.success());
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(!error.contains("not recognized"), "{error}");
    for expected in [
        "type.googleapis.com/google.rpc.ErrorInfo",
        r#""reason": "INVALID_ARGUMENT""#,
        r#""domain": "egressproxy.dev""#,
        "type.googleapis.com/google.rpc.BadRequest",
        r#""field": "placement.machine_type""#,
    ] {
        assert!(
            error.contains(expected),
            "{expected} missing from:\n{error}"
        );
    }
    let files = stdout(&grpcurl(
        &provider,
        &["@ADDR", "describe", "google.rpc.Status"],
    ));
    assert!(files.contains("google.rpc.Status is a message"), "{files}");
}

#[test]
fn documented_fault_injection_works_through_grpcurl() {
    // The examples in docs/writing-a-provider.md.
    let provider = ReferenceProvider::start(&[]).unwrap();
    let inject = r#"{"method":"CreateInstance","count":2,"fail":"ERROR_CLASS_TRANSIENT"}"#;
    stdout(&grpcurl(
        &provider,
        &[
            "-d",
            inject,
            "@ADDR",
            "egressproxy.reference.v1.ControlService/InjectFault",
        ],
    ));
    let create =
        r#"{"key":"k1","placement":{"machineType":"small","image":"debian-12"},"proxyPort":3128}"#;
    for _ in 0..2 {
        let failed = grpcurl(
            &provider,
            &[
                "-d",
                create,
                "@ADDR",
                "egressproxy.provider.v1.Provider/CreateInstance",
            ],
        );
        let error = String::from_utf8_lossy(&failed.stderr);
        assert!(
            !failed.status.success() && error.contains("Unavailable"),
            "{error}"
        );
    }
    stdout(&grpcurl(
        &provider,
        &[
            "-d",
            create,
            "@ADDR",
            "egressproxy.provider.v1.Provider/CreateInstance",
        ],
    ));

    let hang = r#"{"method":"GetInstance","hang":true}"#;
    stdout(&grpcurl(
        &provider,
        &[
            "-d",
            hang,
            "@ADDR",
            "egressproxy.reference.v1.ControlService/InjectFault",
        ],
    ));
    let latency = r#"{"latency":"2s"}"#;
    stdout(&grpcurl(
        &provider,
        &[
            "-d",
            latency,
            "@ADDR",
            "egressproxy.reference.v1.ControlService/InjectFault",
        ],
    ));
    let hung = grpcurl(
        &provider,
        &[
            "-max-time",
            "1",
            "-d",
            r#"{"id":"x"}"#,
            "@ADDR",
            "egressproxy.provider.v1.Provider/GetInstance",
        ],
    );
    let error = String::from_utf8_lossy(&hung.stderr);
    assert!(
        !hung.status.success() && error.contains("DeadlineExceeded"),
        "a hung GetInstance must time out: {error}"
    );
    let started = std::time::Instant::now();
    stdout(&grpcurl(
        &provider,
        &["@ADDR", "egressproxy.provider.v1.Provider/GetPluginInfo"],
    ));
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(2),
        "the latency fault delays other calls"
    );
    stdout(&grpcurl(
        &provider,
        &[
            "@ADDR",
            "egressproxy.reference.v1.ControlService/ClearFaults",
        ],
    ));
    let missing = grpcurl(
        &provider,
        &[
            "-d",
            r#"{"id":"x"}"#,
            "@ADDR",
            "egressproxy.provider.v1.Provider/GetInstance",
        ],
    );
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("NotFound"),
        "faults cleared"
    );
}
