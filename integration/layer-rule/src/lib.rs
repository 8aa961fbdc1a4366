//! A layer rule checked on a crate's source: each top-level module (a file or folder
//! under `src/`) names only the crate modules it may use, so an import that points
//! upwards fails a test with its file and line.
//!
//! A crate lists every module under `src/` with what it may name, in one table; then
//! its test asks these questions:
//! 1. [`LayerRule::upward_imports`]: which lines name a module their layer may not?
//!    A `crate::a::b` path or each entry of a `crate::{a, b::c}` group counts; comments
//!    do not, unless the crate reads them too ([`LayerRule::reading_comments`]).
//! 2. [`LayerRule::unlisted`]: which modules under `src/` are missing from the table
//!    (a new folder cannot escape the rule), and which listed ones no longer exist?
//! 3. [`LayerRule::cycle`]: does the table itself allow a chain of imports that comes
//!    back to where it started? And [`LayerRule::not_below`]: does a layer's list name
//!    something that is no lower layer of the table (a module above, or a typo)?
//!
//! A crate may ask more of its source:
//! 4. [`LayerRule::checking_folders`]: inside every folder, do sibling modules name each
//!    other in a cycle?
//! 5. [`LayerRule::top_only_words`]: does a lower layer write a word (a type's name)
//!    that only the top may, such as the contract's error, built by one mapping there?
//! 6. [`LayerRule::confining`]: does a file of a module write such a word in its code
//!    though only some of the module's files may (the gRPC edge, say)?
//!
//! [`LayerRule::violations`] asks them all and words the answers, each with its file
//! and line where it has one; a crate's test is `rule.assert_holds()`.

#![forbid(unsafe_code)]

mod folders;
mod source;
mod words;

use std::path::{Path, PathBuf};

use words::Confined;

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
    /// Whether comments are read as code ([`LayerRule::reading_comments`]).
    comments: bool,
    /// Whether folders are checked too ([`LayerRule::checking_folders`]).
    folders: bool,
    /// Words only the top may write ([`LayerRule::top_only_words`]).
    top_only: &'static [&'static str],
    /// Words a module writes only in some of its files ([`LayerRule::confining`]).
    confined: Vec<Confined>,
}

