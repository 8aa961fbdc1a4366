//! Room on the configured hosts, and the choice of a host by it.
//!
//! 1. **Measure** ([`measure`]): each candidate host's figures
//!    ([`crate::libvirt::host::capacity`]), asked at once, each for at most
//!    [`MEASURE_TIMEOUT`], so a host that does not answer costs a Create a few seconds,
//!    not its whole deadline.
//! 2. **Capacity** ([`capacity`]): the contract's figures of a host. Free memory is the
//!    host's memory less what its running domains were given and less the host's
//!    `capacity.reservedMemoryMiB`; CPUs are the host's; instances are the agent's
//!    domains in any state, against `capacity.maxInstances`. Free vCPUs are not
//!    reported: running VMs share the host's CPUs, and only a machine type with more
//!    vCPUs than the host has CPUs does not fit.
//! 3. **Choose** ([`choose_host`], a pure function; its table is in
//!    `docs/kvm-agent.md`, row for row with the test below): the candidate with the
//!    most room for the machine type; on a tie the one with the most free memory, then
//!    the first in the configuration. No candidate with room: RESOURCE_EXHAUSTED,
//!    reason CAPACITY_EXHAUSTED, saying what each host lacks. No candidate that
//!    answered: the first one's own error (a host that cannot be reached stays
//!    UNAVAILABLE, not "full").

use std::sync::Arc;
use std::time::Duration;

use egressproxy_provider::{locations, pb};
use tokio::time::Instant;

use crate::config::{HostCapacity, HostConfig, MachineType};
use crate::error::Error;
use crate::libvirt::host::capacity::{self as host_capacity, HostFigures};
use crate::transport::call::LibvirtOp;
use crate::transport::pool::Pool;

/// The longest one host is asked for its figures.
pub const MEASURE_TIMEOUT: Duration = Duration::from_secs(5);

/// One host that may take an instance, and what measuring it gave.
#[derive(Debug)]
pub struct Candidate {
    /// The host's name in the configuration.
    pub host: String,
    /// Its capacity, or why it could not be measured.
    pub measured: Result<pb::Capacity, Error>,
}

/// The contract's capacity of a host with `figures` and the configured `limits`.
pub fn capacity(figures: &HostFigures, limits: &HostCapacity) -> pb::Capacity {
    let reserved = limits.reserved_memory_mib.saturating_mul(1 << 20);
    pb::Capacity {
        free_memory_bytes: Some(
            figures
                .memory_bytes
                .saturating_sub(figures.committed_memory_bytes)
                .saturating_sub(reserved),
        ),
        free_vcpus: None,
        cpus: Some(figures.cpus),
        instances: Some(figures.agent_instances),
        max_instances: limits.max_instances,
    }
}

/// How many instances of `machine` fit in `capacity`.
pub fn room_for(capacity: &pb::Capacity, machine: &MachineType) -> u32 {
    locations::room(
        capacity,
        Some(machine.vcpus),
        Some(machine.memory_mib.saturating_mul(1 << 20)),
    )
    .unwrap_or(u32::MAX)
}

/// Measures every host of `hosts` at once (step 1 of the module docs).
pub async fn measure(pool: &Arc<Pool>, hosts: &[HostConfig], deadline: Instant) -> Vec<Candidate> {
    let bound = deadline.min(Instant::now() + MEASURE_TIMEOUT);
    let asks = hosts.iter().map(|host| async move {
        let measured = async {
            let pool = pool.host(&host.name)?;
            let figures = pool
                .call(
                    LibvirtOp::new("virNodeGetInfo"),
                    bound,
                    host_capacity::measure,
                )
                .await?;
            Ok::<_, Error>(capacity(&figures, &host.capacity))
        }
        .await;
        Candidate {
            host: host.name.clone(),
            measured,
        }
    });
    futures::future::join_all(asks).await
}

/// The location a request asked for, in words (`zone z1`, `host hv1`, `any host`).
pub fn asked(location: Option<&pb::placement::Location>) -> String {
    match location {
        Some(pb::placement::Location::Host(host)) => format!("host {host}"),
        Some(pb::placement::Location::Zone(zone)) => format!("zone {zone}"),
        None => "any host".to_owned(),
    }
}

