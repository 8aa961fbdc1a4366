//! The checks, grouped by what they protect. [`CHECKS`] is the one list: order, name,
//! why, rule. [`Suite`] holds what checks share (the client, a raw channel, the
//! ledger, one RUNNING instance) and the helpers that turn what came back into words.

mod address_identity;
mod concurrency;
mod errors;
mod identity;
mod lifecycle;
mod limits;
mod listing;
mod locations;
mod tag_updates;
mod watching;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tonic::transport::Channel;

use super::{Check, Ledger, Outcome, TAG, Target, describe};
use crate::client::Client;
use crate::pb::{self, InstanceState};
use crate::{ErrorClass, ProviderError};

/// A check's result: `Ok` passes; `Err` carries a failure or a skip.
pub(crate) type Checked = Result<(), Outcome>;

const fn check(name: &'static str, why: &'static str, rule: &'static str) -> Check {
    Check { name, why, rule }
}

/// Every check, in the order a run takes them. `errors-well-formed` runs near the end,
/// so it sees the errors of every check before it; `foreign-instance-survives` last.
pub const CHECKS: &[Check] = &[
    check(
        "health-serving",
        "callers and load balancers ask grpc.health.v1 before sending work",
        "docs/contract.md#health-and-reflection",
    ),
    check(
        "reflection",
        "grpcurl and clients in any language discover the service and decode error details without the project's protos",
        "docs/contract.md#health-and-reflection",
    ),
    check(
        "plugin-info",
        "callers refuse a provider on another major contract version, and log its versions",
        "provider.proto: GetPluginInfoResponse",
    ),
    check(
        "capabilities-match-behaviour",
        "callers decide which optional calls and fields to use from GetCapabilities alone",
        "provider.proto: GetCapabilities, Capability",
    ),
    check(
        "trace-context-accepted",
        "callers that trace send traceparent; a provider must not refuse a call for it, well-formed or not",
        "docs/contract.md#transport",
    ),
    check(
        "error-info-on-every-error",
        "callers log, count and alert on ErrorInfo's reason; a missing or misspelled one hides the cause",
        "docs/contract.md#errors",
    ),
    check(
        "invalid-argument-names-fields",
        "users fix the field BadRequest names; without it they guess",
        "docs/contract.md#errors",
    ),
    check(
        "map-entry-paths",
        "a map entry's field path must name the entry exactly, or users cannot tell which tag to fix",
        "docs/contract.md#errors",
    ),
    check(
        "violations-bounded",
        "an error listing many bad fields must still fit every client's 16 KiB metadata limit",
        "docs/contract.md#bounded-text",
    ),
    check(
        "huge-input-bounded",
        "an error echoing a huge input must not outgrow a client's 16 KiB metadata limit (it would read as RESOURCE_EXHAUSTED and be retried)",
        "docs/contract.md#bounded-text",
    ),
    check(
        "server-deadline",
        "a call past its grpc-timeout must say DEADLINE_EXCEEDED (retry later), not CANCELLED, and never hang",
        "docs/contract.md#deadlines",
    ),
    check(
        "create-idempotent",
        "the operator repeats Create after every crash or timeout and must get the same instance",
        "provider.proto: CreateInstanceRequest.key",
    ),
    check(
        "create-conflict",
        "a key reused with another spec must not silently return the old instance",
        "provider.proto: CreateInstanceRequest.key",
    ),
    check(
        "get-missing",
        "callers treat NOT_FOUND as gone and replace the instance",
        "provider.proto: GetInstance",
    ),
    check(
        "empty-id",
        "an empty id is a caller bug and must say so, not look like a missing instance",
        "provider.proto: GetInstanceRequest.id",
    ),
    check(
        "becomes-running",
        "a Proxy is Ready only once its instance runs with an address",
        "provider.proto: InstanceState",
    ),
    check(
        "addresses-parse",
        "callers connect to the address as an IP of the stated family",
        "provider.proto: Address",
    ),
    check(
        "echo",
        "callers compare what they asked for with what they got to detect drift",
        "provider.proto: Instance",
    ),
    check(
        "list-by-tags",
        "garbage collection finds orphans by listing with its tags",
        "provider.proto: ListInstances",
    ),
    check(
        "tag-selector-and",
        "an OR match would list, and let callers delete, instances of other owners",
        "provider.proto: ListInstancesRequest.tag_selector",
    ),
    check(
        "list-get-agree",
        "garbage collection and status read List and Get; they must tell the same story",
        "docs/contract.md#listing",
    ),
    check(
        "paging-walks-once",
        "a walk must see every instance once, or garbage collection misses or double-counts",
        "docs/contract.md#paging",
    ),
    check(
        "foreign-page-token",
        "a token the provider never issued must be refused, not read as a position (or as the first page)",
        "provider.proto: ListInstancesRequest.page_token",
    ),
    check(
        "page-size-honoured",
        "callers size pages to bound memory and latency; a size over the provider's cap is clamped, not refused",
        "provider.proto: ListInstancesRequest.page_size",
    ),
    check(
        "concurrent-creates-distinct-keys",
        "an operator creates many Proxies at once",
        "provider.proto: CreateInstance",
    ),
    check(
        "concurrent-creates-one-key",
        "retries race the first attempt; one key must give one instance",
        "provider.proto: CreateInstance",
    ),
    check(
        "cancelled-create-converges",
        "a Create cut off by its deadline is repeated and must not leave a second instance",
        "provider.proto: CreateInstance",
    ),
    check(
        "limits-at-boundary",
        "a request exactly at every documented limit is valid",
        "docs/contract.md#limits",
    ),
    check(
        "limits-one-past",
        "one past any documented limit is INVALID_ARGUMENT naming the field",
        "docs/contract.md#limits",
    ),
    check(
        "validate-placement",
        "callers check a placement before creating, when the provider offers it",
        "provider.proto: ValidatePlacement",
    ),
    check(
        "list-locations",
        "callers choose and explain placements from ListLocations; a location listed twice, unnamed or in a zone that is not listed misleads them",
        "provider.proto: ListLocations, Location",
    ),
    check(
        "locations-filter",
        "callers ask where one machine type and image fit; an ignored filter answers another question",
        "provider.proto: ListLocationsRequest",
    ),
    check(
        "locations-paging",
        "a walk of the locations must see each once, and a token the provider never issued must be refused",
        "provider.proto: ListLocationsRequest.page_token",
    ),
    check(
        "locations-placeable",
        "a listed location must be one a Placement can name, and one listed without room must refuse a Create",
        "provider.proto: ListLocations, MachineTypeRoom.room",
    ),
    check(
        "watch-snapshot",
        "a caller that starts watching must learn every instance it watches, and nothing it does not",
        "provider.proto: WatchInstances, WatchInstancesResponse",
    ),
    check(
        "watch-by-id",
        "a caller that watches one instance must hear of it alone, and an id that names no instance is no error",
        "provider.proto: WatchInstancesRequest.id",
    ),
    check(
        "watch-follows-changes",
        "callers act when an instance runs or goes, instead of polling; a change the stream misses is never acted on",
        "provider.proto: WatchInstances, WatchEventType",
    ),
    check(
        "watch-resume",
        "a caller that reconnects must get what it missed, or be told to start over; a token never issued must be refused",
        "provider.proto: WatchInstancesRequest.resume_token",
    ),
    check(
        "address-identity",
        "a replaced Proxy must keep its egress address, or allow-lists that name it stop matching; two instances with one address take each other's traffic",
        "provider.proto: CreateInstanceRequest.address_identity",
    ),
    check(
        "requested-address",
        "callers that ask for an address must get exactly that one, or be told it is taken or not offered",
        "provider.proto: CreateInstanceRequest.requested_address",
    ),
    check(
        "update-tags-replaces",
        "a spare handed to a Proxy must be found by the Proxy's tags and no longer by the pool's, in Get, List and Watch alike, or garbage collection deletes it as an orphan",
        "provider.proto: UpdateInstanceTagsResponse",
    ),
    check(
        "update-tags-compare-and-set",
        "a caller whose view is stale must be refused, and one that retries must not be refused by its own update",
        "provider.proto: UpdateInstanceTagsResponse",
    ),
    check(
        "update-tags-concurrent",
        "two Proxies that adopt the same spare at once must not both get it",
        "provider.proto: UpdateInstanceTagsResponse",
    ),
    check(
        "update-tags-errors",
        "a missing instance, a bad request and an instance being deleted must each say so, as callers act on the code",
        "provider.proto: UpdateInstanceTagsRequest",
    ),
    check(
        "delete-twice-then-gone",
        "Delete is repeated after crashes; the instance must then go (DELETING ends, and is listed meanwhile)",
        "provider.proto: DeleteInstance",
    ),
    check(
        "key-reuse-after-delete",
        "a key whose instance was deleted may be used again; while it is DELETING, Create says so",
        "provider.proto: CreateInstanceRequest.key",
    ),
    check(
        "delete-missing",
        "deleting what is already gone must succeed, or finalizers hang for ever",
        "provider.proto: DeleteInstance",
    ),
    check(
        "delete-while-provisioning",
        "a Proxy deleted while booting must not leave its VM behind",
        "provider.proto: DeleteInstance",
    ),
    check(
        "errors-well-formed",
        "every error a caller meets must carry the contract's details, or callers misread it",
        "docs/contract.md#errors",
    ),
    check(
        "foreign-instance-survives",
        "a provider must delete only what it is asked to; others' instances are not its own",
        "provider.proto: DeleteInstance",
    ),
];

