//! A layer rule checked on a crate's source: each top-level module (a file or folder
//! under `src/`) names only the crate modules it may use, so an import that points
//! upwards fails a test with its file and line.
//!
//! A crate lists every module under `src/` with what it may name, in one table; then
//! its test asks three questions:
//! 1. [`LayerRule::upward_imports`]: which lines name a module their layer may not?
//!    A `crate::a::b` path or each entry of a `crate::{a, b::c}` group counts; comments
//!    do not.
//! 2. [`LayerRule::unlisted`]: which modules under `src/` are missing from the table
//!    (a new folder cannot escape the rule), and which listed ones no longer exist?
//! 3. [`LayerRule::cycle`]: does the table itself allow a chain of imports that comes
//!    back to where it started?
//!
//! [`LayerRule::violations`] asks all three and words the answers; a crate's test is
//! `rule.assert_holds()`.

use std::path::{Path, PathBuf};

/// What a module's source may name.
#[derive(Debug, Clone, Copy)]
pub enum May {
    /// These crate modules (its own name is always allowed).
    Only(&'static [&'static str]),
    /// Anything: the top of the crate, above every layer.
    Anything,
}

/// Every module under a crate's `src/`, with what each may name.
#[derive(Debug)]
pub struct LayerRule {
    src: PathBuf,
    modules: &'static [(&'static str, May)],
}