/// The name of the candidate host an instance of `machine` (named `machine_name`) goes
/// to, for a request that asked for `asked` (step 3 of the module docs).
pub fn choose_host(
    candidates: Vec<Candidate>,
    machine_name: &str,
    machine: &MachineType,
    asked: &str,
) -> Result<String, Error> {
    let mut best: Option<(usize, u32, u64)> = None;
    for (index, candidate) in candidates.iter().enumerate() {
        let Ok(capacity) = &candidate.measured else {
            continue;
        };
        let room = room_for(capacity, machine);
        let free = capacity.free_memory_bytes.unwrap_or(0);
        if room == 0 {
            continue;
        }
        if best.is_none_or(|(_, most, freest)| (room, free) > (most, freest)) {
            best = Some((index, room, free));
        }
    }
    if let Some((index, _, _)) = best {
        return Ok(candidates[index].host.clone());
    }
    if !candidates.iter().any(|c| c.measured.is_ok()) {
        return match candidates.into_iter().next() {
            Some(first) => Err(first.measured.expect_err("no candidate answered")),
            None => Err(Error::NoRoom {
                machine_type: machine_name.to_owned(),
                asked: asked.to_owned(),
                lacks: vec!["no hosts".to_owned()],
            }),
        };
    }
    Err(Error::NoRoom {
        machine_type: format!(
            "{machine_name} ({} vCPU, {} MiB)",
            machine.vcpus, machine.memory_mib
        ),
        asked: asked.to_owned(),
        lacks: candidates
            .iter()
            .map(|c| format!("{}: {}", c.host, lacking(&c.measured, machine)))
            .collect(),
    })
}

