//! The agent's record of an instance, kept in the domain's `<metadata>` element under
//! [`METADATA_NAMESPACE`]: key, name, tags, creation time, placement, proxy port, the
//! digest of the spec, and the address identity and static address when it has them.
//!
//! libvirt returns the metadata element re-indented and without its namespace prefix
//! (whatever prefix it was written with), so [`InstanceMetadata::parse`] matches elements by local name and accepts
//! both forms. Every user-supplied string is an attribute; [`check_xml_safe`] refuses
//! what libvirt's XML cannot keep unchanged.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::XmlError;

/// The namespace URI of the agent's metadata element.
pub const METADATA_NAMESPACE: &str = "https://egressproxy.dev/xmlns/kvm-agent/v1";
/// The prefix the agent writes the metadata element with (`virDomainSetMetadata`'s key).
pub const METADATA_PREFIX: &str = "egressproxy";
/// The agent's record of an instance, stored in the domain's metadata element.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename = "egressproxy:instance")]
pub struct InstanceMetadata {
    /// The idempotency key.
    #[serde(rename = "@key")]
    pub key: String,
    /// The caller's human-readable name.
    #[serde(rename = "@name", default)]
    pub name: String,
    /// Creation time, RFC 3339.
    #[serde(rename = "@created")]
    pub created: String,
    /// TCP port of the proxy in the guest.
    #[serde(rename = "@proxyPort")]
    pub proxy_port: u32,
    /// SHA-256 (hex) of the create request's placement, cloud-init and proxy port: a
    /// repeated Create with another spec is ALREADY_EXISTS.
    #[serde(rename = "@specSha256")]
    pub spec_sha256: String,
    /// The address identity the instance was created with: its NIC's MAC is derived from
    /// it, and the network's DHCP reservation for that MAC is the identity's address.
    #[serde(
        rename = "@addressIdentity",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub address_identity: Option<String>,
    /// The address the agent gave the instance from its bridge host's static block
    /// (`hosts[].staticAddresses`): the domains' metadata is the allocation table, so an
    /// address is held exactly while a domain records it.
    #[serde(
        rename = "@staticAddress",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub static_address: Option<std::net::IpAddr>,
    /// Where and on what the instance runs.
    #[serde(rename(serialize = "egressproxy:placement", deserialize = "placement"))]
    pub placement: PlacementRecord,
    /// The instance's tags.
    #[serde(
        rename(serialize = "egressproxy:tags", deserialize = "tags"),
        default,
        with = "tag_list"
    )]
    pub tags: BTreeMap<String, String>,
}

/// The resolved placement of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRecord {
    /// The host's name in the configuration.
    #[serde(rename = "@host")]
    pub host: String,
    /// The zone the Create asked for, if it named one (Get then answers the zone, as
    /// asked, not the host chosen in it).
    #[serde(rename = "@zone", default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// The machine type's name.
    #[serde(rename = "@machineType")]
    pub machine_type: String,
    /// The image's name.
    #[serde(rename = "@image")]
    pub image: String,
    /// The base volume the overlay is backed by.
    #[serde(rename = "@baseVolume")]
    pub base_volume: String,
}

mod tag_list {
    use super::*;

    #[derive(Serialize, Deserialize)]
    struct Tags {
        #[serde(rename(serialize = "egressproxy:tag", deserialize = "tag"), default)]
        tag: Vec<Tag>,
    }

    #[derive(Serialize, Deserialize)]
    struct Tag {
        #[serde(rename = "@key")]
        key: String,
        #[serde(rename = "@value", default)]
        value: String,
    }

    pub(super) fn serialize<S: serde::Serializer>(
        tags: &BTreeMap<String, String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        Tags {
            tag: tags
                .iter()
                .map(|(key, value)| Tag {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
        }
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, String>, D::Error> {
        Ok(Tags::deserialize(d)?
            .tag
            .into_iter()
            .map(|t| (t.key, t.value))
            .collect())
    }
}

/// A value that cannot be stored in the domain XML unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("contains a control character (U+{code:04X}), which libvirt's XML cannot keep")]
pub struct NotXmlSafe {
    /// The offending character's code point.
    pub code: u32,
}

/// Refuses strings that would not survive a trip through libvirt's XML unchanged.
pub fn check_xml_safe(value: &str) -> Result<(), NotXmlSafe> {
    match value
        .chars()
        .find(|c| c.is_control() || matches!(c, '\u{FFFE}' | '\u{FFFF}'))
    {
        Some(c) => Err(NotXmlSafe { code: u32::from(c) }),
        None => Ok(()),
    }
}

impl InstanceMetadata {
    /// The element as `virDomainSetMetadata` or a domain definition takes it: prefixed,
    /// with the namespace declared.
    pub fn to_xml(&self) -> Result<String, XmlError> {
        let element = MetadataElement {
            xmlns: METADATA_NAMESPACE,
            inner: self,
        };
        Ok(quick_xml::se::to_string_with_root(
            "egressproxy:instance",
            &element,
        )?)
    }

    /// The element as `virDomainSetMetadata` takes it: bare, without prefixes or
    /// namespace declaration. libvirt puts it in the namespace it is given itself, and
    /// refuses an element that declares that prefix already ("failed to create a new XML
    /// namespace"). Element names lose their prefix; attributes other than the
    /// declaration, and every value, are copied as they are (still escaped).
    pub fn to_bare_xml(&self) -> Result<String, XmlError> {
        use quick_xml::events::{BytesEnd, BytesStart, Event};
        let rewrite =
            |e: quick_xml::Error| XmlError::Serialize(quick_xml::SeError::Custom(e.to_string()));
        let prefixed = self.to_xml()?;
        let mut reader = quick_xml::Reader::from_str(&prefixed);
        let mut writer = quick_xml::Writer::new(Vec::new());
        let bare = |start: &BytesStart<'_>| -> Result<BytesStart<'static>, XmlError> {
            let name: String = start.local_name().as_ref().to_owned();
            let mut out = BytesStart::new(name);
            for attribute in start.attributes() {
                let attribute = attribute.map_err(|e| rewrite(e.into()))?;
                if !attribute.key.as_ref().starts_with("xmlns") {
                    out.push_attribute(attribute);
                }
            }
            Ok(out)
        };
        loop {
            let event = match reader.read_event().map_err(rewrite)? {
                Event::Start(start) => Event::Start(bare(&start)?),
                Event::Empty(start) => Event::Empty(bare(&start)?),
                Event::End(end) => {
                    let name: String = end.local_name().as_ref().to_owned();
                    Event::End(BytesEnd::new(name))
                }
                Event::Eof => break,
                other => other.into_owned(),
            };
            writer.write_event(event).map_err(|e| rewrite(e.into()))?;
        }
        String::from_utf8(writer.into_inner())
            .map_err(|e| XmlError::Serialize(quick_xml::SeError::Custom(e.to_string())))
    }

    /// Parses the element as libvirt returns it (bare, re-indented) or as written.
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "instance metadata",
            source,
        })
    }
}

#[derive(Serialize)]
pub(super) struct MetadataElement<'a> {
    #[serde(rename = "@xmlns:egressproxy")]
    pub(super) xmlns: &'static str,
    #[serde(flatten)]
    pub(super) inner: &'a InstanceMetadata,
}
