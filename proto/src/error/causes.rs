//! An error told with its causes in one line: `error: cause: cause of the cause`. The
//! one walker of `source()` chains for the contract crate, the operator and the
//! providers, for messages and logs.

use std::error::Error;

/// `error` followed by each of its sources, joined with `": "`.
pub fn with_causes(error: &dyn Error) -> String {
    append_causes(error.to_string(), error)
}

/// `head` followed by each of `error`'s sources (not `error` itself), joined with `": "`.
/// A cause whose text is empty or already in what is written is left out: wrapped
/// errors often repeat their source's text in their own.
pub fn append_causes(head: String, error: &dyn Error) -> String {
    let mut text = head;
    let mut source = error.source();
    while let Some(cause) = source {
        source = cause.source();
        let cause = cause.to_string();
        if !cause.is_empty() && !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct Link {
        text: &'static str,
        #[source]
        source: Option<Box<Link>>,
    }

    fn chain(texts: &[&'static str]) -> Link {
        texts
            .iter()
            .rev()
            .fold(None, |source, text| {
                Some(Link {
                    text,
                    source: source.map(Box::new),
                })
            })
            .unwrap()
    }

    #[test]
    fn each_cause_is_told_once_in_order() {
        let error = chain(&["connect", "tls handshake", "certificate expired"]);
        assert_eq!(
            with_causes(&error),
            "connect: tls handshake: certificate expired"
        );
        let repeated = chain(&["transport error: refused", "refused", "", "os error 111"]);
        assert_eq!(
            with_causes(&repeated),
            "transport error: refused: os error 111"
        );
        assert_eq!(
            append_causes("hv1: unavailable".into(), &chain(&["outer", "inner"])),
            "hv1: unavailable: inner"
        );
    }
}
