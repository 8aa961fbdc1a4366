//! The conformance suite: the contract's guarantees, checked against a live provider
//! (like CSI's `csi-sanity`). Every provider runs it in its tests; the
//! `provider-conformance` binary runs it against any endpoint.
//!
//! The suite creates instances tagged `egressproxy.dev/conformance=<run id>` and
//! deletes them before it returns, whether checks pass or not.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::client::Client;
use crate::pb::{self, InstanceState};
use crate::{ErrorClass, ProviderError};

/// Tag key that marks the suite's instances.
pub const TAG: &str = "egressproxy.dev/conformance";

/// What the suite needs to know about the provider under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// A placement the provider accepts.
    pub placement: pb::Placement,
    /// User-data for the instances (a minimal `#cloud-config` by default).
    pub user_data: Vec<u8>,
    /// How long an instance may take to become RUNNING with an address.
    pub running_timeout: Duration,
}

impl Target {
    /// A target with a placement and defaults for the rest.
    pub fn new(placement: pb::Placement) -> Self {
        Target {
            placement,
            user_data: b"#cloud-config\n{}\n".to_vec(),
            running_timeout: Duration::from_secs(120),
        }
    }
}

/// The outcome of one check.
#[derive(Debug)]
pub struct CheckResult {
    /// What was checked.
    pub name: &'static str,
    /// `Err` holds what went wrong.
    pub outcome: Result<(), String>,
}

/// Results of every check.
#[derive(Debug, Default)]
pub struct Report {
    /// One entry per check, in order.
    pub checks: Vec<CheckResult>,
}

impl Report {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|check| check.outcome.is_ok())
    }

    /// The checks that failed, with their reasons.
    pub fn failures(&self) -> Vec<String> {
        self.checks
            .iter()
            .filter_map(|c| c.outcome.as_ref().err().map(|e| format!("{}: {e}", c.name)))
            .collect()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for check in &self.checks {
            match &check.outcome {
                Ok(()) => writeln!(f, "PASS {}", check.name)?,
                Err(error) => writeln!(f, "FAIL {}: {error}", check.name)?,
            }
        }
        let passed = self.checks.iter().filter(|c| c.outcome.is_ok()).count();
        write!(f, "{passed} passed, {} failed", self.checks.len() - passed)
    }
}

type CheckOutcome = Result<(), String>;

struct Suite<'a> {
    client: Client,
    target: &'a Target,
    run_id: String,
    created: Vec<String>,
    report: Report,
}

/// Runs one check method of [`Suite`] and records its outcome under `name`.
macro_rules! check {
    ($suite:ident, $name:literal, $method:ident) => {
        let outcome = $suite.$method().await;
        $suite.report.checks.push(CheckResult {
            name: $name,
            outcome,
        });
    };
}

/// Runs every check against the provider behind `client`.
pub async fn run(client: Client, target: &Target) -> Report {
    let mut suite = Suite {
        client,
        target,
        run_id: uuid::Uuid::new_v4().simple().to_string(),
        created: Vec::new(),
        report: Report::default(),
    };
    check!(
        suite,
        "plugin info names a provider on contract v1",
        plugin_info
    );
    check!(
        suite,
        "create is idempotent on the key",
        create_is_idempotent
    );
    check!(
        suite,
        "same key with another spec is ALREADY_EXISTS",
        conflicting_create
    );
    check!(suite, "invalid requests name the field", invalid_arguments);
    check!(suite, "get of a missing instance is NOT_FOUND", get_missing);
    check!(
        suite,
        "instance becomes RUNNING with an address",
        becomes_running
    );
    check!(suite, "list filters by tags", list_by_tags);
    check!(
        suite,
        "validate placement matches capabilities",
        validate_placement
    );
    check!(
        suite,
        "delete succeeds, twice, and get is then NOT_FOUND",
        delete
    );
    check!(
        suite,
        "delete of a missing instance succeeds",
        delete_missing
    );
    suite.cleanup().await;
    suite.report
}

fn expect_class(
    result: Result<impl std::fmt::Debug, tonic::Status>,
    class: ErrorClass,
) -> CheckOutcome {
    match result {
        Ok(value) => Err(format!("expected {class}, got success: {value:?}")),
        Err(status) => {
            let error = ProviderError::from(status);
            if error.class == class {
                Ok(())
            } else {
                Err(format!("expected {class}, got {error}"))
            }
        }
    }
}

