//! ListLocations as the contract states it (since 1.2.0), for providers to share.
//!
//! A provider builds every [`pb::Location`] it offers, then [`answer`]:
//! 1. **check** the request ([`check_request`]): the filters within the default string
//!    limit; a page token this encoding did not make is INVALID_ARGUMENT naming
//!    `page_token` ([`crate::paging`]);
//! 2. **filter**: with `machine_type` (or `image`) set, only the locations that accept
//!    it stay, each listing only that one; a name nobody offers lists nothing;
//! 3. **page** by [`position`] (`host/<name>`, then `zone/<name>`), like ListInstances:
//!    a walk lists every location once, each page within its size and 4 MiB.
//!
//! [`room`] turns a [`pb::Capacity`] into the number of instances of one size that fit
//! (the figure `MachineTypeRoom.room` carries), and [`no_room`] is the error a Create
//! answers where none fits, so every provider explains a full location alike.

use std::time::Duration;

use crate::pb;
use crate::validation::MAX_STRING_BYTES;
use crate::{ProviderError, paging};

/// The ErrorInfo reason of a Create that no location it allows has room for.
pub const CAPACITY_EXHAUSTED: &str = "CAPACITY_EXHAUSTED";
/// How long a Create refused for room is asked to wait before it tries again.
pub const NO_ROOM_RETRY: Duration = Duration::from_secs(30);
/// Most machine types, and most images, one location lists.
pub const MAX_OFFERS: usize = 64;

/// Checks the request's filters (the token is checked when the page is cut).
pub fn check_request(request: &pb::ListLocationsRequest) -> Result<(), ProviderError> {
    let mut error: Option<ProviderError> = None;
    for (field, value) in [
        ("machine_type", &request.machine_type),
        ("image", &request.image),
    ] {
        if value.len() > MAX_STRING_BYTES {
            let description = format!(
                "{} bytes is over the {MAX_STRING_BYTES}-byte limit",
                value.len()
            );
            error = Some(match error {
                None => ProviderError::invalid_argument(field, description),
                Some(error) => error.with_violation(field, description),
            });
        }
    }
    error.map_or(Ok(()), Err)
}

/// Where a location sorts in a walk, and what a page token names: `host/<name>` or
/// `zone/<name>` (hosts first).
pub fn position(location: &pb::Location) -> String {
    match &location.name {
        Some(pb::location::Name::Host(host)) => format!("host/{host}"),
        Some(pb::location::Name::Zone(zone)) => format!("zone/{zone}"),
        None => String::new(),
    }
}

/// ListLocations' answer from every location the provider offers: checked, filtered,
/// sorted and paged as the module docs say.
pub fn answer(
    request: &pb::ListLocationsRequest,
    locations: impl IntoIterator<Item = pb::Location>,
) -> Result<pb::ListLocationsResponse, ProviderError> {
    check_request(request)?;
    paging::decode_token(&request.page_token)?;
    let mut kept: Vec<pb::Location> = locations
        .into_iter()
        .filter_map(|location| filtered(location, &request.machine_type, &request.image))
        .collect();
    kept.sort_by_cached_key(position);
    let size = paging::page_size(request.page_size, paging::DEFAULT_PAGE_SIZE);
    let (locations, next_page_token) = paging::page_by(kept, position, &request.page_token, size)?;
    Ok(pb::ListLocationsResponse {
        locations,
        next_page_token,
    })
}

/// `location` with only the machine type and image asked for, `None` when it does not
/// accept them (an empty filter keeps everything).
fn filtered(mut location: pb::Location, machine_type: &str, image: &str) -> Option<pb::Location> {
    if !machine_type.is_empty() {
        location.machine_types.retain(|m| m.name == machine_type);
        if location.machine_types.is_empty() {
            return None;
        }
    }
    if !image.is_empty() {
        location.images.retain(|i| i == image);
        if location.images.is_empty() {
            return None;
        }
    }
    Some(location)
}