/// What a host lacks for `machine`, in words.
fn lacking(measured: &Result<pb::Capacity, Error>, machine: &MachineType) -> String {
    let capacity = match measured {
        Ok(capacity) => capacity,
        Err(error) => return format!("unreachable ({error})"),
    };
    let mut lacks = Vec::new();
    if let Some(cpus) = capacity.cpus
        && machine.vcpus > cpus
    {
        lacks.push(format!("{cpus} CPUs"));
    }
    if let Some(free) = capacity.free_memory_bytes
        && free < machine.memory_mib.saturating_mul(1 << 20)
    {
        lacks.push(format!("{} MiB free", free >> 20));
    }
    if let (Some(instances), Some(max)) = (capacity.instances, capacity.max_instances)
        && instances >= max
    {
        lacks.push(format!("{instances} of {max} instances"));
    }
    lacks.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn small() -> MachineType {
        MachineType {
            vcpus: 2,
            memory_mib: 1024,
            disk_gib: 10,
        }
    }

    fn host(name: &str, free_gib: u64, cpus: u32, instances: (u32, Option<u32>)) -> Candidate {
        Candidate {
            host: name.into(),
            measured: Ok(pb::Capacity {
                free_memory_bytes: Some(free_gib * GIB),
                free_vcpus: None,
                cpus: Some(cpus),
                instances: Some(instances.0),
                max_instances: instances.1,
            }),
        }
    }

    fn down(name: &str) -> Candidate {
        Candidate {
            host: name.into(),
            measured: Err(Error::from(egressproxy_provider::ProviderError::transient(
                format!("{name}: connection refused"),
            ))),
        }
    }

    /// The table of `docs/kvm-agent.md` ("Placement by room"), row for row.
    #[test]
    fn every_row_of_the_placement_table() {
        // (row, candidates, the host chosen, or the error's reason)
        let rows: Vec<(&str, Vec<Candidate>, Result<&str, &str>)> = vec![
            (
                "1 one host with room",
                vec![host("hv1", 4, 8, (0, None))],
                Ok("hv1"),
            ),
            (
                "2 the most room wins",
                vec![host("hv1", 2, 8, (0, None)), host("hv2", 6, 8, (0, None))],
                Ok("hv2"),
            ),
            (
                "3 equal room: the most free memory",
                vec![
                    host("hv1", 3, 8, (0, None)),
                    host("hv2", 6, 8, (4, Some(7))),
                ],
                Ok("hv2"),
            ),
            (
                "4 equal in every way: the first configured",
                vec![host("hv1", 4, 8, (0, None)), host("hv2", 4, 8, (0, None))],
                Ok("hv1"),
            ),
            (
                "5 a host without room is passed over",
                vec![host("hv1", 0, 8, (0, None)), host("hv2", 1, 8, (0, None))],
                Ok("hv2"),
            ),
            (
                "6 a host at its instance limit is passed over",
                vec![
                    host("hv1", 8, 8, (3, Some(3))),
                    host("hv2", 1, 8, (0, None)),
                ],
                Ok("hv2"),
            ),
            (
                "7 a host with fewer CPUs than the machine type is passed over",
                vec![host("hv1", 8, 1, (0, None)), host("hv2", 1, 8, (0, None))],
                Ok("hv2"),
            ),
            (
                "8 an unreachable host is passed over",
                vec![down("hv1"), host("hv2", 1, 8, (0, None))],
                Ok("hv2"),
            ),
            (
                "9 no host has room",
                vec![host("hv1", 0, 8, (0, None)), down("hv2")],
                Err("CAPACITY_EXHAUSTED"),
            ),
            (
                "10 no host answered",
                vec![down("hv1"), down("hv2")],
                Err("TRANSIENT"),
            ),
        ];
        let documented = documented_rows();
        let numbers: Vec<String> = rows
            .iter()
            .map(|(row, ..)| row.split(' ').next().unwrap().to_owned())
            .collect();
        assert_eq!(
            numbers, documented,
            "the rows of docs/kvm-agent.md and the test differ"
        );
        for (row, candidates, want) in rows {
            let got = choose_host(candidates, "small", &small(), "zone z")
                .map_err(|e| egressproxy_provider::ProviderError::from(e).reason);
            let want = want.map(str::to_owned).map_err(str::to_owned);
            assert_eq!(got, want, "row {row}");
        }
    }

    /// The row numbers of the table under "Placement by room" in docs/kvm-agent.md.
    fn documented_rows() -> Vec<String> {
        let doc = include_str!("../../../docs/kvm-agent.md");
        let section = doc
            .split("\n### Placement by room\n")
            .nth(1)
            .expect("docs/kvm-agent.md has a \"Placement by room\" section");
        section
            .split("\n### ")
            .next()
            .unwrap()
            .lines()
            .filter_map(|line| line.strip_prefix("| "))
            .filter_map(|rest| rest.split(' ').next())
            .filter(|number| number.parse::<u32>().is_ok())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn the_no_room_error_says_what_each_host_lacks() {
        let candidates = vec![host("hv1", 0, 1, (3, Some(3))), down("hv2")];
        let error = egressproxy_provider::ProviderError::from(
            choose_host(candidates, "small", &small(), "zone z").unwrap_err(),
        );
        assert_eq!(
            error.class,
            egressproxy_provider::ErrorClass::QuotaExhausted
        );
        assert!(error.retry_after.is_some());
        for part in [
            "no room for machine type small (2 vCPU, 1024 MiB) in zone z",
            "hv1: 1 CPUs, 0 MiB free, 3 of 3 instances",
            "hv2: unreachable (hv2: connection refused)",
        ] {
            assert!(
                error.message.contains(part),
                "{part:?} in {}",
                error.message
            );
        }
    }

    #[test]
    fn capacity_is_what_no_running_domain_was_given_less_the_reserve() {
        let figures = HostFigures {
            cpus: 4,
            memory_bytes: 8 * GIB,
            committed_memory_bytes: 3 * GIB,
            committed_vcpus: 6,
            agent_instances: 2,
        };
        let limits = HostCapacity {
            reserved_memory_mib: 1024,
            max_instances: Some(5),
        };
        assert_eq!(
            capacity(&figures, &limits),
            pb::Capacity {
                free_memory_bytes: Some(4 * GIB),
                free_vcpus: None,
                cpus: Some(4),
                instances: Some(2),
                max_instances: Some(5),
            }
        );
        let overcommitted = HostFigures {
            committed_memory_bytes: 10 * GIB,
            ..figures
        };
        assert_eq!(capacity(&overcommitted, &limits).free_memory_bytes, Some(0));
        assert_eq!(room_for(&capacity(&figures, &limits), &small()), 3);
    }
}
