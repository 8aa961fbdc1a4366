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
    let misbehave = config.misbehave;
    let provider = MemoryProvider::new(config);
    let (address, _) =
        serve(ProviderServer::new(provider.clone()).with_misbehaviour(misbehave)).await;
    (address, provider)
}

async fn serve(server: ProviderServer) -> (SocketAddr, ()) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        server
            .serve(listener, std::future::pending::<()>())
            .await
            .unwrap()
    });
    (address, ())
}

/// Quick to provision, and DELETING for a moment after Delete, so the suite meets
/// KEY_BEING_DELETED and DELETING instances in List; with a host that has no room, so
/// the suite meets a location a Create must be refused on.
fn fast() -> ReferenceConfig {
    ReferenceConfig {
        provisioning_delay: Duration::from_millis(100),
        deleting_delay: Duration::from_secs(1),
        hosts: vec!["local".into(), "full".into()],
        max_instances: [("full".to_string(), 0)].into(),
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
    // Every instance the run made is deleted: gone, or DELETING for the provider's
    // deleting delay.
    let kept: Vec<&str> = left
        .instances
        .iter()
        .filter(|i| i.state() != pb::InstanceState::Deleting)
        .map(|i| i.id.as_str())
        .collect();
    assert!(kept.is_empty(), "not deleted: {kept:?}");
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
            ..Default::default()
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
}

/// Every check has a broken provider that it must catch.
#[test]
fn every_check_has_a_misbehaviour_it_catches() {
    use egressproxy_provider::reference::Misbehaviour;
    let uncovered: Vec<&str> = CHECKS
        .iter()
        .map(|check| check.name)
        .filter(|name| !Misbehaviour::all().iter().any(|m| m.caught_by() == *name))
        .collect();
    assert!(
        uncovered.is_empty(),
        "checks without a misbehaviour: {uncovered:?}"
    );
    for misbehaviour in Misbehaviour::all() {
        assert!(
            CHECKS.iter().any(|c| c.name == misbehaviour.caught_by()),
            "{} names no check",
            misbehaviour.name()
        );
    }
}

/// `docs/conformance.md` names every misbehaviour beside the check that catches it, so a
/// provider author can read what each check is proven against.
#[test]
fn every_misbehaviour_is_listed_with_its_check_in_the_docs() {
    use egressproxy_provider::reference::Misbehaviour;
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/conformance.md"
    ))
    .unwrap();
    let unlisted: Vec<String> = Misbehaviour::all()
        .iter()
        .filter(|m| {
            let name = format!("`{}`", m.name());
            let check = format!("| `{}` |", m.caught_by());
            !docs.lines().any(|line| {
                line.starts_with("| `") && line.contains(&name) && line.ends_with(&check)
            })
        })
        .map(|m| format!("{} ({})", m.name(), m.caught_by()))
        .collect();
    assert!(
        unlisted.is_empty(),
        "docs/conformance.md's misbehaviour table lacks: {unlisted:?}"
    );
}

/// The two address checks alone, against `config`: their outcomes by name, and the
/// instances left that are not DELETING.
async fn address_checks(config: ReferenceConfig) -> (Vec<(&'static str, Outcome)>, usize) {
    let (address, _provider) = start(config).await;
    let selection = Selection {
        run: vec!["address-identity".into(), "requested-address".into()],
        skip: Vec::new(),
    };
    let ledger = Ledger::new(connect_lazy(&options(address)).unwrap());
    let report = conformance::run_with(&options(address), &target(), &selection, &ledger).await;
    let mut client = connect_lazy(&options(address)).unwrap();
    let left = client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .instances
        .iter()
        .filter(|i| i.state() != pb::InstanceState::Deleting)
        .count();
    let outcomes = report
        .checks
        .into_iter()
        .map(|c| (c.check.name, c.outcome))
        .collect();
    (outcomes, left)
}

/// A provider that offers no address identities (kvm-agent today) passes both address
/// checks by refusing the fields as INVALID_ARGUMENT, and keeps nothing they made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_without_address_identities_passes_by_refusing_the_fields() {
    let (outcomes, left) = address_checks(ReferenceConfig {
        address_identities: false,
        ..fast()
    })
    .await;
    assert_eq!(
        outcomes,
        [
            ("address-identity", Outcome::Pass),
            ("requested-address", Outcome::Pass)
        ]
    );
    assert_eq!(left, 0);
}

