//! The few facts the agent reads back from a defined domain's full XML.

use std::path::PathBuf;

use serde::Deserialize;

use crate::libvirt::xml::XmlError;

/// What the agent reads back from a domain's full XML (`virDomainGetXMLDesc`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DomainFacts {
    /// MAC addresses of the domain's NICs, as libvirt assigned them.
    pub macs: Vec<String>,
    /// Source paths of the domain's file disks.
    pub disk_files: Vec<PathBuf>,
}

impl DomainFacts {
    /// Parses the parts of a full domain XML the agent needs; everything else is ignored.
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        #[derive(Deserialize)]
        struct Domain {
            #[serde(default)]
            devices: Devices,
        }
        #[derive(Deserialize, Default)]
        struct Devices {
            #[serde(default)]
            interface: Vec<Nic>,
            #[serde(default)]
            disk: Vec<DiskView>,
        }
        #[derive(Deserialize)]
        struct Nic {
            mac: Option<Mac>,
        }
        #[derive(Deserialize)]
        struct Mac {
            #[serde(rename = "@address")]
            address: String,
        }
        #[derive(Deserialize)]
        struct DiskView {
            source: Option<SourceView>,
        }
        #[derive(Deserialize)]
        struct SourceView {
            #[serde(rename = "@file")]
            file: Option<PathBuf>,
        }
        let domain: Domain = quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "domain XML",
            source,
        })?;
        Ok(Self {
            macs: domain
                .devices
                .interface
                .into_iter()
                .filter_map(|nic| nic.mac.map(|m| m.address))
                .collect(),
            disk_files: domain
                .devices
                .disk
                .into_iter()
                .filter_map(|d| d.source.and_then(|s| s.file))
                .collect(),
        })
    }
}
