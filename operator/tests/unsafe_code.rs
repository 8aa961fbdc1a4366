//! Unsafe code lives in one place: the allocator trim in `operator/src/shared/memory.rs`.
//!
//! The workspace lint denies `unsafe_code`, and every crate root that can forbids it;
//! the operator's library cannot (the trim lifts the lint for one function), so a new
//! `unsafe` block elsewhere in it would need only its own `allow`. This test reads every
//! Rust file of the workspace and fails on any `unsafe` block, function, impl or extern
//! block, or any lifting of the lint, outside that one file.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// The only file allowed to hold unsafe code, relative to the workspace root.
const THE_ONE_PLACE: &str = "operator/src/shared/memory.rs";

/// Folders that hold no code of ours.
const SKIPPED: &[&str] = &["target", ".git", "node_modules", ".venv"];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the operator crate sits in the workspace")
        .to_path_buf()
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}"));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if !SKIPPED.contains(&name) {
                rust_files(&path, found);
            }
        } else if name.ends_with(".rs") {
            found.push(path);
        }
    }
}

/// What marks unsafe code or a lifted lint. Built from pieces, so that this file does
/// not match itself.
fn needles() -> Vec<String> {
    let word = "unsafe";
    let lint = concat!("unsafe", "_code");
    vec![
        format!("{word} {{"),
        format!("{word} fn "),
        format!("{word} impl "),
        format!("{word} extern"),
        format!("allow({lint}"),
        format!("expect({lint}"),
    ]
}

#[test]
fn unsafe_code_appears_only_in_the_allocator_trim() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(
        files.len() > 100,
        "found only {} Rust files under {root:?}",
        files.len()
    );
    let needles = needles();
    let mut found = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&root).expect("under the root");
        if relative == Path::new(THE_ONE_PLACE) {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        for (number, line) in text.lines().enumerate() {
            if needles.iter().any(|needle| line.contains(needle.as_str())) {
                found.push(format!(
                    "{}:{}: {}",
                    relative.display(),
                    number + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "unsafe code outside {THE_ONE_PLACE}:\n{}",
        found.join("\n")
    );
    let the_one = std::fs::read_to_string(root.join(THE_ONE_PLACE)).expect("the trim's file");
    assert!(
        needles
            .iter()
            .any(|needle| the_one.contains(needle.as_str())),
        "{THE_ONE_PLACE} holds no unsafe code any more: make the operator's library \
         forbid it and drop this exception"
    );
}
