//! Property tests of the user-data handling and the NoCloud seed it goes into, with
//! arbitrary bytes (often not UTF-8, sometimes gzip):
//! - nothing panics;
//! - a refusal is INVALID_ARGUMENT naming `cloud_init.user_data` or
//!   `cloud_init.vendor_data`;
//! - an accepted document reaches the seed byte for byte: the whole user-data (or
//!   vendor-data), or the first part of the multipart beside the guest-agent bootstrap;
//! - the seed image reads back with `isoinfo` (genisoimage), through both directory
//!   trees, with exactly its files and their bytes (a few samples a run).

mod hostile;

use std::io::Write;
use std::process::Command;

use base64::Engine;
use egressproxy_provider::ErrorClass;
use egressproxy_provider::validation::MAX_USER_DATA_BYTES;
use kvm_agent::guest::cloud_init::{GuestAgent, SeedDocuments, seed_documents};
use kvm_agent::guest::seed::build_seed;
use proptest::prelude::*;

use hostile::{hostile_bytes, hostile_text};

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

fn gunzip(data: &[u8]) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(data)
        .read_to_end(&mut out)
        .ok()?;
    Some(out)
}

fn document() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => hostile_bytes(512),
        1 => hostile_bytes(512).prop_map(|d| gzip(&d)),
    ]
}

/// The first part of the agent's multipart, decoded: the body of the part after the
/// first boundary, base64-decoded when so marked. Written here from RFC 2046, not with
/// the agent's code.
fn first_part(multipart: &[u8]) -> Vec<u8> {
    let first_line = multipart.split(|&b| b == b'\n').next().unwrap();
    let first_line = std::str::from_utf8(first_line).expect("the agent's own header is text");
    let boundary = first_line
        .split("boundary=\"")
        .nth(1)
        .and_then(|b| b.split('"').next())
        .expect("a boundary in the first header");
    let delimiter = format!("\n--{boundary}\n");
    let start = multipart
        .windows(delimiter.len())
        .position(|w| w == delimiter.as_bytes())
        .expect("a first part")
        + delimiter.len();
    let rest = &multipart[start..];
    let next = format!("\n--{boundary}");
    let end = rest
        .windows(next.len())
        .position(|w| w == next.as_bytes())
        .expect("a second delimiter");
    let part = &rest[..end];
    // The agent writes its own headers (ASCII) for a body; a nested document brings its
    // own and is kept whole.
    if !part.starts_with(b"Content-Type: ") || !part.windows(2).any(|w| w == b"\n\n") {
        return part.to_vec();
    }
    let split = part.windows(2).position(|w| w == b"\n\n").unwrap();
    let headers = std::str::from_utf8(&part[..split]).unwrap_or("");
    let body = &part[split + 2..];
    if headers.contains("Content-Transfer-Encoding: base64") {
        let joined: Vec<u8> = body.iter().copied().filter(|&b| b != b'\n').collect();
        base64::engine::general_purpose::STANDARD
            .decode(joined)
            .expect("valid base64")
    } else if headers.contains("Content-Transfer-Encoding: 7bit") {
        body.to_vec()
    } else {
        part.to_vec()
    }
}

/// `sent` is `given` byte for byte, or a multipart whose first part it is (beside the
/// bootstrap), or the bootstrap alone when `given` is blank.
fn check_kept(sent: &[u8], given: &[u8], what: &str) -> Result<(), TestCaseError> {
    // A blank document (gzipped or not) leaves cloud-init nothing to do: the bootstrap
    // alone is sent.
    let blank = |d: &[u8]| d.iter().all(u8::is_ascii_whitespace);
    let blank = blank(given) || gunzip(given).is_some_and(|content| blank(&content));
    if sent == given || blank {
        return Ok(());
    }
    let part = first_part(sent);
    // A gzipped MIME document is nested decompressed, so cloud-init reads its parts;
    // every other document is the part, byte for byte.
    let same = part == given || gunzip(given).is_some_and(|content| part == content);
    prop_assert!(same, "the caller's {} part differs from the input", what);
    Ok(())
}

