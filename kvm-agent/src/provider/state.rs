//! What a domain's libvirt state and its addresses mean for the contract.
//!
//! State: `running` and `blocked` are RUNNING once the guest has an address,
//! PROVISIONING before; `nostate` is PROVISIONING (a domain between states), never
//! STOPPED, which would make the operator delete and recreate a booting VM; `paused`,
//! `shutdown`, `shutoff`, `crashed` and `pmsuspended` are STOPPED.
//!
//! Addresses come from [`crate::libvirt::addresses`]; no address yet is PROVISIONING,
//! not an error. An instance given a static address (a bridge host's
//! `staticAddresses`) reports that address first whenever its domain runs, before the
//! guest reports any and whatever else the guest reports ([`reported_addresses`]); its
//! state still waits for the guest: RUNNING once the guest reports an address, so
//! RUNNING keeps meaning the guest's network is up. Get, List and Create build their answer through the one
//! [`to_contract_instance`], so the same domain always reads the same.

use std::net::IpAddr;

use egressproxy_provider::pb;
use virt::sys;

use crate::libvirt::domains::DomainSnapshot;
use crate::libvirt::naming::InstanceId;

/// The contract state of a domain in libvirt state `state`, with a message for humans.
pub fn instance_state(
    state: sys::virDomainState,
    has_address: bool,
) -> (pb::InstanceState, &'static str) {
    use pb::InstanceState as S;
    match state {
        sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED if has_address => (S::Running, ""),
        sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED => {
            (S::Provisioning, "booting: waiting for an address")
        }
        sys::VIR_DOMAIN_NOSTATE => (S::Provisioning, "starting"),
        sys::VIR_DOMAIN_PAUSED => (S::Stopped, "paused"),
        sys::VIR_DOMAIN_SHUTDOWN => (S::Stopped, "shutting down"),
        sys::VIR_DOMAIN_SHUTOFF => (S::Stopped, "shut off"),
        sys::VIR_DOMAIN_CRASHED => (S::Stopped, "crashed"),
        sys::VIR_DOMAIN_PMSUSPENDED => (S::Stopped, "suspended by the guest"),
        // A state newer than this agent: not a reason to replace the VM.
        _ => (S::Provisioning, "in a state this agent does not know"),
    }
}

/// An address as the contract reports it. The agent only knows addresses on the
/// hypervisor's networks, so they are internal.
pub(crate) fn to_contract_address(address: IpAddr) -> pb::Address {
    pb::Address {
        address: address.to_string(),
        scope: pb::AddressScope::Internal.into(),
        family: match address {
            IpAddr::V4(_) => pb::IpFamily::V4,
            IpAddr::V6(_) => pb::IpFamily::V6,
        }
        .into(),
    }
}

/// The addresses an instance reports: while its domain runs, its static address (if it
/// has one) first, then what the guest reports (`observed`) without repeating it.
pub fn reported_addresses(
    static_address: Option<IpAddr>,
    state: sys::virDomainState,
    observed: Vec<IpAddr>,
) -> Vec<IpAddr> {
    let running = matches!(state, sys::VIR_DOMAIN_RUNNING | sys::VIR_DOMAIN_BLOCKED);
    match static_address {
        Some(address) if running => std::iter::once(address)
            .chain(observed.into_iter().filter(|a| *a != address))
            .collect(),
        _ => observed,
    }
}

