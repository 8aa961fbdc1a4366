//! Storage volume XML (`virStorageVolCreateXML`) for what the agent stores in the pool:
//! raw volumes (the seed, a base image's upload target) and the qcow2 overlay that is an
//! instance's root disk, backed by the base volume's file.
//!
//! Built from serde structs like the domain XML; names and paths are escaped by the
//! serializer. [`VolumeFacts`] is the one reader of an existing volume's XML
//! (`virStorageVolGetXMLDesc`), for Create's overlay check and for the image cache.

use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::XmlError;
use crate::config::ImageFormat;

/// A raw volume of `capacity_bytes` (the seed ISO, or a base image's upload target).
pub fn raw_volume(name: &str, capacity_bytes: u64) -> Result<String, XmlError> {
    to_xml(&raw(name, capacity_bytes, None))
}

/// A raw volume of `capacity_bytes` with nothing allocated: an upload target that libvirt
/// creates sparse instead of first writing `capacity_bytes` of zeros.
pub(crate) fn sparse_raw_volume(name: &str, capacity_bytes: u64) -> Result<String, XmlError> {
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

/// What an existing volume's XML (`virStorageVolGetXMLDesc`) says about its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeFacts {
    /// Virtual size in bytes (0 if libvirt gave none).
    pub capacity_bytes: u64,
    /// The format libvirt probed (`qcow2`, `raw`, ...).
    pub format: Option<String>,
    /// The backing file's path, if it has one.
    pub backing_path: Option<String>,
    /// The backing file's format, if libvirt reports it.
    pub backing_format: Option<String>,
    /// The file's last modification, by the hypervisor's clock.
    pub modified: Option<SystemTime>,
}

impl VolumeFacts {
    /// Parses the parts of a volume's XML the agent reads; everything else is ignored.
    pub(crate) fn parse(xml: &str) -> Result<Self, XmlError> {
        #[derive(Deserialize)]
        struct Volume {
            #[serde(default)]
            capacity: Option<CapacityDesc>,
            #[serde(default)]
            target: Option<TargetDesc>,
            #[serde(rename = "backingStore", default)]
            backing_store: Option<BackingStoreDesc>,
        }
        #[derive(Deserialize)]
        struct CapacityDesc {
            #[serde(rename = "@unit")]
            unit: Option<String>,
            #[serde(rename = "$text")]
            value: u64,
        }
        #[derive(Deserialize)]
        struct TargetDesc {
            #[serde(default)]
            format: Option<FormatDesc>,
            #[serde(default)]
            timestamps: Option<TimestampsDesc>,
        }
        #[derive(Deserialize)]
        struct TimestampsDesc {
            /// `<seconds>.<nanoseconds>` since the epoch.
            #[serde(default)]
            mtime: Option<String>,
        }
        #[derive(Deserialize)]
        struct BackingStoreDesc {
            #[serde(default)]
            path: Option<String>,
            #[serde(default)]
            format: Option<FormatDesc>,
        }
        #[derive(Deserialize)]
        struct FormatDesc {
            #[serde(rename = "@type")]
            kind: String,
        }
        let volume: Volume = quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "volume XML",
            source,
        })?;
        let capacity_bytes = volume.capacity.map_or(0, |capacity| {
            // libvirt reports bytes; any other unit is scaled as libvirt's own parser would.
            let scale: u64 = match capacity.unit.as_deref().unwrap_or("bytes") {
                "b" | "bytes" => 1,
                "KB" => 1_000,
                "k" | "KiB" => 1 << 10,
                "MB" => 1_000_000,
                "M" | "MiB" => 1 << 20,
                "GB" => 1_000_000_000,
                "G" | "GiB" => 1 << 30,
                "TB" => 1_000_000_000_000,
                "T" | "TiB" => 1 << 40,
                _ => 1,
            };
            capacity.value.saturating_mul(scale)
        });
        let (format, modified) = match volume.target {
            Some(target) => (
                target.format.map(|f| f.kind),
                target
                    .timestamps
                    .and_then(|t| t.mtime)
                    .and_then(|t| parse_timestamp(&t)),
            ),
            None => (None, None),
        };
        let backing = volume.backing_store;
        Ok(Self {
            capacity_bytes,
            format,
            backing_path: backing
                .as_ref()
                .and_then(|b| b.path.clone())
                .filter(|p| !p.is_empty()),
            backing_format: backing.and_then(|b| b.format).map(|f| f.kind),
            modified,
        })
    }

    /// Whether this is the overlay of `capacity_bytes` on `base_path` in `base_format`.
    pub(crate) fn is_overlay_of(
        &self,
        capacity_bytes: u64,
        base_path: &str,
        base_format: ImageFormat,
    ) -> bool {
        let format = match base_format {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Raw => "raw",
        };
        // qemu-img rounds a size up to whole 512-byte sectors.
        (self.capacity_bytes == capacity_bytes
            || self.capacity_bytes == capacity_bytes.next_multiple_of(512))
            && self.backing_path.as_deref() == Some(base_path)
            && self.backing_format.as_deref().is_none_or(|f| f == format)
    }
}

