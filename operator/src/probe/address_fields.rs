//! An address's scope and family as the contract tells a caller to read them, also
//! from a provider newer than this operator: one reading for the address the operator
//! checks and for the addresses the status lists.
//!
//! prost keeps an enum value it does not know as the raw number, and its accessors
//! (`scope()`, `family()`) turn that number into the `UNSPECIFIED` variant. So a
//! reading names the values it knows and never matches on "anything but EXTERNAL" or
//! "anything but V6": those take a newer scope for `INTERNAL`, a newer family for V4.

use std::net::IpAddr;

use egressproxy_provider::pb;

/// Whether the address is `INTERNAL`. A scope this operator does not know is read
/// like `EXTERNAL` (the contract's rule: used only when no internal address is
/// usable); so is `UNSPECIFIED`, which a provider must not send and which does not say
/// the address is reachable from inside.
pub fn is_internal(address: &pb::Address) -> bool {
    address.scope() == pb::AddressScope::Internal
}

/// The address's IP family: the stated one when it is `V4` or `V6`, otherwise (a
/// value this operator does not know, or `UNSPECIFIED`) the family of the address
/// text, as the contract says. `None` when neither tells it.
pub fn family(address: &pb::Address) -> Option<pb::IpFamily> {
    match address.family() {
        family @ (pb::IpFamily::V4 | pb::IpFamily::V6) => Some(family),
        pb::IpFamily::Unspecified => match address.address.parse::<IpAddr>().ok()? {
            IpAddr::V4(_) => Some(pb::IpFamily::V4),
            IpAddr::V6(_) => Some(pb::IpFamily::V6),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value the generated code has no variant for, as a newer provider may send.
    const NEWER: i32 = 7;

    fn address(ip: &str, scope: i32, family: i32) -> pb::Address {
        pb::Address {
            address: ip.to_owned(),
            scope,
            family,
        }
    }

    #[test]
    fn only_an_internal_scope_is_internal() {
        let internal = pb::AddressScope::Internal as i32;
        let external = pb::AddressScope::External as i32;
        let unspecified = pb::AddressScope::Unspecified as i32;
        assert!(is_internal(&address("10.0.0.7", internal, 1)));
        assert!(!is_internal(&address("10.0.0.7", external, 1)));
        assert!(!is_internal(&address("10.0.0.7", NEWER, 1)));
        assert!(!is_internal(&address("10.0.0.7", unspecified, 1)));
    }

    #[test]
    fn the_stated_family_wins_and_an_unknown_one_comes_from_the_text() {
        use pb::IpFamily::{Unspecified, V4, V6};
        let cases = [
            ("10.0.0.7", V4 as i32, Some(V4)),
            ("2001:db8::7", V6 as i32, Some(V6)),
            ("2001:db8::7", NEWER, Some(V6)),
            ("10.0.0.7", NEWER, Some(V4)),
            ("2001:db8::7", Unspecified as i32, Some(V6)),
            ("not-an-ip", NEWER, None),
        ];
        for (ip, stated, read) in cases {
            assert_eq!(
                family(&address(ip, 1, stated)),
                read,
                "{ip} stated {stated}"
            );
        }
    }
}
