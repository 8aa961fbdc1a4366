//! The folder rule ([`crate::LayerRule::checking_folders`]): inside every folder, the
//! modules that are siblings there (`cache`, `download`, `eviction` in `images/`) name
//! each other without a cycle, so each folder reads top to bottom like the layers do.
//!
//! Module paths come from the files (`a/b.rs` and `a/b/mod.rs` are `a::b`). Each
//! `crate::`, `super::` and `self::` path in a file's code (groups expanded) is resolved
//! as far as it names modules; a path from a module inside sibling `A` to one inside
//! sibling `B` of the same folder is an edge `A -> B`. A module naming its parent, an
//! ancestor or its own children is no edge. Not read, because none of it is an import:
//! comment lines (a module's docs may link to its callers), test modules (a `tests`
//! module in a file of its own, or one written inside a file after `#[cfg(test)]`), and
//! the other crate roots (`main.rs`, `bin/`), whose `crate::` is another crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::rust_files;
use crate::source::code;

/// A module's path from the crate root (`["images", "cache"]`).
type ModulePath = Vec<String>;

/// Each folder with a cycle among its modules: the folder (`src/images/`) and the
/// cycle's edges in order, each as `src/file:line: path`.
pub(crate) fn cycles(src: &Path) -> Vec<(String, Vec<String>)> {
    sibling_edges(src)
        .into_iter()
        .filter_map(|(folder, edges)| {
            let cycle = find_cycle(&edges)?;
            let name = if folder.is_empty() {
                "src/".to_owned()
            } else {
                format!("src/{}/", folder.join("/"))
            };
            Some((name, cycle))
        })
        .collect()
}

/// The module a source file defines, from its path under `src/`.
fn module_of(src: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut path: ModulePath = relative
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    if matches!(path.last().map(String::as_str), Some("mod" | "lib")) {
        path.pop();
    }
    path
}

/// Every path that starts with `crate`, `super` or `self` in `text`, with groups
/// (`super::{a, b::c}`) expanded, each with the byte offset where it starts.
fn relative_paths(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    for keyword in ["crate::", "super::", "self::"] {
        for (at, _) in text.match_indices(keyword) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            for path in expand(&text[at..]) {
                found.push((at, path));
            }
        }
    }
    found.sort();
    found
}

/// The paths that `rest` starts with: one, or one per item of a `{...}` group.
fn expand(rest: &str) -> Vec<Vec<String>> {
    let mut prefix = Vec::new();
    let mut rest = rest;
    loop {
        let trimmed = rest.trim_start();
        let segment: String = trimmed
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if segment.is_empty() {
            let Some(group) = trimmed.strip_prefix('{') else {
                return vec![prefix];
            };
            return crate::top_level_entries(group)
                .flat_map(|item| {
                    expand(item).into_iter().map(|tail| {
                        let mut path = prefix.clone();
                        path.extend(tail);
                        path
                    })
                })
                .collect();
        }
        rest = &trimmed[segment.len()..];
        prefix.push(segment);
        match rest.strip_prefix("::") {
            Some(after) => rest = after,
            None => return vec![prefix],
        }
    }
}

/// The module `path`, written in module `from`, points into: resolved as far as its
/// segments name modules.
fn resolve(from: &[String], path: &[String], modules: &BTreeSet<ModulePath>) -> ModulePath {
    let mut segments = path.iter().peekable();
    let mut base: ModulePath = match segments.next().map(String::as_str) {
        Some("crate") => Vec::new(),
        Some("self") => from.to_vec(),
        _ => from[..from.len().saturating_sub(1)].to_vec(),
    };
    while segments.peek().is_some_and(|s| *s == "super") {
        segments.next();
        base.pop();
    }
    for segment in segments {
        base.push(segment.clone());
        if !modules.contains(&base) {
            base.pop();
            break;
        }
    }
    base
}

/// Edges between siblings, by folder: `folder -> (from, to) -> where it is written`.
type Edges = BTreeMap<ModulePath, BTreeMap<(String, String), String>>;

