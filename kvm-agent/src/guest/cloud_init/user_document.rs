//! The caller's document as cloud-init reads it: decompressed when it is gzip, a MIME
//! document when cloud-init would parse it as one, else typed by its first line.
//!
//! The rules are cloud-init's own (22.4, `user_data.convert_string` and
//! `handlers.type_from_starts_with`), so that the part the agent labels is the part
//! cloud-init would have found:
//! 1. gzip (magic `1f 8b`) is decompressed; a stream that does not decompress is read
//!    as it is;
//! 2. `mime-version:` (any case) in the first 4096 bytes makes it a MIME document;
//! 3. else the first non-blank characters, in any case, give its type (`#cloud-config`,
//!    `#!`, `## template: jinja`, `#include`, ...); without one it stays untyped
//!    (`text/x-not-multipart`) and cloud-init warns and ignores it, as it would anyway.

use std::borrow::Cow;
use std::io::Read;

use egressproxy_provider::validation::MAX_USER_DATA_BYTES;

use super::cloud_config;
use super::document_facts::DocumentFacts;
use super::invalid;
use super::multipart::Part;
use crate::guest::GuestError;

/// Decompressed user-data may be this much larger than the limit on what is sent.
const MAX_DECOMPRESSED_BYTES: usize = 16 * MAX_USER_DATA_BYTES;

/// cloud-init's prefixes and the content types they stand for, longest first so that
/// `#cloud-config-archive` is not taken for `#cloud-config`.
const TYPES_BY_PREFIX: [(&str, &str); 12] = [
    (
        "text/x-shellscript-per-instance",
        "text/x-shellscript-per-instance",
    ),
    ("text/x-shellscript-per-boot", "text/x-shellscript-per-boot"),
    ("text/x-shellscript-per-once", "text/x-shellscript-per-once"),
    ("#cloud-config-archive", "text/cloud-config-archive"),
    ("#cloud-config-jsonp", "text/cloud-config-jsonp"),
    ("## template: jinja", "text/jinja2"),
    ("#cloud-boothook", "text/cloud-boothook"),
    ("#include-once", "text/x-include-once-url"),
    ("#part-handler", "text/part-handler"),
    ("#cloud-config", "text/cloud-config"),
    ("#include", "text/x-include-url"),
    ("#!", "text/x-shellscript"),
];
/// Types whose configuration is known only in the guest: rendered, fetched or unpacked.
const GIVES_CONFIG: [&str; 5] = [
    "text/jinja2",
    "text/x-include-url",
    "text/x-include-once-url",
    "text/cloud-config-archive",
    "text/cloud-config-jsonp",
];
/// What cloud-init calls a document of no known type.
const UNTYPED: &str = "text/x-not-multipart";
const CLOUD_CONFIG: &str = "text/cloud-config";

/// A user-data or vendor-data document, read as cloud-init reads it.
#[derive(Debug)]
pub(super) struct UserDocument<'a> {
    raw: &'a [u8],
    /// `raw`, or what it decompresses to.
    content: Cow<'a, [u8]>,
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Nothing but whitespace: cloud-init has nothing to do.
    Blank,
    /// A MIME document with its own headers and parts.
    Mime,
    /// A single document of this content type.
    Typed(&'static str),
}

impl<'a> UserDocument<'a> {
    /// Reads `raw`; only a gzip stream that decompresses to too much is an error.
    pub(super) fn read(raw: &'a [u8], field: &str) -> Result<Self, GuestError> {
        let content = match gunzip(raw) {
            Some(Ok(content)) => Cow::Owned(content),
            Some(Err(TooLarge)) => {
                return Err(invalid(
                    field,
                    format!(
                        "the gzip data decompresses to more than {MAX_DECOMPRESSED_BYTES} bytes"
                    ),
                ));
            }
            None => Cow::Borrowed(raw),
        };
        let head = &content[..content.len().min(4096)];
        let kind = if content.iter().all(u8::is_ascii_whitespace) {
            Kind::Blank
        } else if head
            .to_ascii_lowercase()
            .windows(b"mime-version:".len())
            .any(|w| w == b"mime-version:")
        {
            Kind::Mime
        } else {
            Kind::Typed(type_from_starts_with(&content))
        };
        Ok(UserDocument { raw, content, kind })
    }

    /// Nothing but whitespace.
    pub(super) fn is_blank(&self) -> bool {
        self.kind == Kind::Blank
    }

