//! ListLocations (since 1.2.0, behind CAPABILITY_LIST_LOCATIONS): every location named
//! once and well-formed, the target's placement offered, the filters honoured, pages
//! that walk every location once and refuse tokens never issued, and locations a
//! Placement can really name (ValidatePlacement accepts them; one listed without room
//! refuses a Create).

use std::collections::{BTreeSet, HashSet};

use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::conformance::{MAX_PAGES, Outcome, describe};
use crate::locations::{MAX_OFFERS, position};
use crate::pb::{self, location::Name, placement::Location};
use crate::validation::{MAX_HOST_BYTES, MAX_STRING_BYTES};

/// Most locations `locations-placeable` asks ValidatePlacement about.
const MAX_VALIDATED: usize = 16;

impl Suite<'_> {
    async fn require_locations(&mut self) -> Checked {
        if self
            .capabilities()
            .await?
            .contains(&pb::Capability::ListLocations)
        {
            Ok(())
        } else {
            Err(Outcome::Skip(
                "the provider does not declare CAPABILITY_LIST_LOCATIONS".into(),
            ))
        }
    }

    /// One ListLocations page, retrying what callers retry.
    async fn locations_page(
        &mut self,
        request: pb::ListLocationsRequest,
    ) -> Result<pb::ListLocationsResponse, tonic::Status> {
        self.retrying("ListLocations", |mut client| {
            let request = request.clone();
            async move { Ok(client.list_locations(request).await?.into_inner()) }
        })
        .await
    }

    /// Every page of a walk with `filter`'s names and `page_size`, bounded like the
    /// instance walks.
    async fn location_pages(
        &mut self,
        filter: (&str, &str),
        page_size: Option<u32>,
    ) -> Result<Vec<Vec<pb::Location>>, Outcome> {
        let mut pages = Vec::new();
        let mut seen_tokens = HashSet::new();
        let mut page_token = String::new();
        loop {
            if pages.len() >= MAX_PAGES {
                return Err(Outcome::fail(
                    format!("the ListLocations walk ends within {MAX_PAGES} pages"),
                    format!("a next_page_token on page {MAX_PAGES}"),
                ));
            }
            let request = pb::ListLocationsRequest {
                machine_type: filter.0.to_owned(),
                image: filter.1.to_owned(),
                page_size,
                page_token: page_token.clone(),
            };
            let page = self.locations_page(request).await.map_err(|status| {
                Outcome::fail("ListLocations answers", describe::status(&status))
            })?;
            pages.push(page.locations);
            if page.next_page_token.is_empty() {
                return Ok(pages);
            }
            if !seen_tokens.insert(page.next_page_token.clone()) {
                return Err(Outcome::fail(
                    "every next_page_token of ListLocations leads forward",
                    format!(
                        "page token {:?} came back a second time (page {})",
                        page.next_page_token,
                        pages.len()
                    ),
                ));
            }
            page_token = page.next_page_token;
        }
    }

    async fn all_locations(&mut self, filter: (&str, &str)) -> Result<Vec<pb::Location>, Outcome> {
        Ok(self
            .location_pages(filter, None)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// The target's machine type and image, as filter names.
    fn target_offer(&self) -> (String, String) {
        (
            self.target.placement.machine_type.clone(),
            self.target.placement.image.clone(),
        )
    }

    /// Another machine type offered with the target's image, and another image offered
    /// with the target's machine type, at a location the target's placement can land on:
    /// requests as valid as the target's, in another placement. Neither without
    /// CAPABILITY_LIST_LOCATIONS, or where the provider offers no other.
    pub(super) async fn other_offers(
        &mut self,
    ) -> Result<(Option<String>, Option<String>), Outcome> {
        if !self
            .capabilities()
            .await?
            .contains(&pb::Capability::ListLocations)
        {
            return Ok((None, None));
        }
        let all = self.all_locations(("", "")).await?;
        let (machine_type, image) = self.target_offer();
        let wanted = match &self.target.placement.location {
            Some(Location::Host(host)) => Some(format!("host/{host}")),
            Some(Location::Zone(zone)) => Some(format!("zone/{zone}")),
            None => None,
        };
        let reachable: Vec<&pb::Location> = all
            .iter()
            .filter(|l| wanted.as_ref().is_none_or(|w| *w == position(l)))
            .collect();
        let other_machine_type = reachable
            .iter()
            .filter(|l| l.images.contains(&image))
            .flat_map(|l| &l.machine_types)
            .map(|m| &m.name)
            .find(|name| **name != machine_type)
            .cloned();
        let other_image = reachable
            .iter()
            .filter(|l| l.machine_types.iter().any(|m| m.name == machine_type))
            .flat_map(|l| &l.images)
            .find(|name| **name != image)
            .cloned();
        Ok((other_machine_type, other_image))
    }

    pub(super) async fn list_locations(&mut self) -> Checked {
        self.require_locations().await?;
        let all = self.all_locations(("", "")).await?;
        let zones: HashSet<&str> = all
            .iter()
            .filter_map(|l| match &l.name {
                Some(Name::Zone(zone)) => Some(zone.as_str()),
                _ => None,
            })
            .collect();
        let mut seen = HashSet::new();
        for location in &all {
            if let Some(problem) = malformed(location, &zones) {
                return Err(Outcome::fail(
                    "every location named by a host (at most 256 bytes) or a zone (at most 128), \
                     a host's in_zone a listed zone, 1 to 64 machine types and images, each named \
                     once within 128 bytes, a message of at most 1 KiB",
                    format!("{}: {problem}", describe_location(location)),
                ));
            }
            if !seen.insert(position(location)) {
                return Err(Outcome::fail(
                    "each location listed once",
                    format!("{} listed twice", describe_location(location)),
                ));
            }
        }
        let (machine_type, image) = self.target_offer();
        let accepts = |l: &pb::Location| {
            l.machine_types.iter().any(|m| m.name == machine_type) && l.images.contains(&image)
        };
        let wanted = match &self.target.placement.location {
            Some(Location::Host(host)) => Some(format!("host/{host}")),
            Some(Location::Zone(zone)) => Some(format!("zone/{zone}")),
            None => None,
        };
        let offered = all
            .iter()
            .filter(|l| wanted.as_ref().is_none_or(|w| *w == position(l)))
            .any(accepts);
        if !offered {
            return Err(Outcome::fail(
                format!(
                    "{} listed, accepting machine type {machine_type} and image {image} (the suite's \
                     instances are created there)",
                    wanted.as_deref().unwrap_or("a location")
                ),
                describe_locations(&all),
            ));
        }
        Ok(())
    }

    pub(super) async fn locations_filter(&mut self) -> Checked {
        self.require_locations().await?;
        let (machine_type, image) = self.target_offer();
        let all = self.all_locations(("", "")).await?;
        let expected: BTreeSet<String> = all
            .iter()
            .filter(|l| {
                l.machine_types.iter().any(|m| m.name == machine_type) && l.images.contains(&image)
            })
            .map(position)
            .collect();
        let filtered = self.all_locations((&machine_type, &image)).await?;
        let narrowed = filtered.iter().all(|l| {
            l.machine_types.len() == 1
                && l.machine_types[0].name == machine_type
                && l.images == [image.clone()]
        });
        let got: BTreeSet<String> = filtered.iter().map(position).collect();
        if got != expected || !narrowed {
            return Err(Outcome::fail(
                format!(
                    "ListLocations with machine_type {machine_type} and image {image} lists exactly \
                     the locations that accept both ({}), each with only those two",
                    join(&expected)
                ),
                describe_locations(&filtered),
            ));
        }
        let unknown = format!("cf-{}-no-such-type", self.run_id());
        let none = self.all_locations((&unknown, "")).await?;
        if !none.is_empty() {
            return Err(Outcome::fail(
                format!(
                    "ListLocations with machine_type {unknown} (offered nowhere) lists nothing"
                ),
                describe_locations(&none),
            ));
        }
        Ok(())
    }

    pub(super) async fn locations_paging(&mut self) -> Checked {
        self.require_locations().await?;
        let all: BTreeSet<String> = self
            .all_locations(("", ""))
            .await?
            .iter()
            .map(position)
            .collect();
        let pages = self.location_pages(("", ""), Some(1)).await?;
        if let Some(big) = pages.iter().find(|page| page.len() > 1) {
            return Err(Outcome::fail(
                "pages of at most page_size 1",
                format!("a page of {}", big.len()),
            ));
        }
        let mut walked = Vec::new();
        for location in pages.iter().flatten() {
            walked.push(position(location));
        }
        let once: BTreeSet<String> = walked.iter().cloned().collect();
        if once.len() != walked.len() || once != all {
            return Err(Outcome::fail(
                format!(
                    "a walk with page_size 1 lists every location once: {}",
                    join(&all)
                ),
                walked.join(", "),
            ));
        }
        let mut issued = None;
        if all.len() >= 2 {
            let first = self
                .locations_page(pb::ListLocationsRequest {
                    page_size: Some(1),
                    ..Default::default()
                })
                .await
                .map_err(|status| {
                    Outcome::fail("ListLocations answers", describe::status(&status))
                })?;
            issued = Some(format!("{}0", first.next_page_token));
        }
        let tokens = [
            ("a made-up page token", Some("not-a-page-token".to_owned())),
            ("an issued page token with a character added", issued),
        ];
        for (what, token) in tokens {
            let Some(page_token) = token else { continue };
            let result = self
                .locations_page(pb::ListLocationsRequest {
                    page_size: Some(1),
                    page_token,
                    ..Default::default()
                })
                .await;
            let what = format!("ListLocations with {what}");
            let status = expect_code(result, Code::InvalidArgument, &what)?;
            let named = status
                .get_error_details()
                .bad_request()
                .is_some_and(|bad| bad.field_violations.iter().any(|v| v.field == "page_token"));
            if !named {
                return Err(Outcome::fail(
                    format!("{what}: BadRequest naming page_token"),
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn locations_placeable(&mut self) -> Checked {
        self.require_locations().await?;
        let (machine_type, image) = self.target_offer();
        let offered = self.all_locations((&machine_type, &image)).await?;
        let validates = self
            .capabilities()
            .await?
            .contains(&pb::Capability::ValidatePlacement);
        let placement_at = |location: &pb::Location| pb::Placement {
            location: location.name.clone().map(|name| match name {
                Name::Host(host) => Location::Host(host),
                Name::Zone(zone) => Location::Zone(zone),
            }),
            machine_type: machine_type.clone(),
            image: image.clone(),
        };
        if validates {
            for location in offered.iter().take(MAX_VALIDATED) {
                let placement = placement_at(location);
                let asked = placement.location.clone();
                let answer = self
                    .retrying("ValidatePlacement", |mut client| {
                        let placement = placement.clone();
                        async move {
                            client
                                .validate_placement(pb::ValidatePlacementRequest {
                                    placement: Some(placement),
                                })
                                .await
                        }
                    })
                    .await;
                let expected = format!(
                    "ValidatePlacement of {} (listed by ListLocations) answers OK, resolved to it",
                    describe_location(location)
                );
                let resolved = match answer {
                    Ok(answer) => answer.into_inner().resolved.and_then(|p| p.location),
                    Err(status) => return Err(Outcome::fail(expected, describe::status(&status))),
                };
                if resolved != asked {
                    return Err(Outcome::fail(expected, format!("resolved to {resolved:?}")));
                }
            }
        }
        let full = offered
            .iter()
            .find(|l| l.machine_types.first().and_then(|m| m.room) == Some(0));
        if let Some(full) = full {
            let mut request = self.request("no-room");
            request.placement = Some(placement_at(full));
            let result = self.create_once(request).await;
            expect_code(
                result,
                Code::ResourceExhausted,
                &format!(
                    "Create on {}, listed with room 0 for machine type {machine_type}",
                    describe_location(full)
                ),
            )?;
        }
        if !validates && full.is_none() {
            return Err(Outcome::Skip(
                "no CAPABILITY_VALIDATE_PLACEMENT, and no location is listed without room".into(),
            ));
        }
        Ok(())
    }
}

/// What is wrong with one location's fields, if anything.
fn malformed(location: &pb::Location, zones: &HashSet<&str>) -> Option<String> {
    match &location.name {
        None => return Some("neither host nor zone".into()),
        Some(Name::Host(host)) if host.is_empty() || host.len() > MAX_HOST_BYTES => {
            return Some(format!("a host name of {} bytes", host.len()));
        }
        Some(Name::Zone(zone)) if zone.is_empty() || zone.len() > MAX_STRING_BYTES => {
            return Some(format!("a zone name of {} bytes", zone.len()));
        }
        Some(Name::Zone(_)) if !location.in_zone.is_empty() => {
            return Some(format!("a zone in zone {:?}", location.in_zone));
        }
        Some(Name::Host(_))
            if !location.in_zone.is_empty() && !zones.contains(location.in_zone.as_str()) =>
        {
            return Some(format!(
                "in zone {:?}, which is not listed",
                location.in_zone
            ));
        }
        Some(_) => {}
    }
    let names: Vec<&str> = location
        .machine_types
        .iter()
        .map(|m| m.name.as_str())
        .collect();
    for (what, names) in [
        ("machine types", names),
        (
            "images",
            location.images.iter().map(String::as_str).collect(),
        ),
    ] {
        let unique: HashSet<&&str> = names.iter().collect();
        if names.is_empty() || names.len() > MAX_OFFERS || unique.len() != names.len() {
            return Some(format!("{} {what}, {} distinct", names.len(), unique.len()));
        }
        if let Some(bad) = names
            .iter()
            .find(|n| n.is_empty() || n.len() > MAX_STRING_BYTES)
        {
            return Some(format!("{what}: a name of {} bytes", bad.len()));
        }
    }
    if location.message.len() > 1024 {
        return Some(format!("a message of {} bytes", location.message.len()));
    }
    None
}

fn describe_location(location: &pb::Location) -> String {
    match &location.name {
        Some(Name::Host(host)) => format!("host {host}"),
        Some(Name::Zone(zone)) => format!("zone {zone}"),
        None => "a location without a name".into(),
    }
}

fn describe_locations(locations: &[pb::Location]) -> String {
    if locations.is_empty() {
        return "no location".into();
    }
    let described: Vec<String> = locations
        .iter()
        .map(|l| {
            let types: Vec<&str> = l.machine_types.iter().map(|m| m.name.as_str()).collect();
            format!(
                "{} (machine types {}; images {})",
                describe_location(l),
                types.join(", "),
                l.images.join(", ")
            )
        })
        .collect();
    described.join("; ")
}

fn join(positions: &BTreeSet<String>) -> String {
    positions.iter().cloned().collect::<Vec<_>>().join(", ")
}
