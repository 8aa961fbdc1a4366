//! Checks of a running provider from outside: its gRPC health, and a listing of its
//! instances. For exec probes (the kubelet's own gRPC probe speaks no TLS, so it cannot
//! check a provider that serves TLS or mutual TLS) and for `helm test`.
//!
//! 1. The connection uses the same [`ClientOptions`] as the operator: TLS with a CA and
//!    a server name, and a client certificate for mutual TLS.
//! 2. Health asks the standard `grpc.health.v1.Health/Check` for the whole server (the
//!    empty service name): only `SERVING` passes; `NOT_SERVING` (shutting down), an
//!    error, or no answer within the deadline fails, with the reason.
//! 3. The listing walks every page of `ListInstances`, bounded by the same deadline per
//!    call.

use std::time::Duration;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::client::{ClientOptions, connect_lazy, raw_channel};
use crate::error::{append_causes, with_causes};
use crate::pb;

/// Most pages a listing reads before it gives up (a provider that never stops paging).
const MAX_PAGES: usize = 1000;

/// Whether the provider at `options` says it is `SERVING`; `Err` says why not.
pub async fn check_health(options: &ClientOptions) -> Result<(), String> {
    let endpoint = options.endpoint.clone();
    let channel = raw_channel(options).map_err(|error| with_causes(&error))?;
    let mut health = HealthClient::new(channel);
    let asked = health.check(HealthCheckRequest {
        service: String::new(),
    });
    let answer = tokio::time::timeout(options.call_timeout, asked)
        .await
        .map_err(|_| {
            format!(
                "{endpoint}: no health answer within {:?}",
                options.call_timeout
            )
        })?
        .map_err(|status| format!("{endpoint}: {}", describe(&status)))?;
    match answer.into_inner().status() {
        ServingStatus::Serving => Ok(()),
        other => Err(format!("{endpoint}: health is {}", other.as_str_name())),
    }
}

/// Every instance the provider at `options` lists.
pub async fn list_instances(options: &ClientOptions) -> Result<Vec<pb::Instance>, String> {
    let endpoint = options.endpoint.clone();
    let mut client = connect_lazy(options).map_err(|error| with_causes(&error))?;
    let mut instances = Vec::new();
    let mut page_token = String::new();
    for _ in 0..MAX_PAGES {
        let page = client
            .list_instances(pb::ListInstancesRequest {
                page_token: page_token.clone(),
                ..Default::default()
            })
            .await
            .map_err(|status| format!("{endpoint}: ListInstances: {}", describe(&status)))?
            .into_inner();
        instances.extend(page.instances);
        if page.next_page_token.is_empty() {
            return Ok(instances);
        }
        page_token = page.next_page_token;
    }
    Err(format!(
        "{endpoint}: ListInstances did not end after {MAX_PAGES} pages"
    ))
}

/// Options for a probe of `address` (`host:port`): TLS when `ca` is given, verifying
/// `server_name` (default: the host), with the client certificate `identity`.
pub fn options(
    address: &str,
    ca: Option<std::path::PathBuf>,
    server_name: Option<String>,
    identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    timeout: Duration,
) -> ClientOptions {
    let scheme = if ca.is_some() { "https" } else { "http" };
    let mut options = ClientOptions::new(format!("{scheme}://{address}"));
    options.call_timeout = timeout;
    options.connect_timeout = timeout;
    options.tls = ca.map(|ca| crate::client::ClientTls {
        ca,
        domain: server_name,
        identity,
    });
    options
}

/// A status as a person reads it, with its transport cause (a TLS refusal, a refused
/// connection), which tonic keeps in the source chain.
fn describe(status: &tonic::Status) -> String {
    append_causes(format!("{:?}: {}", status.code(), status.message()), status)
}
