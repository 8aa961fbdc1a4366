//! The layer rule, checked on the source: each layer names only the crate modules it may
//! use, so an import that points upwards fails the build's tests with its file and line.
//!
//! A layer may use the layers below it and the shared leaves ([`crate::classification`],
//! [`crate::config`], `single_flight`). No layer below the provider names the top-level
//! `error` module (or its re-export `crate::Error`) or builds a contract error
//! (`ProviderError`): each returns its own error type, and the one mapping in `error.rs`
//! turns it into the contract's.

use std::path::{Path, PathBuf};

/// Each lower layer (a folder, or a single file, under `src/`) with the crate modules it
/// may name.
const LAYERS: &[(&str, &[&str])] = &[
    ("transport", &["transport", "config", "classification"]),
    (
        "libvirt",
        &[
            "libvirt",
            "transport",
            "config",
            "classification",
            "single_flight",
        ],
    ),
    ("guest", &["guest", "config", "classification"]),
    (
        "images",
        &[
            "images",
            "libvirt",
            "transport",
            "config",
            "classification",
            "single_flight",
        ],
    ),
    // The configuration is shared by every layer; its validation borrows three helpers
    // that depend on nothing above them (key loading, URL redaction, the guest-agent
    // choice), so it may name those layers, but never the top level or the provider.
    (
        "config",
        &["config", "classification", "transport", "images", "guest"],
    ),
    (
        "config.rs",
        &["config", "classification", "transport", "images", "guest"],
    ),
    ("single_flight.rs", &["single_flight"]),
    ("classification.rs", &["classification"]),
];

/// Contract types a lower layer must not build: every contract error comes from the one
/// mapping.
const CONTRACT_ONLY: &[&str] = &["ProviderError"];

fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_owned()];
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The crate modules (first path segment after `crate::`) `line` names, including each
/// name of a `crate::{a, b::c}` group.
fn crate_modules(line: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let preceded_by_ident = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[at + "crate::".len()..];
        if preceded_by_ident {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => return true,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    false
                })
                .map_or(group.len(), |(i, _)| i);
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in group[..end].char_indices().chain([(end, ',')]) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.push(first_segment(&group[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            names.push(first_segment(rest));
        }
    }
    names.retain(|n| !n.is_empty() && n != "self");
    names
}

fn first_segment(path: &str) -> String {
    path.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

fn contains_word(line: &str, word: &str) -> bool {
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

/// Every place a lower layer names a module it may not use, as `file:line: what`.
fn violations() -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for (layer, allowed) in LAYERS {
        for file in rust_files(&src.join(layer)) {
            let text = std::fs::read_to_string(&file).unwrap();
            let shown = file
                .strip_prefix(&src)
                .unwrap_or(&file)
                .display()
                .to_string();
            for (number, line) in text.lines().enumerate() {
                for module in crate_modules(line) {
                    if !allowed.contains(&module.as_str()) {
                        found.push(format!(
                            "src/{shown}:{}: layer `{layer}` names `crate::{module}`: {}",
                            number + 1,
                            line.trim()
                        ));
                    }
                }
                for contract in CONTRACT_ONLY {
                    if contains_word(line, contract) {
                        found.push(format!(
                            "src/{shown}:{}: layer `{layer}` names the contract's `{contract}`: {}",
                            number + 1,
                            line.trim()
                        ));
                    }
                }
            }
        }
    }
    found
}

#[test]
fn lower_layers_name_only_the_layers_below_them() {
    let found = violations();
    assert!(
        found.is_empty(),
        "imports that point upwards (see docs/adr/0008):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_rule_reads_every_form_of_a_crate_path() {
    assert_eq!(crate_modules("use crate::error::Error;"), ["error"]);
    assert_eq!(crate_modules("crate::Error::from(e)"), ["Error"]);
    assert_eq!(
        crate_modules("use crate::{config::Config, provider::{a, b}, self};"),
        ["config", "provider"]
    );
    assert_eq!(
        crate_modules("/// [`x`](crate::images::fetch::redact_url)"),
        ["images"]
    );
    assert!(crate_modules("use egressproxy_provider::ErrorClass;").is_empty());
    assert!(crate_modules("use other_crate::error;").is_empty());
    assert!(contains_word(
        "-> Result<(), ProviderError> {",
        "ProviderError"
    ));
    assert!(!contains_word("MyProviderErrors", "ProviderError"));
}