fn sibling_edges(src: &Path) -> Edges {
    let files: Vec<_> = rust_files(src)
        .into_iter()
        .filter(|f| {
            let relative = f.strip_prefix(src).unwrap_or(f);
            relative != Path::new("main.rs") && !relative.starts_with("bin")
        })
        .collect();
    let modules: BTreeSet<ModulePath> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges = Edges::new();
    for file in &files {
        let from = module_of(src, file);
        if from.iter().any(|segment| segment == "tests") {
            continue;
        }
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let text = code(&text);
        for (at, path) in relative_paths(&text) {
            let to = resolve(&from, &path, &modules);
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue;
            }
            let line = text[..at].lines().count().max(1);
            let shown = file.strip_prefix(src).unwrap_or(file).display();
            edges
                .entry(from[..common].to_vec())
                .or_default()
                .entry((from[common].clone(), to[common].clone()))
                .or_insert_with(|| format!("src/{shown}:{line}: {}", path.join("::")));
        }
    }
    edges
}

/// A cycle among `edges`, as the edges' evidence in order, if there is one.
fn find_cycle(edges: &BTreeMap<(String, String), String>) -> Option<Vec<String>> {
    let next = |node: &str| -> Vec<&String> {
        edges
            .keys()
            .filter(|(from, _)| from == node)
            .map(|(_, to)| to)
            .collect()
    };
    for (start, _) in edges.keys() {
        // Depth-first from `start`; reaching it again closes a cycle.
        let mut path: Vec<&String> = vec![start];
        let mut stack = vec![next(start).into_iter()];
        let mut seen = BTreeSet::new();
        while let Some(children) = stack.last_mut() {
            match children.next() {
                Some(node) if node == start => {
                    path.push(node);
                    return Some(
                        path.windows(2)
                            .map(|w| edges[&(w[0].clone(), w[1].clone())].clone())
                            .collect(),
                    );
                }
                Some(node) if seen.insert(node) => {
                    path.push(node);
                    stack.push(next(node).into_iter());
                }
                Some(_) => {}
                None => {
                    stack.pop();
                    path.pop();
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::tree;

    fn module(p: &[&str]) -> ModulePath {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn paths_resolve_the_way_rust_reads_them() {
        let modules: BTreeSet<ModulePath> = [
            module(&["images"]),
            module(&["images", "cache"]),
            module(&["images", "download"]),
            module(&["guest"]),
            module(&["guest", "cloud_init"]),
            module(&["guest", "cloud_init", "bootstrap"]),
        ]
        .into_iter()
        .collect();
        let from = module(&["images", "download"]);
        let paths: Vec<_> = relative_paths(
            "use super::{cache::{A, B}, error::E};\nuse crate::images::cache::C;\n\
             let x = self::f(); // not_super::x",
        )
        .into_iter()
        .map(|(_, path)| resolve(&from, &path, &modules))
        .collect();
        assert_eq!(
            paths,
            [
                module(&["images", "cache"]),
                module(&["images", "cache"]),
                module(&["images"]),
                module(&["images", "cache"]),
                module(&["images", "download"]),
            ]
        );
        let from = module(&["guest", "cloud_init", "bootstrap"]);
        let [(_, path)] = &relative_paths("super::super::cloud_init::bootstrap::X")[..] else {
            panic!("one path");
        };
        assert_eq!(resolve(&from, path, &modules), from);
    }

    #[test]
    fn siblings_that_name_each_other_are_a_cycle_with_file_and_line() {
        let src = tree(
            "folders-cycle",
            &[
                ("lib.rs", "pub mod images;\n"),
                ("images/mod.rs", "mod cache;\nmod download;\n"),
                ("images/cache.rs", "\nuse super::download::get;\n"),
                ("images/download.rs", "use crate::images::cache::Entry;\n"),
                // Neither a parent naming its child, nor docs, nor tests are edges.
                ("guest/mod.rs", "use self::seed::x;\n"),
                ("guest/seed.rs", "//! see [`crate::guest::iso`]\n"),
                (
                    "guest/iso.rs",
                    "use super::seed::y;\n#[cfg(test)]\nmod tests {\nuse super::super::seed;\n}\n",
                ),
                ("guest/tests.rs", "use super::iso::z;\n"),
                ("main.rs", "use crate::images::cache;\n"),
            ],
        );
        let found = cycles(&src);
        std::fs::remove_dir_all(src.parent().unwrap()).unwrap();

        assert_eq!(
            found,
            [(
                "src/images/".to_owned(),
                vec![
                    "src/images/cache.rs:2: super::download::get".to_owned(),
                    "src/images/download.rs:1: crate::images::cache::Entry".to_owned(),
                ]
            )]
        );
    }
}
