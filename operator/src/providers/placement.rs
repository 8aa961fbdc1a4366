//! A Proxy's placement as CreateInstance and ValidatePlacement ask for it: one mapping,
//! for a Proxy's instance and a pool's spare alike; and back, the location an
//! instance reports (the provider's choice where the placement named none).

use egressproxy_provider::pb;
use pb::placement::Location;

use crate::crd::{InstanceLocation, Placement};

/// `placement` as the contract spells it. A host is the narrower ask, so with both a
/// host and a zone set the host is the location asked for.
pub fn to_pb(placement: &Placement) -> pb::Placement {
    pb::Placement {
        location: match (&placement.host, &placement.zone) {
            (Some(host), _) => Some(Location::Host(host.clone())),
            (None, Some(zone)) => Some(Location::Zone(zone.clone())),
            (None, None) => None,
        },
        machine_type: placement.machine_type.clone(),
        image: placement.image.clone(),
    }
}

/// Where an instance with `placement` (`Instance.placement`) runs; `None` when it
/// reports no location (the contract requires one, so that is a provider's bug, and
/// the caller keeps what it knew).
pub fn location_of(placement: Option<&pb::Placement>) -> Option<InstanceLocation> {
    match placement?.location.as_ref()? {
        Location::Host(host) => Some(InstanceLocation {
            host: Some(host.clone()),
            zone: None,
        }),
        Location::Zone(zone) => Some(InstanceLocation {
            host: None,
            zone: Some(zone.clone()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(host: Option<&str>, zone: Option<&str>) -> Placement {
        Placement {
            host: host.map(str::to_owned),
            zone: zone.map(str::to_owned),
            machine_type: "small".into(),
            image: "debian-12".into(),
        }
    }

    #[test]
    fn the_host_wins_over_the_zone_and_neither_lets_the_provider_choose() {
        let cases = [
            (at(Some("hv1"), None), Some(Location::Host("hv1".into()))),
            (at(None, Some("z1")), Some(Location::Zone("z1".into()))),
            (
                at(Some("hv1"), Some("z1")),
                Some(Location::Host("hv1".into())),
            ),
            (at(None, None), None),
        ];
        for (placement, location) in cases {
            let asked = to_pb(&placement);
            assert_eq!(asked.location, location, "{placement:?}");
            assert_eq!(asked.machine_type, "small");
            assert_eq!(asked.image, "debian-12");
        }
    }

    #[test]
    fn an_instance_s_location_is_its_host_or_its_zone() {
        let reported = |location: Option<Location>| pb::Placement {
            location,
            machine_type: "small".into(),
            image: "debian-12".into(),
        };
        let host = reported(Some(Location::Host("hv2".into())));
        assert_eq!(
            location_of(Some(&host)),
            Some(InstanceLocation {
                host: Some("hv2".into()),
                zone: None
            })
        );
        let zone = reported(Some(Location::Zone("z1".into())));
        assert_eq!(
            location_of(Some(&zone)),
            Some(InstanceLocation {
                host: None,
                zone: Some("z1".into())
            })
        );
        assert_eq!(location_of(Some(&reported(None))), None);
        assert_eq!(location_of(None), None);
    }
}
