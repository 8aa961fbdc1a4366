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

use super::GuestAgent;
use super::multipart::Part;

/// The package that reports guest addresses to libvirt.
pub const GUEST_AGENT_PACKAGE: &str = "qemu-guest-agent";
/// The command that starts it once installed.
pub const GUEST_AGENT_RUNCMD: [&str; 4] = ["systemctl", "enable", "--now", "qemu-guest-agent"];
/// How cloud-init merges the bootstrap into what came before it.
pub const MERGE_TYPE: &str = "list(append)+dict(no_replace,recurse_list)+str()";
/// The bootstrap part's file name, shown in cloud-init's logs and `cloud-config.txt`.
const PART_FILE_NAME: &str = "egressproxy-guest-agent.cfg";

/// What a configuration already does of the bootstrap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AlreadyThere {
    /// `packages` installs qemu-guest-agent.
    pub(crate) package: bool,
    /// `runcmd` starts it.
    pub(crate) runcmd: bool,
}

/// Which of the two bootstrap items the guest still needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bootstrap {
    package: bool,
    runcmd: bool,
}

impl Bootstrap {
    /// Everything an image set up as `guest_agent` needs.
    pub(super) fn for_image(guest_agent: GuestAgent) -> Self {
        Bootstrap {
            package: guest_agent == GuestAgent::Install,
            runcmd: true,
        }
    }

    /// Without what the user's configuration already does.
    pub(super) fn without(self, already: AlreadyThere) -> Self {
        Bootstrap {
            package: self.package && !already.package,
            runcmd: self.runcmd && !already.runcmd,
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
