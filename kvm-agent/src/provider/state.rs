//! What a domain's libvirt state and its addresses mean for the contract.
//!
//! State: `running` and `blocked` are RUNNING once the guest has an address,
//! PROVISIONING before; `nostate` is PROVISIONING (a domain between states), never
//! STOPPED, which would make the operator delete and recreate a booting VM; `paused`,
//! `shutdown`, `shutoff`, `crashed` and `pmsuspended` are STOPPED.
//!
//! Addresses come from [`crate::libvirt::addresses`]; no address yet is PROVISIONING,
//! not an error. Get, List and Create build their answer through the one
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

/// The contract's view of a domain on `host`.
pub fn to_contract_instance(host: &str, snapshot: DomainSnapshot) -> pb::Instance {
    let (state, message) = instance_state(snapshot.state, !snapshot.addresses.is_empty());
    let metadata = snapshot.metadata;
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
        addresses: snapshot
            .addresses
            .into_iter()
            .map(to_contract_address)
            .collect(),
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
