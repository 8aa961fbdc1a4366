//! Words (a type's name, say) that only some of a crate may write, so that what they
//! stand for is built in one place: a contract error only by the one mapping at the
//! top, not by a layer below it nor by any file of the top but its edge.

use std::path::Path;

use crate::LayerRule;
use crate::source::{code, contains_word};

/// A word that one module's files may write only in some of them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Confined {
    /// The word, matched whole.
    pub(crate) word: &'static str,
    /// The module whose files are read.
    pub(crate) within: &'static str,
    /// The files under `src/` (`provider/service.rs`) that may write it in their code.
    pub(crate) to: &'static [&'static str],
}

impl LayerRule {
    /// Every line where a lower layer writes a word only the top may, as
    /// `src/file:line: what`.
    pub fn top_only_written_below(&self) -> Vec<String> {
        let mut found = Vec::new();
        self.each_lower_line(|layer, _, at, line| {
            for word in self.top_only {
                if contains_word(line, word) {
                    found.push(format!("{at}: `{layer}` writes `{word}`: {}", line.trim()));
                }
            }
        });
        found
    }

    /// Every line where a file writes a word [`LayerRule::confining`] keeps to other
    /// files, as `src/file:line: what`.
    pub fn confined_written_elsewhere(&self) -> Vec<String> {
        let mut found = Vec::new();
        for confined in &self.confined {
            for file in self.module_files(confined.within) {
                let shown = file.strip_prefix(&self.src).unwrap_or(&file);
                if confined.to.iter().any(|to| shown == Path::new(to)) {
                    continue;
                }
                let text = std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                for (number, line) in code(&text).lines().enumerate() {
                    if contains_word(line, confined.word) {
                        found.push(format!(
                            "src/{}:{}: `{}` outside {}: {}",
                            shown.display(),
                            number + 1,
                            confined.word,
                            confined.to.join(", "),
                            line.trim()
                        ));
                    }
                }
            }
        }
        found
    }
}
