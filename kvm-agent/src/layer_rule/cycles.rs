//! The folder rule, checked on the source: inside every folder, the modules that are
//! siblings there (`cache`, `download`, `eviction` in `images/`) name each other without a
//! cycle, so each folder reads top to bottom like the layers do.
//!
//! Module paths come from the files (`a/b.rs` and `a/b/mod.rs` are `a::b`). Each
//! `crate::`, `super::` and `self::` path in a file's code (groups expanded) is resolved
//! as far as it names modules; a path from a module inside sibling `A` to one inside
//! sibling `B` of the same folder is an edge `A -> B`. A module naming its parent, an
//! ancestor or its own children is no edge. Not read, because none of it is an import:
//! comment lines (a module's docs may link to its callers), test modules (a `tests`
//! module in a file of its own, or one written inside a file after `#[cfg(test)]`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::{rust_files, src};

/// A module's path from the crate root (`["images", "cache"]`).
type ModulePath = Vec<String>;

/// The module a source file defines, from its path under `src/`.
fn module_of(file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src()).unwrap().with_extension("");
    let mut path: ModulePath = relative
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    if matches!(path.last().map(String::as_str), Some("mod" | "lib")) {
        path.pop();
    }
    path
}

/// The code of `text`: without comment lines and a test module written inside it.
pub(super) fn code(text: &str) -> String {
    without_inline_tests(text)
        .lines()
        .map(|line| {
            if line.trim_start().starts_with("//") {
                ""
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The source without a test module written inside it.
fn without_inline_tests(text: &str) -> &str {
    let mut at = 0;
    while let Some(found) = text[at..].find("#[cfg(test)]") {
        let start = at + found;
        let after = text[start + "#[cfg(test)]".len()..].trim_start();
        if let Some(rest) = after.strip_prefix("mod ") {
            let header = rest.split(['\n', ';']).next().unwrap_or("");
            if header.contains('{') {
                return &text[..start];
            }
        }
        at = start + 1;
    }
    text
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
            return group_items(group)
                .into_iter()
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

/// The top-level items of a group whose opening brace is already consumed.
fn group_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items
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

fn sibling_edges() -> Edges {
    let files: Vec<_> = rust_files(&src())
        .into_iter()
        .filter(|f| f.file_name().is_some_and(|n| n != "main.rs"))
        .collect();
    let modules: BTreeSet<ModulePath> = files.iter().map(|f| module_of(f)).collect();
    let mut edges = Edges::new();
    for file in &files {
        let from = module_of(file);
        if from.iter().any(|segment| segment == "tests") {
            continue;
        }
        let text = code(&std::fs::read_to_string(file).unwrap());
        for (at, path) in relative_paths(&text) {
            let to = resolve(&from, &path, &modules);
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue;
            }
            let line = text[..at].lines().count().max(1);
            let shown = file.strip_prefix(src()).unwrap().display();
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

#[test]
fn no_folder_has_a_cycle_among_its_modules() {
    let mut cycles = Vec::new();
    for (folder, edges) in sibling_edges() {
        if let Some(cycle) = find_cycle(&edges) {
            let name = if folder.is_empty() {
                "src/".to_owned()
            } else {
                format!("src/{}/", folder.join("/"))
            };
            cycles.push(format!("{name}:\n  {}", cycle.join("\n  ")));
        }
    }
    assert!(
        cycles.is_empty(),
        "modules that name each other in a cycle (move what both need below them):\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_folder_rule_reads_paths_the_way_rust_does() {
    let modules: BTreeSet<ModulePath> = [
        vec!["images"],
        vec!["images", "cache"],
        vec!["images", "download"],
        vec!["guest"],
        vec!["guest", "cloud_init"],
        vec!["guest", "cloud_init", "bootstrap"],
    ]
    .into_iter()
    .map(|p| p.into_iter().map(String::from).collect())
    .collect();
    let module = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<ModulePath>();
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
    assert_eq!(
        code("a\n//! [`x`](crate::y)\n#[cfg(test)]\nmod tests;\nb\n#[cfg(test)]\nmod tests {\nc"),
        "a\n\n#[cfg(test)]\nmod tests;\nb"
    );
}
