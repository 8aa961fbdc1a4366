//! A Proxy's placement as CreateInstance and ValidatePlacement ask for it: one mapping,
//! for a Proxy's instance and a pool's spare alike.

use egressproxy_provider::pb;
use pb::placement::Location;

use crate::crd::Placement;

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
}