/// A provider of a contract from before 1.4.0 does not know the fields and may ignore
/// them: both address checks are skipped, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn address_checks_skip_a_provider_from_before_address_identities() {
    let (outcomes, left) = address_checks(ReferenceConfig {
        contract_version: "1.3.0".into(),
        ..fast()
    })
    .await;
    for (name, outcome) in outcomes {
        assert!(
            matches!(&outcome, Outcome::Skip(why) if why.contains("1.3.0")),
            "{name}: {outcome:?}"
        );
    }
    assert_eq!(left, 0);
}

/// A provider without UpdateInstanceTags (one of a contract before 1.5.0) passes:
/// the call answers UNIMPLEMENTED, as `capabilities-match-behaviour` checks, and the
/// update checks are skipped, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_without_tag_updates_passes_and_the_update_checks_skip() {
    let (address, _provider) = start(ReferenceConfig {
        update_tags: false,
        ..fast()
    })
    .await;
    let updates = [
        "update-tags-replaces",
        "update-tags-compare-and-set",
        "update-tags-concurrent",
        "update-tags-errors",
    ];
    let selection = Selection {
        run: std::iter::once("capabilities-match-behaviour")
            .chain(updates)
            .map(String::from)
            .collect(),
        skip: Vec::new(),
    };
    let ledger = Ledger::new(connect_lazy(&options(address)).unwrap());
    let report = conformance::run_with(&options(address), &target(), &selection, &ledger).await;
    for check in &report.checks {
        if check.check.name == "capabilities-match-behaviour" {
            assert_eq!(check.outcome, Outcome::Pass, "{report}");
        } else {
            assert!(
                matches!(&check.outcome, Outcome::Skip(why) if why.contains("CAPABILITY_UPDATE_TAGS")),
                "{}: {:?}",
                check.check.name,
                check.outcome
            );
        }
    }
    assert_eq!(report.checks.len(), 5);
}

/// Answers the contract calls transient (UNAVAILABLE, UNKNOWN, INTERNAL, ABORTED,
/// CANCELLED) and RESOURCE_EXHAUSTED with a RetryInfo are retried, as callers must: a
/// provider that sends them now and then passes. Before, only some were retried, and
/// RESOURCE_EXHAUSTED on the first Creates failed the capability and foreign-instance
/// checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_callers_retry_are_retried_and_retry_info_is_honoured() {
    use egressproxy_provider::ErrorClass;
    use egressproxy_provider::reference::{Fault, FaultEffect};
    let provider = MemoryProvider::new(fast());
    let flaky = Flaky {
        inner: provider.clone(),
        codes: std::sync::Arc::new(std::sync::Mutex::new(vec![
            tonic::Code::Unknown,
            tonic::Code::Internal,
            tonic::Code::Aborted,
            tonic::Code::Cancelled,
        ])),
    };
    for method in [
        "CreateInstance",
        "GetInstance",
        "ListInstances",
        "DeleteInstance",
    ] {
        provider.faults().inject(Fault {
            method: Some(method.into()),
            remaining: Some(3),
            effect: FaultEffect::Fail(ErrorClass::QuotaExhausted),
            message: "a quota of 10 creates per second".into(),
            retry_after: Some(Duration::from_millis(50)),
        });
    }
    let (address, _) = serve(ProviderServer::new(flaky)).await;
    let report = conformance::run(&options(address), &target())
        .await
        .unwrap();
    assert!(report.passed(), "{}", report.failures().join("\n"));
}

/// The reference provider whose first Creates answer codes outside the contract's
/// table that callers classify as transient, with the contract's details.
#[derive(Clone)]
struct Flaky {
    inner: MemoryProvider,
    codes: std::sync::Arc<std::sync::Mutex<Vec<tonic::Code>>>,
}

