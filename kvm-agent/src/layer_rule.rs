//! The layer rule, checked on the source: each layer names only the crate modules it may
//! use, so an import that points upwards fails the build's tests with its file and line.
//!
//! Every module under `src/` (a folder, a file, or both) is listed in [`MODULES`]: a new
//! one that is not fails [`every_module_under_src_is_listed`], so nothing escapes the
//! rule. A lower layer may use the layers below it and the shared leaves
//! ([`crate::classification`], [`crate::config`], `single_flight`, [`crate::metrics`]),
//! which name no layer.
//! The map of what may name what is itself checked to have no cycle, so no chain of
//! imports can come back to where it started. No layer below the provider names the
//! top-level `error` module (or its re-export `crate::Error`) or builds a contract error
//! (`ProviderError`): each returns its own error type, and the one mapping in `error.rs`
//! turns it into the contract's.

use std::path::{Path, PathBuf};

mod cycles;

/// What a module's source may name.
enum May {
    /// These crate modules (its own name included).
    Only(&'static [&'static str]),
    /// Anything: the top of the crate, above every layer.
    Anything,
}

/// Every module under `src/` with the crate modules it may name.
const MODULES: &[(&str, May)] = &[
    ("lib", May::Anything),
    ("main", May::Anything),
    ("layer_rule", May::Anything),
    ("error", May::Anything),
    ("startup", May::Anything),
    ("provider", May::Anything),
    (
        "images",
        May::Only(&[
            "images",
            "libvirt",
            "transport",
            "config",
            "classification",
            "single_flight",
            "metrics",
        ]),
    ),
    ("guest", May::Only(&["guest", "config", "classification"])),
    (
        "libvirt",
        May::Only(&[
            "libvirt",
            "transport",
            "config",
            "classification",
            "single_flight",
            "metrics",
        ]),
    ),
    (
        "transport",
        May::Only(&["transport", "config", "classification", "metrics"]),
    ),
    ("config", May::Only(&["config", "classification"])),
    ("single_flight", May::Only(&["single_flight"])),
    ("classification", May::Only(&["classification"])),
    ("metrics", May::Only(&["metrics"])),
];

/// Contract types a lower layer must not build: every contract error comes from the one
/// mapping.
const CONTRACT_ONLY: &[&str] = &["ProviderError"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The source files of the top-level module `name`: `src/name.rs` and all under `src/name/`.
fn module_files(name: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let file = src().join(format!("{name}.rs"));
    if file.is_file() {
        files.push(file);
    }
    let folder = src().join(name);
    if folder.is_dir() {
        files.extend(rust_files(&folder));
    }
    files
}

fn rust_files(path: &Path) -> Vec<PathBuf> {
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
    let src = src();
    let mut found = Vec::new();
    for (layer, may) in MODULES {
        let May::Only(allowed) = may else {
            continue;
        };
        for file in module_files(layer) {
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

/// The provider layer works with the crate's `Error`; only the gRPC edge (`service.rs`)
/// turns it into the contract's, as `error.rs`'s one mapping builds it.
#[test]
fn the_provider_layer_answers_the_contract_only_at_the_grpc_edge() {
    let mut found = Vec::new();
    for file in module_files("provider") {
        if file.ends_with("provider/service.rs") {
            continue;
        }
        let code = cycles::code(&std::fs::read_to_string(&file).unwrap());
        for (number, line) in code.lines().enumerate() {
            if CONTRACT_ONLY.iter().any(|word| contains_word(line, word)) {
                let shown = file.strip_prefix(src()).unwrap_or(&file).display();
                found.push(format!("src/{shown}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "return the crate's Error; service.rs answers the contract:\n{}",
        found.join("\n")
    );
}

#[test]
fn every_module_under_src_is_listed() {
    let mut unlisted = Vec::new();
    let mut found = Vec::new();
    for entry in std::fs::read_dir(src()).unwrap() {
        let path = entry.unwrap().path();
        let name = if path.is_dir() {
            path.file_name()
        } else if path.extension().is_some_and(|e| e == "rs") {
            path.file_stem()
        } else {
            continue;
        };
        let name = name.unwrap().to_string_lossy().into_owned();
        if !MODULES.iter().any(|(listed, _)| *listed == name) {
            unlisted.push(format!(
                "src/{}",
                path.file_name().unwrap().to_string_lossy()
            ));
        }
        found.push(name);
    }
    assert!(
        unlisted.is_empty(),
        "list these in layer_rule::MODULES with what they may name: {unlisted:?}"
    );
    let stale: Vec<_> = MODULES
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !found.iter().any(|f| f == name))
        .collect();
    assert!(stale.is_empty(), "listed but not under src/: {stale:?}");
}

#[test]
fn the_layer_map_has_no_cycle() {
    let may_name = |module: &str| -> Vec<&'static str> {
        MODULES
            .iter()
            .find(|(name, _)| *name == module)
            .map_or(Vec::new(), |(name, may)| match may {
                May::Only(allowed) => allowed.iter().copied().filter(|a| a != name).collect(),
                May::Anything => Vec::new(),
            })
    };
    for (start, may) in MODULES {
        let May::Only(_) = may else { continue };
        // Depth-first from `start`: reaching it again is a cycle.
        let mut path = vec![*start];
        let mut stack = vec![may_name(start).into_iter()];
        while let Some(next) = stack.last_mut() {
            match next.next() {
                Some(module) => {
                    assert!(
                        module != *start,
                        "the layer map has a cycle: {} -> {module}",
                        path.join(" -> ")
                    );
                    assert!(
                        MODULES
                            .iter()
                            .any(|(name, may)| *name == module && matches!(may, May::Only(_))),
                        "`{}` may name `{module}`, which is not a lower layer",
                        path.last().unwrap()
                    );
                    if !path.contains(&module) {
                        path.push(module);
                        stack.push(may_name(module).into_iter());
                    }
                }
                None => {
                    stack.pop();
                    path.pop();
                }
            }
        }
    }
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
