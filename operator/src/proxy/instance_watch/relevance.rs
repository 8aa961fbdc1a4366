//! Which change of an instance is worth reconciling its Proxy at once: a pure decision,
//! so that a watch's snapshot (every instance, at every start) and the PROVISIONING
//! event that follows each Create do not reconcile Proxies that would learn nothing.
//! Missing a change here only delays it to the Proxy's next periodic reconcile.
//!
//! | the Proxy | the change | reconcile now? |
//! |---|---|---|
//! | being deleted | any | no: its cleanup waits for nothing the provider reports |
//! | any | gone, its recorded instance | yes: replace it |
//! | any | gone, another instance | no |
//! | any | another instance, PROVISIONING | no: the Create that made it is still looking |
//! | any | another instance, any other state | yes: its id may not be recorded yet |
//! | Ready or Degraded | PROVISIONING | yes: it went back |
//! | not Ready nor Degraded | PROVISIONING | no: nothing new |
//! | not Ready nor Degraded | RUNNING without an address | no: nothing new |
//! | not Ready nor Degraded | RUNNING with an address | yes: check the proxy |
//! | Ready or Degraded | RUNNING, the addresses and location recorded | no: nothing new |
//! | Ready or Degraded | RUNNING, other addresses | yes: record and check them |
//! | Ready or Degraded | RUNNING, another location (moved, or none recorded yet) | yes: record it |
//! | any | STOPPED, DELETING or a state this operator does not know | yes |

use std::collections::BTreeSet;

use egressproxy_provider::pb::{self, InstanceState};

use crate::crd::{Phase, Proxy, ProxyStatus};
use crate::providers::placement;

/// What a watch reported about one instance.
#[derive(Debug, Clone, Copy)]
pub enum Change<'a> {
    /// The instance as it is now.
    Updated(&'a pb::Instance),
    /// The instance with this id is gone.
    Gone(&'a str),
}

impl Change<'_> {
    fn id(&self) -> &str {
        match self {
            Change::Updated(instance) => &instance.id,
            Change::Gone(id) => id,
        }
    }
}

/// Whether `change` should reconcile `proxy` at once (the module's table).
pub fn worth_reconciling(proxy: &Proxy, change: Change<'_>) -> bool {
    if proxy.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let status = proxy.status.clone().unwrap_or_default();
    let recorded = status.provider_id.as_deref() == Some(change.id());
    let instance = match change {
        Change::Gone(_) => return recorded,
        Change::Updated(instance) => instance,
    };
    let state = instance.state();
    if !recorded {
        return state != InstanceState::Provisioning;
    }
    let serving = matches!(status.phase, Some(Phase::Ready | Phase::Degraded));
    match state {
        InstanceState::Provisioning => serving,
        InstanceState::Running if serving => {
            !same_addresses(&status, instance) || !same_location(&status, instance)
        }
        InstanceState::Running => !instance.addresses.is_empty(),
        _ => true,
    }
}

/// Whether the status records exactly the instance's addresses (in any order: the
/// status puts the one it checks first).
fn same_addresses(status: &ProxyStatus, instance: &pb::Instance) -> bool {
    let recorded: BTreeSet<&str> = status
        .addresses
        .iter()
        .map(|a| a.address.as_str())
        .collect();
    let reported: BTreeSet<&str> = instance
        .addresses
        .iter()
        .map(|a| a.address.as_str())
        .collect();
    recorded == reported
}

