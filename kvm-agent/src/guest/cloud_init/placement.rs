//! Where each item of the bootstrap goes: into user-data, into vendor-data, or nowhere.
//!
//! cloud-init merges user-data's configuration over vendor-data's, and a key that
//! user-data sets replaces vendor-data's whole, lists included. So an item goes with the
//! list that will reach the guest: user-data's when user-data sets it; else
//! vendor-data's when vendor-data sets it (or may: the agent cannot always tell before
//! the guest), since a bootstrap list in user-data would replace the vendor's; else
//! user-data's. An item already there (the list installs or starts the agent) is not
//! added again. Vendor-data counts only when there is some and user-data does not turn
//! it off (`vendor_data: {enabled: false}`).
//!
//! | user-data's list           | vendor-data's list (when read)            | the item goes to |
//! |----------------------------|-------------------------------------------|------------------|
//! | set, with the agent        | any                                       | nowhere          |
//! | set, without the agent     | any                                       | user-data        |
//! | not set, or cannot tell    | none, not read, or not set                | user-data        |
//! | not set, or cannot tell    | set, with the agent                       | nowhere          |
//! | not set, or cannot tell    | set without the agent, or cannot tell     | vendor-data      |
//!
//! The same table is in `docs/kvm-agent.md`. When user-data that the agent cannot read
//! (a jinja template, `#include`, MIME) turns out to set a list that vendor-data sets
//! too, cloud-init drops the vendor's list, and the item with it: the caller's own lists
//! are never lost for the bootstrap's sake, but then the user-data should list the agent
//! itself.

use super::bootstrap::{Bootstrap, Item};
use super::document_facts::{DocumentFacts, ListSeen};
use crate::config::GuestAgent;

/// Where one item goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Destination {
    /// Appended to user-data's list (or making it).
    UserData,
    /// Appended to vendor-data's list (or making it).
    VendorData,
    /// Already there.
    Nowhere,
}

/// The table of the module docs, for one item: `vendor` is `None` when there is no
/// vendor-data or cloud-init will not read it.
pub(super) fn destination(user: ListSeen, vendor: Option<ListSeen>) -> Destination {
    use ListSeen::{Absent, Present, Unknown};
    match (user, vendor) {
        (Present { has_agent: true }, _) => Destination::Nowhere,
        (Present { has_agent: false }, _) => Destination::UserData,
        (Absent | Unknown, None | Some(Absent)) => Destination::UserData,
        (Absent | Unknown, Some(Present { has_agent: true })) => Destination::Nowhere,
        (Absent | Unknown, Some(Present { has_agent: false } | Unknown)) => Destination::VendorData,
    }
}

/// The bootstrap of each document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placed {
    /// What goes into user-data.
    pub(super) user: Bootstrap,
    /// What goes into vendor-data.
    pub(super) vendor: Bootstrap,
}

/// Splits the bootstrap an image set up as `guest_agent` needs between user-data (whose
/// facts are `user`) and vendor-data (`vendor`, when the caller sent any).
pub(super) fn place(
    guest_agent: GuestAgent,
    user: &DocumentFacts,
    vendor: Option<&DocumentFacts>,
) -> Placed {
    let needed = Bootstrap::for_image(guest_agent);
    let read_vendor = vendor.filter(|_| user.vendor_data_enabled != Some(false));
    let mut placed = Placed {
        user: Bootstrap::NONE,
        vendor: Bootstrap::NONE,
    };
    for item in Item::ALL.into_iter().filter(|item| needed.has(*item)) {
        match destination(user.list(item), read_vendor.map(|v| v.list(item))) {
            Destination::UserData => placed.user = placed.user.with(item),
            Destination::VendorData => placed.vendor = placed.vendor.with(item),
            Destination::Nowhere => {}
        }
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    const WITH: ListSeen = ListSeen::Present { has_agent: true };
    const WITHOUT: ListSeen = ListSeen::Present { has_agent: false };
    const ABSENT: ListSeen = ListSeen::Absent;
    const UNKNOWN: ListSeen = ListSeen::Unknown;

    #[test]
    fn the_table_of_the_docs() {
        use Destination::{Nowhere, UserData, VendorData};
        let vendors = [None, Some(ABSENT), Some(WITH), Some(WITHOUT), Some(UNKNOWN)];
        for vendor in vendors {
            assert_eq!(destination(WITH, vendor), Nowhere, "{vendor:?}");
            assert_eq!(destination(WITHOUT, vendor), UserData, "{vendor:?}");
        }
        for user in [ABSENT, UNKNOWN] {
            for (vendor, want) in [
                (None, UserData),
                (Some(ABSENT), UserData),
                (Some(WITH), Nowhere),
                (Some(WITHOUT), VendorData),
                (Some(UNKNOWN), VendorData),
            ] {
                assert_eq!(destination(user, vendor), want, "{user:?} {vendor:?}");
            }
        }
    }

    #[test]
    fn the_docs_show_the_same_table() {
        let rows = |text: &str, prefix: &str| -> Vec<String> {
            text.lines()
                .filter_map(|line| line.strip_prefix(prefix))
                .filter(|line| line.starts_with('|'))
                .map(str::to_owned)
                .collect()
        };
        let here = rows(include_str!("placement.rs"), "//! ");
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md");
        let docs = std::fs::read_to_string(path).unwrap();
        assert_eq!(here.len(), 7, "{here:?}");
        let docs_rows = rows(&docs, "");
        let at = docs_rows
            .iter()
            .position(|row| *row == here[0])
            .expect("the table's header in docs/kvm-agent.md");
        assert_eq!(docs_rows[at..at + here.len()], here[..]);
    }

    #[test]
    fn vendor_data_turned_off_by_user_data_is_not_counted() {
        let vendor = DocumentFacts {
            packages: WITHOUT,
            runcmd: WITHOUT,
            vendor_data_enabled: Some(true),
        };
        let off = DocumentFacts {
            vendor_data_enabled: Some(false),
            ..DocumentFacts::NO_CONFIG
        };
        let placed = place(GuestAgent::Install, &off, Some(&vendor));
        assert_eq!(placed.user, Bootstrap::for_image(GuestAgent::Install));
        assert_eq!(placed.vendor, Bootstrap::NONE);
        let placed = place(
            GuestAgent::Install,
            &DocumentFacts::NO_CONFIG,
            Some(&vendor),
        );
        assert_eq!(placed.user, Bootstrap::NONE);
        assert_eq!(placed.vendor, Bootstrap::for_image(GuestAgent::Install));
    }

    #[test]
    fn a_preinstalled_agent_places_only_the_command() {
        let vendor = DocumentFacts::UNKNOWN;
        let placed = place(
            GuestAgent::Preinstalled,
            &DocumentFacts::UNKNOWN,
            Some(&vendor),
        );
        assert_eq!(placed.user, Bootstrap::NONE);
        assert_eq!(placed.vendor, Bootstrap::NONE.with(Item::Runcmd));
    }
}
