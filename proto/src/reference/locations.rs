//! The reference provider's locations: every host and zone of its configuration, with
//! room counted in instances (each host holds at most its `max_instances`).
//!
//! 1. A Create names a host, a zone, or neither. It goes to that host; to the zone's
//!    host with the most room; or to the host with the most room of all (the first
//!    of those on a tie). The instance's placement says what was asked for (the zone
//!    stays the zone), or the chosen host when nothing was.
//! 2. A new instance where no host has room is RESOURCE_EXHAUSTED, reason
//!    `CAPACITY_EXHAUSTED` ([`crate::locations::no_room`]); a repeated Create of an
//!    existing key still answers its instance.
//! 3. ListLocations lists every host (with its zone) and every zone, each accepting
//!    every machine type and image, with the room of each: for a zone, the sum of its
//!    hosts'. Deleted instances take room until they are gone.

use crate::pb::{self, location::Name, placement::Location};
use crate::{ProviderError, locations};

use super::{MemoryProvider, Misbehaviour, State};

/// The most instances a host holds when the configuration gives no number.
pub const DEFAULT_MAX_INSTANCES: u32 = 1000;

impl MemoryProvider {
    fn max_instances(&self, host: &str) -> u32 {
        self.config
            .max_instances
            .get(host)
            .copied()
            .unwrap_or(DEFAULT_MAX_INSTANCES)
    }