/// Whether the status records where the instance reports it runs. A report without a
/// location tells nothing new: the reconcile keeps the one it knows.
fn same_location(status: &ProxyStatus, instance: &pb::Instance) -> bool {
    placement::location_of(instance.placement.as_ref())
        .is_none_or(|reported| status.location.as_ref() == Some(&reported))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ProxyAddress;

    fn proxy(phase: Option<Phase>, id: Option<&str>, addresses: &[&str]) -> Proxy {
        let mut proxy: Proxy = serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": "p", "namespace": "n", "uid": "u"},
            "spec": {"provider": "kvm", "placement": {"machineType": "small", "image": "debian-12"}},
        }))
        .unwrap();
        proxy.status = Some(ProxyStatus {
            phase,
            provider_id: id.map(str::to_owned),
            addresses: addresses
                .iter()
                .map(|a| ProxyAddress {
                    address: (*a).to_owned(),
                    scope: "Internal".into(),
                    family: "IPv4".into(),
                })
                .collect(),
            ..ProxyStatus::default()
        });
        proxy
    }

    fn instance(id: &str, state: InstanceState, addresses: &[&str]) -> pb::Instance {
        pb::Instance {
            id: id.into(),
            state: state.into(),
            addresses: addresses
                .iter()
                .map(|a| pb::Address {
                    address: (*a).to_owned(),
                    ..pb::Address::default()
                })
                .collect(),
            ..pb::Instance::default()
        }
    }

    /// `proxy` recorded on host `host`.
    fn recorded_on(mut proxy: Proxy, host: &str) -> Proxy {
        if let Some(status) = proxy.status.as_mut() {
            status.location = Some(crate::crd::InstanceLocation {
                host: Some(host.into()),
                zone: None,
            });
        }
        proxy
    }

    /// `instance` reported on host `host`.
    fn on(mut instance: pb::Instance, host: &str) -> pb::Instance {
        instance.placement = Some(pb::Placement {
            location: Some(pb::placement::Location::Host(host.into())),
            ..pb::Placement::default()
        });
        instance
    }

    /// The module's table, row for row.
    #[test]
    fn the_table() {
        use InstanceState::{Deleting, Provisioning, Running, Stopped, Unspecified};
        use Phase::{Degraded, Pending, Ready};
        let ip = ["10.0.0.7"];
        let mut deleting = proxy(Some(Ready), Some("i"), &ip);
        deleting.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
        );
        let running = instance("i", Running, &ip);
        let cases: Vec<(&str, Proxy, pb::Instance, Option<&str>, bool)> = vec![
            (
                "deleting, gone",
                deleting.clone(),
                running.clone(),
                Some("i"),
                false,
            ),
            (
                "deleting, stopped",
                deleting,
                instance("i", Stopped, &ip),
                None,
                false,
            ),
            (
                "its instance gone",
                proxy(Some(Ready), Some("i"), &ip),
                running.clone(),
                Some("i"),
                true,
            ),
            (
                "another gone",
                proxy(Some(Ready), Some("i"), &ip),
                running.clone(),
                Some("old"),
                false,
            ),
            (
                "another provisioning",
                proxy(Some(Pending), None, &[]),
                instance("new", Provisioning, &[]),
                None,
                false,
            ),
            (
                "another running",
                proxy(Some(Pending), None, &[]),
                instance("new", Running, &ip),
                None,
                true,
            ),
            (
                "serving, provisioning",
                proxy(Some(Degraded), Some("i"), &ip),
                instance("i", Provisioning, &[]),
                None,
                true,
            ),
            (
                "waiting, provisioning",
                proxy(Some(Phase::Provisioning), Some("i"), &[]),
                instance("i", Provisioning, &[]),
                None,
                false,
            ),
            (
                "waiting, running without address",
                proxy(Some(Phase::Provisioning), Some("i"), &[]),
                instance("i", Running, &[]),
                None,
                false,
            ),
            (
                "waiting, running with address",
                proxy(Some(Phase::Provisioning), Some("i"), &[]),
                running.clone(),
                None,
                true,
            ),
            (
                "no phase yet, running with address",
                proxy(None, Some("i"), &[]),
                running.clone(),
                None,
                true,
            ),
            (
                "ready, same addresses",
                proxy(Some(Ready), Some("i"), &ip),
                running.clone(),
                None,
                false,
            ),
            (
                "ready, other addresses",
                proxy(Some(Ready), Some("i"), &ip),
                instance("i", Running, &["10.0.0.8"]),
                None,
                true,
            ),
            (
                "ready, same addresses and host",
                recorded_on(proxy(Some(Ready), Some("i"), &ip), "h0"),
                on(running.clone(), "h0"),
                None,
                false,
            ),
            (
                "ready, moved to another host",
                recorded_on(proxy(Some(Ready), Some("i"), &ip), "h0"),
                on(running.clone(), "h1"),
                None,
                true,
            ),
            (
                "ready, no host recorded yet",
                proxy(Some(Ready), Some("i"), &ip),
                on(running.clone(), "h0"),
                None,
                true,
            ),
            (
                "ready, stopped",
                proxy(Some(Ready), Some("i"), &ip),
                instance("i", Stopped, &ip),
                None,
                true,
            ),
            (
                "ready, deleting",
                proxy(Some(Ready), Some("i"), &ip),
                instance("i", Deleting, &ip),
                None,
                true,
            ),
            (
                "ready, unknown state",
                proxy(Some(Ready), Some("i"), &ip),
                instance("i", Unspecified, &ip),
                None,
                true,
            ),
        ];
        for (row, proxy, instance, gone, expected) in cases {
            let change = match gone {
                Some(id) => Change::Gone(id),
                None => Change::Updated(&instance),
            };
            assert_eq!(worth_reconciling(&proxy, change), expected, "{row}");
        }
    }
}
