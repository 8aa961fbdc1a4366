//! Observing a Proxy's world, each part fetched once per pass: the provider (looked
//! up and handshaken), the recorded instance (GetInstance), its proxy (the health
//! check, when the instance runs with an address), and the cloud-init Secret (only
//! when an instance is about to be created).

use std::net::{IpAddr, SocketAddr};

use egressproxy_provider::pb;
use egressproxy_provider::validation::MAX_USER_DATA_BYTES;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use super::key::ProxyKey;
use crate::context::Context;
use crate::crd::{Proxy, ProxyStatus};
use crate::probe::health_check;
use crate::providers::Provider;
use crate::shared::error::{Error, Result};

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
    let user_data = match (&spec.user_data, &spec.user_data_secret_ref) {
        (Some(inline), _) => inline.clone().into_bytes(),
        (None, Some(reference)) => {
            let secret_name = format!("{}/{}", key.namespace, reference.name);
            let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &key.namespace);
            let secret =
                secrets
                    .get_opt(&reference.name)
                    .await?
                    .ok_or_else(|| Error::CloudInitSecret {
                        secret: secret_name.clone(),
                        problem:
                            "not found: create it, or fix spec.cloudInit.userDataSecretRef.name"
                                .into(),
                    })?;
            let value = secret
                .data
                .as_ref()
                .and_then(|data| data.get(&reference.key));
            let user_data =
                value
                    .map(|bytes| bytes.0.clone())
                    .ok_or_else(|| Error::CloudInitSecret {
                        secret: secret_name.clone(),
                        problem: format!(
                            "has no key {:?}: fix spec.cloudInit.userDataSecretRef.key",
                            reference.key
                        ),
                    })?;
            // Inline user-data is checked at admission; a Secret's only here, and
            // the error names the Secret, which a person fixes without touching
            // the Proxy.
            if user_data.len() > MAX_USER_DATA_BYTES {
                return Err(Error::CloudInitSecret {
                    secret: secret_name,
                    problem: format!(
                        "key {:?} holds {} bytes of user-data, over the {MAX_USER_DATA_BYTES}-byte limit: \
                             move large files into the image or fetch them at boot",
                        reference.key,
                        user_data.len()
                    ),
                });
            }
            user_data
        }
        (None, None) => Vec::new(),
    };
    Ok(pb::CloudInit {
        user_data,
        vendor_data: spec.vendor_data.clone().map(String::into_bytes),
    })
}

/// The address the proxy is checked at, as the contract tells callers to choose: the
/// first `INTERNAL` address of an IP family the operator reaches, and an `EXTERNAL` one
/// only when there is none. An external address is often not reachable from inside the
/// cluster, where the operator and the proxy's clients run; an address of a family the
/// operator has no route for (IPv6 in an IPv4-only cluster) is tried only when no other
/// is left.
pub(crate) fn probe_address(addresses: &[pb::Address]) -> Option<IpAddr> {
    choose_address(addresses, has_route)
}

/// [`probe_address`] with the reachability of an address given.
fn choose_address(addresses: &[pb::Address], reaches: impl Fn(IpAddr) -> bool) -> Option<IpAddr> {
    let usable: Vec<(bool, IpAddr)> = addresses
        .iter()
        .filter_map(|a| {
            let ip = a
                .address
                .parse::<IpAddr>()
                .ok()
                .filter(|ip| !ip.is_unspecified())?;
            Some((a.scope() != pb::AddressScope::External, ip))
        })
        .collect();
    let first = |internal: bool, reachable: bool| {
        usable
            .iter()
            .find(|(is_internal, ip)| *is_internal == internal && (!reachable || reaches(*ip)))
            .map(|(_, ip)| *ip)
    };
    first(true, true)
        .or_else(|| first(false, true))
        .or_else(|| first(true, false))
        .or_else(|| first(false, false))
}

/// Whether this host has a route to `ip`: the kernel's route lookup for a UDP socket
/// connected to it (no packet is sent). False for a family the host has no address or
/// route for.
fn has_route(ip: IpAddr) -> bool {
    let any: SocketAddr = match ip {
        IpAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    std::net::UdpSocket::bind(any)
        .and_then(|socket| socket.connect(SocketAddr::new(ip, 9)))
        .is_ok()
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

    /// Before, the first internal address won whatever its family: an IPv6 address
    /// listed first was checked from an IPv4-only cluster.
    #[test]
    fn the_first_internal_address_of_a_family_the_operator_reaches_wins() {
        let addresses = [
            address("2001:db8::7", pb::AddressScope::Internal),
            address("10.0.0.7", pb::AddressScope::Internal),
            address("203.0.113.7", pb::AddressScope::External),
        ];
        let v4_only = |ip: IpAddr| ip.is_ipv4();
        assert_eq!(
            choose_address(&addresses, v4_only),
            Some("10.0.0.7".parse().unwrap())
        );
        let both = |_: IpAddr| true;
        assert_eq!(
            choose_address(&addresses, both),
            Some("2001:db8::7".parse().unwrap())
        );
        // Nothing internal is reachable: a reachable external one, then anything.
        let only_public = |ip: IpAddr| ip == "203.0.113.7".parse::<IpAddr>().unwrap();
        assert_eq!(
            choose_address(&addresses, only_public),
            Some("203.0.113.7".parse().unwrap())
        );
        let none = |_: IpAddr| false;
        assert_eq!(
            choose_address(&addresses, none),
            Some("2001:db8::7".parse().unwrap())
        );
    }

    #[test]
    fn loopback_has_a_route() {
        assert!(has_route("127.0.0.1".parse().unwrap()));
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