pub(crate) struct Suite<'a> {
    ledger: Ledger,
    client: Client,
    channel: Channel,
    target: &'a Target,
    running: Option<pb::Instance>,
    bystander: Option<String>,
    /// `host:port` of a plaintext endpoint, for raw HTTP/2 calls.
    plaintext_authority: Option<String>,
    /// Every error the provider answered during the run, with the call that got it.
    observed: Vec<(&'static str, tonic::Status)>,
    /// The proxy port of each key suffix the run has asked for ([`Suite::request`]).
    ports: std::sync::Mutex<HashMap<String, u32>>,
}

/// The proxy port of the run's first key: the port a real proxy listens on by default.
const FIRST_PORT: u32 = 3128;
/// Where the ports of the run's other keys start: clear of the ports checks name
/// themselves (3129, 3130, 65535), and below Linux's ephemeral ports (32768 and up),
/// where a host-network proxy could meet a port some connection on the host holds.
const OTHER_PORTS: u32 = 20000;

impl<'a> Suite<'a> {
    pub(crate) fn new(
        ledger: Ledger,
        channel: Channel,
        target: &'a Target,
        endpoint: &str,
    ) -> Self {
        Suite {
            plaintext_authority: endpoint
                .strip_prefix("http://")
                .map(|rest| rest.trim_end_matches('/').to_owned()),
            client: ledger.client(),
            ledger,
            channel,
            target,
            running: None,
            bystander: None,
            observed: Vec::new(),
            ports: std::sync::Mutex::default(),
        }
    }