#[tonic::async_trait]
impl pb::provider_server::Provider for Flaky {
    async fn get_plugin_info(
        &self,
        request: tonic::Request<pb::GetPluginInfoRequest>,
    ) -> Result<tonic::Response<pb::GetPluginInfoResponse>, tonic::Status> {
        self.inner.get_plugin_info(request).await
    }
    async fn get_capabilities(
        &self,
        request: tonic::Request<pb::GetCapabilitiesRequest>,
    ) -> Result<tonic::Response<pb::GetCapabilitiesResponse>, tonic::Status> {
        self.inner.get_capabilities(request).await
    }
    async fn create_instance(
        &self,
        request: tonic::Request<pb::CreateInstanceRequest>,
    ) -> Result<tonic::Response<pb::CreateInstanceResponse>, tonic::Status> {
        let code = self.codes.lock().unwrap().pop();
        if let Some(code) = code {
            let mut details = tonic_types::ErrorDetails::new();
            details.set_error_info("FLAKY", "egressproxy.dev", HashMap::new());
            return Err(
                <tonic::Status as tonic_types::StatusExt>::with_error_details(
                    code, "a hiccup", details,
                ),
            );
        }
        self.inner.create_instance(request).await
    }
    async fn get_instance(
        &self,
        request: tonic::Request<pb::GetInstanceRequest>,
    ) -> Result<tonic::Response<pb::GetInstanceResponse>, tonic::Status> {
        self.inner.get_instance(request).await
    }
    async fn delete_instance(
        &self,
        request: tonic::Request<pb::DeleteInstanceRequest>,
    ) -> Result<tonic::Response<pb::DeleteInstanceResponse>, tonic::Status> {
        self.inner.delete_instance(request).await
    }
    async fn list_instances(
        &self,
        request: tonic::Request<pb::ListInstancesRequest>,
    ) -> Result<tonic::Response<pb::ListInstancesResponse>, tonic::Status> {
        self.inner.list_instances(request).await
    }
    async fn validate_placement(
        &self,
        request: tonic::Request<pb::ValidatePlacementRequest>,
    ) -> Result<tonic::Response<pb::ValidatePlacementResponse>, tonic::Status> {
        self.inner.validate_placement(request).await
    }
    async fn list_locations(
        &self,
        request: tonic::Request<pb::ListLocationsRequest>,
    ) -> Result<tonic::Response<pb::ListLocationsResponse>, tonic::Status> {
        self.inner.list_locations(request).await
    }
    async fn watch_instances(
        &self,
        request: tonic::Request<pb::WatchInstancesRequest>,
    ) -> Result<tonic::Response<egressproxy_provider::watch::WatchStream>, tonic::Status> {
        self.inner.watch_instances(request).await
    }
    async fn update_instance_tags(
        &self,
        request: tonic::Request<pb::UpdateInstanceTagsRequest>,
    ) -> Result<tonic::Response<pb::UpdateInstanceTagsResponse>, tonic::Status> {
        self.inner.update_instance_tags(request).await
    }
}

/// Told that the provider has no cloud-init, the suite fails one that accepts
/// user-data (the reference provider runs the instance with it), rather than letting a
/// provider ignore user-data silently; and it sends none where it checks other rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cloud_init_accepted_user_data_fails_limits_at_boundary() {
    let (address, _provider) = start(fast()).await;
    let selection = Selection {
        run: vec!["limits-at-boundary".into(), "create-conflict".into()],
        skip: Vec::new(),
    };
    let mut target = target();
    target.cloud_init = false;
    let ledger = Ledger::new(connect_lazy(&options(address)).unwrap());
    let report = conformance::run_with(&options(address), &target, &selection, &ledger).await;
    let outcome = |name: &str| {
        report
            .checks
            .iter()
            .find(|c| c.check.name == name)
            .map(|c| c.outcome.clone())
            .unwrap()
    };
    let Outcome::Fail { expected, .. } = outcome("limits-at-boundary") else {
        panic!("limits-at-boundary passed:\n{report}");
    };
    assert!(expected.contains("without cloud-init"), "{expected}");
    assert!(
        matches!(outcome("create-conflict"), Outcome::Pass),
        "{report}"
    );
}