/// The contract's view of a domain on `host`.
pub fn to_contract_instance(host: &str, snapshot: DomainSnapshot) -> pb::Instance {
    let (state, message) = instance_state(snapshot.state, !snapshot.addresses.is_empty());
    let metadata = snapshot.metadata;
    let addresses = reported_addresses(metadata.static_address, snapshot.state, snapshot.addresses);
    let id = InstanceId {
        host: host.to_owned(),
        key: metadata.key.clone(),
    };
    pb::Instance {
        id: id.to_string(),
        key: metadata.key,
        name: metadata.name,
        state: state.into(),
        state_message: message.to_owned(),
        addresses: addresses.into_iter().map(to_contract_address).collect(),
        create_time: metadata.created.parse().ok(),
        tags: metadata.tags.into_iter().collect(),
        placement: Some(pb::Placement {
            location: Some(match metadata.placement.zone {
                Some(zone) => pb::placement::Location::Zone(zone),
                None => pb::placement::Location::Host(metadata.placement.host),
            }),
            machine_type: metadata.placement.machine_type,
            image: metadata.placement.image,
        }),
        proxy_port: metadata.proxy_port,
        address_identity: metadata.address_identity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::InstanceState as S;

    #[test]
    fn every_libvirt_state_maps_to_the_contract_state() {
        let table = [
            (sys::VIR_DOMAIN_RUNNING, true, S::Running),
            (sys::VIR_DOMAIN_BLOCKED, true, S::Running),
            (sys::VIR_DOMAIN_RUNNING, false, S::Provisioning),
            (sys::VIR_DOMAIN_BLOCKED, false, S::Provisioning),
            (sys::VIR_DOMAIN_NOSTATE, true, S::Provisioning),
            (sys::VIR_DOMAIN_NOSTATE, false, S::Provisioning),
            (sys::VIR_DOMAIN_PAUSED, true, S::Stopped),
            (sys::VIR_DOMAIN_SHUTDOWN, true, S::Stopped),
            (sys::VIR_DOMAIN_SHUTOFF, false, S::Stopped),
            (sys::VIR_DOMAIN_CRASHED, false, S::Stopped),
            (sys::VIR_DOMAIN_PMSUSPENDED, true, S::Stopped),
            (99, true, S::Provisioning),
        ];
        for (state, has_address, want) in table {
            assert_eq!(
                instance_state(state, has_address).0,
                want,
                "state {state} address {has_address}"
            );
        }
    }

    #[test]
    fn a_static_address_comes_first_while_the_domain_runs() {
        let ip = |text: &str| -> IpAddr { text.parse().unwrap() };
        let fixed = Some(ip("192.0.2.12"));
        type Case = (
            Option<IpAddr>,
            sys::virDomainState,
            Vec<IpAddr>,
            Vec<IpAddr>,
        );
        let table: Vec<Case> = vec![
            // Before the guest reports anything.
            (
                fixed,
                sys::VIR_DOMAIN_RUNNING,
                vec![],
                vec![ip("192.0.2.12")],
            ),
            // Once it does: once, first.
            (
                fixed,
                sys::VIR_DOMAIN_RUNNING,
                vec![ip("192.0.2.12")],
                vec![ip("192.0.2.12")],
            ),
            // Another address the guest has (a foreign DHCP server's): after it.
            (
                fixed,
                sys::VIR_DOMAIN_BLOCKED,
                vec![ip("198.51.100.7"), ip("192.0.2.12")],
                vec![ip("192.0.2.12"), ip("198.51.100.7")],
            ),
            // Not running: nothing, like any instance.
            (fixed, sys::VIR_DOMAIN_SHUTOFF, vec![], vec![]),
            // No static address: what the guest reports.
            (
                None,
                sys::VIR_DOMAIN_RUNNING,
                vec![ip("10.0.0.5")],
                vec![ip("10.0.0.5")],
            ),
        ];
        for (fixed, state, observed, want) in table {
            assert_eq!(
                reported_addresses(fixed, state, observed.clone()),
                want,
                "{fixed:?} {state} {observed:?}"
            );
        }
    }

    #[test]
    fn contract_addresses_carry_their_family() {
        let v6 = to_contract_address("2001:db8::10".parse().unwrap());
        assert_eq!(v6.family(), pb::IpFamily::V6);
        assert_eq!(v6.scope(), pb::AddressScope::Internal);
        assert_eq!(
            to_contract_address("10.0.0.1".parse().unwrap()).family(),
            pb::IpFamily::V4
        );
    }
}
