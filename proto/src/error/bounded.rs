//! Bounds on the text an error carries on the wire.
//!
//! Error messages and field violations often echo the caller's input (an id, a tag
//! key, a host name). Unbounded, a 4,000-character id makes the status larger than
//! the 16 KiB of metadata C-core clients (Python, C++) accept, and they report
//! RESOURCE_EXHAUSTED instead of the real error, which the contract tells them to
//! retry. So, when a status is encoded:
//! 1. every word (a run without whitespace) longer than [`MAX_ECHO_CHARS`] is cut to
//!    that length and marked `…(N bytes)`, so the sentence around it stays readable;
//! 2. the message is then cut to [`MAX_MESSAGE_BYTES`], a field violation's
//!    description to [`MAX_DESCRIPTION_BYTES`];
//! 3. a field violation's field path is sent whole up to [`MAX_FIELD_PATH_BYTES`] (a
//!    path naming a map entry within the map's limits always fits, so it names the
//!    entry exactly; `validation::map_entry_path` already cuts a key over the limit);
//!    a longer path is bounded like a description;
//! 4. at most [`MAX_VIOLATIONS`] field violations are sent, and fewer when the encoded
//!    details would pass [`MAX_DETAILS_BYTES`]; the message says how many more there
//!    were.

/// Longest word of caller input echoed in full.
pub const MAX_ECHO_CHARS: usize = 128;
/// Largest error message sent, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// Largest field violation description sent, in bytes.
pub const MAX_DESCRIPTION_BYTES: usize = 512;
/// Most field violations sent in one error.
pub const MAX_VIOLATIONS: usize = 10;
/// Longest field path sent whole, in bytes.
pub const MAX_FIELD_PATH_BYTES: usize = 1024;
/// Largest encoded `google.rpc.Status` sent in `grpc-status-details-bin`, in bytes.
/// Base64 makes it a third larger: with the message, the trailers stay under the
/// 16 KiB of metadata C-core clients accept.
pub const MAX_DETAILS_BYTES: usize = 8 * 1024;

/// A field path as sent: whole up to [`MAX_FIELD_PATH_BYTES`], bounded beyond.
pub(crate) fn field_path(path: &str) -> String {
    if path.len() <= MAX_FIELD_PATH_BYTES {
        path.to_owned()
    } else {
        bound(path, MAX_DESCRIPTION_BYTES)
    }
}

/// One word cut to [`MAX_ECHO_CHARS`] characters and marked, when longer.
pub(crate) fn cut_word(word: &str) -> String {
    let mut out = String::new();
    push_word(&mut out, word);
    out
}

/// `text` with long words shortened and the whole cut to `max_bytes`.
pub(crate) fn bound(text: &str, max_bytes: usize) -> String {
    let mut bounded = String::with_capacity(text.len().min(max_bytes + 32));
    let mut word = String::new();
    for c in text.chars() {
        if c.is_whitespace() {
            push_word(&mut bounded, &word);
            word.clear();
            bounded.push(c);
        } else {
            word.push(c);
        }
    }
    push_word(&mut bounded, &word);
    cut(&bounded, max_bytes)
}

fn push_word(out: &mut String, word: &str) {
    match word.char_indices().nth(MAX_ECHO_CHARS) {
        None => out.push_str(word),
        Some((end, _)) => {
            out.push_str(&word[..end]);
            out.push_str(&marker(word.len()));
        }
    }
}

fn cut(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_owned();
    }
    let marker = marker(text.len());
    let mut end = max_bytes.saturating_sub(marker.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{marker}", &text[..end])
}

fn marker(len: usize) -> String {
    format!("…({len} bytes)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_word_is_cut_and_the_sentence_around_it_stays() {
        let id = "x".repeat(4000);
        let text = bound(&format!("instance {id} does not exist"), MAX_MESSAGE_BYTES);
        assert_eq!(
            text,
            format!("instance {}…(4000 bytes) does not exist", "x".repeat(128))
        );
    }

    #[test]
    fn short_text_is_unchanged_whitespace_included() {
        let text = "placement.image: unknown image \"x\"\n\tuse debian-12";
        assert_eq!(bound(text, MAX_MESSAGE_BYTES), text);
    }

    #[test]
    fn many_words_are_cut_to_the_byte_limit_on_a_char_boundary() {
        let text = "é ".repeat(2000);
        let bounded = bound(&text, MAX_MESSAGE_BYTES);
        assert!(bounded.len() <= MAX_MESSAGE_BYTES, "{}", bounded.len());
        assert!(bounded.ends_with("…(6000 bytes)"), "{bounded}");
    }

    #[test]
    fn multibyte_words_are_cut_by_characters() {
        let word = "é".repeat(200);
        let bounded = bound(&word, MAX_MESSAGE_BYTES);
        assert_eq!(bounded, format!("{}…(400 bytes)", "é".repeat(128)));
    }
}
