//! What the agent can tell of a document's configuration before the guest reads it: the
//! facts that decide where the bootstrap goes (`placement`).

use super::bootstrap::Item;

/// What a document does with one of the bootstrap's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ListSeen {
    /// The document does not set the list.
    Absent,
    /// It sets the list, which already has the bootstrap's item or not.
    Present {
        /// The list installs the agent (`packages`) or starts it (`runcmd`).
        has_agent: bool,
    },
    /// The agent cannot tell before the guest renders, fetches or unpacks the document
    /// (jinja, `#include`, MIME, `#cloud-config-archive`).
    Unknown,
}

/// What a document's configuration does, as far as it matters to the bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DocumentFacts {
    /// Its `packages`.
    pub(super) packages: ListSeen,
    /// Its `runcmd`.
    pub(super) runcmd: ListSeen,
    /// Whether cloud-init reads vendor-data after it as user-data (`vendor_data.enabled`,
    /// true unless turned off); `None` when the agent cannot tell.
    pub(super) vendor_data_enabled: Option<bool>,
}

impl DocumentFacts {
    /// A document that gives cloud-init no configuration: blank, a script, a boot hook.
    pub(super) const NO_CONFIG: DocumentFacts = DocumentFacts {
        packages: ListSeen::Absent,
        runcmd: ListSeen::Absent,
        vendor_data_enabled: Some(true),
    };

    /// A document the agent cannot read before the guest does.
    pub(super) const UNKNOWN: DocumentFacts = DocumentFacts {
        packages: ListSeen::Unknown,
        runcmd: ListSeen::Unknown,
        vendor_data_enabled: None,
    };

    /// What it does with the list of `item`.
    pub(super) fn list(&self, item: Item) -> ListSeen {
        match item {
            Item::Package => self.packages,
            Item::Runcmd => self.runcmd,
        }
    }
}
