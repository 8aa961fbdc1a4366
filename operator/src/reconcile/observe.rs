//! Observing a Proxy's world, each part fetched once per pass: the provider (looked
//! up and handshaken), the recorded instance (GetInstance), its proxy (the health
//! check, when the instance runs with an address), and the cloud-init Secret (only
//! when an instance is about to be created).

use std::net::{IpAddr, SocketAddr};

use egressproxy_provider::pb;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use super::key::ProxyKey;
use crate::context::Context;
use crate::crd::{Proxy, ProxyStatus};
use crate::error::{Error, Result};
use crate::health_check;
use crate::providers::Provider;

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
    let Some(spec) = &proxy.spec.cloud_init else {
        return Ok(pb::CloudInit::default());
    };
    let user_data =
        match (&spec.user_data, &spec.user_data_secret_ref) {
            (Some(inline), _) => inline.clone().into_bytes(),
            (None, Some(reference)) => {
                let secret_name = format!("{}/{}", key.namespace, reference.name);
                let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &key.namespace);
                let secret = secrets.get_opt(&reference.name).await?.ok_or_else(|| {
                    Error::CloudInitSecret {
                        secret: secret_name.clone(),
                        problem:
                            "not found: create it, or fix spec.cloudInit.userDataSecretRef.name"
                                .into(),
                    }
                })?;
                let value = secret
                    .data
                    .as_ref()
                    .and_then(|data| data.get(&reference.key));
                value
                    .map(|bytes| bytes.0.clone())
                    .ok_or_else(|| Error::CloudInitSecret {
                        secret: secret_name,
                        problem: format!(
                            "has no key {:?}: fix spec.cloudInit.userDataSecretRef.key",
                            reference.key
                        ),
                    })?
            }
            (None, None) => Vec::new(),
        };
    Ok(pb::CloudInit {
        user_data,
        vendor_data: spec.vendor_data.clone().map(String::into_bytes),
    })
}

/// The address the proxy is checked at, as the contract tells callers to choose: the
/// first usable `INTERNAL` address, and an `EXTERNAL` one only when there is none. An
/// external address is often not reachable from inside the cluster, where the operator
/// and the proxy's clients run.
pub(crate) fn probe_address(addresses: &[pb::Address]) -> Option<IpAddr> {
    let usable = |internal: bool| {
        addresses
            .iter()
            .filter(move |a| (a.scope() != pb::AddressScope::External) == internal)
            .find_map(|a| a.address.parse::<IpAddr>().ok())
    };
    usable(true).or_else(|| usable(false))
}

#[cfg(test)]
mod probe_address_tests {
    use super::*;

    fn address(ip: &str, scope: pb::AddressScope) -> pb::Address {
        let mut address = pb::Address {
            address: ip.to_owned(),
            ..pb::Address::default()
        };
        address.set_scope(scope);
        address
    }

    #[test]
    fn an_internal_address_wins_over_an_external_one_listed_first() {
        let addresses = [
            address("203.0.113.7", pb::AddressScope::External),
            address("10.0.0.7", pb::AddressScope::Internal),
        ];
        assert_eq!(probe_address(&addresses), Some("10.0.0.7".parse().unwrap()));
    }

    #[test]
    fn an_external_address_is_used_when_there_is_no_internal_one() {
        let addresses = [
            address("not-an-ip", pb::AddressScope::Internal),
            address("203.0.113.7", pb::AddressScope::External),
        ];
        assert_eq!(
            probe_address(&addresses),
            Some("203.0.113.7".parse().unwrap())
        );
    }

    #[test]
    fn no_usable_address_is_none() {
        assert_eq!(probe_address(&[]), None);
        assert_eq!(
            probe_address(&[address("", pb::AddressScope::Internal)]),
            None
        );
    }
}