/// libvirt's `<seconds>.<nanoseconds>` timestamps.
fn parse_timestamp(text: &str) -> Option<SystemTime> {
    let (seconds, nanos) = text.trim().split_once('.').unwrap_or((text.trim(), "0"));
    let nanos = format!("{nanos:0<9}");
    let since_epoch = Duration::new(seconds.parse().ok()?, nanos.get(..9)?.parse().ok()?);
    SystemTime::UNIX_EPOCH.checked_add(since_epoch)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Whatever libvirt (or a hostile hypervisor) answers, reading it never panics.
        #[test]
        fn volume_facts_never_panic(text in prop_oneof![
            ".{0,64}",
            "<volume>(<|>|/|capacity|unit='[a-zA-Z]{0,4}'|[0-9]{0,22}|target|format|type='x'|timestamps|mtime|[0-9.é]{0,24}|backingStore|path| ){0,40}",
        ]) {
            let _ = VolumeFacts::parse(&text);
        }

        #[test]
        fn timestamps_never_panic(text in "[0-9.é -]{0,40}") {
            let _ = parse_timestamp(&text);
        }
    }

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

    #[test]
    fn overlay_facts_parse_libvirt_volume_xml() {
        let xml = "<volume type='file'>\n  <name>egressproxy-k.root.qcow2</name>\n  \
                   <key>/p/egressproxy-k.root.qcow2</key>\n  <capacity unit='bytes'>1073741824</capacity>\n  \
                   <allocation unit='bytes'>200704</allocation>\n  <physical unit='bytes'>196624</physical>\n  \
                   <target>\n    <path>/p/egressproxy-k.root.qcow2</path>\n    <format type='qcow2'/>\n  </target>\n  \
                   <backingStore>\n    <path>/p/egressproxy-base-ab.img</path>\n    <format type='qcow2'/>\n  </backingStore>\n</volume>";
        let facts = VolumeFacts::parse(xml).unwrap();
        assert_eq!(
            facts,
            VolumeFacts {
                capacity_bytes: 1 << 30,
                format: Some("qcow2".into()),
                backing_path: Some("/p/egressproxy-base-ab.img".into()),
                backing_format: Some("qcow2".into()),
                modified: None,
            }
        );
        assert!(facts.is_overlay_of(1 << 30, "/p/egressproxy-base-ab.img", ImageFormat::Qcow2));
        assert!(!facts.is_overlay_of(2 << 30, "/p/egressproxy-base-ab.img", ImageFormat::Qcow2));
        assert!(!facts.is_overlay_of(1 << 30, "/p/egressproxy-base-cd.img", ImageFormat::Qcow2));
        assert!(!facts.is_overlay_of(1 << 30, "/p/egressproxy-base-ab.img", ImageFormat::Raw));
        // A size qemu-img rounded up to whole sectors is the wanted one.
        assert!(facts.is_overlay_of(
            (1 << 30) - 100,
            "/p/egressproxy-base-ab.img",
            ImageFormat::Qcow2
        ));

        let plain = VolumeFacts::parse(
            "<volume><name>v</name><capacity unit='KiB'>64</capacity><target/></volume>",
        )
        .unwrap();
        assert_eq!(plain.capacity_bytes, 64 << 10);
        assert_eq!(plain.backing_path, None);
        assert!(!plain.is_overlay_of(64 << 10, "/p/base", ImageFormat::Raw));
    }

    #[test]
    fn volume_xml_yields_format_and_backing_file() {
        let xml = "<volume type='file'><name>o</name><capacity unit='bytes'>1</capacity>\
                   <target><path>/p/o</path><format type='qcow2'/></target>\
                   <backingStore><path>/p/a</path><format type='qcow2'/></backingStore></volume>";
        let facts = VolumeFacts::parse(xml).unwrap();
        assert_eq!(facts.format.as_deref(), Some("qcow2"));
        assert_eq!(facts.backing_path.as_deref(), Some("/p/a"));
        assert_eq!(facts.modified, None);
        let xml = "<volume type='file'><name>a</name><target><path>/p/a</path>\
                   <format type='raw'/><timestamps><atime>1764470000.5</atime>\
                   <mtime>1764470400.000000250</mtime></timestamps></target></volume>";
        let facts = VolumeFacts::parse(xml).unwrap();
        assert_eq!(facts.format.as_deref(), Some("raw"));
        assert_eq!(facts.backing_path, None);
        assert_eq!(
            facts.modified,
            Some(SystemTime::UNIX_EPOCH + Duration::new(1_764_470_400, 250))
        );
        assert_eq!(
            parse_timestamp("12"),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(12))
        );
        assert_eq!(parse_timestamp("x.1"), None);
    }
}
