//! ListInstances and ListLocations paging as the contract states it, for providers to
//! share.
//!
//! 1. **Page size.** [`page_size`] turns the request's `page_size` into a count: unset
//!    or 0 is the provider's default, anything over [`MAX_PAGE_SIZE`] is clamped (never
//!    refused).
//! 2. **Page bytes.** A page also stops before the response would pass
//!    [`MAX_RESPONSE_BYTES`], the largest message every caller must accept (gRPC's
//!    default limit): a page of 1,000 instances with maximal tags would be about
//!    36 MiB, so a page may hold fewer instances than `page_size` and still have a next
//!    page.
//! 3. **Tokens.** A token is the last id of the previous page, encoded with a checksum
//!    ([`encode_token`]); [`decode_token`] refuses anything this encoding did not make
//!    as INVALID_ARGUMENT naming `page_token`. Tokens name a position, not a snapshot,
//!    so they survive restarts of the provider, and instances created or deleted
//!    between pages neither repeat nor shift the rest.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use prost::Message;
use sha2::{Digest, Sha256};

use crate::ProviderError;
use crate::pb;

/// Instances per page when the caller sets no size (a provider may choose another).
pub const DEFAULT_PAGE_SIZE: usize = 100;
/// The largest page size a provider honours; larger requests are clamped to it.
pub const MAX_PAGE_SIZE: usize = 1000;
/// The largest response message every caller must accept (4 MiB, gRPC's default).
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
/// Room kept in a page for the token and the message's own framing.
const RESPONSE_SLACK_BYTES: usize = 4 * 1024;
/// Separates the encoded id from its checksum in a token.
const TOKEN_SEPARATOR: char = '.';
/// Hex digits of the checksum kept in a token.
const CHECKSUM_HEX_DIGITS: usize = 16;
/// Binds checksums to this use, so no other digest of an id passes as a token.
const CHECKSUM_CONTEXT: &[u8] = b"egressproxy.dev/page-token/v1\0";

/// The number of instances a page may hold for a request's `page_size`, with
/// `default` for unset or 0 and [`MAX_PAGE_SIZE`] as the cap.
pub fn page_size(requested: Option<u32>, default: usize) -> usize {
    match requested {
        None | Some(0) => default.clamp(1, MAX_PAGE_SIZE),
        Some(size) => usize::try_from(size)
            .unwrap_or(MAX_PAGE_SIZE)
            .min(MAX_PAGE_SIZE),
    }
}

/// The token of a page whose last instance is `last_id`.
pub fn encode_token(last_id: &str) -> String {
    format!(
        "{}{TOKEN_SEPARATOR}{}",
        URL_SAFE_NO_PAD.encode(last_id),
        checksum(last_id)
    )
}

/// The last id of the previous page, `None` for the first page (an empty token).
/// A token [`encode_token`] did not make is INVALID_ARGUMENT naming `page_token`.
pub fn decode_token(token: &str) -> Result<Option<String>, ProviderError> {
    if token.is_empty() {
        return Ok(None);
    }
    let foreign = || {
        ProviderError::invalid_argument(
            "page_token",
            "not a token this provider issued: pass the next_page_token of the previous \
             page unchanged, or an empty token to start again",
        )
        .with_reason("INVALID_PAGE_TOKEN")
    };
    let (encoded, sum) = token.split_once(TOKEN_SEPARATOR).ok_or_else(foreign)?;
    let id = URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(foreign)?;
    if sum != checksum(&id) {
        return Err(foreign());
    }
    Ok(Some(id))
}

fn checksum(id: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(CHECKSUM_CONTEXT);
    hash.update(id.as_bytes());
    let mut hex = String::with_capacity(CHECKSUM_HEX_DIGITS);
    for byte in &hash.finalize()[..CHECKSUM_HEX_DIGITS / 2] {
        hex.push_str(&format!("{byte:02x}"));
    }
    hex
}

/// One page of `instances` (sorted by id, already filtered by the selector) after the
/// request's token: at most `size` instances and at most [`MAX_RESPONSE_BYTES`], and
/// the token of the next page when there is one.
pub fn page(
    instances: impl IntoIterator<Item = pb::Instance>,
    page_token: &str,
    size: usize,
) -> Result<pb::ListInstancesResponse, ProviderError> {
    let (instances, next_page_token) =
        page_by(instances, |i: &pb::Instance| i.id.clone(), page_token, size)?;
    Ok(pb::ListInstancesResponse {
        instances,
        next_page_token,
    })
}