impl LayerRule {
    /// The rule for the crate whose sources are under `src`.
    pub fn new(src: impl Into<PathBuf>, modules: &'static [(&'static str, May)]) -> Self {
        Self {
            src: src.into(),
            modules,
        }
    }

    /// Every line where a module names one it may not, as `src/file:line: what`.
    pub fn upward_imports(&self) -> Vec<String> {
        let mut found = Vec::new();
        for (layer, may) in self.modules {
            let May::Only(allowed) = may else {
                continue;
            };
            for file in self.module_files(layer) {
                let text = std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                let shown = file.strip_prefix(&self.src).unwrap_or(&file).display();
                for (number, line) in text.lines().enumerate() {
                    for module in crate_modules(code_of(line)) {
                        if module != *layer && !allowed.contains(&module.as_str()) {
                            found.push(format!(
                                "src/{shown}:{}: `{layer}` names `crate::{module}`: {}",
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

    /// Modules under `src/` the table does not list, and listed ones that do not exist.
    pub fn unlisted(&self) -> (Vec<String>, Vec<&'static str>) {
        let mut present = Vec::new();
        for entry in std::fs::read_dir(&self.src).expect("src/ is readable") {
            let path = entry.expect("src/ is readable").path();
            let name = if path.is_dir() {
                path.file_name()
            } else if path.extension().is_some_and(|e| e == "rs") {
                path.file_stem()
            } else {
                None
            };
            if let Some(name) = name {
                present.push(name.to_string_lossy().into_owned());
            }
        }
        present.sort();
        present.dedup();
        let unlisted = present
            .iter()
            .filter(|name| !self.modules.iter().any(|(listed, _)| listed == name))
            .cloned()
            .collect();
        let stale = self
            .modules
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| !present.iter().any(|p| p == name))
            .collect();
        (unlisted, stale)
    }

    /// A chain of allowed imports that comes back to its start, if the table has one.
    pub fn cycle(&self) -> Option<Vec<&'static str>> {
        let allowed = |name: &str| -> &'static [&'static str] {
            match self.modules.iter().find(|(listed, _)| *listed == name) {
                Some((_, May::Only(names))) => names,
                _ => &[],
            }
        };
        // Depth-first search from every module; `path` is the chain being followed.
        fn visit(
            name: &'static str,
            allowed: &dyn Fn(&str) -> &'static [&'static str],
            path: &mut Vec<&'static str>,
            done: &mut Vec<&'static str>,
        ) -> Option<Vec<&'static str>> {
            if let Some(at) = path.iter().position(|p| *p == name) {
                let mut cycle = path[at..].to_vec();
                cycle.push(name);
                return Some(cycle);
            }
            if done.contains(&name) {
                return None;
            }
            path.push(name);
            for next in allowed(name).iter().filter(|next| **next != name) {
                if let Some(cycle) = visit(next, allowed, path, done) {
                    return Some(cycle);
                }
            }
            path.pop();
            done.push(name);
            None
        }
        let mut done = Vec::new();
        self.modules
            .iter()
            .find_map(|(name, _)| visit(name, &allowed, &mut Vec::new(), &mut done))
    }

    /// Every answer of the three questions that breaks the rule, in words: the upward
    /// imports, the modules to list, the listed ones that are gone, the cycle.
    pub fn violations(&self) -> Vec<String> {
        let mut found: Vec<String> = self
            .upward_imports()
            .into_iter()
            .map(|line| format!("import points upwards: {line}"))
            .collect();
        let (unlisted, stale) = self.unlisted();
        found.extend(unlisted.into_iter().map(|name| {
            format!("`{name}` is under src/ but not in the table: list it with what it may name")
        }));
        found.extend(
            stale
                .into_iter()
                .map(|name| format!("`{name}` is in the table but not under src/: remove it")),
        );
        if let Some(cycle) = self.cycle() {
            found.push(format!("the table allows a cycle: {}", cycle.join(" → ")));
        }
        found
    }

    /// Panics with every violation, one per line, unless there is none.
    #[track_caller]
    pub fn assert_holds(&self) {
        let found = self.violations();
        assert!(
            found.is_empty(),
            "the layer rule of {} does not hold:\n{}",
            self.src.display(),
            found.join("\n")
        );
    }

    /// The source files of module `name`: `src/name.rs` and every file under `src/name/`.
    fn module_files(&self, name: &str) -> Vec<PathBuf> {
        let mut files = Vec::new();
        let file = self.src.join(format!("{name}.rs"));
        if file.is_file() {
            files.push(file);
        }
        let folder = self.src.join(name);
        if folder.is_dir() {
            files.extend(rust_files(&folder));
        }
        files
    }
}

fn rust_files(folder: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let entries = std::fs::read_dir(folder).unwrap_or_else(|e| panic!("{}: {e}", folder.display()));
    for entry in entries {
        let path = entry.expect("a readable folder").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// `line` without a trailing `//` comment (doc comments included: a doc may mention a
/// layer above it without depending on it).
fn code_of(line: &str) -> &str {
    line.find("//").map_or(line, |at| &line[..at])
}

/// The crate modules (the first segment after `crate::`) `line` names, each entry of a
/// `crate::{a, b::c}` group included.
pub fn crate_modules(line: &str) -> Vec<String> {
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
        match rest.strip_prefix('{') {
            Some(group) => names.extend(top_level_entries(group).map(first_segment)),
            None => names.push(first_segment(rest)),
        }
    }
    names.retain(|n| !n.is_empty() && n != "self");
    names
}

/// The comma-separated entries of a `{...}` group (its opening brace already taken),
/// nested groups kept whole.
fn top_level_entries(group: &str) -> impl Iterator<Item = &str> {
    let mut entries = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                entries.push(&group[start..i]);
                return entries.into_iter();
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                entries.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    entries.push(&group[start..]);
    entries.into_iter()
}

fn first_segment(path: &str) -> String {
    path.trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_groups_name_their_first_segments() {
        assert_eq!(crate_modules("use crate::a::b::C;"), ["a"]);
        assert_eq!(
            crate_modules("use crate::{a, b::c, d::{e, f}};"),
            ["a", "b", "d"]
        );
        assert_eq!(
            crate_modules("let x = crate::a::f() + crate::b::g();"),
            ["a", "b"]
        );
        assert!(crate_modules("use other_crate::a;").is_empty());
        assert!(crate_modules("use crate::{self};").is_empty());
    }

    #[test]
    fn comments_name_nothing() {
        assert!(crate_modules(code_of("//! see [`crate::top`]")).is_empty());
        assert_eq!(crate_modules(code_of("use crate::a; // crate::b")), ["a"]);
    }

    static CYCLIC: &[(&str, May)] = &[
        ("a", May::Only(&["b"])),
        ("b", May::Only(&["c"])),
        ("c", May::Only(&["a"])),
    ];
    static LAYERED: &[(&str, May)] = &[
        ("top", May::Anything),
        ("a", May::Only(&["b", "c"])),
        ("b", May::Only(&["c"])),
        ("c", May::Only(&[])),
    ];

    #[test]
    fn a_table_that_allows_a_loop_has_a_cycle() {
        let cycle = LayerRule::new("/nonexistent", CYCLIC).cycle();
        assert_eq!(cycle, Some(vec!["a", "b", "c", "a"]));
        assert_eq!(LayerRule::new("/nonexistent", LAYERED).cycle(), None);
    }

    #[test]
    fn an_upward_import_and_an_unlisted_module_are_found() {
        let dir = std::env::temp_dir().join(format!("layer-rule-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("b")).unwrap();
        std::fs::write(dir.join("top.rs"), "use crate::a;\n").unwrap();
        std::fs::write(dir.join("a.rs"), "use crate::b::x;\n").unwrap();
        std::fs::write(dir.join("b/mod.rs"), "// crate::a in a comment\n").unwrap();
        std::fs::write(dir.join("b/inner.rs"), "\nuse crate::{c, a::y};\n").unwrap();
        std::fs::write(dir.join("extra.rs"), "").unwrap();
        let rule = LayerRule::new(&dir, LAYERED);
        let (found, (unlisted, stale)) = (rule.upward_imports(), rule.unlisted());
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("src/b/inner.rs:2: `b` names `crate::a`"),
            "{found:?}"
        );
        assert_eq!(unlisted, ["extra"]);
        assert_eq!(stale, ["c"]);
    }

    #[test]
    fn violations_word_every_answer() {
        let dir = std::env::temp_dir().join(format!("layer-rule-v-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["a", "b", "extra"] {
            std::fs::write(dir.join(format!("{name}.rs")), "").unwrap();
        }
        std::fs::write(dir.join("c.rs"), "use crate::b;\n").unwrap();
        let found = LayerRule::new(&dir, CYCLIC).violations();
        let held = std::panic::catch_unwind(|| LayerRule::new(&dir, CYCLIC).assert_holds());
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(
            found,
            [
                "import points upwards: src/c.rs:1: `c` names `crate::b`: use crate::b;",
                "`extra` is under src/ but not in the table: list it with what it may name",
                "the table allows a cycle: a → b → c → a",
            ]
        );
        assert!(held.is_err());
    }
}