impl LayerRule {
    /// The rule for the crate whose sources are under `src`.
    pub fn new(src: impl Into<PathBuf>, modules: &'static [(&'static str, May)]) -> Self {
        Self {
            src: src.into(),
            modules,
            comments: false,
            folders: false,
            top_only: &[],
            confined: Vec::new(),
        }
    }

    /// Reads a lower layer's comments as code: a doc link (``[`f`](crate::a::f)``) or a
    /// `crate::a` in a comment counts as naming `a`, since rustdoc resolves the link and
    /// the reader follows it, upwards.
    pub fn reading_comments(mut self) -> Self {
        self.comments = true;
        self
    }

    /// Also fails on sibling modules of a folder (of `src/` itself too) that name each
    /// other in a cycle, naming each edge's file and line: what two siblings share
    /// belongs in a third below both.
    pub fn checking_folders(mut self) -> Self {
        self.folders = true;
        self
    }

    /// Also fails where a lower layer writes one of `words` (whole), read as its imports
    /// are: only the modules that may name anything may write them.
    pub fn top_only_words(mut self, words: &'static [&'static str]) -> Self {
        self.top_only = words;
        self
    }

    /// Also fails where a file of module `within` writes `word` (whole) in its code,
    /// unless it is one of `to` (paths under `src/`, such as `provider/service.rs`).
    /// Comment lines and an inline test module are not read: they may name it.
    pub fn confining(
        mut self,
        word: &'static str,
        within: &'static str,
        to: &'static [&'static str],
    ) -> Self {
        self.confined.push(Confined { word, within, to });
        self
    }

    /// Every line where a module names one it may not, as `src/file:line: what`.
    pub fn upward_imports(&self) -> Vec<String> {
        let mut found = Vec::new();
        self.each_lower_line(|layer, allowed, at, line| {
            for module in crate_modules(line) {
                if module != layer && !allowed.contains(&module.as_str()) {
                    found.push(format!(
                        "{at}: `{layer}` names `crate::{module}`: {}",
                        line.trim()
                    ));
                }
            }
        });
        found
    }

    /// Calls `each` with every line a lower layer's files hold (without its comments
    /// unless [`LayerRule::reading_comments`]): the layer, what it may name, where
    /// (`src/file:line`), and the line.
    pub(crate) fn each_lower_line(&self, mut each: impl FnMut(&str, &[&str], &str, &str)) {
        for (layer, may) in self.modules {
            let May::Only(allowed) = may else {
                continue;
            };
            for file in self.module_files(layer) {
                let text = std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                let shown = file.strip_prefix(&self.src).unwrap_or(&file).display();
                for (number, line) in text.lines().enumerate() {
                    let read = if self.comments { line } else { code_of(line) };
                    each(layer, allowed, &format!("src/{shown}:{}", number + 1), read);
                }
            }
        }
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

    /// Names in a layer's list that are no lower layer of the table (a module that may
    /// name anything, or none listed), as `(layer, name)`.
    pub fn not_below(&self) -> Vec<(&'static str, &'static str)> {
        let is_layer = |name: &str| {
            self.modules
                .iter()
                .any(|(listed, may)| *listed == name && matches!(may, May::Only(_)))
        };
        let mut found = Vec::new();
        for (layer, may) in self.modules {
            if let May::Only(allowed) = may {
                found.extend(
                    allowed
                        .iter()
                        .filter(|name| *name != layer && !is_layer(name))
                        .map(|name| (*layer, *name)),
                );
            }
        }
        found
    }

    /// Every answer that breaks the rule, in words: the upward imports, the modules to
    /// list, the listed ones that are gone, the table's cycle and names that are no lower
    /// layer, then what the crate asked for beyond them (folder cycles, words).
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
        found.extend(self.not_below().into_iter().map(|(layer, name)| {
            format!("`{layer}` may name `{name}`, which is not a lower layer in the table")
        }));
        if self.folders {
            found.extend(folders::cycles(&self.src).into_iter().map(|(folder, edges)| {
                format!(
                    "modules of {folder} name each other in a cycle (move what both need below them): {}",
                    edges.join(" → ")
                )
            }));
        }
        found.extend(
            self.top_only_written_below()
                .into_iter()
                .map(|line| format!("a word only the top may write: {line}")),
        );
        found.extend(
            self.confined_written_elsewhere()
                .into_iter()
                .map(|line| format!("a word written outside its files: {line}")),
        );
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
    pub(crate) fn module_files(&self, name: &str) -> Vec<PathBuf> {
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
        assert_eq!(crate_modules("crate::Error::from(e)"), ["Error"]);
        assert_eq!(
            crate_modules("use crate::{config::Config, provider::{a, b}, self};"),
            ["config", "provider"]
        );
        assert_eq!(
            crate_modules("/// [`x`](crate::images::fetch::redact_url)"),
            ["images"]
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

    /// A crate's `src/` under the temporary folder, with `files` (path, text) written;
    /// remove its parent when done.
    pub(crate) fn tree(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let src = std::env::temp_dir()
            .join(format!("layer-rule-{name}-{}", std::process::id()))
            .join("src");
        for (path, text) in files {
            let path = src.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        src
    }

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

    #[test]
    fn a_layer_may_name_only_lower_layers_of_the_table() {
        static ABOVE_OR_UNKNOWN: &[(&str, May)] = &[
            ("top", May::Anything),
            ("a", May::Only(&["a", "top", "b", "typo"])),
            ("b", May::Only(&[])),
        ];
        let rule = LayerRule::new("/nonexistent", ABOVE_OR_UNKNOWN);
        assert_eq!(rule.not_below(), [("a", "top"), ("a", "typo")]);
        assert_eq!(LayerRule::new("/nonexistent", LAYERED).not_below(), []);
    }

    #[test]
    fn read_with_its_comments_a_lower_layer_may_not_link_upwards() {
        let src = tree(
            "comments",
            &[
                ("top.rs", ""),
                (
                    "a.rs",
                    "//! Called by [`run`](crate::top::run).\nuse crate::b;\n",
                ),
                ("b.rs", "// Not crate::c's.\n"),
                ("c.rs", ""),
            ],
        );
        let code_only = LayerRule::new(&src, LAYERED).upward_imports();
        let with_comments = LayerRule::new(&src, LAYERED)
            .reading_comments()
            .upward_imports();
        std::fs::remove_dir_all(src.parent().unwrap()).unwrap();

        assert_eq!(code_only, Vec::<String>::new());
        assert_eq!(
            with_comments,
            ["src/a.rs:1: `a` names `crate::top`: //! Called by [`run`](crate::top::run)."]
        );
    }

    #[test]
    fn a_word_of_the_top_is_found_below_it_and_outside_its_files() {
        let src = tree(
            "words",
            &[
                ("top/mod.rs", "pub fn map() -> ProviderError {}\n"),
                ("top/edge.rs", "let e = ProviderError::from(error);\n"),
                (
                    "top/plan.rs",
                    "//! Not a [`ProviderError`] here.\nfn f() -> ProviderError {}\n\
                     #[cfg(test)]\nmod tests {\nuse ProviderError;\n}\n",
                ),
                ("a.rs", "fn f() -> MyProviderErrors {}\n"),
                ("b.rs", "\n// builds a ProviderError\n"),
                ("c.rs", "type E = ProviderError;\n"),
            ],
        );
        let rule = || {
            LayerRule::new(&src, LAYERED)
                .reading_comments()
                .top_only_words(&["ProviderError"])
                .confining("ProviderError", "top", &["top/edge.rs", "top/mod.rs"])
        };
        let (below, elsewhere) = (
            rule().top_only_written_below(),
            rule().confined_written_elsewhere(),
        );
        std::fs::remove_dir_all(src.parent().unwrap()).unwrap();

        assert_eq!(
            below,
            [
                "src/b.rs:2: `b` writes `ProviderError`: // builds a ProviderError",
                "src/c.rs:1: `c` writes `ProviderError`: type E = ProviderError;",
            ]
        );
        assert_eq!(
            elsewhere,
            [
                "src/top/plan.rs:2: `ProviderError` outside top/edge.rs, top/mod.rs: fn f() -> ProviderError {}"
            ]
        );
    }

    #[test]
    fn the_checks_a_crate_asks_for_are_among_the_violations() {
        let src = tree(
            "asked",
            &[
                ("top.rs", ""),
                ("a/mod.rs", "mod x;\nmod y;\n"),
                ("a/x.rs", "use super::y::Y;\n"),
                ("a/y.rs", "use super::x::X;\n"),
                (
                    "b.rs",
                    "/// [`T`](crate::top::T)\nstruct E(ProviderError);\n",
                ),
                ("c.rs", ""),
            ],
        );
        let plain = LayerRule::new(&src, LAYERED).violations();
        let asked = LayerRule::new(&src, LAYERED)
            .reading_comments()
            .checking_folders()
            .top_only_words(&["ProviderError"])
            .violations();
        std::fs::remove_dir_all(src.parent().unwrap()).unwrap();

        assert_eq!(plain, Vec::<String>::new());
        assert_eq!(
            asked,
            [
                "import points upwards: src/b.rs:1: `b` names `crate::top`: /// [`T`](crate::top::T)",
                "modules of src/a/ name each other in a cycle (move what both need below them): \
                 src/a/x.rs:1: super::y::Y → src/a/y.rs:1: super::x::X",
                "a word only the top may write: src/b.rs:2: `b` writes `ProviderError`: struct E(ProviderError);",
            ]
        );
    }
}
