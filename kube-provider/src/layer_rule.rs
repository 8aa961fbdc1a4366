//! The import direction of the crate's doc, checked on the source: `service` and
//! `provider` may name anything; the pure modules name only those below them, and
//! `config` and `kube_errors` name nothing of the crate. A use that points upwards fails
//! with its file and line; a module under `src/` that [`MODULES`] does not list fails
//! too, so no new file escapes the rule.

use std::path::Path;

/// Every module under `src/` with the crate modules it may name (`None`: anything).
const MODULES: &[(&str, Option<&[&str]>)] = &[
    ("lib", None),
    ("main", None),
    ("layer_rule", None),
    ("service", None),
    ("provider", None),
    ("pod_watch", Some(&["instance", "record"])),
    ("request", Some(&["config"])),
    ("placement", Some(&["record"])),
    ("pod_spec", Some(&["config", "record"])),
    ("instance", Some(&["record"])),
    ("record", Some(&[])),
    ("kube_errors", Some(&[])),
    ("config", Some(&[])),
];

fn src() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"))
}

/// The crate modules a line names through `crate::`, including `crate::{a, b::c}`.
fn named_modules(line: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in line.match_indices("crate::") {
        let rest = &line[at + "crate::".len()..];
        let paths: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => group.split('}').next().unwrap_or("").split(',').collect(),
            None => vec![rest],
        };
        for path in paths {
            let name: String = path
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name != "self" {
                names.push(name);
            }
        }
    }
    names
}

#[test]
fn imports_point_down() {
    let mut upwards = Vec::new();
    for (module, may) in MODULES {
        let Some(may) = may else { continue };
        let file = src().join(format!("{module}.rs"));
        let text = std::fs::read_to_string(&file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for name in named_modules(line) {
                let allowed = name == *module
                    || may.contains(&name.as_str())
                    || !MODULES.iter().any(|(m, _)| *m == name);
                if !allowed {
                    upwards.push(format!(
                        "src/{module}.rs:{}: names crate::{name}",
                        number + 1
                    ));
                }
            }
        }
    }
    assert!(
        upwards.is_empty(),
        "imports that point upwards:\n{}",
        upwards.join("\n")
    );
}

#[test]
fn every_module_under_src_is_listed() {
    let mut unlisted = Vec::new();
    for entry in std::fs::read_dir(src()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if !MODULES.iter().any(|(m, _)| *m == name) {
            unlisted.push(path.display().to_string());
        }
    }
    assert!(
        unlisted.is_empty(),
        "modules layer_rule does not list: {unlisted:?}"
    );
}

#[test]
fn named_modules_reads_single_and_grouped_paths() {
    assert_eq!(named_modules("use crate::config::Config;"), ["config"]);
    assert_eq!(
        named_modules("use crate::{record::X, instance, self};"),
        ["record", "instance"]
    );
    assert!(named_modules("use super::*;").is_empty());
}
