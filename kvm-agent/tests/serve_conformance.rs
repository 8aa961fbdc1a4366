//! `kvm-agent serve` as a process, against a private libvirtd reached over real SSH:
//! the contract's conformance suite passes every check (instances boot iPXE, which takes
//! a DHCP lease, so they reach RUNNING with an address), the `grpcurl` examples of
//! `docs/kvm-agent.md` work as written, the caller's deadline bounds the agent's libvirt
//! calls, ValidatePlacement reports a host that is not ready, and SIGTERM stops the
//! server.

mod guest_env;

use std::process::Command;
use std::time::Duration;

use egressproxy_integration::eventually::eventually;
use egressproxy_integration::http_server::HttpServer;
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_integration::reference_provider::workspace_binary;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::conformance::{self, Target};
use egressproxy_provider::{ErrorClass, ProviderError, pb};
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};

/// The `grpcurl` commands of the `serve` section of docs/kvm-agent.md, continuation
/// lines joined.
fn documented_grpcurl_commands() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Serving the Provider"))
        .expect("docs/kvm-agent.md has a \"Serving the Provider\" section");
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in section.lines() {
        let line = line.trim();
        if current.is_empty() && !line.starts_with("grpcurl ") {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(start) => current.push_str(start),
            None => {
                current.push_str(line);
                commands.push(std::mem::take(&mut current));
            }
        }
    }
    commands
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvm_agent_serve_passes_the_conformance_suite() {
    let mut guest_host = GuestHost::start();
    let work = tempfile::tempdir().unwrap();
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let config = work.path().join("config.yaml");
    std::fs::write(
        &config,
        guest_host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha),
    )
    .unwrap();
    let mut served = ServedAgent::start(&config).unwrap();

    let mut options = ClientOptions::new(served.endpoint());
    options.call_timeout = Duration::from_secs(90);
    let client = connect_lazy(&options).unwrap();
    let mut target = Target::new(pb::Placement {
        location: None,
        machine_type: "tiny".into(),
        image: "ipxe".into(),
    });
    target.running_timeout = Duration::from_secs(120);
    let report = conformance::run(&options, &target).await.unwrap();
    println!("{report}");
    if !report.passed() {
        println!("{}", guest_host.diagnostics());
    }
    assert!(report.passed(), "{:#?}", report.failures());
    assert_eq!(report.checks.len(), conformance::CHECKS.len(), "{report}");
    // The suite deleted what it made: only the base image and its marker remain.
    assert!(
        guest_host.domains().is_empty(),
        "{:?}",
        guest_host.domains()
    );
    assert_eq!(
        guest_host.pool_files().len(),
        2,
        "{:?}",
        guest_host.pool_files()
    );

    // The documented grpcurl examples, with this test's address and names.
    let grpcurl = egressproxy_integration::tools::bin("grpcurl").unwrap();
    let commands = documented_grpcurl_commands();
    assert!(commands.len() >= 3, "{commands:?}");
    let mut outputs = Vec::new();
    for command in &commands {
        let command = command
            .replacen("grpcurl", &grpcurl.display().to_string(), 1)
            .replace("127.0.0.1:50051", served.address())
            .replace("\"small\"", "\"tiny\"")
            .replace("\"debian-12\"", "\"ipxe\"");
        let out = Command::new("sh").arg("-c").arg(&command).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{command}\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        outputs.push(text);
    }
    let all = outputs.concat();
    assert!(all.contains("egressproxy.provider.v1.Provider"), "{all}");
    assert!(all.contains("\"name\": \"kvm.egressproxy.dev\""), "{all}");
    assert!(all.contains("\"resolved\""), "{all}");
    assert!(all.contains("\"host\": \"hv1\""), "{all}");

    // The caller's deadline (grpc-timeout) bounds the agent's libvirt calls: with the
    // hypervisor frozen, the agent itself answers DEADLINE_EXCEEDED before the caller
    // gives up (its ErrorInfo reason says so; a client-side timeout would have none).
    let mut impatient = ClientOptions::new(served.endpoint());
    impatient.call_timeout = Duration::from_secs(2);
    let impatient = connect_lazy(&impatient).unwrap();
    guest_host.libvirtd.pause().unwrap();
    let started = std::time::Instant::now();
    let err = impatient
        .clone()
        .get_instance(pb::GetInstanceRequest {
            id: "hv1/frozen".into(),
        })
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    guest_host.libvirtd.resume().unwrap();
    let err = ProviderError::from(err);
    assert_eq!(err.class, ErrorClass::DeadlineExceeded, "{err}");
    assert_eq!(err.reason, "LIBVIRT_DEADLINE", "{err}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");

    // ValidatePlacement runs the host check: without the network, the host is not
    // ready, and the answer says what to fix.
    let out = Command::new("virsh")
        .args(["-c", &guest_host.libvirtd.uri(), "net-destroy", "default"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = client
        .clone()
        .validate_placement(pb::ValidatePlacementRequest {
            placement: Some(target.placement.clone()),
        })
        .await
        .unwrap_err();
    let err = ProviderError::from(err);
    assert_eq!(err.class, ErrorClass::Permanent, "{err}");
    assert_eq!(err.reason, "HOST_NOT_READY", "{err}");
    assert!(err.message.contains("virsh net-start default"), "{err}");

    // The documented flags exist (the TLS ones mirror the reference provider's).
    let help = Command::new(workspace_binary("kvm-agent").unwrap())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--config",
        "--listen",
        "--tls-cert",
        "--tls-key",
        "--client-ca",
        "KVM_AGENT_LISTEN",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }

    // SIGTERM: graceful shutdown, exit status 0.
    let pid = served.pid().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = eventually("an exit after SIGTERM", Duration::from_secs(20), || {
        std::future::ready(served.try_wait().unwrap().ok_or("still running"))
    })
    .await;
    assert!(status.success(), "{status:?}");
}