fn status(context: &str) -> impl FnOnce(tonic::Status) -> String + '_ {
    move |status| format!("{context}: {}", ProviderError::from(status))
}

impl Suite<'_> {
    fn request(&self, suffix: &str) -> pb::CreateInstanceRequest {
        pb::CreateInstanceRequest {
            key: format!("conformance-{}-{suffix}", self.run_id),
            name: format!("conformance/{suffix}"),
            tags: HashMap::from([(TAG.to_string(), self.run_id.clone())]),
            placement: Some(self.target.placement.clone()),
            cloud_init: Some(pb::CloudInit {
                user_data: self.target.user_data.clone(),
                vendor_data: None,
            }),
            proxy_port: 3128,
        }
    }

    async fn create(
        &mut self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, tonic::Status> {
        let instance = self
            .client
            .create_instance(request)
            .await?
            .into_inner()
            .instance;
        let instance = instance
            .ok_or_else(|| tonic::Status::internal("CreateInstance returned no instance"))?;
        if !self.created.contains(&instance.id) {
            self.created.push(instance.id.clone());
        }
        Ok(instance)
    }

    async fn get(&mut self, id: &str) -> Result<pb::Instance, tonic::Status> {
        let request = pb::GetInstanceRequest { id: id.to_owned() };
        let instance = self
            .client
            .get_instance(request)
            .await?
            .into_inner()
            .instance;
        instance.ok_or_else(|| tonic::Status::internal("GetInstance returned no instance"))
    }

    async fn plugin_info(&mut self) -> CheckOutcome {
        let info = self
            .client
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .map_err(status("GetPluginInfo"))?;
        let info = info.into_inner();
        if info.name.is_empty() {
            return Err("name is empty".into());
        }
        let major = |version: &str| version.split('.').next().unwrap_or_default().to_owned();
        let expected = major(crate::CONTRACT_VERSION);
        if major(&info.contract_version) != expected {
            let found = &info.contract_version;
            return Err(format!("contract_version {found:?} is not {expected}.x"));
        }
        self.client
            .get_capabilities(pb::GetCapabilitiesRequest {})
            .await
            .map_err(status("GetCapabilities"))?;
        Ok(())
    }

    async fn create_is_idempotent(&mut self) -> CheckOutcome {
        let first = self
            .create(self.request("idempotent"))
            .await
            .map_err(status("first create"))?;
        let second = self
            .create(self.request("idempotent"))
            .await
            .map_err(status("second create"))?;
        if first.id.is_empty() || first.id != second.id {
            return Err(format!("ids differ: {:?} then {:?}", first.id, second.id));
        }
        if first.create_time.is_none() {
            return Err("create_time is not set".into());
        }
        if first.tags.get(TAG) != Some(&self.run_id) {
            return Err(format!("tags not stored: {:?}", first.tags));
        }
        Ok(())
    }

    async fn conflicting_create(&mut self) -> CheckOutcome {
        self.create(self.request("conflict"))
            .await
            .map_err(status("create"))?;
        let mut conflicting = self.request("conflict");
        conflicting.proxy_port = 3129;
        expect_class(self.create(conflicting).await, ErrorClass::AlreadyExists)
    }

    async fn invalid_arguments(&mut self) -> CheckOutcome {
        let mut empty_key = self.request("x");
        empty_key.key.clear();
        let error = match self.create(empty_key).await {
            Ok(instance) => return Err(format!("empty key accepted: {}", instance.id)),
            Err(status) => ProviderError::from(status),
        };
        if error.class != ErrorClass::InvalidArgument
            || !error.field_violations.iter().any(|v| v.field == "key")
        {
            return Err(format!(
                "empty key: expected INVALID_ARGUMENT on field key, got {error:?}"
            ));
        }
        let mut bad_machine = self.request("bad-machine");
        bad_machine.placement.as_mut().expect("set").machine_type = "no-such-machine-type-0".into();
        let error = match self.create(bad_machine).await {
            Ok(instance) => return Err(format!("unknown machine type accepted: {}", instance.id)),
            Err(status) => ProviderError::from(status),
        };
        let named = error
            .field_violations
            .iter()
            .any(|v| v.field == "placement.machine_type");
        if error.class != ErrorClass::InvalidArgument || !named {
            return Err(format!(
                "unknown machine type: expected INVALID_ARGUMENT on placement.machine_type, got {error:?}"
            ));
        }
        Ok(())
    }

    async fn get_missing(&mut self) -> CheckOutcome {
        expect_class(
            self.get(&format!("missing-{}", self.run_id)).await,
            ErrorClass::NotFound,
        )
    }

    async fn becomes_running(&mut self) -> CheckOutcome {
        let id = self
            .create(self.request("running"))
            .await
            .map_err(status("create"))?
            .id;
        let deadline = Instant::now() + self.target.running_timeout;
        loop {
            let instance = self.get(&id).await.map_err(status("get"))?;
            match instance.state() {
                InstanceState::Running if !instance.addresses.is_empty() => return Ok(()),
                InstanceState::Running => return Err("RUNNING without an address".into()),
                InstanceState::Provisioning => {}
                other => return Err(format!("unexpected state {other:?}")),
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "still PROVISIONING after {:?}",
                    self.target.running_timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn list_by_tags(&mut self) -> CheckOutcome {
        let id = self
            .create(self.request("listed"))
            .await
            .map_err(status("create"))?
            .id;
        let mine = self
            .list(HashMap::from([(TAG.to_string(), self.run_id.clone())]))
            .await?;
        if !mine.contains(&id) {
            return Err(format!("{id} missing from a list by its tag"));
        }
        let others = self
            .list(HashMap::from([(
                TAG.to_string(),
                format!("not-{}", self.run_id),
            )]))
            .await?;
        if !others.is_empty() {
            return Err(format!("a selector matching nothing listed {others:?}"));
        }
        Ok(())
    }

    async fn list(&mut self, tag_selector: HashMap<String, String>) -> Result<Vec<String>, String> {
        let mut ids = Vec::new();
        let mut page_token = String::new();
        loop {
            let request = pb::ListInstancesRequest {
                tag_selector: tag_selector.clone(),
                page_size: Some(2),
                page_token,
            };
            let page = self
                .client
                .list_instances(request)
                .await
                .map_err(status("list"))?
                .into_inner();
            ids.extend(page.instances.into_iter().map(|i| i.id));
            if page.next_page_token.is_empty() {
                return Ok(ids);
            }
            page_token = page.next_page_token;
        }
    }

    async fn validate_placement(&mut self) -> CheckOutcome {
        let capabilities = self
            .client
            .get_capabilities(pb::GetCapabilitiesRequest {})
            .await
            .map_err(status("caps"))?;
        let supported = capabilities
            .into_inner()
            .capabilities
            .contains(&(pb::Capability::ValidatePlacement as i32));
        let valid = pb::ValidatePlacementRequest {
            placement: Some(self.target.placement.clone()),
        };
        let result = self.client.validate_placement(valid).await;
        if !supported {
            return expect_class(result, ErrorClass::Unimplemented);
        }
        result.map_err(status("valid placement"))?;
        let mut bad = self.target.placement.clone();
        bad.image = "no-such-image-0".into();
        let invalid = pb::ValidatePlacementRequest {
            placement: Some(bad),
        };
        expect_class(
            self.client.validate_placement(invalid).await,
            ErrorClass::InvalidArgument,
        )
    }

    async fn delete(&mut self) -> CheckOutcome {
        let id = self
            .create(self.request("deleted"))
            .await
            .map_err(status("create"))?
            .id;
        for attempt in ["first", "second"] {
            let request = pb::DeleteInstanceRequest { id: id.clone() };
            self.client
                .delete_instance(request)
                .await
                .map_err(status(attempt))?;
        }
        let deadline = Instant::now() + self.target.running_timeout;
        loop {
            match self.get(&id).await {
                Err(status) if status.code() == tonic::Code::NotFound => return Ok(()),
                Ok(instance)
                    if instance.state() == InstanceState::Deleting && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => {
                    return Err(format!(
                        "get after delete: expected NOT_FOUND, got {other:?}"
                    ));
                }
            }
        }
    }

    async fn delete_missing(&mut self) -> CheckOutcome {
        let request = pb::DeleteInstanceRequest {
            id: format!("missing-{}", self.run_id),
        };
        self.client
            .delete_instance(request)
            .await
            .map_err(status("delete"))?;
        Ok(())
    }

    async fn cleanup(&mut self) {
        for id in std::mem::take(&mut self.created) {
            if let Err(error) = self
                .client
                .delete_instance(pb::DeleteInstanceRequest { id: id.clone() })
                .await
            {
                self.report.checks.push(CheckResult {
                    name: "cleanup deletes every instance the suite created",
                    outcome: Err(format!("{id}: {}", ProviderError::from(error))),
                });
            }
        }
    }
}
