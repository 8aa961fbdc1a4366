//! ListLocations: every configured host and every zone, with the machine types and
//! images the agent offers and the room of each.
//!
//! 1. Every host is measured at once ([`room::measure`]), each for a few seconds at
//!    most, so one host that does not answer does not hold the answer up.
//! 2. A host lists its zone, every configured machine type with its size and room
//!    ([`room::room_for`]), every configured image, and its capacity
//!    ([`room::capacity`]). A host that did not answer is still listed, with capacity
//!    and room unset and a message saying why (a caller sees every location and why it
//!    cannot place there now).
//! 3. A zone adds up its hosts that answered: the room of a machine type is the sum of
//!    its hosts' (each host takes its own instances), and so are free memory, CPUs and
//!    instances; the instance limit only when every such host has one. A zone whose
//!    hosts all failed to answer has no figures.
//! 4. The contract crate filters and pages the list ([`locations::answer`]).

use egressproxy_provider::locations;
use egressproxy_provider::pb::{self, location::Name};
use tokio::time::Instant;

use crate::config::Config;
use crate::error::Error;
use crate::provider::plan::zone_names;
use crate::provider::room::{self, Candidate};
use crate::transport::pool::Pool;

/// ListLocations' answer on the hosts of `config`. See the module docs.
pub async fn list_locations(
    config: &Config,
    pool: &std::sync::Arc<Pool>,
    request: &pb::ListLocationsRequest,
    deadline: Instant,
) -> Result<pb::ListLocationsResponse, Error> {
    locations::check_request(request)?;
    egressproxy_provider::paging::decode_token(&request.page_token)?;
    let measured = room::measure(pool, &config.hosts, deadline).await;
    Ok(locations::answer(
        request,
        all_locations(config, &measured),
    )?)
}

/// Every host and zone of `config`, with what `measured` found (steps 2 and 3).
pub fn all_locations(config: &Config, measured: &[Candidate]) -> Vec<pb::Location> {
    let mut all: Vec<pb::Location> = config
        .hosts
        .iter()
        .zip(measured)
        .map(|(host, candidate)| {
            let capacity = candidate.measured.as_ref().ok();
            pb::Location {
                name: Some(Name::Host(host.name.clone())),
                in_zone: host.zone.clone().unwrap_or_default(),
                machine_types: machine_types(config, |machine| {
                    capacity.map(|c| room::room_for(c, machine))
                }),
                images: config.images.keys().cloned().collect(),
                capacity: capacity.cloned(),
                message: match &candidate.measured {
                    Err(error) => format!("unreachable: {error}"),
                    Ok(capacity) if no_room_at_all(config, capacity) => {
                        "no room for any machine type".to_owned()
                    }
                    Ok(_) => String::new(),
                },
            }
        })
        .collect();
    for zone in zone_names(config) {
        let members: Vec<&pb::Capacity> = config
            .hosts
            .iter()
            .zip(measured)
            .filter(|(host, _)| host.zone.as_deref() == Some(zone))
            .filter_map(|(_, candidate)| candidate.measured.as_ref().ok())
            .collect();
        let hosts = config
            .hosts
            .iter()
            .filter(|h| h.zone.as_deref() == Some(zone))
            .count();
        let sum = |figure: fn(&pb::Capacity) -> Option<u64>| {
            members
                .iter()
                .map(|c| figure(c).unwrap_or(0))
                .fold(0u64, u64::saturating_add)
        };
        let capacity = (!members.is_empty()).then(|| pb::Capacity {
            free_memory_bytes: Some(sum(|c| c.free_memory_bytes)),
            free_vcpus: None,
            cpus: Some(clamp(sum(|c| c.cpus.map(u64::from)))),
            instances: Some(clamp(sum(|c| c.instances.map(u64::from)))),
            max_instances: members
                .iter()
                .all(|c| c.max_instances.is_some())
                .then(|| clamp(sum(|c| c.max_instances.map(u64::from)))),
        });
        all.push(pb::Location {
            name: Some(Name::Zone(zone.to_owned())),
            in_zone: String::new(),
            machine_types: machine_types(config, |machine| {
                (!members.is_empty()).then(|| {
                    members
                        .iter()
                        .map(|c| room::room_for(c, machine))
                        .fold(0u32, u32::saturating_add)
                })
            }),
            images: config.images.keys().cloned().collect(),
            capacity,
            message: if members.len() < hosts {
                format!(
                    "{} of its {hosts} hosts did not answer",
                    hosts - members.len()
                )
            } else {
                String::new()
            },
        });
    }
    all
}