/// How many more instances of `vcpus` virtual CPUs and `memory_bytes` fit in
/// `capacity`: the smallest of what free memory, free vCPUs and the instance limit
/// allow; 0 when an instance would have more vCPUs than the location's `cpus`. `None`
/// when no figure bounds it (the provider cannot tell).
pub fn room(capacity: &pb::Capacity, vcpus: Option<u32>, memory_bytes: Option<u64>) -> Option<u32> {
    if let (Some(cpus), Some(vcpus)) = (capacity.cpus, vcpus)
        && vcpus > cpus
    {
        return Some(0);
    }
    let by_memory = match (capacity.free_memory_bytes, memory_bytes) {
        (Some(free), Some(size)) if size > 0 => Some(free / size),
        _ => None,
    };
    let by_vcpus = match (capacity.free_vcpus, vcpus) {
        (Some(free), Some(size)) if size > 0 => Some(u64::from(free / size)),
        _ => None,
    };
    let by_count = capacity
        .max_instances
        .map(|max| u64::from(max.saturating_sub(capacity.instances.unwrap_or(0))));
    [by_memory, by_vcpus, by_count]
        .into_iter()
        .flatten()
        .min()
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// The error of a Create that no location it allows has room for: RESOURCE_EXHAUSTED,
/// reason [`CAPACITY_EXHAUSTED`], retry after [`NO_ROOM_RETRY`]. `message` says which
/// locations were considered and what each lacks.
pub fn no_room(message: impl Into<String>) -> ProviderError {
    ProviderError::quota_exhausted(message, Some(NO_ROOM_RETRY)).with_reason(CAPACITY_EXHAUSTED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorClass;

    fn host(name: &str, machine_types: &[&str], images: &[&str]) -> pb::Location {
        pb::Location {
            name: Some(pb::location::Name::Host(name.into())),
            machine_types: machine_types
                .iter()
                .map(|m| pb::MachineTypeRoom {
                    name: (*m).into(),
                    ..Default::default()
                })
                .collect(),
            images: images.iter().map(|i| (*i).into()).collect(),
            ..Default::default()
        }
    }

    fn names(response: &pb::ListLocationsResponse) -> Vec<String> {
        response.locations.iter().map(position).collect()
    }

    #[test]
    fn filters_keep_only_locations_that_accept_the_names_and_only_those_names() {
        let all = vec![
            host("b", &["small", "large"], &["debian-12"]),
            host("a", &["small"], &["debian-12", "debian-13"]),
            host("c", &["large"], &["debian-13"]),
        ];
        let ask = |machine_type: &str, image: &str| {
            answer(
                &pb::ListLocationsRequest {
                    machine_type: machine_type.into(),
                    image: image.into(),
                    ..Default::default()
                },
                all.clone(),
            )
            .unwrap()
        };
        assert_eq!(names(&ask("", "")), ["host/a", "host/b", "host/c"]);
        let small = ask("small", "");
        assert_eq!(names(&small), ["host/a", "host/b"]);
        assert!(small.locations.iter().all(|l| l.machine_types.len() == 1));
        let both = ask("large", "debian-13");
        assert_eq!(names(&both), ["host/c"]);
        assert_eq!(both.locations[0].images, ["debian-13"]);
        assert!(ask("huge", "").locations.is_empty());
    }

    #[test]
    fn pages_walk_every_location_once_and_refuse_foreign_tokens() {
        let all: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|n| host(n, &["small"], &["debian-12"]))
            .chain([pb::Location {
                name: Some(pb::location::Name::Zone("z".into())),
                ..host("", &["small"], &["debian-12"])
            }])
            .collect();
        let mut request = pb::ListLocationsRequest {
            page_size: Some(1),
            ..Default::default()
        };
        let mut seen = Vec::new();
        loop {
            let page = answer(&request, all.clone()).unwrap();
            assert!(page.locations.len() <= 1);
            seen.extend(names(&page));
            if page.next_page_token.is_empty() {
                break;
            }
            request.page_token = page.next_page_token;
        }
        assert_eq!(seen, ["host/a", "host/b", "host/c", "zone/z"]);
        request.page_token = "host/b".into();
        let error = answer(&request, all).unwrap_err();
        assert_eq!(error.class, ErrorClass::InvalidArgument);
        assert_eq!(error.field_violations[0].field, "page_token");
    }

    #[test]
    fn long_filters_are_refused_naming_the_field() {
        let error = check_request(&pb::ListLocationsRequest {
            machine_type: "m".repeat(129),
            image: "i".repeat(129),
            ..Default::default()
        })
        .unwrap_err();
        let fields: Vec<_> = error.field_violations.iter().map(|v| &v.field).collect();
        assert_eq!(fields, ["machine_type", "image"]);
    }

    #[test]
    fn room_is_the_tightest_figure() {
        const GIB: u64 = 1 << 30;
        let capacity = |memory: Option<u64>,
                        vcpus: Option<u32>,
                        cpus: Option<u32>,
                        count: Option<(u32, u32)>| pb::Capacity {
            free_memory_bytes: memory,
            free_vcpus: vcpus,
            cpus,
            instances: count.map(|(n, _)| n),
            max_instances: count.map(|(_, max)| max),
        };
        // (capacity, vcpus, memory) -> room
        let table = [
            (capacity(None, None, None, None), Some(1), Some(GIB), None),
            (
                capacity(Some(3 * GIB), None, None, None),
                Some(1),
                Some(GIB),
                Some(3),
            ),
            (
                capacity(Some(3 * GIB - 1), None, None, None),
                Some(1),
                Some(GIB),
                Some(2),
            ),
            (
                capacity(Some(8 * GIB), Some(3), None, None),
                Some(2),
                Some(GIB),
                Some(1),
            ),
            (
                capacity(Some(8 * GIB), None, None, Some((4, 5))),
                Some(1),
                Some(GIB),
                Some(1),
            ),
            (
                capacity(Some(8 * GIB), None, None, Some((7, 5))),
                Some(1),
                Some(GIB),
                Some(0),
            ),
            (
                capacity(Some(8 * GIB), None, Some(2), None),
                Some(4),
                Some(GIB),
                Some(0),
            ),
            (
                capacity(Some(8 * GIB), None, Some(2), None),
                Some(2),
                Some(GIB),
                Some(8),
            ),
            (capacity(Some(8 * GIB), None, None, None), None, None, None),
        ];
        for (capacity, vcpus, memory, want) in table {
            assert_eq!(
                room(&capacity, vcpus, memory),
                want,
                "{capacity:?} {vcpus:?} {memory:?}"
            );
        }
    }

    #[test]
    fn no_room_is_quota_exhausted_with_its_reason_and_a_delay() {
        let error = no_room("hv1: 512 MiB free, small needs 1 GiB");
        assert_eq!(error.class, ErrorClass::QuotaExhausted);
        assert_eq!(error.reason, CAPACITY_EXHAUSTED);
        assert_eq!(error.retry_after, Some(NO_ROOM_RETRY));
    }
}
