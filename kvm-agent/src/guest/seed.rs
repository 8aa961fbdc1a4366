//! The NoCloud seed of an instance: an ISO 9660 image labelled `cidata` holding
//! `meta-data`, `user-data` and, when there is any, `vendor-data`, and for an instance
//! with a static address its `network-config` ([`crate::guest::network_config`]).
//!
//! Built in memory ([`crate::guest::iso9660`]): the agent runs in containers with a
//! read-only root filesystem, and the image is small (the documents are limited to
//! 64 KiB each). It is rebuilt and re-uploaded on every Create attempt before the domain
//! exists, never reused: a cancelled Create may have left a truncated one.
//!
//! `meta-data` carries the `instance-id` (the key: cloud-init runs its once-per-instance
//! modules again only when it changes) and the `local-hostname`.

use serde::Serialize;

use crate::guest::cloud_init::SeedDocuments;
use crate::guest::iso9660::{self, IsoFile};

/// The volume label cloud-init's NoCloud datasource looks for.
pub const SEED_LABEL: &str = "cidata";

#[derive(Serialize)]
struct MetaData<'a> {
    #[serde(rename = "instance-id")]
    instance_id: &'a str,
    #[serde(rename = "local-hostname")]
    local_hostname: &'a str,
}

/// The `meta-data` document (YAML; values quoted as needed, so a key like `true` or
/// `1e3` stays a string).
pub fn meta_data(instance_id: &str, hostname: &str) -> String {
    serde_norway::to_string(&MetaData {
        instance_id,
        local_hostname: hostname,
    })
    .expect("two strings always serialize")
}

/// The seed image for an instance with `documents` and, when it has one, the
/// `network_config` document.
pub fn build_seed(
    documents: &SeedDocuments,
    instance_id: &str,
    hostname: &str,
    network_config: Option<&str>,
) -> Vec<u8> {
    let meta = meta_data(instance_id, hostname);
    let mut files = vec![
        IsoFile {
            name: "meta-data",
            data: meta.as_bytes(),
        },
        IsoFile {
            name: "user-data",
            data: &documents.user_data,
        },
    ];
    if let Some(vendor) = &documents.vendor_data {
        files.push(IsoFile {
            name: "vendor-data",
            data: vendor,
        });
    }
    if let Some(network) = network_config {
        files.push(IsoFile {
            name: "network-config",
            data: network.as_bytes(),
        });
    }
    iso9660::build(SEED_LABEL, &files).expect("fixed label and names are valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_data_keeps_keys_that_look_like_other_yaml_types_as_strings() {
        for id in ["true", "1e3", "null", "0x1F", "uid-1"] {
            let doc = meta_data(id, "egressproxy-x");
            let value: serde_norway::Value = serde_norway::from_str(&doc).unwrap();
            assert_eq!(value["instance-id"].as_str(), Some(id), "{doc}");
            assert_eq!(value["local-hostname"].as_str(), Some("egressproxy-x"));
        }
    }

    #[test]
    fn vendor_data_is_present_only_when_given() {
        let mut docs = SeedDocuments {
            user_data: b"#!/bin/sh\n".to_vec(),
            vendor_data: None,
        };
        let without = build_seed(&docs, "k", "h", None);
        docs.vendor_data = Some(b"#cloud-config\n".to_vec());
        let with = build_seed(&docs, "k", "h", None);
        let has = |image: &[u8]| image.windows(14).any(|w| w == b"VENDOR-DATA.;1");
        assert!(!has(&without));
        assert!(has(&with));
    }
}
