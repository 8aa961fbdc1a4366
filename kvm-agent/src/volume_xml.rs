//! Storage volume XML (`virStorageVolCreateXML`) for what the agent stores in the pool:
//! raw volumes (the seed, a base image's upload target) and the qcow2 overlay that is an
//! instance's root disk, backed by the base volume's file.
//!
//! Built from serde structs like the domain XML; names and paths are escaped by the
//! serializer.

use std::path::Path;

use serde::Serialize;

use crate::config::ImageFormat;
use crate::domain_xml::XmlError;

/// A raw volume of `capacity_bytes` (the seed ISO, or a base image's upload target).
pub fn raw_volume(name: &str, capacity_bytes: u64) -> Result<String, XmlError> {
    to_xml(&raw(name, capacity_bytes, None))
}

/// A raw volume of `capacity_bytes` with nothing allocated: an upload target that libvirt
/// creates sparse instead of first writing `capacity_bytes` of zeros.
pub fn sparse_raw_volume(name: &str, capacity_bytes: u64) -> Result<String, XmlError> {
    to_xml(&raw(name, capacity_bytes, Some(0)))
}

fn raw(name: &str, capacity_bytes: u64, allocation_bytes: Option<u64>) -> Volume<'_> {
    Volume {
        kind: "file",
        name,
        capacity: Capacity {
            unit: "bytes",
            value: capacity_bytes,
        },
        allocation: allocation_bytes.map(|value| Capacity {
            unit: "bytes",
            value,
        }),
        target: Target {
            format: Format { kind: "raw" },
        },
        backing_store: None,
    }
}

/// A qcow2 overlay of `capacity_bytes` whose backing file is `base_path` in
/// `base_format`: the base is never written, so any number of overlays share it.
pub fn overlay_volume(
    name: &str,
    capacity_bytes: u64,
    base_path: &Path,
    base_format: ImageFormat,
) -> Result<String, XmlError> {
    to_xml(&Volume {
        kind: "file",
        name,
        capacity: Capacity {
            unit: "bytes",
            value: capacity_bytes,
        },
        allocation: None,
        target: Target {
            format: Format { kind: "qcow2" },
        },
        backing_store: Some(BackingStore {
            path: base_path.display().to_string(),
            format: Format {
                kind: match base_format {
                    ImageFormat::Qcow2 => "qcow2",
                    ImageFormat::Raw => "raw",
                },
            },
        }),
    })
}

fn to_xml(volume: &Volume<'_>) -> Result<String, XmlError> {
    Ok(quick_xml::se::to_string(volume)?)
}

#[derive(Serialize)]
#[serde(rename = "volume")]
struct Volume<'a> {
    #[serde(rename = "@type")]
    kind: &'static str,
    name: &'a str,
    capacity: Capacity,
    #[serde(skip_serializing_if = "Option::is_none")]
    allocation: Option<Capacity>,
    target: Target,
    #[serde(rename = "backingStore", skip_serializing_if = "Option::is_none")]
    backing_store: Option<BackingStore>,
}

#[derive(Serialize)]
struct Capacity {
    #[serde(rename = "@unit")]
    unit: &'static str,
    #[serde(rename = "$text")]
    value: u64,
}

#[derive(Serialize)]
struct Target {
    format: Format,
}

#[derive(Serialize)]
struct Format {
    #[serde(rename = "@type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct BackingStore {
    path: String,
    format: Format,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(xml: &str) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("volume.xml");
        std::fs::write(&path, xml).unwrap();
        let out = std::process::Command::new("virt-xml-validate")
            .arg(&path)
            .arg("storagevol")
            .output()
            .expect("virt-xml-validate (libvirt-clients) is installed");
        assert!(
            out.status.success(),
            "{xml}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn overlay_is_qcow2_backed_by_the_base_file() {
        let xml = overlay_volume(
            "egressproxy-k.root.qcow2",
            10 << 30,
            Path::new("/var/lib/libvirt/images/egressproxy-base-ab.img"),
            ImageFormat::Qcow2,
        )
        .unwrap();
        assert_eq!(
            xml,
            "<volume type=\"file\"><name>egressproxy-k.root.qcow2</name>\
             <capacity unit=\"bytes\">10737418240</capacity>\
             <target><format type=\"qcow2\"/></target>\
             <backingStore><path>/var/lib/libvirt/images/egressproxy-base-ab.img</path>\
             <format type=\"qcow2\"/></backingStore></volume>"
        );
        validate(&xml);
    }

    #[test]
    fn raw_volumes_and_escaped_paths_validate() {
        validate(&raw_volume("egressproxy-k.seed.iso", 57344).unwrap());
        let sparse = sparse_raw_volume("egressproxy-base-ab.img", 1 << 30).unwrap();
        assert!(
            sparse.contains("<allocation unit=\"bytes\">0</allocation>"),
            "{sparse}"
        );
        validate(&sparse);
        let xml = overlay_volume("o", 1, Path::new("/pool <&>/base"), ImageFormat::Raw).unwrap();
        assert!(
            xml.contains("<path>/pool &lt;&amp;&gt;/base</path>"),
            "{xml}"
        );
        assert!(xml.contains("<backingStore><path>"), "{xml}");
        validate(&xml);
    }
}
