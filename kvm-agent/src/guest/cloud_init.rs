//! The cloud-init documents of an instance: the caller's user-data and vendor-data,
//! unchanged, each with the part of the qemu-guest-agent bootstrap that belongs there
//! beside it, for cloud-init itself to merge.
//!
//! The agent finds guest addresses through qemu-guest-agent first, so every guest must
//! install and start it. Where the bootstrap goes matters: cloud-init lets a key that
//! user-data sets *replace* vendor-data's, lists included, so a bootstrap list in the
//! wrong document either is lost or makes the caller's list lost; and editing the
//! caller's YAML changes it (a re-serialised `"1:5.7"` comes back as the YAML 1.1 number
//! `65.7`). So:
//! 1. **The caller's documents are never edited.** Each goes into the seed byte for
//!    byte: as the first part of a MIME multipart (`multipart`), typed the way
//!    cloud-init itself types it (`user_document`): cloud-config, jinja template,
//!    script, `#include`, gzip, or, for the caller's own MIME document, nested with its
//!    own parts.
//! 2. **The bootstrap is the last part** (`bootstrap`): a cloud-config whose merge type
//!    appends to lists and recurses into dictionaries, so cloud-init adds it to the
//!    document's `packages` and `runcmd` instead of replacing them.
//! 3. **Each item goes with the list that reaches the guest** (`placement`): into
//!    user-data when user-data sets that list, else into vendor-data when vendor-data
//!    sets it (or may), else into user-data; so a vendor's `packages` or `runcmd` is
//!    never replaced by a bootstrap list in user-data.
//! 4. **Only what is missing is added.** In a plain (or gzipped) `#cloud-config`, a
//!    `qemu-guest-agent` already in the list that reaches the guest (as a name,
//!    `name=version` or a `[name, version]` pair) drops the package, and a `runcmd` that
//!    already starts the agent drops the command (`cloud_config`); with nothing left a
//!    document is exactly the caller's. An image whose configuration says
//!    `guestAgent: preinstalled` never gets the package, only the command.
//! 5. **A broken `#cloud-config` is refused**, not sent: one that does not parse, is not
//!    a YAML mapping, has a merge key (`<<`) that names no mapping, or whose `packages`
//!    or `runcmd` (its own or merged in) is not a list is INVALID_ARGUMENT on
//!    `cloud_init.user_data` (`cloud_init.vendor_data` for the caller's vendor-data) with
//!    reason `INVALID_CLOUD_CONFIG`. cloud-init would ignore it, or replace a string
//!    `packages` with the bootstrap's list, and the VM would never report an address or
//!    miss the caller's package. Duplicate keys are accepted, the last one wins, and
//!    merge keys are resolved, as in cloud-init's YAML loader (`yaml_tree`).
//!
//! Either document is at most [`MAX_USER_DATA_BYTES`]. Error messages name a line and
//! column at most, never the content: user-data may hold secrets.

mod bootstrap;
mod cloud_config;
mod document_facts;
mod multipart;
mod placement;
mod user_document;
mod yaml_tree;

use egressproxy_provider::validation::MAX_USER_DATA_BYTES;

use bootstrap::Bootstrap;
pub use bootstrap::{GUEST_AGENT_PACKAGE, GUEST_AGENT_RUNCMD, MERGE_TYPE};
use user_document::UserDocument;

// An image's setting, read from the configuration; re-exported because every caller of
// `seed_documents` passes one.
pub use crate::config::GuestAgent;
use crate::guest::GuestError;

const USER_DATA_FIELD: &str = "cloud_init.user_data";
const VENDOR_DATA_FIELD: &str = "cloud_init.vendor_data";

/// The documents that go into the NoCloud seed.
#[derive(Clone, PartialEq, Eq)]
pub struct SeedDocuments {
    /// `user-data`.
    pub user_data: Vec<u8>,
    /// `vendor-data`, when there is any.
    pub vendor_data: Option<Vec<u8>>,
}

impl std::fmt::Debug for SeedDocuments {
    // Never print the documents: they may hold secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedDocuments")
            .field("user_data_bytes", &self.user_data.len())
            .field(
                "vendor_data_bytes",
                &self.vendor_data.as_ref().map(Vec::len),
            )
            .finish()
    }
}

/// Builds the seed's documents from the caller's user-data and vendor-data for an image
/// whose guest agent is set up as `guest_agent`. See the module docs.
pub fn seed_documents(
    user_data: &[u8],
    vendor_data: Option<&[u8]>,
    guest_agent: GuestAgent,
) -> Result<SeedDocuments, GuestError> {
    check_size(USER_DATA_FIELD, user_data)?;
    let vendor = match vendor_data {
        Some(vendor) => {
            check_size(VENDOR_DATA_FIELD, vendor)?;
            let document = UserDocument::read(vendor, VENDOR_DATA_FIELD)?;
            let facts = document.check(VENDOR_DATA_FIELD)?;
            Some((document, facts))
        }
        None => None,
    };
    let user = UserDocument::read(user_data, USER_DATA_FIELD)?;
    let user_facts = user.check(USER_DATA_FIELD)?;
    let placed = placement::place(guest_agent, &user_facts, vendor.as_ref().map(|(_, f)| f));
    Ok(SeedDocuments {
        user_data: with_bootstrap(&user, placed.user),
        vendor_data: vendor.map(|(document, _)| with_bootstrap(&document, placed.vendor)),
    })
}

/// `document` with `bootstrap` as its last part; exactly the caller's when there is
/// nothing to add, the bootstrap alone when the document is blank.
fn with_bootstrap(document: &UserDocument<'_>, bootstrap: Bootstrap) -> Vec<u8> {
    if bootstrap.is_empty() {
        document.raw().to_vec()
    } else if document.is_blank() {
        bootstrap.document().into_bytes()
    } else {
        multipart::build(&[document.part(), bootstrap.part()])
    }
}

fn check_size(field: &str, data: &[u8]) -> Result<(), GuestError> {
    if data.len() > MAX_USER_DATA_BYTES {
        return Err(GuestError::TooLarge {
            field: field.to_owned(),
            description: format!(
                "{} bytes is over the {MAX_USER_DATA_BYTES}-byte limit",
                data.len()
            ),
        });
    }
    Ok(())
}

/// A cloud-config on `field` that cannot be used (`INVALID_CLOUD_CONFIG` on the wire,
/// through the crate's one mapping).
fn invalid(field: &str, description: impl Into<String>) -> GuestError {
    GuestError::InvalidCloudConfig {
        field: field.to_owned(),
        description: description.into(),
    }
}

#[cfg(test)]
mod tests;