    fn instances_on(&self, state: &State, host: &str) -> u32 {
        let count = state
            .instances
            .values()
            .filter(|record| record.host.as_deref() == Some(host))
            .count();
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    fn room_on(&self, state: &State, host: &str) -> u32 {
        self.max_instances(host)
            .saturating_sub(self.instances_on(state, host))
    }

    fn hosts_in_zone<'a>(&'a self, zone: &'a str) -> impl Iterator<Item = &'a String> {
        self.config
            .hosts
            .iter()
            .filter(move |host| self.config.host_zones.get(*host).is_some_and(|z| z == zone))
    }

    /// Where an instance of `placement` (names already checked) would go now, and the
    /// placement it reports (step 1 of the module docs). `None`: a zone without hosts.
    pub(super) fn choose(
        &self,
        state: &State,
        placement: &pb::Placement,
    ) -> (Option<String>, pb::Placement) {
        let most_room = |hosts: &mut dyn Iterator<Item = &String>| {
            hosts
                .fold(None, |best: Option<(&String, u32)>, host| {
                    let room = self.room_on(state, host);
                    match best {
                        Some((_, most)) if most >= room => best,
                        _ => Some((host, room)),
                    }
                })
                .map(|(host, _)| host.clone())
        };
        match &placement.location {
            Some(Location::Host(host)) => (Some(host.clone()), placement.clone()),
            Some(Location::Zone(zone)) => {
                (most_room(&mut self.hosts_in_zone(zone)), placement.clone())
            }
            None => {
                let host = most_room(&mut self.config.hosts.iter());
                let reported = pb::Placement {
                    location: host.clone().map(Location::Host),
                    ..placement.clone()
                };
                (host, reported)
            }
        }
    }

    /// Step 2 of the module docs: refuses a new instance on `host` without room.
    pub(super) fn check_room(
        &self,
        state: &State,
        host: Option<&str>,
        placement: &pb::Placement,
    ) -> Result<(), ProviderError> {
        let asked = match &placement.location {
            Some(Location::Zone(zone)) => format!("zone {zone}"),
            Some(Location::Host(host)) => format!("host {host}"),
            None => "any host".to_owned(),
        };
        match host {
            None => Err(locations::no_room(format!(
                "no room for machine type {} in {asked}: it has no hosts",
                placement.machine_type
            ))),
            Some(host) if self.room_on(state, host) == 0 => Err(locations::no_room(format!(
                "no room for machine type {} in {asked}: host {host} holds {} of its {} instances; \
                     delete instances or name another location (ListLocations shows the room of each)",
                placement.machine_type,
                self.instances_on(state, host),
                self.max_instances(host)
            ))),
            Some(_) => Ok(()),
        }
    }

    /// ValidatePlacement's answer for a checked placement: where it would go, and a
    /// warning when no host there has room now.
    pub(super) fn placed(&self, placement: &pb::Placement) -> (pb::Placement, Vec<String>) {
        let mut state = self.lock();
        self.purge(&mut state);
        let (host, resolved) = self.choose(&state, placement);
        let warnings = self
            .check_room(&state, host.as_deref(), &resolved)
            .err()
            .map(|error| {
                format!(
                    "a Create now would answer RESOURCE_EXHAUSTED: {}",
                    error.message
                )
            })
            .into_iter()
            .collect();
        (resolved, warnings)
    }

    fn location(&self, name: Name, in_zone: String, instances: u32, max: u32) -> pb::Location {
        let room = max.saturating_sub(instances);
        pb::Location {
            name: Some(name),
            in_zone,
            machine_types: self
                .config
                .machine_types
                .iter()
                .map(|machine_type| pb::MachineTypeRoom {
                    name: machine_type.clone(),
                    vcpus: None,
                    memory_bytes: None,
                    room: Some(room),
                })
                .collect(),
            images: self.config.images.clone(),
            capacity: Some(pb::Capacity {
                instances: Some(instances),
                max_instances: Some(max),
                ..Default::default()
            }),
            message: if room == 0 {
                format!("no room: {instances} of {max} instances")
            } else {
                String::new()
            },
        }
    }

    /// Every location (step 3 of the module docs), as a misbehaviour may break them.
    fn all_locations(&self, state: &State) -> Vec<pb::Location> {
        let mut all: Vec<pb::Location> = self
            .config
            .hosts
            .iter()
            .map(|host| {
                let zone = self
                    .config
                    .host_zones
                    .get(host)
                    .cloned()
                    .unwrap_or_default();
                let zone = if self.breaks(Misbehaviour::HostInUnlistedZone) {
                    "unlisted-zone".to_owned()
                } else {
                    zone
                };
                self.location(
                    Name::Host(host.clone()),
                    zone,
                    self.instances_on(state, host),
                    self.max_instances(host),
                )
            })
            .collect();
        for zone in &self.config.zones {
            let (instances, max) = self.hosts_in_zone(zone).fold((0u32, 0u32), |(n, m), host| {
                (
                    n.saturating_add(self.instances_on(state, host)),
                    m.saturating_add(self.max_instances(host)),
                )
            });
            all.push(self.location(Name::Zone(zone.clone()), String::new(), instances, max));
        }
        if self.breaks(Misbehaviour::DuplicateLocations)
            && let Some(first) = all.first().cloned()
        {
            all.push(first);
        }
        if self.breaks(Misbehaviour::UnplaceableLocation)
            && let Some(first) = all.first().cloned()
        {
            all.push(pb::Location {
                name: Some(Name::Zone("nowhere".into())),
                in_zone: String::new(),
                ..first
            });
        }
        all
    }

    /// ListLocations' work: every location, filtered and paged by the contract crate.
    pub(super) fn locations_page(
        &self,
        request: &pb::ListLocationsRequest,
    ) -> Result<pb::ListLocationsResponse, ProviderError> {
        let all = {
            let mut state = self.lock();
            self.purge(&mut state);
            self.all_locations(&state)
        };
        let mut request = request.clone();
        if self.breaks(Misbehaviour::LocationFilterIgnored) {
            request.machine_type.clear();
            request.image.clear();
        }
        if self.breaks(Misbehaviour::LocationsAcceptForeignPageToken)
            && crate::paging::decode_token(&request.page_token).is_err()
        {
            request.page_token.clear();
        }
        locations::answer(&request, all)
    }
}
