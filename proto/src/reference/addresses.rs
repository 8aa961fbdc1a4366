//! The reference provider's address identities (CAPABILITY_ADDRESS_IDENTITY and
//! CAPABILITY_REQUESTED_ADDRESS): the whole provider is one network, with one range.
//!
//! The provider keeps no table of holdings: an identity holds the address of its
//! instances that still exist (DELETING ones included), and an address is taken while
//! any existing instance holds it. So an address is released exactly when the last
//! instance holding it is gone, and nothing can be left behind. `grant` decides one
//! Create, in this order:
//! 1. an earlier instance of the identity still exists (any state): UNAVAILABLE,
//!    `ADDRESS_IDENTITY_IN_USE` (the contract lets a provider move the identity off
//!    STOPPED instances; this one never does, the simplest choice that keeps it);
//! 2. a requested address outside the range: INVALID_ARGUMENT on `requested_address`,
//!    `ADDRESS_NOT_IN_RANGE`, naming the range; held by another instance:
//!    ALREADY_EXISTS, `ADDRESS_TAKEN`; otherwise it is granted;
//! 3. without a request, the identity's preferred address (a hash of the identity
//!    picks it, so an identity whose last instance is gone gets the same address back
//!    while it is free), else the next free one after it; none free:
//!    RESOURCE_EXHAUSTED, `ADDRESSES_EXHAUSTED`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::Misbehaviour;
use crate::ProviderError;

/// IPv4 addresses from `first` to `last`, both included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRange {
    /// The first address of the range.
    pub first: Ipv4Addr,
    /// The last address of the range (not before `first`).
    pub last: Ipv4Addr,
}

impl AddressRange {
    /// The reference provider's default: 192.0.2.10 to 192.0.2.250 (TEST-NET-1, an
    /// address no real network routes).
    pub const DEFAULT: AddressRange = AddressRange {
        first: Ipv4Addr::new(192, 0, 2, 10),
        last: Ipv4Addr::new(192, 0, 2, 250),
    };

    /// Whether `address` is in the range.
    pub fn contains(&self, address: IpAddr) -> bool {
        match address {
            IpAddr::V4(v4) => (self.first..=self.last).contains(&v4),
            IpAddr::V6(_) => false,
        }
    }

    fn size(&self) -> u32 {
        u32::from(self.last).saturating_sub(u32::from(self.first)) + 1
    }

    fn nth(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.first) + n % self.size())
    }
}

impl fmt::Display for AddressRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

/// An existing instance, as `grant` sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holder<'a> {
    /// The instance's id.
    pub(super) id: &'a str,
    /// Its address identity, if it was created with one.
    pub(super) identity: Option<&'a str>,
    /// The address it holds from the range, if any.
    pub(super) address: Option<Ipv4Addr>,
}

/// The address a Create with `identity` (and `requested`) gets, given the instances
/// that exist; see the module docs. `misbehave` breaks one rule on purpose.
pub(super) fn grant<'a>(
    range: AddressRange,
    identity: &str,
    requested: Option<IpAddr>,
    holders: impl Iterator<Item = Holder<'a>> + Clone,
    misbehave: Option<Misbehaviour>,
) -> Result<Ipv4Addr, ProviderError> {
    let breaks = |m: Misbehaviour| misbehave == Some(m);
    if let Some(earlier) = holders.clone().find(|h| h.identity == Some(identity)) {
        if breaks(Misbehaviour::IdentitySharedWhileRunning)
            && let Some(address) = earlier.address
        {
            return Ok(address);
        }
        return Err(ProviderError::transient(format!(
            "address identity {identity} is held by instance {}, which still exists: \
             delete it, then create again (two instances with one address would take \
             each other's traffic)",
            earlier.id
        ))
        .with_reason("ADDRESS_IDENTITY_IN_USE")
        .with_retry_after(Some(Duration::from_millis(100))));
    }
    let taken = |address: Ipv4Addr| holders.clone().find(|h| h.address == Some(address));
    if let Some(requested) = requested.filter(|_| !breaks(Misbehaviour::RequestedAddressIgnored)) {
        let not_in_range = || {
            ProviderError::invalid_argument(
                "requested_address",
                format!("{requested} is not in a range this provider offers: use one of {range}"),
            )
            .with_reason("ADDRESS_NOT_IN_RANGE")
        };
        if !range.contains(requested) && !breaks(Misbehaviour::OutOfRangeAccepted) {
            return Err(not_in_range());
        }
        // The range is IPv4 only, so even misbehaving there is no IPv6 address to grant.
        let IpAddr::V4(requested) = requested else {
            return Err(not_in_range());
        };
        if let Some(holder) = taken(requested)
            && !breaks(Misbehaviour::TakenAddressGranted)
        {
            return Err(ProviderError::already_exists(format!(
                "address {requested} is held by instance {}: ask for another, or delete \
                 that instance first",
                holder.id
            ))
            .with_reason("ADDRESS_TAKEN"));
        }
        return Ok(requested);
    }
    let preferred = preferred_index(identity);
    (0..range.size())
        .map(|step| range.nth(preferred.wrapping_add(step)))
        .find(|address| taken(*address).is_none() && Some(IpAddr::V4(*address)) != requested)
        .ok_or_else(|| {
            ProviderError::quota_exhausted(
                format!(
                    "every address of {range} is held by an instance: delete one, or retry later"
                ),
                Some(Duration::from_secs(1)),
            )
            .with_reason("ADDRESSES_EXHAUSTED")
        })
}