    pub(crate) async fn run(&mut self, name: &str) -> Outcome {
        let result = match name {
            "health-serving" => self.health_serving().await,
            "reflection" => self.reflection().await,
            "plugin-info" => self.plugin_info().await,
            "capabilities-match-behaviour" => self.capabilities_match_behaviour().await,
            "trace-context-accepted" => self.trace_context_accepted().await,
            "error-info-on-every-error" => self.error_info_on_every_error().await,
            "invalid-argument-names-fields" => self.invalid_argument_names_fields().await,
            "map-entry-paths" => self.map_entry_paths().await,
            "violations-bounded" => self.violations_bounded().await,
            "huge-input-bounded" => self.huge_input_bounded().await,
            "server-deadline" => self.server_deadline().await,
            "create-idempotent" => self.create_idempotent().await,
            "create-conflict" => self.create_conflict().await,
            "get-missing" => self.get_missing().await,
            "empty-id" => self.empty_id().await,
            "becomes-running" => self.becomes_running().await,
            "addresses-parse" => self.addresses_parse().await,
            "echo" => self.echo().await,
            "list-by-tags" => self.list_by_tags().await,
            "tag-selector-and" => self.tag_selector_and().await,
            "list-get-agree" => self.list_get_agree().await,
            "paging-walks-once" => self.paging_walks_once().await,
            "foreign-page-token" => self.foreign_page_token().await,
            "page-size-honoured" => self.page_size_honoured().await,
            "concurrent-creates-distinct-keys" => self.concurrent_distinct_keys().await,
            "concurrent-creates-one-key" => self.concurrent_one_key().await,
            "cancelled-create-converges" => self.cancelled_create_converges().await,
            "limits-at-boundary" => self.limits_at_boundary().await,
            "limits-one-past" => self.limits_one_past().await,
            "validate-placement" => self.validate_placement().await,
            "list-locations" => self.list_locations().await,
            "locations-filter" => self.locations_filter().await,
            "locations-paging" => self.locations_paging().await,
            "locations-placeable" => self.locations_placeable().await,
            "watch-snapshot" => self.watch_snapshot().await,
            "watch-by-id" => self.watch_by_id().await,
            "watch-follows-changes" => self.watch_follows_changes().await,
            "watch-resume" => self.watch_resume().await,
            "address-identity" => self.address_identity().await,
            "requested-address" => self.requested_address().await,
            "update-tags-replaces" => self.update_tags_replaces().await,
            "update-tags-compare-and-set" => self.update_tags_compare_and_set().await,
            "update-tags-concurrent" => self.update_tags_concurrent().await,
            "update-tags-errors" => self.update_tags_errors().await,
            "delete-twice-then-gone" => self.delete_twice_then_gone().await,
            "key-reuse-after-delete" => self.key_reuse_after_delete().await,
            "delete-missing" => self.delete_missing().await,
            "delete-while-provisioning" => self.delete_while_provisioning().await,
            "errors-well-formed" => self.errors_well_formed().await,
            "foreign-instance-survives" => self.foreign_instance_survives().await,
            other => Err(Outcome::Skip(format!("no check named {other}"))),
        };
        match result {
            Ok(()) => Outcome::Pass,
            Err(outcome) => outcome,
        }
    }