/// One page of any list the contract pages (instances, locations): `items` sorted by
/// `position`, those after the token's position, at most `size` of them and at most
/// [`MAX_RESPONSE_BYTES`] as the repeated field 1 of the response; with the token of
/// the next page, empty on the last.
pub fn page_by<T: Message>(
    items: impl IntoIterator<Item = T>,
    position: impl Fn(&T) -> String,
    page_token: &str,
    size: usize,
) -> Result<(Vec<T>, String), ProviderError> {
    let after = decode_token(page_token)?;
    let budget = MAX_RESPONSE_BYTES - RESPONSE_SLACK_BYTES;
    let mut page = Vec::new();
    let mut bytes = 0;
    let mut more = false;
    for item in items.into_iter().filter(|i| {
        after
            .as_deref()
            .is_none_or(|after| position(i).as_str() > after)
    }) {
        // Field 1, length-delimited: a tag byte, the length and the item.
        let len = item.encoded_len();
        let framed = 1 + prost::encoding::encoded_len_varint(len as u64) + len;
        if page.len() == size || (!page.is_empty() && bytes + framed > budget) {
            more = true;
            break;
        }
        bytes += framed;
        page.push(item);
    }
    let next_page_token = match page.last() {
        Some(last) if more => encode_token(&position(last)),
        _ => String::new(),
    };
    Ok((page, next_page_token))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorClass;

    fn instance(id: &str) -> pb::Instance {
        pb::Instance {
            id: id.into(),
            ..Default::default()
        }
    }

    fn ids(response: &pb::ListInstancesResponse) -> Vec<&str> {
        response.instances.iter().map(|i| i.id.as_str()).collect()
    }

    #[test]
    fn tokens_round_trip_and_anything_else_names_page_token() {
        for id in ["ref-1", "hv1/key-2", "", "é/\"x\"\n"] {
            assert_eq!(
                decode_token(&encode_token(id)).unwrap().as_deref(),
                Some(id)
            );
        }
        assert_eq!(decode_token("").unwrap(), None);
        let tampered = encode_token("ref-1").replacen('c', "d", 1);
        for foreign in [
            "ref-1",
            "py-1",
            "cycle",
            "not.a-token",
            tampered.as_str(),
            &format!("{}.{}", URL_SAFE_NO_PAD.encode("ref-2"), checksum("ref-1")),
        ] {
            let error = decode_token(foreign).unwrap_err();
            assert_eq!(error.class, ErrorClass::InvalidArgument, "{foreign}");
            assert_eq!(error.field_violations[0].field, "page_token");
        }
    }

    #[test]
    fn sizes_default_and_clamp_but_never_refuse() {
        assert_eq!(page_size(None, DEFAULT_PAGE_SIZE), DEFAULT_PAGE_SIZE);
        assert_eq!(page_size(Some(0), 7), 7);
        assert_eq!(page_size(Some(2), DEFAULT_PAGE_SIZE), 2);
        assert_eq!(page_size(Some(u32::MAX), DEFAULT_PAGE_SIZE), MAX_PAGE_SIZE);
    }

    #[test]
    fn pages_follow_ids_and_the_last_one_has_no_token() {
        let all: Vec<_> = ["a/1", "a/2", "b/1", "b/2", "c/1"]
            .into_iter()
            .map(instance)
            .collect();
        let mut token = String::new();
        let mut seen = Vec::new();
        loop {
            let page = page(all.clone(), &token, 2).unwrap();
            assert!(page.instances.len() <= 2);
            seen.extend(ids(&page).into_iter().map(str::to_owned));
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        assert_eq!(seen, ["a/1", "a/2", "b/1", "b/2", "c/1"]);
        assert_eq!(page(all.clone(), "", 5).unwrap().next_page_token, "");
        // An instance deleted between pages does not shift the rest.
        let fewer: Vec<_> = all.into_iter().filter(|i| i.id != "a/2").collect();
        let next = page(fewer, &encode_token("a/2"), 2).unwrap();
        assert_eq!(ids(&next), ["b/1", "b/2"]);
    }

    #[test]
    fn a_page_of_maximal_instances_stays_under_the_response_limit() {
        let tags: std::collections::HashMap<String, String> = (0..crate::validation::MAX_TAGS)
            .map(|n| (format!("{n:0>256}"), "v".repeat(256)))
            .collect();
        let all: Vec<pb::Instance> = (0..300)
            .map(|n| pb::Instance {
                id: format!("ref-{n:05}"),
                tags: tags.clone(),
                ..Default::default()
            })
            .collect();
        let first = page(all.clone(), "", MAX_PAGE_SIZE).unwrap();
        assert!(
            first.encoded_len() <= MAX_RESPONSE_BYTES,
            "{}",
            first.encoded_len()
        );
        assert!(first.instances.len() < 300 && !first.next_page_token.is_empty());
        let second = page(all, &first.next_page_token, MAX_PAGE_SIZE).unwrap();
        assert_eq!(
            second.instances[0].id,
            format!("ref-{:05}", first.instances.len())
        );
    }
}
