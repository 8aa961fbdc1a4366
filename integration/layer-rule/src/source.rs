//! Reading a source file the way the checks need it: its code without comment lines or
//! an inline test module, and whole words.

/// The code of `text`, line for line: comment lines blanked, and nothing from an inline
/// test module (`#[cfg(test)] mod tests { ... }`) on, since such a module ends its file by
/// custom and none of it is the module's own code.
pub(crate) fn code(text: &str) -> String {
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

/// The source up to a test module written inside it (a `#[cfg(test)] mod x;` that
/// points to a file of its own is kept).
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

/// Whether `line` holds `word` whole (not as part of a longer identifier).
pub(crate) fn contains_word(line: &str, word: &str) -> bool {
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_drops_comment_lines_and_an_inline_test_module_only() {
        assert_eq!(
            code(
                "a\n//! [`x`](crate::y)\n#[cfg(test)]\nmod tests;\nb\n#[cfg(test)]\nmod tests {\nc"
            ),
            "a\n\n#[cfg(test)]\nmod tests;\nb"
        );
    }

    #[test]
    fn a_word_counts_only_whole() {
        assert!(contains_word(
            "-> Result<(), ProviderError> {",
            "ProviderError"
        ));
        assert!(contains_word("ProviderError::new()", "ProviderError"));
        assert!(!contains_word("MyProviderErrors", "ProviderError"));
        assert!(!contains_word("ProviderError_x", "ProviderError"));
    }
}
