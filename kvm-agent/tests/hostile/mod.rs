//! Shared pieces of the property tests: how many cases a run tries, and strategies for
//! the hostile text and bytes a user can put into a request.
//!
//! Case counts: `PROPTEST_CASES` when set (`make fuzz` sets it high), else a small
//! default so that every property test together stays around a minute in CI. Checks
//! that start a process per sample (`virt-xml-validate`, `isoinfo`) run on a
//! hundredth of that, at least [`MIN_SAMPLED_CASES`].

#![allow(dead_code, unreachable_pub)]

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};

/// Cases of an in-process property when `PROPTEST_CASES` is not set.
pub const DEFAULT_CASES: u32 = 256;
/// The fewest cases of a property that runs an external tool per case.
pub const MIN_SAMPLED_CASES: u32 = 8;

fn configured_cases() -> Option<u32> {
    std::env::var("PROPTEST_CASES").ok()?.parse().ok()
}

/// The proptest configuration of an in-process property of test file `file`
/// (`file!()`): a failing case's seed is kept in `tests/proptest-regressions/`, and
/// every later run tries it first.
pub fn config(file: &str) -> Config {
    with_cases(file, configured_cases().unwrap_or(DEFAULT_CASES))
}

/// The proptest configuration of a property that starts a process per case.
pub fn sampled_config(file: &str) -> Config {
    let cases = configured_cases().map_or(MIN_SAMPLED_CASES, |n| (n / 100).max(MIN_SAMPLED_CASES));
    with_cases(file, cases)
}

fn with_cases(file: &str, cases: u32) -> Config {
    let stem = std::path::Path::new(file)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("proptest");
    // proptest wants a `&'static str`; one short path per test binary is leaked.
    let path: &'static str = Box::leak(
        format!(
            "{}/tests/proptest-regressions/{stem}.txt",
            env!("CARGO_MANIFEST_DIR")
        )
        .into_boxed_str(),
    );
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(path))),
        ..Config::default()
    }
}

/// Characters a hostile user reaches for: XML and shell metacharacters, path
/// separators, NUL and other controls (C0 and C1), bidirectional overrides, XML's
/// non-characters, a BOM, and a character outside the Basic Multilingual Plane.
pub const HOSTILE_CHARS: &[char] = &[
    '<',
    '>',
    '&',
    '"',
    '\'',
    '/',
    '\\',
    '.',
    ':',
    ';',
    '$',
    '`',
    '|',
    '*',
    '?',
    '%',
    '=',
    ' ',
    '\0',
    '\t',
    '\n',
    '\r',
    '\u{1}',
    '\u{1b}',
    '\u{7f}',
    '\u{85}',
    '\u{9f}',
    '\u{200e}',
    '\u{200f}',
    '\u{202e}',
    '\u{2066}',
    '\u{2028}',
    '\u{feff}',
    '\u{fffe}',
    '\u{ffff}',
    '\u{1f600}',
    'a',
    'Z',
    '0',
    '-',
    '_',
];

/// Fragments that mean something to XML, to a path or to a shell.
pub const HOSTILE_FRAGMENTS: &[&str] = &[
    "..",
    "../",
    "/etc/passwd",
    "]]>",
    "<![CDATA[",
    "<!--",
    "&amp;",
    "&#0;",
    "&lt;",
    "<?xml version='1.0'?>",
    "<!DOCTYPE x [<!ENTITY e SYSTEM 'file:///etc/passwd'>]>",
    "xmlns:egressproxy=\"x\"",
    "</egressproxy:instance>",
    "${IFS}",
    "$(reboot)",
];

/// Text built from [`HOSTILE_CHARS`] and [`HOSTILE_FRAGMENTS`], mixed with arbitrary
/// Unicode, up to `max_len` pieces long.
pub fn hostile_text(max_len: usize) -> BoxedStrategy<String> {
    let piece = prop_oneof![
        3 => proptest::sample::select(HOSTILE_CHARS).prop_map(String::from),
        1 => proptest::sample::select(HOSTILE_FRAGMENTS).prop_map(str::to_owned),
        2 => any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(piece, 0..=max_len)
        .prop_map(|pieces| pieces.concat())
        .boxed()
}

/// Arbitrary bytes, often not UTF-8, sometimes starting like a document cloud-init
/// recognises (so that its parsers, not only the type sniffing, see the rest).
pub fn hostile_bytes(max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    let prefix = proptest::sample::select(
        &[
            "",
            "#cloud-config\n",
            "#cloud-config\npackages:\n",
            "#cloud-config\nruncmd:\n",
            "#!/bin/sh\n",
            "## template: jinja\n",
            "#include\n",
            "Content-Type: multipart/mixed; boundary=\"b\"\nMIME-Version: 1.0\n\n--b\n",
            "\u{1f}\u{8b}",
            " \n\t",
        ][..],
    );
    let body = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..=max_len),
        hostile_text(max_len / 4).prop_map(String::into_bytes),
    ];
    (prefix, body).prop_map(|(prefix, body)| [prefix.as_bytes(), &body].concat())
}
