//! The qemu-guest-agent bootstrap: a cloud-config part that cloud-init merges into the
//! user's configuration by appending to its lists.
//!
//! The merge type is what makes it safe to put beside any user-data. cloud-init's
//! default for a later cloud-config part is `dict(replace)`, under which the last
//! `packages:` wins; [`MERGE_TYPE`] instead appends lists (`list(append)`), leaves the
//! user's other settings alone (`dict(no_replace)`) and still descends into lists that
//! both define (`recurse_list`). Debian 12's cloud-init (22.4) honours it in the part's
//! `X-Merge-Type` header, which keeps the document itself free of a `merge_how` key
//! that would otherwise end up in the merged configuration.

use std::borrow::Cow;

use super::multipart::Part;
use crate::config::GuestAgent;

/// The package that reports guest addresses to libvirt.
pub const GUEST_AGENT_PACKAGE: &str = "qemu-guest-agent";
/// The command that starts it once installed.
pub const GUEST_AGENT_RUNCMD: [&str; 4] = ["systemctl", "enable", "--now", "qemu-guest-agent"];
/// How cloud-init merges the bootstrap into what came before it.
pub const MERGE_TYPE: &str = "list(append)+dict(no_replace,recurse_list)+str()";
/// The bootstrap part's file name, shown in cloud-init's logs and `cloud-config.txt`.
const PART_FILE_NAME: &str = "egressproxy-guest-agent.cfg";

/// One item of the bootstrap, and the list cloud-init takes it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Item {
    /// [`GUEST_AGENT_PACKAGE`] in `packages`.
    Package,
    /// [`GUEST_AGENT_RUNCMD`] in `runcmd`.
    Runcmd,
}

impl Item {
    /// Both items, in the order the bootstrap writes them.
    pub(super) const ALL: [Item; 2] = [Item::Package, Item::Runcmd];

    /// The top-level key of the list the item goes into.
    pub(super) fn key(self) -> &'static str {
        match self {
            Item::Package => "packages",
            Item::Runcmd => "runcmd",
        }
    }
}

/// Which of the two bootstrap items a document gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bootstrap {
    package: bool,
    runcmd: bool,
}

impl Bootstrap {
    /// No item.
    pub(super) const NONE: Bootstrap = Bootstrap {
        package: false,
        runcmd: false,
    };

    /// Everything an image set up as `guest_agent` needs.
    pub(super) fn for_image(guest_agent: GuestAgent) -> Self {
        Bootstrap {
            package: guest_agent == GuestAgent::Install,
            runcmd: true,
        }
    }

    /// Whether `item` is in it.
    pub(super) fn has(self, item: Item) -> bool {
        match item {
            Item::Package => self.package,
            Item::Runcmd => self.runcmd,
        }
    }

    /// With `item` too.
    pub(super) fn with(self, item: Item) -> Self {
        match item {
            Item::Package => Bootstrap {
                package: true,
                ..self
            },
            Item::Runcmd => Bootstrap {
                runcmd: true,
                ..self
            },
        }
    }

    /// Nothing left to add.
    pub(super) fn is_empty(self) -> bool {
        !self.package && !self.runcmd
    }

    /// The bootstrap as a `#cloud-config` document.
    pub(super) fn document(self) -> String {
        let mut doc = String::from("#cloud-config\n");
        if self.package {
            doc.push_str(&format!("packages:\n  - {GUEST_AGENT_PACKAGE}\n"));
        }
        if self.runcmd {
            doc.push_str(&format!(
                "runcmd:\n  - [{}]\n",
                GUEST_AGENT_RUNCMD.join(", ")
            ));
        }
        doc
    }

    /// The bootstrap as the last part of the user-data multipart.
    pub(super) fn part(self) -> Part<'static> {
        Part::Body {
            content_type: "text/cloud-config",
            merge_type: Some(MERGE_TYPE),
            file_name: Some(PART_FILE_NAME),
            body: Cow::Owned(self.document().into_bytes()),
        }
    }
}