    /// Plants an instance early in the run that no check deletes; the last check
    /// makes sure it is still there.
    pub(crate) async fn plant_bystander(&mut self) {
        if let Ok(instance) = self.create_raw(self.request("bystander")).await {
            self.bystander = Some(instance.id);
        }
    }

    fn run_id(&self) -> &str {
        self.ledger.run_id()
    }

    /// The proxy port of key suffix `suffix`: the same for every request of one key, and
    /// another for each key, so that a provider whose instances share one host's ports
    /// (host-network pods on one node) can hold every instance of a run at once.
    fn port_of(&self, suffix: &str) -> u32 {
        let mut ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
        let next = match ports.len() {
            0 => FIRST_PORT,
            // A run asks for a few dozen keys: far fewer than the ports up to 32768.
            n => OTHER_PORTS + n as u32,
        };
        *ports.entry(suffix.to_owned()).or_insert(next)
    }

    /// A valid Create request for this run: key `cf-<run>-<suffix>`, the run's tag, the
    /// key's own proxy port ([`Suite::port_of`]).
    fn request(&self, suffix: &str) -> pb::CreateInstanceRequest {
        pb::CreateInstanceRequest {
            key: format!("cf-{}-{suffix}", self.run_id()),
            name: format!("conformance/{suffix}"),
            tags: HashMap::from([(TAG.to_string(), self.run_id().to_owned())]),
            placement: Some(self.target.placement.clone()),
            cloud_init: Some(pb::CloudInit {
                user_data: if self.target.cloud_init {
                    self.target.user_data.clone()
                } else {
                    Vec::new()
                },
                vendor_data: None,
            }),
            proxy_port: self.port_of(suffix),
            ..Default::default()
        }
    }