/// Checks one answer of [`seed_documents`] against its input.
fn check_seed_documents(
    user: &[u8],
    vendor: Option<&[u8]>,
    result: Result<SeedDocuments, egressproxy_provider::ProviderError>,
) -> Result<(), TestCaseError> {
    match result {
        Err(e) => {
            prop_assert_eq!(e.class, ErrorClass::InvalidArgument, "{}", e);
            prop_assert!(!e.field_violations.is_empty(), "{}", e);
            for violation in &e.field_violations {
                prop_assert!(
                    ["cloud_init.user_data", "cloud_init.vendor_data"]
                        .contains(&violation.field.as_str()),
                    "{}",
                    e
                );
            }
        }
        Ok(docs) => {
            check_kept(&docs.user_data, user, "user-data")?;
            match (docs.vendor_data.as_deref(), vendor) {
                (Some(sent), Some(given)) => check_kept(sent, given, "vendor-data")?,
                (sent, given) => prop_assert_eq!(sent, given),
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(hostile::config(file!()))]

    #[test]
    fn user_data_is_refused_with_its_field_or_kept_byte_for_byte(
        user in document(),
        vendor in proptest::option::of(document()),
        preinstalled in any::<bool>(),
    ) {
        let agent = if preinstalled { GuestAgent::Preinstalled } else { GuestAgent::Install };
        let result = seed_documents(&user, vendor.as_deref(), agent);
        check_seed_documents(&user, vendor.as_deref(), result.map_err(Into::into))?;
    }
}

fn isoinfo(image: &std::path::Path, args: &[&str]) -> Vec<u8> {
    let out = Command::new("isoinfo")
        .args(args)
        .arg("-i")
        .arg(image)
        .output()
        .expect("isoinfo (genisoimage) is installed");
    assert!(
        out.status.success(),
        "isoinfo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

proptest! {
    #![proptest_config(hostile::sampled_config(file!()))]

    /// Whatever the documents and names, the seed is an ISO that `isoinfo` lists with
    /// exactly the seed's files and extracts with the same bytes; `meta-data` parses back
    /// to the instance id and hostname given, however hostile.
    #[test]
    fn the_seed_reads_back_with_isoinfo(
        user in hostile_bytes(6000),
        vendor in proptest::option::of(hostile_bytes(3000)),
        instance_id in hostile_text(16),
        hostname in hostile_text(16),
    ) {
        let docs = SeedDocuments { user_data: user, vendor_data: vendor };
        let image = build_seed(&docs, &instance_id, &hostname, None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seed.iso");
        std::fs::write(&path, &image).unwrap();

        let mut want = vec!["meta-data", "user-data"];
        if docs.vendor_data.is_some() {
            want.push("vendor-data");
        }
        let listing = String::from_utf8(isoinfo(&path, &["-J", "-f"])).unwrap();
        let mut listed: Vec<&str> = listing.lines().map(|l| l.trim_start_matches('/')).collect();
        listed.sort_unstable();
        prop_assert_eq!(&listed, &want);

        for name in want {
            let joliet = isoinfo(&path, &["-J", "-x", &format!("/{name}")]);
            let primary = isoinfo(&path, &["-x", &format!("/{}.;1", name.to_uppercase())]);
            prop_assert_eq!(&joliet, &primary, "{}", name);
            match name {
                "user-data" => prop_assert_eq!(&joliet, &docs.user_data),
                "vendor-data" => prop_assert_eq!(Some(&joliet), docs.vendor_data.as_ref()),
                _ => {
                    let meta: serde_norway::Value =
                        serde_norway::from_slice(&joliet).expect("meta-data is YAML");
                    prop_assert_eq!(meta["instance-id"].as_str(), Some(instance_id.as_str()));
                    prop_assert_eq!(meta["local-hostname"].as_str(), Some(hostname.as_str()));
                }
            }
        }
    }
}

/// Documents at and over the size limit, which random cases rarely reach.
#[test]
fn the_size_limit_is_named_and_exact() {
    for (len, refused) in [
        (MAX_USER_DATA_BYTES, false),
        (MAX_USER_DATA_BYTES + 1, true),
    ] {
        // Every byte value, non-UTF-8 included, repeated up to the length.
        let user: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let result = seed_documents(&user, None, GuestAgent::Install);
        assert_eq!(result.is_err(), refused, "{len} bytes");
        check_seed_documents(&user, None, result.map_err(Into::into)).unwrap();
        let result = seed_documents(b"#!/bin/sh\n", Some(&user), GuestAgent::Install);
        assert_eq!(result.is_err(), refused, "{len} bytes of vendor-data");
        check_seed_documents(b"#!/bin/sh\n", Some(&user), result.map_err(Into::into)).unwrap();
    }
    // A small gzip stream that decompresses to far more than the limit.
    let bomb = gzip(&vec![b'#'; 32 * MAX_USER_DATA_BYTES]);
    assert!(bomb.len() <= MAX_USER_DATA_BYTES);
    let result = seed_documents(&bomb, None, GuestAgent::Install);
    assert!(result.is_err());
    check_seed_documents(&bomb, None, result.map_err(Into::into)).unwrap();
}
