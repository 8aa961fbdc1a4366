//! libvirt XML, built from serde structs (never by string concatenation) and parsed back
//! into the few facts the agent reads.
//!
//! - [`domain`]: an instance's domain XML, and the facts read back from a defined domain.
//! - [`metadata`]: the agent's `<metadata>` element (key, tags, placement, spec digest).
//! - [`network`]: a network's DHCP ranges and host reservations, and a `<host>` element.
//! - [`volume`]: raw, sparse and overlay volume XML, and the facts of an existing volume.
//! - [`capabilities`]: libvirt's domain capabilities (KVM, UEFI firmware).

pub mod capabilities;
pub mod domain;
pub mod metadata;
pub mod network;
pub mod volume;

use crate::classification::{Classification, ErrorClass};

impl XmlError {
    /// The layer's verdict. Either way retrying gets the same XML, so both are permanent:
    /// XML libvirt returned that the agent cannot read is not a transient I/O failure.
    pub fn classify(&self) -> Classification {
        let of = Classification::new;
        match self {
            XmlError::Parse { .. } => of(ErrorClass::Permanent, "LIBVIRT_XML_UNREADABLE"),
            XmlError::Serialize(_) => of(ErrorClass::Permanent, "LIBVIRT_XML_UNBUILDABLE"),
        }
    }
}

/// XML (de)serialization failed.
#[derive(Debug, thiserror::Error)]
pub enum XmlError {
    /// Building the XML failed.
    #[error("cannot build libvirt XML: {0}")]
    Serialize(#[from] quick_xml::SeError),
    /// The XML libvirt returned does not parse as expected.
    #[error("cannot parse {what}: {source}")]
    Parse {
        /// What was being parsed.
        what: &'static str,
        /// The parser's error.
        #[source]
        source: quick_xml::DeError,
    },
}
