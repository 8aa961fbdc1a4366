//! Where a pool's new members go: the fixed `spec.spread` list, or, with
//! `spec.spreadAcross`, the locations the template's provider lists.
//!
//! 1. A fixed list is used as it is, and a member at no listed target is outdated
//!    (moving the list moves the members).
//! 2. `spreadAcross` asks the provider's ListLocations (contract 1.2.0) for the
//!    template's machine type and image at every pass, keeps the locations of that
//!    kind (hosts within the template's zone, if it names one) that have room for one
//!    more member, and sorts them by name. Members are judged by their template only:
//!    a location that leaves the list (full, or not answering for a while) gets no
//!    new members, but the members already there stay instead of being replaced.
//! 3. A provider without the capability spreads nothing (every member takes the
//!    template's placement) and the pool says so. A listing that fails keeps the
//!    targets of the last pass, so an unreachable provider does not reshuffle the pool.

use egressproxy_provider::pb;
use egressproxy_provider::pb::location::Name;

use crate::crd::{ProxyPool, SpreadAcross, SpreadTarget};
use crate::providers::Provider;
use crate::shared::error::Result;

/// The targets a pass spreads new members across.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spread {
    /// Where new members go, in order (index = the plan's target number).
    pub targets: Vec<SpreadTarget>,
    /// Whether the targets are the provider's (members are then judged by their
    /// template only).
    pub from_provider: bool,
    /// Why `spreadAcross` spreads nothing, for a Warning.
    pub unavailable: Option<String>,
}

/// The spread of `pool` for this pass (module doc).
pub async fn resolve(pool: &ProxyPool, provider: Result<&Provider>) -> Spread {
    let Some(across) = pool.spec.spread_across else {
        return Spread {
            targets: pool.spec.spread.clone(),
            ..Spread::default()
        };
    };
    let last = || {
        pool.status
            .as_ref()
            .map(|s| s.spread_targets.clone())
            .unwrap_or_default()
    };
    let placement = &pool.spec.template.spec.placement;
    let listed = match provider {
        Ok(provider) => {
            provider
                .locations(&placement.machine_type, &placement.image)
                .await
        }
        Err(error) => Err(error),
    };
    match listed {
        Ok(Some(locations)) => Spread {
            targets: targets(
                across,
                placement.zone.as_deref(),
                &placement.machine_type,
                &locations,
            ),
            from_provider: true,
            unavailable: None,
        },
        Ok(None) => Spread {
            targets: Vec::new(),
            from_provider: true,
            unavailable: Some(format!(
                "provider {} does not list its locations: every member takes the template's \
                 placement (list hosts or zones in spec.spread instead of spec.spreadAcross)",
                pool.spec.template.spec.provider
            )),
        },
        Err(error) => {
            tracing::warn!(
                pool = %kube::ResourceExt::name_any(pool),
                error = %error.describe(),
                "listing the provider's locations failed; spreading across the last known ones"
            );
            Spread {
                targets: last(),
                from_provider: true,
                unavailable: None,
            }
        }
    }
}

/// The locations of kind `across` in `locations` (hosts only in `zone`, when set) with
/// room for one more `machine_type`, sorted by name.
pub fn targets(
    across: SpreadAcross,
    zone: Option<&str>,
    machine_type: &str,
    locations: &[pb::Location],
) -> Vec<SpreadTarget> {
    let has_room = |location: &pb::Location| {
        location
            .machine_types
            .iter()
            .find(|m| m.name == machine_type)
            .is_some_and(|m| m.room != Some(0))
    };
    let mut targets: Vec<SpreadTarget> = locations
        .iter()
        .filter(|l| has_room(l))
        .filter_map(|l| match (&l.name, across) {
            (Some(Name::Host(host)), SpreadAcross::Hosts)
                if zone.is_none_or(|z| z == l.in_zone) =>
            {
                Some(SpreadTarget {
                    host: Some(host.clone()),
                    zone: None,
                })
            }
            (Some(Name::Zone(name)), SpreadAcross::Zones) => Some(SpreadTarget {
                host: None,
                zone: Some(name.clone()),
            }),
            _ => None,
        })
        .collect();
    targets.sort_by(|a, b| (&a.host, &a.zone).cmp(&(&b.host, &b.zone)));
    targets.dedup();
    targets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(name: Name, in_zone: &str, machine_type: &str, room: Option<u32>) -> pb::Location {
        pb::Location {
            name: Some(name),
            in_zone: in_zone.to_owned(),
            machine_types: vec![pb::MachineTypeRoom {
                name: machine_type.to_owned(),
                room,
                ..pb::MachineTypeRoom::default()
            }],
            images: vec!["debian-12".to_owned()],
            ..pb::Location::default()
        }
    }

    fn host(name: &str) -> SpreadTarget {
        SpreadTarget {
            host: Some(name.to_owned()),
            zone: None,
        }
    }

    fn listed() -> Vec<pb::Location> {
        vec![
            location(Name::Host("h2".into()), "z1", "small", Some(3)),
            location(Name::Host("h1".into()), "z0", "small", None),
            location(Name::Host("h0".into()), "z0", "small", Some(1)),
            location(Name::Host("full".into()), "z0", "small", Some(0)),
            location(Name::Host("big-only".into()), "z0", "large", Some(9)),
            location(Name::Zone("z1".into()), "", "small", Some(3)),
            location(Name::Zone("z0".into()), "", "small", Some(1)),
        ]
    }

    #[test]
    fn hosts_with_room_for_the_machine_type_sorted_by_name() {
        let got = targets(SpreadAcross::Hosts, None, "small", &listed());
        assert_eq!(got, vec![host("h0"), host("h1"), host("h2")]);
    }

    #[test]
    fn hosts_only_in_the_template_s_zone_when_it_names_one() {
        let got = targets(SpreadAcross::Hosts, Some("z0"), "small", &listed());
        assert_eq!(got, vec![host("h0"), host("h1")]);
    }

    #[test]
    fn zones_are_listed_as_zones() {
        let got = targets(SpreadAcross::Zones, None, "small", &listed());
        let zones: Vec<_> = got.iter().map(|t| t.zone.clone().unwrap()).collect();
        assert_eq!(zones, ["z0", "z1"]);
        assert!(got.iter().all(|t| t.host.is_none()));
    }

    #[test]
    fn a_machine_type_nobody_offers_spreads_nowhere() {
        assert!(targets(SpreadAcross::Hosts, None, "huge", &listed()).is_empty());
    }
}