    /// Records an error the provider answered, for `errors-well-formed`. Errors the
    /// client made itself (a transport failure, its own deadline) are not answers.
    fn observe(&mut self, call: &'static str, status: &tonic::Status) {
        let from_client = std::error::Error::source(status).is_some()
            || (matches!(
                status.code(),
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
            ) && status.details().is_empty());
        if !from_client {
            self.observed.push((call, status.clone()));
        }
    }

    /// Calls `attempt` until it succeeds or answers an error callers do not retry, as
    /// the contract tells callers to: transient classes (UNAVAILABLE, UNKNOWN, INTERNAL,
    /// ABORTED, CANCELLED, DEADLINE_EXCEEDED) with exponential backoff, and
    /// RESOURCE_EXHAUSTED after its RetryInfo delay; for at most the running timeout.
    async fn retrying<T, F, Fut>(
        &mut self,
        call: &'static str,
        mut attempt: F,
    ) -> Result<T, tonic::Status>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let deadline = Instant::now() + self.target.running_timeout;
        let mut backoff = Duration::from_millis(100);
        loop {
            let status = match attempt(self.client.clone()).await {
                Ok(answer) => return Ok(answer),
                Err(status) => status,
            };
            self.observe(call, &status);
            let now = Instant::now();
            if !ErrorClass::from_code(status.code()).is_retryable() || now >= deadline {
                return Err(status);
            }
            let hint = ProviderError::from_status(&status).retry_after;
            let wait = hint
                .unwrap_or(backoff)
                .min(MAX_RETRY_WAIT)
                .min(deadline - now);
            tokio::time::sleep(wait).await;
            backoff = (backoff * 2).min(MAX_RETRY_WAIT);
        }
    }

    /// Create once, no retry, recording the id for cleanup and any error.
    async fn create_once(
        &mut self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, tonic::Status> {
        let answer = match self.client.create_instance(request).await {
            Ok(answer) => answer.into_inner(),
            Err(status) => {
                self.observe("CreateInstance", &status);
                return Err(status);
            }
        };
        let instance = instance_in(answer.instance, "CreateInstance")?;
        self.ledger.record(&instance.id);
        Ok(instance)
    }

    /// Create, retrying what callers retry, recording the id for cleanup.
    async fn create_raw(
        &mut self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, tonic::Status> {
        let answer = self
            .retrying("CreateInstance", |mut client| {
                let request = request.clone();
                async move { client.create_instance(request).await }
            })
            .await?;
        let instance = instance_in(answer.into_inner().instance, "CreateInstance")?;
        self.ledger.record(&instance.id);
        Ok(instance)
    }

    /// Create, as a step that must succeed.
    async fn create(
        &mut self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, Outcome> {
        let key = request.key.clone();
        self.create_raw(request).await.map_err(|status| {
            Outcome::fail(
                format!("CreateInstance of a valid request (key {key}) succeeds"),
                describe::status(&status),
            )
        })
    }

    async fn get_raw(&mut self, id: &str) -> Result<pb::Instance, tonic::Status> {
        let id = id.to_owned();
        let answer = self
            .retrying("GetInstance", |mut client| {
                let request = pb::GetInstanceRequest { id: id.clone() };
                async move { client.get_instance(request).await }
            })
            .await?;
        instance_in(answer.into_inner().instance, "GetInstance")
    }

    async fn get(&mut self, id: &str) -> Result<pb::Instance, Outcome> {
        self.get_raw(id).await.map_err(|status| {
            Outcome::fail(
                format!("GetInstance of {id}, which exists, succeeds"),
                describe::status(&status),
            )
        })
    }

    async fn delete_raw(&mut self, id: &str) -> Result<(), tonic::Status> {
        let id = id.to_owned();
        self.retrying("DeleteInstance", |mut client| {
            let request = pb::DeleteInstanceRequest { id: id.clone() };
            async move { client.delete_instance(request).await.map(|_| ()) }
        })
        .await
    }

    async fn delete(&mut self, id: &str) -> Checked {
        self.delete_raw(id).await.map_err(|status| {
            Outcome::fail(
                format!("DeleteInstance of {id} succeeds"),
                describe::status(&status),
            )
        })
    }

    /// One ListInstances page, retrying what callers retry.
    async fn list_page(
        &mut self,
        request: pb::ListInstancesRequest,
    ) -> Result<pb::ListInstancesResponse, tonic::Status> {
        self.retrying("ListInstances", |mut client| {
            let request = request.clone();
            async move { Ok(client.list_instances(request).await?.into_inner()) }
        })
        .await
    }

    /// Polls Get until the instance is RUNNING with an address.
    async fn wait_running(&mut self, id: &str) -> Result<pb::Instance, Outcome> {
        let deadline = Instant::now() + self.target.running_timeout;
        loop {
            let instance = self.get(id).await?;
            match instance.state() {
                InstanceState::Running if !instance.addresses.is_empty() => return Ok(instance),
                InstanceState::Running => {
                    return Err(Outcome::fail(
                        "RUNNING only with at least one address",
                        describe::instance(&instance),
                    ));
                }
                InstanceState::Provisioning => {}
                _ => {
                    return Err(Outcome::fail(
                        "PROVISIONING until RUNNING",
                        describe::instance(&instance),
                    ));
                }
            }
            if Instant::now() > deadline {
                return Err(Outcome::fail(
                    format!(
                        "RUNNING with an address within {}",
                        humantime::format_duration(self.target.running_timeout)
                    ),
                    describe::instance(&instance),
                ));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// Polls Get until it answers NOT_FOUND (DELETING meanwhile is fine).
    async fn wait_gone(&mut self, id: &str) -> Checked {
        let deadline = Instant::now() + self.target.running_timeout;
        loop {
            let still = match self.get_raw(id).await {
                Err(status) if status.code() == tonic::Code::NotFound => {
                    self.ledger.forget(id);
                    return Ok(());
                }
                Err(status) => describe::status(&status),
                Ok(instance) => describe::instance(&instance),
            };
            if Instant::now() > deadline {
                return Err(Outcome::fail(
                    format!(
                        "GetInstance of a deleted instance answers NOT_FOUND within {} (DELETING until then)",
                        humantime::format_duration(self.target.running_timeout)
                    ),
                    still,
                ));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// One RUNNING instance that checks may read but not change.
    async fn running_instance(&mut self) -> Result<pb::Instance, Outcome> {
        if let Some(instance) = &self.running {
            return Ok(instance.clone());
        }
        let id = self.create(self.request("running")).await?.id;
        let instance = self.wait_running(&id).await?;
        self.running = Some(instance.clone());
        Ok(instance)
    }

    async fn capabilities(&mut self) -> Result<Vec<pb::Capability>, Outcome> {
        let answer = self
            .retrying("GetCapabilities", |mut client| async move {
                client.get_capabilities(pb::GetCapabilitiesRequest {}).await
            })
            .await
            .map_err(|status| {
                Outcome::fail("GetCapabilities answers", describe::status(&status))
            })?;
        Ok(answer.into_inner().capabilities().collect())
    }
}

/// The longest the suite waits before retrying a call.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(5);
/// How often the suite polls a state it waits for.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// The instance an answer must carry: the field is required in every response.
fn instance_in(instance: Option<pb::Instance>, call: &str) -> Result<pb::Instance, tonic::Status> {
    instance.ok_or_else(|| {
        tonic::Status::internal(format!(
            "{call} answered OK without an instance (the field is required)"
        ))
    })
}

/// The error a call must have failed with, or a failure naming what came instead.
fn expect_code<T>(
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    what: &str,
) -> Result<tonic::Status, Outcome> {
    let expected = format!("{what}: {}", describe::code_name(code));
    match result {
        Ok(_) => Err(Outcome::fail(expected, "success")),
        Err(status) if status.code() == code => Ok(status),
        Err(status) => Err(Outcome::fail(expected, describe::status(&status))),
    }
}
