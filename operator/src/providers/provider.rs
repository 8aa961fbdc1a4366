//! One configured provider: its client, its calls and its handshake.
//!
//! Guarantees:
//! 1. Before first use, a provider is asked for `GetPluginInfo` and `GetCapabilities`;
//!    a different contract major version is refused with a clear error. Concurrent
//!    callers share one handshake (single flight): the first asks, the others wait for
//!    its answer, success or failure. The answer is cached until a call finds the
//!    provider unavailable (it may come back as another version) or its settings
//!    change.
//! 2. When a TLS file changes on disk (a renewed certificate), the next call builds a
//!    new client with it.
//! 3. When its settings change (a reloaded config file), the next call uses them;
//!    calls already running finish on the old client.
//! 4. An unavailable provider's error names the endpoint and the underlying cause
//!    (for example the OS error of a refused connection).

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use egressproxy_provider::client::{Client, ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::{CONTRACT_VERSION, ErrorClass, ProviderError, pb};
use tracing::Instrument;

use super::config::ProviderConfig;
use crate::shared::error::{Error, Result};
use crate::shared::metrics::Metrics;
use crate::shared::tables::shrink_when_sparse;

/// The contract's gRPC service, as client spans name it.
const PROVIDER_SERVICE: &str = "egressproxy.provider.v1.Provider";

/// What a provider told us about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginInfo {
    /// Its self-reported name.
    pub name: String,
    /// Its version.
    pub vendor_version: String,
    /// The contract version it implements.
    pub contract_version: String,
    /// Its optional capabilities.
    pub capabilities: Vec<pb::Capability>,
}

/// One configured provider. Its handle lives as long as the operator; a reloaded
/// config changes its settings, or marks it removed.
#[derive(Debug)]
pub struct Provider {
    name: String,
    state: Mutex<State>,
    /// Held by the one caller that runs the handshake.
    handshake_turn: tokio::sync::Mutex<()>,
    metrics: Arc<Metrics>,
    /// Instances this operator asked to delete lately, and when: what a watch then
    /// says about them is the operator's own doing, not news.
    deleted_here: Mutex<DeletedHere>,
}

/// When each instance this operator deleted lately was deleted, by a keyed hash of its
/// id. A mass delete records thousands of ids and keeps them for minutes; as strings,
/// they would be thousands of small allocations made in the middle of the burst,
/// pinning pages of memory the burst freed. As hashes they live in the table alone.
/// Two ids with the same 64-bit hash (keyed per process, so no provider can aim for
/// it) would only make a watch event about the second look like the operator's own.
#[derive(Debug)]
struct DeletedHere {
    hasher: std::collections::hash_map::RandomState,
    at: HashMap<u64, Instant>,
    pruned: Instant,
}

/// How often expired entries of [`DeletedHere`] are dropped: a pass over them all on
/// every delete would make a mass delete quadratic.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

impl Default for DeletedHere {
    fn default() -> Self {
        DeletedHere {
            hasher: std::collections::hash_map::RandomState::new(),
            at: HashMap::new(),
            pruned: Instant::now(),
        }
    }
}

impl DeletedHere {
    fn key(&self, id: &str) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(id)
    }

    /// Drops the entries older than [`DELETED_MEMORY`], at most every [`PRUNE_EVERY`].
    fn prune(&mut self) {
        if self.pruned.elapsed() < PRUNE_EVERY {
            return;
        }
        self.pruned = Instant::now();
        self.at.retain(|_, at| at.elapsed() < DELETED_MEMORY);
        shrink_when_sparse(&mut self.at);
    }
}

/// How long an instance this operator deleted is remembered as such.
const DELETED_MEMORY: std::time::Duration = std::time::Duration::from_secs(600);

#[derive(Debug)]
struct State {
    /// `None` once a reloaded config no longer has this provider.
    config: Option<ProviderConfig>,
    client: Option<Client>,
    tls_mtimes: Vec<Option<SystemTime>>,
    info: Option<PluginInfo>,
    /// Handshakes that failed so far, and how the last one failed: a caller that
    /// waited its turn while one failed gets that failure instead of asking again.
    handshake_failures: u64,
    last_handshake_failure: Option<HandshakeFailure>,
}

/// A failed handshake, kept so that callers who waited for it share its outcome.
#[derive(Debug, Clone)]
enum HandshakeFailure {
    Call {
        op: &'static str,
        error: ProviderError,
    },
    Incompatible {
        found: String,
        expected: String,
    },
}

