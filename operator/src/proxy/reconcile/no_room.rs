//! Why nothing fits: when a Create answers RESOURCE_EXHAUSTED and the provider lists
//! its locations (`CAPABILITY_LIST_LOCATIONS`), the operator asks it which locations
//! the Proxy's placement allows and what room each has for its machine type, and adds
//! that to the error, so the Proxy's `Ready` condition and `lastError` say where room
//! is missing and why (a host at its instance limit, one without memory, one that does
//! not answer), not only that the provider is full.
//!
//! 1. Only RESOURCE_EXHAUSTED from a provider with the capability is explained; any
//!    other error, and a ListLocations that fails, leave the error as it was.
//! 2. The locations are those the placement allows ([`allowed`]): the host it names;
//!    the zone it names and that zone's hosts; or all of them.
//! 3. The summary ([`summary`]) names each with its room for the machine type, what it
//!    says about itself, and its free memory and instances; at most
//!    [`MAX_LOCATIONS_SHOWN`] of them, then how many more.

use egressproxy_provider::ErrorClass;
use egressproxy_provider::pb::{self, location::Name, placement::Location};

use crate::providers::Provider;
use crate::shared::error::Error;

/// Most locations one summary names.
pub const MAX_LOCATIONS_SHOWN: usize = 8;

/// `error`, with where the placement has no room when the provider can say (see the
/// module docs).
pub(super) async fn explained(
    provider: &Provider,
    placement: &pb::Placement,
    error: Error,
) -> Error {
    let Error::Provider {
        provider: name,
        op,
        mut source,
    } = error
    else {
        return error;
    };
    if source.class == ErrorClass::QuotaExhausted {
        match provider
            .locations(&placement.machine_type, &placement.image)
            .await
        {
            Ok(Some(locations)) => {
                source.message = format!("{}; {}", source.message, summary(placement, &locations));
            }
            Ok(None) => {}
            Err(listing) => tracing::debug!(
                provider = %name,
                error = %listing.describe(),
                "ListLocations failed; the Create's error is reported as it is"
            ),
        }
    }
    Error::Provider {
        provider: name,
        op,
        source,
    }
}

/// The locations `placement` allows (step 2 of the module docs).
pub fn allowed<'a>(
    placement: &pb::Placement,
    locations: &'a [pb::Location],
) -> Vec<&'a pb::Location> {
    locations
        .iter()
        .filter(|location| match (&placement.location, &location.name) {
            (None, _) => true,
            (Some(Location::Host(asked)), Some(Name::Host(host))) => asked == host,
            (Some(Location::Zone(asked)), Some(Name::Zone(zone))) => asked == zone,
            (Some(Location::Zone(asked)), Some(Name::Host(_))) => *asked == location.in_zone,
            _ => false,
        })
        .collect()
}

/// What the allowed locations have for `placement`'s machine type (step 3).
pub fn summary(placement: &pb::Placement, locations: &[pb::Location]) -> String {
    let allowed = allowed(placement, locations);
    let what = format!(
        "machine type {} and image {}",
        placement.machine_type, placement.image
    );
    if allowed.is_empty() {
        return format!("the provider lists no location that accepts {what} there");
    }
    let described: Vec<String> = allowed
        .iter()
        .take(MAX_LOCATIONS_SHOWN)
        .map(|location| describe(location, &placement.machine_type))
        .collect();
    let more = match allowed.len().saturating_sub(MAX_LOCATIONS_SHOWN) {
        0 => String::new(),
        n => format!("; and {n} more"),
    };
    format!("room for {what}: {}{more}", described.join("; "))
}

fn describe(location: &pb::Location, machine_type: &str) -> String {
    let name = match &location.name {
        Some(Name::Host(host)) => format!("host {host}"),
        Some(Name::Zone(zone)) => format!("zone {zone}"),
        None => "an unnamed location".to_owned(),
    };
    let room = location
        .machine_types
        .iter()
        .find(|m| m.name == machine_type)
        .and_then(|m| m.room)
        .map_or_else(|| "room unknown".to_owned(), |room| format!("room {room}"));
    let mut facts = vec![room];
    if !location.message.is_empty() {
        facts.push(location.message.clone());
    }
    if let Some(capacity) = &location.capacity {
        if let Some(free) = capacity.free_memory_bytes {
            facts.push(format!("{} MiB free", free >> 20));
        }
        match (capacity.instances, capacity.max_instances) {
            (Some(n), Some(max)) => facts.push(format!("{n} of {max} instances")),
            (Some(n), None) => facts.push(format!("{n} instances")),
            _ => {}
        }
    }
    format!("{name} ({})", facts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(name: Name, in_zone: &str, room: Option<u32>, message: &str) -> pb::Location {
        pb::Location {
            name: Some(name),
            in_zone: in_zone.into(),
            machine_types: vec![pb::MachineTypeRoom {
                name: "small".into(),
                room,
                ..Default::default()
            }],
            images: vec!["debian-12".into()],
            capacity: room.map(|_| pb::Capacity {
                free_memory_bytes: Some(512 << 20),
                instances: Some(3),
                max_instances: Some(3),
                ..Default::default()
            }),
            message: message.into(),
        }
    }

    fn placement(location: Option<Location>) -> pb::Placement {
        pb::Placement {
            location,
            machine_type: "small".into(),
            image: "debian-12".into(),
        }
    }

    fn all() -> Vec<pb::Location> {
        vec![
            location(Name::Host("hv1".into()), "z1", Some(0), "no room"),
            location(
                Name::Host("hv2".into()),
                "z1",
                None,
                "unreachable: connection refused",
            ),
            location(Name::Host("hv3".into()), "", Some(0), ""),
            location(Name::Zone("z1".into()), "", Some(0), ""),
        ]
    }

    #[test]
    fn a_placement_allows_its_host_its_zone_and_the_zones_hosts_or_everything() {
        let names = |location: Option<Location>| -> Vec<String> {
            allowed(&placement(location), &all())
                .into_iter()
                .map(egressproxy_provider::locations::position)
                .collect()
        };
        assert_eq!(names(None), ["host/hv1", "host/hv2", "host/hv3", "zone/z1"]);
        assert_eq!(names(Some(Location::Host("hv3".into()))), ["host/hv3"]);
        assert_eq!(
            names(Some(Location::Zone("z1".into()))),
            ["host/hv1", "host/hv2", "zone/z1"]
        );
    }

    #[test]
    fn the_summary_names_each_location_with_its_room_and_why() {
        let text = summary(&placement(Some(Location::Zone("z1".into()))), &all());
        assert_eq!(
            text,
            "room for machine type small and image debian-12: \
             host hv1 (room 0, no room, 512 MiB free, 3 of 3 instances); \
             host hv2 (room unknown, unreachable: connection refused); \
             zone z1 (room 0, 512 MiB free, 3 of 3 instances)"
        );
        let nowhere = summary(&placement(Some(Location::Host("hv9".into()))), &all());
        assert_eq!(
            nowhere,
            "the provider lists no location that accepts machine type small and image debian-12 there"
        );
    }

    #[test]
    fn a_long_list_is_cut_saying_how_many_more() {
        let many: Vec<pb::Location> = (0..12)
            .map(|n| location(Name::Host(format!("hv{n}")), "", Some(0), ""))
            .collect();
        let text = summary(&placement(None), &many);
        assert!(text.ends_with("; and 4 more"), "{text}");
        assert_eq!(text.matches("host hv").count(), MAX_LOCATIONS_SHOWN);
    }
}
