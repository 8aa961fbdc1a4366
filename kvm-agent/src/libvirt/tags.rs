//! UpdateInstanceTags' libvirt work: compare-and-set of an instance's tags, which live in
//! its domain's metadata element ([`crate::libvirt::xml::metadata`]).
//!
//! [`compare_and_set_tags`], one blocking function of one connection:
//! 1. **Find.** No domain with the instance's name, or one without the agent's metadata
//!    (not the agent's): [`TagsUpdate::NoInstance`], nothing touched.
//! 2. **Compare.** The tags read from the metadata (the running definition for a running
//!    domain, the persistent one otherwise, as Get reads them) already equal the new
//!    ones: nothing is written ([`TagsUpdate::Done`] with `written: false`), so a retry
//!    whose first answer was lost succeeds. Otherwise they must equal the expected ones
//!    exactly (same keys, same values), else [`TagsUpdate::TagsDiffer`], nothing written.
//! 3. **Set.** The whole element, with only its tags replaced, goes back with
//!    `virDomainSetMetadata`: for a running domain to the running and the persistent
//!    definition at once (`VIR_DOMAIN_AFFECT_LIVE | VIR_DOMAIN_AFFECT_CONFIG`), for one
//!    that is not running to the persistent one. So `virsh dumpxml` (with or without
//!    `--inactive`) shows the new tags, and a restart of the agent, of libvirtd or of the
//!    domain keeps them. A domain that stops between the check and the write (libvirt
//!    refuses the live part) or starts in between (its running definition was copied
//!    from the old persistent one) is written again for its state now.
//! 4. **Read back** as Get reads it, so the answer carries the new tags with the
//!    instance's state and addresses.
//!
//! libvirt has no conditional write: steps 2 and 3 are one step only because the caller
//! holds the key's lock, which every Create, Delete and tag update of the key in the
//! agent takes (the provider layer, above this one).

use std::collections::BTreeMap;

use virt::connect::Connect;
use virt::error::ErrorNumber;
use virt::sys;

use crate::libvirt::domains::{
    DomainSnapshot, NicKind, lookup_domain, read_instance, read_metadata,
};
use crate::libvirt::error::LibvirtError;
use crate::libvirt::naming::InstanceNames;
use crate::libvirt::xml::metadata::{METADATA_NAMESPACE, METADATA_PREFIX};
use crate::transport::call::CallFailure;

/// Writes tried when the domain's state keeps changing between the check and the write.
const STATE_RACE_ATTEMPTS: usize = 3;

/// What [`compare_and_set_tags`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagsUpdate {
    /// No domain of the agent with the instance's name.
    NoInstance,
    /// The tags are neither the expected nor the new ones; nothing was written.
    TagsDiffer,
    /// The instance has the new tags now.
    Done {
        /// Whether they were written (false: it had them already).
        written: bool,
        /// The instance as Get reads it after the write.
        snapshot: Box<DomainSnapshot>,
    },
}

/// Replaces the tags of instance `names` by `new` while they are exactly `expected`.
/// See the module docs.
pub fn compare_and_set_tags(
    conn: &Connect,
    names: &InstanceNames,
    expected: &BTreeMap<String, String>,
    new: &BTreeMap<String, String>,
    nic: NicKind,
) -> Result<TagsUpdate, CallFailure<LibvirtError>> {
    let Some(domain) = lookup_domain(conn, &names.domain)? else {
        return Ok(TagsUpdate::NoInstance);
    };
    let Some(mut metadata) = read_metadata(&domain)? else {
        return Ok(TagsUpdate::NoInstance);
    };
    let written = if metadata.tags == *new {
        false
    } else if metadata.tags != *expected {
        return Ok(TagsUpdate::TagsDiffer);
    } else {
        metadata.tags = new.clone();
        let element = metadata.to_bare_xml().map_err(|e| {
            CallFailure::Agent(LibvirtError::xml(
                format!("metadata of domain {}", names.domain),
                e,
            ))
        })?;
        set_metadata_everywhere(&domain, &element)?;
        true
    };
    Ok(match read_instance(conn, names, nic)? {
        Some(snapshot) => TagsUpdate::Done {
            written,
            snapshot: Box::new(snapshot),
        },
        // Undefined by someone outside the agent since the write.
        None => TagsUpdate::NoInstance,
    })
}

/// Step 3 of the module docs: `element` into every definition the domain has now.
fn set_metadata_everywhere(
    domain: &virt::domain::Domain,
    element: &str,
) -> Result<(), CallFailure<LibvirtError>> {
    for attempt in 1..=STATE_RACE_ATTEMPTS {
        let last = attempt == STATE_RACE_ATTEMPTS;
        let running = domain.is_active()?;
        let flags = if running {
            sys::VIR_DOMAIN_AFFECT_LIVE | sys::VIR_DOMAIN_AFFECT_CONFIG
        } else {
            sys::VIR_DOMAIN_AFFECT_CONFIG
        };
        match domain.set_metadata(
            sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(element),
            Some(METADATA_PREFIX),
            Some(METADATA_NAMESPACE),
            flags,
        ) {
            Ok(()) => {}
            // Stopped since the check: libvirt refuses the live part.
            Err(e) if !last && running && e.code().is(ErrorNumber::OperationInvalid) => continue,
            Err(e) => return Err(e.into()),
        }
        // Started since the check: its running definition may hold the old tags.
        if !running && !last && domain.is_active()? {
            continue;
        }
        return Ok(());
    }
    Ok(())
}
