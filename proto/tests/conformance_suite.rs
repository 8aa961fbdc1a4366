//! The conformance suite itself, over real TCP: it passes against the reference
//! provider, never deletes an instance it did not create, reports in the documented
//! JSON shape, and fails a provider that breaks a rule, naming the rule.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::conformance::{self, CHECKS, Ledger, Outcome, Selection, Target};
use egressproxy_provider::pb;
use egressproxy_provider::reference::{MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::ProviderServer;

async fn start(config: ReferenceConfig) -> (SocketAddr, MemoryProvider) {
    let provider = MemoryProvider::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = ProviderServer::new(provider.clone());
    tokio::spawn(async move {
        server
            .serve(listener, std::future::pending::<()>())
            .await
            .unwrap()
    });
    (address, provider)
}

fn fast() -> ReferenceConfig {
    ReferenceConfig {
        provisioning_delay: Duration::from_millis(100),
        ..ReferenceConfig::default()
    }
}

fn target() -> Target {
    let mut target = Target::new(pb::Placement {
        location: None,
        machine_type: "small".into(),
        image: "debian-12".into(),
    });
    target.running_timeout = Duration::from_secs(10);
    target.check_timeout = Duration::from_secs(30);
    target
}

fn options(address: SocketAddr) -> ClientOptions {
    let mut options = ClientOptions::new(format!("http://{address}"));
    options.call_timeout = Duration::from_secs(10);
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_passes_against_the_reference_provider_and_nothing_is_left() {
    let (address, provider) = start(fast()).await;
    let report = conformance::run(&options(address), &target())
        .await
        .unwrap();
    println!("{report}");
    assert!(report.passed(), "{}", report.failures().join("\n"));
    assert_eq!(report.checks.len(), CHECKS.len());
    let skipped: Vec<_> = report
        .checks
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Skip(_)))
        .map(|c| c.check.name)
        .collect();
    assert!(skipped.is_empty(), "{skipped:?}");
    assert!(provider.call_counts()["ListInstances"] >= 10);
    let mut client = connect_lazy(&options(address)).unwrap();
    let left = client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(left.instances.is_empty(), "{:?}", left.instances);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suite_never_deletes_an_instance_it_did_not_create() {
    let (address, _provider) = start(fast()).await;
    let mut client = connect_lazy(&options(address)).unwrap();
    let foreign = client
        .create_instance(pb::CreateInstanceRequest {
            key: "someone-elses".into(),
            name: "prod/egress".into(),
            tags: HashMap::from([("egressproxy.dev/cluster".into(), "prod".into())]),
            placement: target().placement.into(),
            cloud_init: None,
            proxy_port: 3128,
        })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    let report = conformance::run(&options(address), &target())
        .await
        .unwrap();
    assert!(report.passed(), "{}", report.failures().join("\n"));
    let still = client
        .get_instance(pb::GetInstanceRequest { id: foreign.id })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    assert_eq!(still.key, "someone-elses");
}

#[tokio::test]
async fn the_json_report_has_the_documented_shape() {
    let (address, _provider) = start(fast()).await;
    let options = options(address);
    let ledger = Ledger::new(connect_lazy(&options).unwrap());
    let selection = Selection {
        run: vec![
            "plugin-info".into(),
            "validate-placement".into(),
            "get-missing".into(),
        ],
        skip: vec!["get-missing".into()],
    };
    let report = conformance::run_with(&options, &target(), &selection, &ledger).await;
    let json = report.to_json();
    assert_eq!(json["schema"], conformance::REPORT_SCHEMA);
    assert_eq!(json["run_id"], ledger.run_id());
    assert_eq!(json["passed"], true);
    assert_eq!(json["summary"]["pass"], 2);
    let checks = json["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["plugin-info", "validate-placement"]);
    for check in checks {
        for key in ["why", "rule", "status", "duration_ms"] {
            assert!(!check[key].is_null(), "{key} missing from {check}");
        }
    }
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/conformance.md"
    ))
    .unwrap();
    assert!(docs.contains(conformance::REPORT_SCHEMA));
    for check in CHECKS {
        assert!(
            docs.contains(&format!("`{}`", check.name)),
            "docs/conformance.md does not describe {}",
            check.name
        );
    }
}

/// Every misbehaviour of the reference provider fails the whole suite, and the
/// failures name the check (and its rule) that the misbehaviour breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_misbehaviour_fails_the_suite_naming_the_broken_rule() {
    use egressproxy_provider::reference::Misbehaviour;
    let runs = Misbehaviour::all().iter().map(|&misbehaviour| async move {
        let (address, _provider) = start(ReferenceConfig {
            misbehave: Some(misbehaviour),
            ..fast()
        })
        .await;
        let report = conformance::run(&options(address), &target())
            .await
            .unwrap();
        (misbehaviour, report)
    });
    let mut missed = Vec::new();
    for (misbehaviour, report) in futures::future::join_all(runs).await {
        let failures = report.failures().join("\n");
        let check = misbehaviour.caught_by();
        let rule = CHECKS.iter().find(|c| c.name == check).unwrap().rule;
        let named = report.failures().iter().any(|f| {
            f.starts_with(&format!("{check}: expected ")) && f.ends_with(&format!("(rule: {rule})"))
        });
        if report.passed() || !named {
            missed.push(format!(
                "{}: {check} did not fail:\n{failures}",
                misbehaviour.name()
            ));
        }
        assert!(
            !failures.contains("Status {"),
            "Rust Debug output in:\n{failures}"
        );
    }
    assert!(missed.is_empty(), "{}", missed.join("\n\n"));
    assert!(Misbehaviour::all().len() >= 15);
}
