//! Property tests of the ISO writer with arbitrary labels, names, file counts and
//! contents: building never panics, refuses exactly what the module docs rule out, and
//! an image it builds reads back with `isoinfo` (genisoimage) through both directory
//! trees, with exactly its files and their bytes.
//!
//! Cases: `PROPTEST_CASES` (`make fuzz` sets it high), else 256; the `isoinfo` property
//! starts processes per case and runs a hundredth of that, at least 8.

use std::process::Command;

use proptest::prelude::*;
use proptest::test_runner::Config;

use super::*;

fn cases(divisor: u32, default: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse::<u32>().ok())
        .map_or(default, |n| (n / divisor).max(default.min(n)));
    Config {
        cases,
        ..Config::default()
    }
}

/// Names near the rules: mostly valid characters, sometimes one that is not.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9._-]{1,30}",
        1 => "[a-z0-9._-]{31,34}",
        1 => "[a-zA-Z0-9._/ \\x00<>é-]{0,8}",
    ]
}

fn files() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    proptest::collection::vec(
        (
            name(),
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                proptest::collection::vec(any::<u8>(), SECTOR - 2..SECTOR * 2 + 2),
            ],
        ),
        0..=MAX_FILES + 1,
    )
}

fn label() -> impl Strategy<Value = String> {
    prop_oneof![4 => "[A-Za-z0-9_]{1,32}", 1 => ".{0,34}"]
}

fn valid_name(name: &str) -> bool {
    !matches!(name, "." | "..")
        && (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}

/// Whether the module docs allow these files under this label.
fn allowed(label: &str, files: &[(String, Vec<u8>)]) -> bool {
    let mut names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    (1..=32).contains(&label.len())
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && files.len() <= MAX_FILES
        && names.len() == files.len()
        && files.iter().all(|(n, _)| valid_name(n))
}

fn build_owned(label: &str, files: &[(String, Vec<u8>)]) -> Result<Vec<u8>, IsoError> {
    let files: Vec<IsoFile<'_>> = files
        .iter()
        .map(|(name, data)| IsoFile { name, data })
        .collect();
    build(label, &files)
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
    #![proptest_config(cases(1, 256))]

    #[test]
    fn builds_exactly_what_the_rules_allow(label in label(), files in files()) {
        let built = build_owned(&label, &files);
        prop_assert_eq!(built.is_ok(), allowed(&label, &files), "{:?}", built.err());
        if let Ok(image) = built {
            prop_assert_eq!(image.len() % SECTOR, 0);
            prop_assert_eq!(build_owned(&label, &files).unwrap(), image, "not deterministic");
        }
    }
}

proptest! {
    #![proptest_config(cases(100, 8))]

    #[test]
    fn an_image_reads_back_with_isoinfo(
        label in "[A-Za-z0-9_]{1,32}",
        files in proptest::collection::btree_map(
            "[a-z0-9._-]{1,30}".prop_filter("a valid name", |n| valid_name(n)),
            proptest::collection::vec(any::<u8>(), 0..5000),
            0..=MAX_FILES,
        ),
    ) {
        let files: Vec<(String, Vec<u8>)> = files.into_iter().collect();
        let image = build_owned(&label, &files).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("image.iso");
        std::fs::write(&path, &image).unwrap();

        let header = String::from_utf8_lossy(&isoinfo(&path, &["-d"])).into_owned();
        prop_assert!(header.contains(&format!("Volume id: {label}")), "{}", header);
        let listing = String::from_utf8(isoinfo(&path, &["-J", "-f"])).unwrap();
        let listed: Vec<&str> = listing.lines().map(|l| l.trim_start_matches('/')).collect();
        let want: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        prop_assert_eq!(listed, want);
        for (name, data) in &files {
            let joliet = isoinfo(&path, &["-J", "-x", &format!("/{name}")]);
            prop_assert_eq!(&joliet, data, "Joliet {}", name);
            let primary = isoinfo(&path, &["-x", &format!("/{}.;1", name.to_uppercase())]);
            prop_assert_eq!(&primary, data, "primary {}", name);
        }
    }
}