impl Provider {
    pub(super) fn new(name: String, config: ProviderConfig, metrics: Arc<Metrics>) -> Self {
        Provider {
            name,
            state: Mutex::new(State {
                config: Some(config),
                client: None,
                tls_mtimes: Vec::new(),
                info: None,
                handshake_failures: 0,
                last_handshake_failure: None,
            }),
            handshake_turn: tokio::sync::Mutex::new(()),
            metrics,
            deleted_here: Mutex::default(),
        }
    }

    /// The configured name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The echo service its proxies' egress addresses are observed with, if configured.
    pub fn egress_check_url(&self) -> Option<String> {
        self.state().config.as_ref()?.egress_check_url.clone()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the current config has this provider.
    pub(super) fn is_configured(&self) -> bool {
        self.state().config.is_some()
    }

    /// Applies new settings (`None`: removed). Returns whether anything changed; a
    /// change drops the client and the cached handshake.
    pub(super) fn reconfigure(&self, config: Option<ProviderConfig>) -> bool {
        let mut state = self.state();
        if state.config == config {
            return false;
        }
        state.config = config;
        state.client = None;
        state.tls_mtimes.clear();
        state.info = None;
        true
    }

    /// A client, rebuilt when a TLS file changed since the last one was built.
    fn client(&self) -> Result<(Client, String)> {
        let config = self
            .state()
            .config
            .clone()
            .ok_or_else(|| Error::ProviderNotConfigured(self.name.clone()))?;
        let mtimes: Vec<_> = tls_files(&config)
            .iter()
            .map(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
            .collect();
        let mut state = self.state();
        if let Some(client) = &state.client
            && state.tls_mtimes == mtimes
        {
            return Ok((client.clone(), config.endpoint));
        }
        if state.client.is_some() {
            tracing::info!(provider = %self.name, "TLS files changed: reconnecting with the new ones");
        }
        let mut options = ClientOptions::new(config.endpoint.clone());
        options.call_timeout = config.call_timeout;
        options.tls = config.tls.as_ref().map(|tls| ClientTls {
            ca: tls.ca.clone(),
            domain: tls.server_name.clone(),
            identity: tls.cert.clone().zip(tls.key.clone()),
        });
        let client = connect_lazy(&options).map_err(|source| Error::Connect {
            provider: self.name.clone(),
            source,
        })?;
        state.client = Some(client.clone());
        state.tls_mtimes = mtimes;
        Ok((client, config.endpoint))
    }

    fn error(&self, op: &'static str, error: ProviderError) -> Error {
        Error::Provider {
            provider: self.name.clone(),
            op,
            source: Box::new(error),
        }
    }

    /// Runs one call inside a client span, timing it into the metrics and classifying
    /// its error. The span is current while the request is built, so the trace context
    /// the provider receives names it as the parent of the provider's own spans.
    pub(super) async fn call<T, F, Fut>(&self, op: &'static str, call: F) -> Result<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let (client, endpoint) = self.client()?;
        let span = tracing::info_span!(
            "provider.call",
            otel.name = %format!("{PROVIDER_SERVICE}/{op}"),
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = PROVIDER_SERVICE,
            rpc.method = op,
            provider = %self.name,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let started = Instant::now();
        let result = call(client).instrument(span.clone()).await;
        let code = result
            .as_ref()
            .map_or_else(tonic::Status::code, |_| tonic::Code::Ok);
        span.record("rpc.grpc.status_code", code as i32);
        self.metrics
            .provider_call(&self.name, op, code, started.elapsed());
        result.map(tonic::Response::into_inner).map_err(|status| {
            if status.code() == tonic::Code::Unavailable {
                // It may come back as another version: ask again next time.
                self.state().info = None;
            }
            self.error(op, explain_unavailable(&status, &endpoint))
        })
    }

    /// CreateInstance. An answer without an instance (or its id) is a provider bug:
    /// reported and retried like a transient error, never recorded as an empty id.
    pub async fn create(&self, request: pb::CreateInstanceRequest) -> Result<pb::Instance> {
        let answer = self
            .call("CreateInstance", |mut c| async move {
                c.create_instance(request).await
            })
            .await?;
        self.instance_in(answer.instance, "CreateInstance")
    }

    /// GetInstance; `None` when the instance does not exist.
    pub async fn get(&self, id: &str) -> Result<Option<pb::Instance>> {
        let request = pb::GetInstanceRequest { id: id.to_owned() };
        match self
            .call("GetInstance", |mut c| async move {
                c.get_instance(request).await
            })
            .await
        {
            Ok(answer) => self.instance_in(answer.instance, "GetInstance").map(Some),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// The instance an answer must carry; a provider that omits it (or its id) is
    /// broken, which is reported and retried rather than recorded as an empty id.
    fn instance_in(
        &self,
        instance: Option<pb::Instance>,
        op: &'static str,
    ) -> Result<pb::Instance> {
        match instance {
            Some(instance) if !instance.id.is_empty() => Ok(instance),
            _ => Err(self.error(
                op,
                ProviderError::transient(
                    "the provider answered without an instance id (a provider bug)",
                )
                .with_reason("MALFORMED_RESPONSE"),
            )),
        }
    }

    /// DeleteInstance; a missing instance is success. The id is remembered for a while
    /// ([`Provider::deleted_here`]) before the call, so a watch event that the call
    /// causes is known as the operator's own.
    pub async fn delete(&self, id: &str) -> Result<()> {
        {
            let mut deleted = self.deleted_here.lock().unwrap_or_else(|p| p.into_inner());
            deleted.prune();
            let key = deleted.key(id);
            deleted.at.insert(key, Instant::now());
        }
        let request = pb::DeleteInstanceRequest { id: id.to_owned() };
        match self
            .call("DeleteInstance", |mut c| async move {
                c.delete_instance(request).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::NotFound => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// Whether this operator asked to delete instance `id` in the last ten minutes.
    pub fn deleted_here(&self, id: &str) -> bool {
        let mut deleted = self.deleted_here.lock().unwrap_or_else(|p| p.into_inner());
        deleted.prune();
        deleted
            .at
            .get(&deleted.key(id))
            .is_some_and(|at| at.elapsed() < DELETED_MEMORY)
    }

    /// Every instance whose tags contain `selector`, across pages, walked as
    /// [`super::list_walk`] bounds it.
    pub async fn list(&self, selector: &HashMap<String, String>) -> Result<Vec<pb::Instance>> {
        super::list_walk::walk(
            selector,
            |request| {
                self.call("ListInstances", |mut c| async move {
                    c.list_instances(request).await
                })
            },
            |error| self.error("ListInstances", error),
        )
        .await
    }

    /// UpdateInstanceTags: `id`'s tags become `tags` if they are exactly `expected`
    /// (compare-and-set, contract "Ownership hand-over"), or already are `tags`.
    pub async fn update_tags(
        &self,
        id: &str,
        expected: HashMap<String, String>,
        tags: HashMap<String, String>,
    ) -> Result<pb::Instance> {
        let request = pb::UpdateInstanceTagsRequest {
            id: id.to_owned(),
            expected_tags: expected,
            tags,
        };
        let answer = self
            .call("UpdateInstanceTags", |mut c| async move {
                c.update_instance_tags(request).await
            })
            .await?;
        self.instance_in(answer.instance, "UpdateInstanceTags")
    }

    /// Whether `error`, from [`Provider::update_tags`], says the instance is no longer
    /// the one the caller read: gone, being deleted, or its tags changed (another
    /// caller won). The caller reads again and decides anew; any other error is retried.
    pub fn lost_the_instance(error: &Error) -> bool {
        use egressproxy_provider::error::reason;
        match error {
            Error::Provider { source, .. } => {
                source.class == ErrorClass::NotFound
                    || (source.class == ErrorClass::Permanent
                        && (source.reason == reason::TAGS_CHANGED
                            || source.reason == reason::INSTANCE_DELETING))
            }
            _ => false,
        }
    }

    /// Whether the provider declares `capability` (after the handshake).
    pub async fn offers(&self, capability: pb::Capability) -> Result<bool> {
        Ok(self.handshake().await?.capabilities.contains(&capability))
    }

    /// Opens a WatchInstances stream. The call carries a deadline as long as the
    /// caller means to watch (`watch_for`), as the contract asks, while the stream's
    /// opening is bounded by the provider's call timeout, so a hung provider cannot hold
    /// the watcher. Its events are not timed: only the opening is a call.
    pub async fn watch(
        &self,
        request: pb::WatchInstancesRequest,
        watch_for: std::time::Duration,
    ) -> Result<tonic::Streaming<pb::WatchInstancesResponse>> {
        let call_timeout = self
            .state()
            .config
            .as_ref()
            .map_or(std::time::Duration::from_secs(30), |c| c.call_timeout);
        let open = self.call("WatchInstances", |mut c| async move {
            let mut request = tonic::Request::new(request);
            request.set_timeout(watch_for);
            c.watch_instances(request).await
        });
        match tokio::time::timeout(call_timeout, open).await {
            Ok(result) => result,
            Err(_) => Err(self.error(
                "WatchInstances",
                ProviderError::deadline_exceeded(format!(
                    "the provider did not open the stream within the call timeout of {}",
                    humantime::format_duration(call_timeout)
                )),
            )),
        }
    }

    /// ValidatePlacement when the provider supports it; `Ok(())` when it does not.
    pub async fn validate_placement(&self, placement: pb::Placement) -> Result<()> {
        let info = self.handshake().await?;
        if !info
            .capabilities
            .contains(&pb::Capability::ValidatePlacement)
        {
            return Ok(());
        }
        let request = pb::ValidatePlacementRequest {
            placement: Some(placement),
        };
        match self
            .call("ValidatePlacement", |mut c| async move {
                c.validate_placement(request).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::Unimplemented => {
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Plugin info and capabilities, asked once and cached; refuses another major
    /// contract version. Concurrent callers share one handshake.
    pub async fn handshake(&self) -> Result<PluginInfo> {
        let failures_before = {
            let state = self.state();
            if let Some(info) = &state.info {
                return Ok(info.clone());
            }
            state.handshake_failures
        };
        let _turn = self.handshake_turn.lock().await;
        {
            let state = self.state();
            if let Some(info) = &state.info {
                return Ok(info.clone());
            }
            if state.handshake_failures != failures_before
                && let Some(failure) = state.last_handshake_failure.clone()
            {
                return Err(self.handshake_error(failure));
            }
        }
        let outcome = self.ask_plugin_info().await;
        let mut state = self.state();
        match outcome {
            Ok(info) => {
                tracing::info!(provider = %self.name, plugin = %info.name, version = %info.vendor_version,
                    contract = %info.contract_version, "provider handshake done");
                state.info = Some(info.clone());
                Ok(info)
            }
            Err(error) => {
                let failure = match &error {
                    Error::Provider { op, source, .. } => Some(HandshakeFailure::Call {
                        op,
                        error: (**source).clone(),
                    }),
                    Error::IncompatibleProvider {
                        found, expected, ..
                    } => Some(HandshakeFailure::Incompatible {
                        found: found.clone(),
                        expected: expected.clone(),
                    }),
                    // Building the client failed before any call: waiters try it
                    // themselves, which costs the provider nothing.
                    _ => None,
                };
                if let Some(failure) = failure {
                    state.handshake_failures += 1;
                    state.last_handshake_failure = Some(failure);
                }
                Err(error)
            }
        }
    }

    fn handshake_error(&self, failure: HandshakeFailure) -> Error {
        match failure {
            HandshakeFailure::Call { op, error } => self.error(op, error),
            HandshakeFailure::Incompatible { found, expected } => Error::IncompatibleProvider {
                provider: self.name.clone(),
                found,
                expected,
            },
        }
    }

    async fn ask_plugin_info(&self) -> Result<PluginInfo> {
        let info = self
            .call("GetPluginInfo", |mut c| async move {
                c.get_plugin_info(pb::GetPluginInfoRequest {}).await
            })
            .await?;
        let expected = major(CONTRACT_VERSION);
        if major(&info.contract_version) != expected {
            return Err(Error::IncompatibleProvider {
                provider: self.name.clone(),
                found: info.contract_version,
                expected: expected.to_owned(),
            });
        }
        let capabilities = match self
            .call("GetCapabilities", |mut c| async move {
                c.get_capabilities(pb::GetCapabilitiesRequest {}).await
            })
            .await
        {
            Ok(answer) => answer.capabilities().collect(),
            Err(Error::Provider { source, .. }) if source.class == ErrorClass::Unimplemented => {
                Vec::new()
            }
            Err(error) => return Err(error),
        };
        Ok(PluginInfo {
            name: info.name,
            vendor_version: info.vendor_version,
            contract_version: info.contract_version,
            capabilities,
        })
    }
}

fn tls_files(config: &ProviderConfig) -> Vec<PathBuf> {
    let Some(tls) = &config.tls else {
        return Vec::new();
    };
    [Some(tls.ca.clone()), tls.cert.clone(), tls.key.clone()]
        .into_iter()
        .flatten()
        .collect()
}

fn major(version: &str) -> &str {
    version.split('.').next().unwrap_or_default()
}

/// The classified error of a failed call. When the client could not reach the
/// provider, tonic's message alone ("tcp connect error") names neither the endpoint
/// nor the cause: add both, the cause from the transport error's source chain.
fn explain_unavailable(status: &tonic::Status, endpoint: &str) -> ProviderError {
    let mut error = ProviderError::from(status.clone());
    // Only a failure on the client's side carries a source; an UNAVAILABLE that the
    // provider itself answered already says what it means.
    if status.code() != tonic::Code::Unavailable || std::error::Error::source(status).is_none() {
        return error;
    }
    error.message = egressproxy_provider::error::append_causes(
        format!("{endpoint}: {}", error.message),
        status,
    );
    error
}