/// Where in a range an identity's search for a free address starts.
fn preferred_index(identity: &str) -> u32 {
    let digest = Sha256::digest(identity.as_bytes());
    u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: AddressRange = AddressRange {
        first: Ipv4Addr::new(192, 0, 2, 10),
        last: Ipv4Addr::new(192, 0, 2, 12),
    };

    fn holder<'a>(id: &'a str, identity: Option<&'a str>, address: u8) -> Holder<'a> {
        Holder {
            id,
            identity,
            address: Some(Ipv4Addr::new(192, 0, 2, address)),
        }
    }

    fn reason(result: Result<Ipv4Addr, ProviderError>) -> String {
        result.unwrap_err().reason
    }

    #[test]
    fn an_identity_gets_its_preferred_address_again_once_released() {
        let first = grant(SMALL, "uid-1", None, [].into_iter(), None).unwrap();
        assert!(SMALL.contains(first.into()));
        let again = grant(SMALL, "uid-1", None, [].into_iter(), None).unwrap();
        assert_eq!(first, again);
    }

    #[test]
    fn an_earlier_instance_of_the_identity_holds_it() {
        let holders = [holder("ref-1", Some("uid-1"), 10)];
        assert_eq!(
            reason(grant(SMALL, "uid-1", None, holders.into_iter(), None)),
            "ADDRESS_IDENTITY_IN_USE"
        );
    }

    #[test]
    fn two_identities_never_share_and_a_full_range_is_exhausted() {
        let holders = [
            holder("ref-1", Some("a"), 10),
            holder("ref-2", Some("b"), 11),
        ];
        let third = grant(SMALL, "c", None, holders.into_iter(), None).unwrap();
        assert_eq!(third, Ipv4Addr::new(192, 0, 2, 12));
        let full = [
            holder("ref-1", Some("a"), 10),
            holder("ref-2", Some("b"), 11),
            holder("ref-3", None, 12),
        ];
        assert_eq!(
            reason(grant(SMALL, "d", None, full.into_iter(), None)),
            "ADDRESSES_EXHAUSTED"
        );
    }

    #[test]
    fn a_requested_address_is_granted_refused_as_taken_or_outside_the_range() {
        let holders = [holder("ref-1", Some("a"), 10)];
        let free: IpAddr = "192.0.2.11".parse().unwrap();
        assert_eq!(
            grant(SMALL, "b", Some(free), holders.into_iter(), None).unwrap(),
            Ipv4Addr::new(192, 0, 2, 11)
        );
        let held: IpAddr = "192.0.2.10".parse().unwrap();
        assert_eq!(
            reason(grant(SMALL, "b", Some(held), holders.into_iter(), None)),
            "ADDRESS_TAKEN"
        );
        let outside: IpAddr = "203.0.113.254".parse().unwrap();
        let error = grant(SMALL, "b", Some(outside), holders.into_iter(), None).unwrap_err();
        assert_eq!(error.reason, "ADDRESS_NOT_IN_RANGE");
        assert_eq!(error.field_violations[0].field, "requested_address");
        assert!(
            error.field_violations[0]
                .description
                .contains("192.0.2.10-192.0.2.12")
        );
    }
}
