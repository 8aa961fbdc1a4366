//! The user-data MIME multipart: what cloud-init's `UserDataProcessor` splits back into
//! the user's document and the bootstrap.
//!
//! Each part keeps its bytes exactly:
//! - a body of printable ASCII with LF line ends goes in as it is (readable with
//!   `isoinfo`); anything else (CRLF, UTF-8, gzip) is base64-encoded, because Python's
//!   e-mail parser, which cloud-init uses, re-encodes non-ASCII text of an unencoded part
//!   as Latin-1 and so would change it;
//! - the line break written after a body belongs to the boundary line that follows (RFC
//!   2046), so a document without a final newline still has none when cloud-init reads it;
//! - a document with its own MIME headers (the user's own multipart) is nested as it is:
//!   cloud-init walks nested multiparts part by part;
//! - the boundary is derived from the content and never occurs in it.

use std::borrow::Cow;

use base64::Engine;
use sha2::{Digest, Sha256};

/// One part of the multipart.
#[derive(Debug, Clone)]
pub(super) enum Part<'a> {
    /// A document that brings its own MIME headers.
    Nested(Cow<'a, [u8]>),
    /// A body under headers written here.
    Body {
        /// `Content-Type`, as cloud-init would name the body's type.
        content_type: &'static str,
        /// `X-Merge-Type`: how cloud-init merges a cloud-config body.
        merge_type: Option<&'static str>,
        /// The file name cloud-init gives the part (else `part-NNN`).
        file_name: Option<&'static str>,
        /// The bytes, exactly as cloud-init must see them.
        body: Cow<'a, [u8]>,
    },
}

impl Part<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Part::Nested(document) => document,
            Part::Body { body, .. } => body,
        }
    }
}

/// The multipart of `parts`, in order.
pub(super) fn build(parts: &[Part<'_>]) -> Vec<u8> {
    let boundary = boundary(parts);
    let mut out =
        format!("Content-Type: multipart/mixed; boundary=\"{boundary}\"\nMIME-Version: 1.0\n")
            .into_bytes();
    for part in parts {
        out.extend_from_slice(format!("\n--{boundary}\n").as_bytes());
        match part {
            Part::Nested(document) => out.extend_from_slice(document),
            Part::Body {
                content_type,
                merge_type,
                file_name,
                body,
            } => {
                let plain = is_plain_text(body);
                out.extend_from_slice(format!("Content-Type: {content_type}\n").as_bytes());
                out.extend_from_slice(b"MIME-Version: 1.0\n");
                if let Some(merge_type) = merge_type {
                    out.extend_from_slice(format!("X-Merge-Type: {merge_type}\n").as_bytes());
                }
                if let Some(name) = file_name {
                    out.extend_from_slice(
                        format!("Content-Disposition: attachment; filename=\"{name}\"\n")
                            .as_bytes(),
                    );
                }
                let encoding = if plain { "7bit" } else { "base64" };
                out.extend_from_slice(
                    format!("Content-Transfer-Encoding: {encoding}\n\n").as_bytes(),
                );
                if plain {
                    out.extend_from_slice(body);
                } else {
                    out.extend_from_slice(base64_lines(body).as_bytes());
                }
            }
        }
    }
    out.extend_from_slice(format!("\n--{boundary}--\n").as_bytes());
    out
}

/// Printable ASCII, tabs and LF line ends only: safe in an unencoded part.
fn is_plain_text(body: &[u8]) -> bool {
    body.iter()
        .all(|&b| b == b'\n' || b == b'\t' || (b' '..=b'~').contains(&b))
}

/// Base64 in lines of 76 characters, as MIME asks.
fn base64_lines(body: &[u8]) -> String {
    let encoded = base64::engine::general_purpose::STANDARD.encode(body);
    let lines: Vec<&str> = encoded
        .as_bytes()
        .chunks(76)
        .map(|line| std::str::from_utf8(line).expect("base64 is ASCII"))
        .collect();
    lines.join("\n")
}

/// A boundary that occurs in no part. Derived from the content, so the same documents
/// always give the same seed.
fn boundary(parts: &[Part<'_>]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.bytes().len() as u64).to_be_bytes());
        hash.update(part.bytes());
    }
    let mut digest = hash.finalize();
    loop {
        let hex = hex::encode(&digest[..12]);
        let boundary = format!("==egressproxy-{hex}==");
        let occurs = parts.iter().any(|part| {
            part.bytes()
                .windows(boundary.len())
                .any(|w| w == boundary.as_bytes())
        });
        if !occurs {
            return boundary;
        }
        digest = Sha256::digest(digest);
    }
}