fn machine_types(
    config: &Config,
    room: impl Fn(&crate::config::MachineType) -> Option<u32>,
) -> Vec<pb::MachineTypeRoom> {
    config
        .machine_types
        .iter()
        .map(|(name, machine)| pb::MachineTypeRoom {
            name: name.clone(),
            vcpus: Some(machine.vcpus),
            memory_bytes: Some(machine.memory_mib.saturating_mul(1 << 20)),
            room: room(machine),
        })
        .collect()
}

fn no_room_at_all(config: &Config, capacity: &pb::Capacity) -> bool {
    config
        .machine_types
        .values()
        .all(|machine| room::room_for(capacity, machine) == 0)
}

fn clamp(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn config() -> Config {
        Config::parse(
            "hosts:\n- {name: hv1, local: true, zone: z1}\n\
             - {name: hv2, local: true, zone: z1, capacity: {maxInstances: 4}}\n\
             - {name: hv3, local: true}\n\
             machineTypes:\n  small: {vcpus: 1, memoryMiB: 1024, diskGiB: 10}\n  \
             big: {vcpus: 8, memoryMiB: 4096, diskGiB: 10}\n\
             images:\n  debian-12: {url: 'https://example.org/d.qcow2'}\n",
        )
        .unwrap()
    }

    fn measured(
        host: &str,
        free_gib: u64,
        cpus: u32,
        instances: u32,
        max: Option<u32>,
    ) -> Candidate {
        Candidate {
            host: host.into(),
            measured: Ok(pb::Capacity {
                free_memory_bytes: Some(free_gib * GIB),
                free_vcpus: None,
                cpus: Some(cpus),
                instances: Some(instances),
                max_instances: max,
            }),
        }
    }

    fn rooms(location: &pb::Location) -> Vec<(String, Option<u32>)> {
        location
            .machine_types
            .iter()
            .map(|m| (m.name.clone(), m.room))
            .collect()
    }

    #[test]
    fn hosts_carry_their_zone_and_room_and_zones_add_up_their_hosts() {
        let all = all_locations(
            &config(),
            &[
                measured("hv1", 6, 4, 1, None),
                measured("hv2", 20, 16, 2, Some(4)),
                Candidate {
                    host: "hv3".into(),
                    measured: Err(Error::from(egressproxy_provider::ProviderError::transient(
                        "connection refused",
                    ))),
                },
            ],
        );
        let names: Vec<String> = all.iter().map(locations::position).collect();
        assert_eq!(names, ["host/hv1", "host/hv2", "host/hv3", "zone/z1"]);
        // hv1: 6 GiB fit 6 small and 1 big by memory, but it has 4 CPUs: no big.
        assert_eq!(all[0].in_zone, "z1");
        assert_eq!(
            rooms(&all[0]),
            [("big".into(), Some(0)), ("small".into(), Some(6))]
        );
        // hv2: its limit of 4 instances, 2 taken, bounds both.
        assert_eq!(
            rooms(&all[1]),
            [("big".into(), Some(2)), ("small".into(), Some(2))]
        );
        // hv3 is listed without figures, saying why.
        assert_eq!(
            rooms(&all[2]),
            [("big".into(), None), ("small".into(), None)]
        );
        assert_eq!(all[2].capacity, None);
        assert_eq!(all[2].message, "unreachable: connection refused");
        assert_eq!(all[2].images, ["debian-12"]);
        // z1 is hv1 and hv2.
        let zone = &all[3];
        assert_eq!(
            rooms(zone),
            [("big".into(), Some(2)), ("small".into(), Some(8))]
        );
        let capacity = zone.capacity.unwrap();
        assert_eq!(capacity.free_memory_bytes, Some(26 * GIB));
        assert_eq!(capacity.cpus, Some(20));
        assert_eq!(capacity.instances, Some(3));
        assert_eq!(capacity.max_instances, None, "hv1 has no limit");
        assert_eq!(zone.in_zone, "");
    }
}
