//! Unsafe code lives in one place: the allocator trim in `operator/src/shared/memory.rs`.
//!
//! The workspace lint denies `unsafe_code`, and every library and binary root that can
//! forbids it; the operator's library cannot (the trim lifts the lint for one
//! function), so a new `unsafe` block elsewhere in it would need only its own `allow`.
//! This test reads every Rust file of the workspace and fails on:
//! - the word `unsafe` outside a comment (a block, function, impl, trait, extern block
//!   or attribute), anywhere but that file, and more than once there;
//! - an attribute that lifts the lint (`allow`, `expect` or `warn` naming it), anywhere
//!   but that file, and more than once there;
//! - a member crate that does not take the workspace's lints, or a workspace lint that
//!   no longer denies unsafe code.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// The only file allowed to hold unsafe code, relative to the workspace root.
const THE_ONE_PLACE: &str = "operator/src/shared/memory.rs";
/// This test, whose strings name what it looks for.
const THIS_TEST: &str = "operator/tests/unsafe_code.rs";
/// Folders that hold no code of ours.
const SKIPPED: &[&str] = &["target", ".git", "node_modules", ".venv"];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the operator crate sits in the workspace")
        .to_path_buf()
}

fn files_named(dir: &Path, wanted: &dyn Fn(&str) -> bool, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if !SKIPPED.contains(&name) {
                files_named(&path, wanted, found);
            }
        } else if wanted(name) {
            found.push(path);
        }
    }
}

/// What is left of `line` before a line comment (a `//` inside a string cuts it short,
/// which can only hide code, never invent it).
fn code_of(line: &str) -> &str {
    line.split("//").next().unwrap_or_default()
}

/// Whether `code` holds `word` as a whole word (not part of `unsafe_code`).
fn holds_word(code: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(word).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + word.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}

/// Whether `code` is an attribute that lifts the unsafe-code lint.
fn lifts_the_lint(code: &str) -> bool {
    code.contains('#')
        && holds_word(code, "unsafe_code")
        && ["allow", "expect", "warn"]
            .iter()
            .any(|level| holds_word(code, level))
}

/// `(file:line: text)` of every line of `text` that `matches`.
fn lines_where(relative: &Path, text: &str, matches: impl Fn(&str) -> bool) -> Vec<String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| matches(code_of(line)))
        .map(|(number, line)| format!("{}:{}: {}", relative.display(), number + 1, line.trim()))
        .collect()
}

#[test]
fn unsafe_code_appears_only_in_the_allocator_trim() {
    let root = workspace_root();
    let mut files = Vec::new();
    files_named(&root, &|name| name.ends_with(".rs"), &mut files);
    assert!(
        files.len() > 100,
        "found only {} Rust files under {root:?}",
        files.len()
    );
    let mut found = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&root).expect("under the root");
        if relative == Path::new(THE_ONE_PLACE) || relative == Path::new(THIS_TEST) {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        found.extend(lines_where(relative, &text, |code| {
            holds_word(code, "unsafe") || lifts_the_lint(code)
        }));
    }
    assert!(
        found.is_empty(),
        "unsafe code outside {THE_ONE_PLACE}:\n{}",
        found.join("\n")
    );

    let the_one = std::fs::read_to_string(root.join(THE_ONE_PLACE)).expect("the trim's file");
    let relative = Path::new(THE_ONE_PLACE);
    let blocks = lines_where(relative, &the_one, |code| holds_word(code, "unsafe"));
    let lifts = lines_where(relative, &the_one, lifts_the_lint);
    assert!(
        blocks.len() == 1 && lifts.len() == 1,
        "{THE_ONE_PLACE} must hold exactly one unsafe block and one lifting of the lint \
         (the malloc_trim call); a second needs its own review and this test changed:\n{}",
        [blocks, lifts].concat().join("\n")
    );
}

#[test]
fn every_crate_takes_the_workspace_lint_that_denies_unsafe_code() {
    let root = workspace_root();
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let lint = workspace
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with("unsafe_code"))
        .expect("the workspace sets the unsafe_code lint");
    assert!(
        lint.contains("\"deny\"") || lint.contains("\"forbid\""),
        "the workspace lint is `{lint}`"
    );
    let mut manifests = Vec::new();
    files_named(&root, &|name| name == "Cargo.toml", &mut manifests);
    let members: Vec<&PathBuf> = manifests
        .iter()
        .filter(|path| path.parent() != Some(root.as_path()))
        .collect();
    assert!(members.len() >= 6, "found only {members:?}");
    let strays: Vec<String> = members
        .iter()
        .filter(|path| {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let lints = text.split("[lints]").nth(1).unwrap_or_default();
            !lints
                .lines()
                .map(str::trim)
                .take_while(|line| !line.starts_with('['))
                .any(|line| line.replace(' ', "") == "workspace=true")
        })
        .map(|path| {
            path.strip_prefix(&root)
                .unwrap_or(path)
                .display()
                .to_string()
        })
        .collect();
    assert!(
        strays.is_empty(),
        "crates that do not take the workspace's lints (`[lints] workspace = true`): {strays:?}"
    );
}
