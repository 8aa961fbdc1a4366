//! Observing a Proxy's world, each part fetched once per pass: the provider (looked
//! up and handshaken), the recorded instance (GetInstance), its proxy (the health
//! check, when the instance runs with an address), and the cloud-init Secret (only
//! when an instance is about to be created).

use std::net::SocketAddr;

use egressproxy_provider::pb;

use super::key::ProxyKey;
use crate::context::Context;
use crate::crd::{Proxy, ProxyStatus};
use crate::probe::address::probe_address;
use crate::probe::health_check;
use crate::providers::Provider;
use crate::shared::error::Result;
use crate::shared::tables::shrink_when_sparse;

/// What was observed.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// The recorded instance, as the provider reports it.
    pub instance: Instance,
    /// The health check of its proxy, when it runs with an address.
    pub health: Option<Health>,
    /// When it was observed: the provisioning timeout is measured against it.
    pub at: jiff::Timestamp,
}

/// The recorded instance at the provider.
#[derive(Debug, Clone, PartialEq)]
pub enum Instance {
    /// Not looked up: none is recorded, or the placement changed so it goes anyway.
    NotLookedUp,
    /// The provider no longer knows the recorded instance (NOT_FOUND).
    Vanished,
    /// The provider's answer.
    Found(Box<pb::Instance>),
}

/// One health check and the failures in a row it makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// The check's result; `Err` says what failed.
    pub result: Result<(), String>,
    /// Consecutive failures including this one (0 after a pass).
    pub consecutive_failures: u32,
}

/// The Proxy's provider, after its handshake (contract version checked).
pub async fn provider<'a>(ctx: &'a Context, proxy: &Proxy) -> Result<&'a Provider> {
    let provider = ctx.providers.get(&proxy.spec.provider)?;
    provider.handshake().await?;
    Ok(provider)
}

/// Looks up the recorded instance and, when it runs with an address, checks its
/// proxy (counting failures in a row per Proxy).
pub async fn observe(
    ctx: &Context,
    key: &ProxyKey,
    proxy: &Proxy,
    status: &ProxyStatus,
    provider: &Provider,
) -> Result<Observation> {
    let id = match &status.provider_id {
        Some(id) if status.placement.as_ref() == Some(&proxy.spec.placement) => id,
        _ => {
            return Ok(Observation {
                instance: Instance::NotLookedUp,
                health: None,
                at: jiff::Timestamp::now(),
            });
        }
    };
    let Some(instance) = provider.get(id).await? else {
        return Ok(Observation {
            instance: Instance::Vanished,
            health: None,
            at: jiff::Timestamp::now(),
        });
    };
    let health = if instance.state() == pb::InstanceState::Running {
        match probe_address(&instance.addresses) {
            Some(ip) => {
                let check = proxy.spec.health_check.clone().unwrap_or_default();
                let address = SocketAddr::new(ip, proxy.spec.proxy_port);
                let result = health_check::probe(address, &check).await;
                Some(count_failures(ctx, key, result))
            }
            None if instance.addresses.is_empty() => None,
            None => Some(count_failures(
                ctx,
                key,
                Err("the provider reported no usable IP address".to_owned()),
            )),
        }
    } else {
        None
    };
    Ok(Observation {
        instance: Instance::Found(Box::new(instance)),
        health,
        at: jiff::Timestamp::now(),
    })
}

fn count_failures(ctx: &Context, key: &ProxyKey, result: Result<(), String>) -> Health {
    let mut failures = ctx
        .health_failures
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let consecutive_failures = if result.is_ok() {
        failures.remove(&key.uid);
        shrink_when_sparse(&mut failures);
        0
    } else {
        let count = failures.entry(key.uid.clone()).or_default();
        *count = count.saturating_add(1);
        *count
    };
    Health {
        result,
        consecutive_failures,
    }
}

/// The cloud-init input for a new instance: inline, or read from its Secret.
pub async fn cloud_init(ctx: &Context, key: &ProxyKey, proxy: &Proxy) -> Result<pb::CloudInit> {
    crate::k8s::cloud_init::read(&ctx.client, &key.namespace, &proxy.spec).await
}
