//! UpdateInstanceTags (contract 1.5.0, CAPABILITY_UPDATE_TAGS): compare-and-set of an
//! instance's tags.
//!
//! 1. **Check** the request (`check_update_tags_request`): every problem at once as
//!    INVALID_ARGUMENT naming its field: an empty `id` and `expected_tags` or `tags`
//!    past the contract's tag limits (the contract crate's own check); a `tags` entry libvirt's XML cannot keep unchanged (as
//!    Create refuses it). An `expected_tags` entry no stored tag can have just never
//!    matches (TAGS_CHANGED).
//! 2. **Resolve** the id as Get does: one this provider cannot have made
//!    (not `<host>/<key>`) or whose domain is missing is NOT_FOUND.
//! 3. **Lock** the key, the lock every Create and Delete of the key in this agent takes,
//!    whatever host the id names: a concurrent Delete either ran first (NOT_FOUND) or
//!    runs after and deletes the instance with its new tags, and of concurrent updates
//!    each compares what the one before it wrote.
//! 4. **Compare and set** on the host ([`crate::libvirt::tags`]): equal to the new
//!    tags already, OK with nothing written; equal to `expected_tags`, written to the
//!    domain's running and persistent definitions; otherwise FAILED_PRECONDITION
//!    TAGS_CHANGED, nothing written. The answer is the instance as Get reads it.
//! 5. **Tell** WatchInstances' hub the answer at once (UPDATED), as Create does.
//!
//! The agent never answers INSTANCE_DELETING: its Delete runs to its end under the key's
//! lock, so no instance of it is ever seen DELETING.

use std::collections::BTreeMap;

use egressproxy_provider::pb;
use egressproxy_provider::validation::{self, map_entry_path};

use crate::error::Error;
use crate::libvirt::xml::metadata::check_xml_safe;

/// The request's tag maps, checked and ordered as the metadata stores them:
/// `(expected_tags, tags)`.
pub(crate) type CheckedTags = (BTreeMap<String, String>, BTreeMap<String, String>);

/// Step 1 of the module docs: the contract's checks (the crate's, as every provider
/// words them), then the agent's own on what libvirt's XML can keep.
pub(crate) fn check_update_tags_request(
    request: &pb::UpdateInstanceTagsRequest,
) -> Result<CheckedTags, Error> {
    let mut violations: Vec<(String, String)> = match validation::check_update_tags_request(request)
    {
        Ok(()) => Vec::new(),
        Err(error) => error
            .field_violations
            .into_iter()
            .map(|v| (v.field, v.description))
            .collect(),
    };
    let expected = ordered(&request.expected_tags);
    let tags = ordered(&request.tags);
    for (key, value) in &tags {
        if let Err(e) = check_xml_safe(key).and_then(|()| check_xml_safe(value)) {
            violations.push((map_entry_path("tags", key), e.to_string()));
        }
    }
    if violations.is_empty() {
        Ok((expected, tags))
    } else {
        Err(Error::InvalidFields { violations })
    }
}

fn ordered(tags: &std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    tags.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use egressproxy_provider::validation::{MAX_TAG_BYTES, MAX_TAGS};

    fn request(
        id: &str,
        expected: &[(&str, &str)],
        tags: &[(&str, &str)],
    ) -> pb::UpdateInstanceTagsRequest {
        let map = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        pb::UpdateInstanceTagsRequest {
            id: id.to_owned(),
            expected_tags: map(expected),
            tags: map(tags),
        }
    }

    fn fields(error: Error) -> Vec<String> {
        match error {
            Error::InvalidFields { violations } => violations.into_iter().map(|(f, _)| f).collect(),
            other => panic!("not InvalidFields: {other}"),
        }
    }

    #[test]
    fn every_bad_field_is_named_at_once() {
        let long = "k".repeat(MAX_TAG_BYTES + 1);
        let error = check_update_tags_request(&request(
            "",
            &[("", "v")],
            &[("owner", "tab\there"), (&long, "v")],
        ))
        .unwrap_err();
        let named = fields(error);
        assert_eq!(named[0], "id");
        assert!(
            named.contains(&r#"expected_tags[""]"#.to_owned()),
            "{named:?}"
        );
        assert!(named.contains(&r#"tags["owner"]"#.to_owned()), "{named:?}");
        assert!(
            named
                .iter()
                .any(|f| f.starts_with("tags[\"kkk") && f.contains("bytes")),
            "{named:?}"
        );
    }

    #[test]
    fn too_many_tags_names_the_map() {
        let many: Vec<(String, String)> = (0..=MAX_TAGS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        let pairs: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let named = fields(check_update_tags_request(&request("hv/k", &[], &pairs)).unwrap_err());
        assert_eq!(named, ["tags"]);
    }

    #[test]
    fn empty_maps_are_valid_and_come_back_ordered() {
        let (expected, tags) =
            check_update_tags_request(&request("hv/k", &[], &[("b", "2"), ("a", "1")])).unwrap();
        assert!(expected.is_empty());
        assert_eq!(tags.keys().collect::<Vec<_>>(), ["a", "b"]);
    }
}