    /// Checks a `#cloud-config` (see [`cloud_config::check`]) and tells what the
    /// document does. Scripts, boot hooks and part handlers give cloud-init no
    /// configuration; what jinja, `#include`, MIME and `#cloud-config-archive` documents
    /// give is known only once the guest renders, fetches or unpacks them.
    pub(super) fn check(&self, field: &str) -> Result<DocumentFacts, GuestError> {
        match self.kind {
            Kind::Blank => Ok(DocumentFacts::NO_CONFIG),
            Kind::Mime => Ok(DocumentFacts::UNKNOWN),
            Kind::Typed(CLOUD_CONFIG) => match std::str::from_utf8(&self.content) {
                Ok(text) => cloud_config::check(text, field),
                // Unreachable: only UTF-8 is typed as a cloud-config, like cloud-init does.
                Err(_) => Ok(DocumentFacts::NO_CONFIG),
            },
            Kind::Typed(content_type) if GIVES_CONFIG.contains(&content_type) => {
                Ok(DocumentFacts::UNKNOWN)
            }
            Kind::Typed(_) => Ok(DocumentFacts::NO_CONFIG),
        }
    }

    /// The document as the caller sent it.
    pub(super) fn raw(&self) -> &'a [u8] {
        self.raw
    }

    /// The document as the first part of the multipart, typed as cloud-init types it.
    pub(super) fn part(&self) -> Part<'_> {
        let compressed = !matches!(self.content, Cow::Borrowed(_));
        match self.kind {
            // A MIME document nested in a gzip part would be typed by its first line,
            // which is a header: cloud-init would drop it. Nested decompressed, each of
            // its parts is read.
            Kind::Mime => Part::Nested(Cow::Borrowed(&self.content)),
            _ if compressed => Part::Body {
                content_type: "application/x-gzip",
                merge_type: None,
                file_name: None,
                body: Cow::Borrowed(self.raw),
            },
            Kind::Typed(content_type) => Part::Body {
                content_type,
                merge_type: None,
                file_name: None,
                body: Cow::Borrowed(self.raw),
            },
            Kind::Blank => Part::Body {
                content_type: UNTYPED,
                merge_type: None,
                file_name: None,
                body: Cow::Borrowed(self.raw),
            },
        }
    }
}

struct TooLarge;

/// The decompressed content of a gzip stream; `None` when `raw` is not one.
fn gunzip(raw: &[u8]) -> Option<Result<Vec<u8>, TooLarge>> {
    if !raw.starts_with(&[0x1f, 0x8b]) {
        return None;
    }
    let mut content = Vec::new();
    let limit = MAX_DECOMPRESSED_BYTES as u64 + 1;
    match flate2::read::MultiGzDecoder::new(raw)
        .take(limit)
        .read_to_end(&mut content)
    {
        Ok(_) if content.len() > MAX_DECOMPRESSED_BYTES => Some(Err(TooLarge)),
        Ok(_) => Some(Ok(content)),
        // cloud-init, too, reads a stream that does not decompress as it is.
        Err(_) => None,
    }
}

/// The content type cloud-init gives a document from its first characters.
fn type_from_starts_with(content: &[u8]) -> &'static str {
    let Ok(text) = std::str::from_utf8(content) else {
        return UNTYPED;
    };
    let head: String = text
        .trim_start()
        .chars()
        .take(40)
        .flat_map(char::to_lowercase)
        .collect();
    TYPES_BY_PREFIX
        .iter()
        .find(|(prefix, _)| head.starts_with(prefix))
        .map_or(UNTYPED, |(_, content_type)| content_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_found_as_cloud_init_finds_them() {
        for (document, want) in [
            (&b"#cloud-config\n"[..], "text/cloud-config"),
            (b"  #Cloud-Config\n", "text/cloud-config"),
            (b"#cloud-config-archive\n", "text/cloud-config-archive"),
            (b"#cloud-config-jsonp\n", "text/cloud-config-jsonp"),
            (b"## template: jinja\n", "text/jinja2"),
            (b"#!/bin/sh\n", "text/x-shellscript"),
            (b"#include-once\n", "text/x-include-once-url"),
            (b"#include\n", "text/x-include-url"),
            (b"hello\n", UNTYPED),
            (b"#cloud-config\n\xff", UNTYPED),
        ] {
            assert_eq!(type_from_starts_with(document), want, "{document:?}");
        }
    }

    #[test]
    fn mime_is_recognised_anywhere_in_the_first_4096_bytes() {
        let doc =
            UserDocument::read(b"Content-Type: text/plain\nMiMe-VeRsIoN: 1.0\n\nx", "f").unwrap();
        assert_eq!(doc.kind, Kind::Mime);
        let mut late = vec![b'#'; 4096];
        late.extend_from_slice(b"\nMIME-Version: 1.0\n");
        let doc = UserDocument::read(&late, "f").unwrap();
        assert_eq!(doc.kind, Kind::Typed(UNTYPED));
    }

    #[test]
    fn a_stream_that_is_not_gzip_after_all_is_read_as_it_is() {
        let doc = UserDocument::read(b"\x1f\x8bnot gzip", "f").unwrap();
        assert_eq!(doc.kind, Kind::Typed(UNTYPED));
        assert!(matches!(doc.content, Cow::Borrowed(_)));
    }
}
