//! Request checks every provider applies the same way, so callers see one set of
//! limits and field names whatever the infrastructure. Each check collects every
//! violation, so a user fixes a request in one round.
//!
//! The limits are the contract's (`provider.proto`, the limits table in
//! `docs/contract.md`): a provider accepts every value within them, and answers one
//! past them with INVALID_ARGUMENT naming the field. A map entry is named by
//! [`map_entry_path`].

use crate::ProviderError;
use crate::error::bounded;
use crate::pb;

/// Largest accepted `cloud_init.user_data` (and `vendor_data`), in bytes.
pub const MAX_USER_DATA_BYTES: usize = 64 * 1024;
/// Longest accepted idempotency key.
pub const MAX_KEY_LEN: usize = 128;
/// Largest accepted tag key or value, in bytes.
pub const MAX_TAG_BYTES: usize = 256;
/// Most tags on one instance (and entries in a tag selector).
pub const MAX_TAGS: usize = 64;
/// The default limit of a string field without a limit of its own, in bytes (CSI's).
pub const MAX_STRING_BYTES: usize = 128;
/// Largest accepted `name`, in bytes (`namespace/name` of a Kubernetes object fits).
pub const MAX_NAME_BYTES: usize = 512;
/// Largest accepted `placement.host`, in bytes (a DNS name fits).
pub const MAX_HOST_BYTES: usize = 256;
/// Largest instance id a provider returns, in bytes; a longer one names no instance.
pub const MAX_ID_BYTES: usize = 512;
/// The `page_size` callers ask for: every provider honours it (a page may still hold
/// fewer instances, to stay under 4 MiB).
pub const FULL_PAGE_SIZE: u32 = 1000;
/// Most pages a caller walks for one listing. A provider fits every listing into this
/// many pages; a walk that goes on past it is a provider bug, and the caller stops it
/// with an error rather than looping with ever more memory.
pub const MAX_LIST_PAGES: usize = 1000;
/// Longest address text: `Address.address` and `requested_address`.
pub const MAX_ADDRESS_BYTES: usize = 64;

#[derive(Default)]
struct Violations(Vec<(String, String)>);

impl Violations {
    fn add(&mut self, field: impl Into<String>, description: impl Into<String>) {
        self.0.push((field.into(), description.into()));
    }

    fn into_result(self) -> Result<(), ProviderError> {
        let mut violations = self.0.into_iter();
        let Some((field, description)) = violations.next() else {
            return Ok(());
        };
        let mut error = ProviderError::invalid_argument(field, description);
        for (field, description) in violations {
            error = error.with_violation(field, description);
        }
        let summary: Vec<String> = error
            .field_violations
            .iter()
            .map(|v| format!("{}: {}", v.field, v.description))
            .collect();
        error.message = format!("invalid request: {}", summary.join("; "));
        Err(error)
    }
}

/// Checks the fields of a CreateInstance request that do not depend on the provider's
/// configuration (which names are valid hosts, machine types and images).
pub fn check_create_request(request: &pb::CreateInstanceRequest) -> Result<(), ProviderError> {
    let mut violations = Violations::default();
    check_key(&request.key, &mut violations);
    if request.name.len() > MAX_NAME_BYTES {
        violations.add(
            "name",
            format!(
                "{} bytes is over the {MAX_NAME_BYTES}-byte limit",
                request.name.len()
            ),
        );
    }
    check_tags("tags", &request.tags, &mut violations);
    match &request.placement {
        None => violations.add("placement", "required: set machine_type and image"),
        Some(placement) => check_placement(placement, &mut violations),
    }
    if let Some(cloud_init) = &request.cloud_init {
        if cloud_init.user_data.len() > MAX_USER_DATA_BYTES {
            violations.add(
                "cloud_init.user_data",
                format!(
                    "{} bytes is over the {MAX_USER_DATA_BYTES}-byte limit: move large files to the image or fetch them at boot",
                    cloud_init.user_data.len()
                ),
            );
        }
        if cloud_init
            .vendor_data
            .as_ref()
            .is_some_and(|v| v.len() > MAX_USER_DATA_BYTES)
        {
            violations.add(
                "cloud_init.vendor_data",
                format!("over the {MAX_USER_DATA_BYTES}-byte limit"),
            );
        }
    }
    if !(1..=65535).contains(&request.proxy_port) {
        violations.add(
            "proxy_port",
            format!("{} is not a TCP port: use 1 to 65535", request.proxy_port),
        );
    }
    check_address_request(request, &mut violations);
    violations.into_result()
}

/// `address_identity` is a key-like name; `requested_address` an address a host can
/// hold, given with an identity.
fn check_address_request(request: &pb::CreateInstanceRequest, violations: &mut Violations) {
    if let Some(identity) = &request.address_identity
        && !is_valid_key(identity)
    {
        violations.add(
            "address_identity",
            format!("must be 1 to {MAX_KEY_LEN} characters of [A-Za-z0-9._-]"),
        );
    }
    let Some(requested) = &request.requested_address else {
        return;
    };
    if let Err(reason) = parse_requested_address(requested) {
        violations.add("requested_address", reason);
    } else if request.address_identity.is_none() {
        violations.add(
            "requested_address",
            "needs address_identity: an address is held by an identity; set one (such \
             as the Proxy's UID)",
        );
    }
}

/// `text` as an address an instance can be asked to hold: an IP address in its textual
/// form, at most [`MAX_ADDRESS_BYTES`], not loopback, link-local, multicast,
/// unspecified or broadcast. The error says what is wrong, echoing `text` bounded.
pub fn parse_requested_address(text: &str) -> Result<std::net::IpAddr, String> {
    use std::net::IpAddr;
    if text.len() > MAX_ADDRESS_BYTES {
        return Err(format!(
            "{} bytes is over the {MAX_ADDRESS_BYTES}-byte limit",
            text.len()
        ));
    }
    let address: IpAddr = text.parse().map_err(|_| {
        format!(
            "{:?} is not an IP address (192.0.2.10, 2001:db8::10)",
            bounded::cut_word(text)
        )
    })?;
    let unusable = address.is_loopback()
        || address.is_unspecified()
        || address.is_multicast()
        || match address {
            IpAddr::V4(v4) => v4.is_link_local() || v4.is_broadcast(),
            IpAddr::V6(v6) => v6.is_unicast_link_local(),
        };
    if unusable {
        return Err(format!(
            "{address} is a loopback, link-local, multicast, unspecified or broadcast \
             address: no instance can hold it"
        ));
    }
    Ok(address)
}

/// Checks a ListInstances request: the selector's size and entries (the page token is
/// the provider's to check, see [`crate::paging`]).
pub fn check_list_request(request: &pb::ListInstancesRequest) -> Result<(), ProviderError> {
    let mut violations = Violations::default();
    check_tags("tag_selector", &request.tag_selector, &mut violations);
    violations.into_result()
}

/// Checks an UpdateInstanceTags request: the id is given, and `expected_tags` and
/// `tags` are within the limits of tags (each violation named by its map entry).
pub fn check_update_tags_request(
    request: &pb::UpdateInstanceTagsRequest,
) -> Result<(), ProviderError> {
    let mut violations = Violations::default();
    if request.id.is_empty() {
        violations.add("id", "required: the id CreateInstance returned");
    }
    check_tags("expected_tags", &request.expected_tags, &mut violations);
    check_tags("tags", &request.tags, &mut violations);
    violations.into_result()
}

/// The field path of entry `key` of map field `map`: `tags["egressproxy.dev/uid"]`,
/// with exactly `"` and `\` escaped by a backslash and every other character as it is.
/// A key within the map's limit ([`MAX_TAG_BYTES`]) is written whole, so the path names
/// the entry exactly; a longer one is cut to its first 128 characters and marked
/// `…(N bytes)` inside the quotes, like any echoed value.
pub fn map_entry_path(map: &str, key: &str) -> String {
    let shown = if key.len() <= MAX_TAG_BYTES {
        key.to_owned()
    } else {
        bounded::cut_word(key)
    };
    let mut path = String::with_capacity(map.len() + shown.len() + 4);
    path.push_str(map);
    path.push_str("[\"");
    for c in shown.chars() {
        if matches!(c, '"' | '\\') {
            path.push('\\');
        }
        path.push(c);
    }
    path.push_str("\"]");
    path
}

fn check_tags(
    field: &str,
    tags: &std::collections::HashMap<String, String>,
    violations: &mut Violations,
) {
    if tags.len() > MAX_TAGS {
        violations.add(
            field,
            format!("at most {MAX_TAGS} entries, got {}", tags.len()),
        );
    }
    let mut keys: Vec<&String> = tags.keys().collect();
    keys.sort();
    for key in keys {
        let value = &tags[key];
        if key.is_empty() || key.len() > MAX_TAG_BYTES || value.len() > MAX_TAG_BYTES {
            violations.add(
                map_entry_path(field, key),
                format!(
                    "keys must be 1 to {MAX_TAG_BYTES} bytes and values at most {MAX_TAG_BYTES} \
                     (this key is {} bytes, its value {})",
                    key.len(),
                    value.len()
                ),
            );
        }
    }
}

/// Checks that a placement names a machine type and an image.
pub fn check_placement_request(placement: Option<&pb::Placement>) -> Result<(), ProviderError> {
    let mut violations = Violations::default();
    match placement {
        None => violations.add("placement", "required: set machine_type and image"),
        Some(placement) => check_placement(placement, &mut violations),
    }
    violations.into_result()
}

/// Checks that an instance id was given.
pub fn check_id(id: &str) -> Result<(), ProviderError> {
    if id.is_empty() {
        return Err(ProviderError::invalid_argument(
            "id",
            "required: the id CreateInstance returned",
        ));
    }
    Ok(())
}

/// Whether `key` is a valid idempotency key: 1 to [`MAX_KEY_LEN`] characters of
/// `[A-Za-z0-9._-]`, nothing else (no whitespace, no line end).
pub fn is_valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn check_key(key: &str, violations: &mut Violations) {
    if !is_valid_key(key) {
        violations.add(
            "key",
            format!("must be 1 to {MAX_KEY_LEN} characters of [A-Za-z0-9._-]"),
        );
    }
}

fn check_placement(placement: &pb::Placement, violations: &mut Violations) {
    use pb::placement::Location;
    if placement.machine_type.is_empty() {
        violations.add("placement.machine_type", "required");
    }
    if placement.image.is_empty() {
        violations.add("placement.image", "required");
    }
    match &placement.location {
        Some(Location::Host(host)) if host.is_empty() => violations.add(
            "placement.host",
            "empty: name a host or leave the location unset",
        ),
        Some(Location::Zone(zone)) if zone.is_empty() => violations.add(
            "placement.zone",
            "empty: name a zone or leave the location unset",
        ),
        _ => {}
    }
    let mut limit = |field: &str, value: &str, max: usize| {
        if value.len() > max {
            violations.add(
                field,
                format!("{} bytes is over the {max}-byte limit", value.len()),
            );
        }
    };
    match &placement.location {
        Some(Location::Host(host)) => limit("placement.host", host, MAX_HOST_BYTES),
        Some(Location::Zone(zone)) => limit("placement.zone", zone, MAX_STRING_BYTES),
        None => {}
    }
    limit(
        "placement.machine_type",
        &placement.machine_type,
        MAX_STRING_BYTES,
    );
    limit("placement.image", &placement.image, MAX_STRING_BYTES);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> pb::CreateInstanceRequest {
        pb::CreateInstanceRequest {
            key: "4f1c2d3e-uid".into(),
            name: "default/egress".into(),
            tags: [("cluster".to_string(), "dev".to_string())].into(),
            placement: Some(pb::Placement {
                location: Some(pb::placement::Location::Host("hv1".into())),
                machine_type: "small".into(),
                image: "debian-12".into(),
            }),
            cloud_init: Some(pb::CloudInit {
                user_data: b"#cloud-config\n".to_vec(),
                vendor_data: None,
            }),
            proxy_port: 3128,
            ..Default::default()
        }
    }

    fn fields(result: Result<(), ProviderError>) -> Vec<String> {
        result
            .unwrap_err()
            .field_violations
            .into_iter()
            .map(|v| v.field)
            .collect()
    }

    #[test]
    fn a_complete_request_passes() {
        check_create_request(&valid()).unwrap();
    }

    #[test]
    fn every_bad_field_is_reported_at_once() {
        let mut request = valid();
        request.key = "has space".into();
        request.proxy_port = 0;
        request.placement.as_mut().unwrap().image.clear();
        request.cloud_init.as_mut().unwrap().user_data = vec![b'a'; MAX_USER_DATA_BYTES + 1];
        assert_eq!(
            fields(check_create_request(&request)),
            [
                "key",
                "placement.image",
                "cloud_init.user_data",
                "proxy_port"
            ]
        );
    }

    #[test]
    fn an_update_of_tags_names_the_id_and_each_bad_entry_of_both_maps() {
        let valid = pb::UpdateInstanceTagsRequest {
            id: "ref-1".into(),
            expected_tags: [("pool".to_string(), "spares".to_string())].into(),
            tags: std::collections::HashMap::new(),
        };
        check_update_tags_request(&valid).unwrap();
        let request = pb::UpdateInstanceTagsRequest {
            id: String::new(),
            expected_tags: [(String::new(), "v".to_string())].into(),
            tags: [("k".to_string(), "v".repeat(MAX_TAG_BYTES + 1))].into(),
        };
        assert_eq!(
            fields(check_update_tags_request(&request)),
            ["id", "expected_tags[\"\"]", "tags[\"k\"]"]
        );
    }

    #[test]
    fn missing_placement_and_empty_host_are_named() {
        let mut request = valid();
        request.placement = None;
        assert_eq!(fields(check_create_request(&request)), ["placement"]);
        let placement = pb::Placement {
            location: Some(pb::placement::Location::Host(String::new())),
            machine_type: "small".into(),
            image: "x".into(),
        };
        assert_eq!(
            fields(check_placement_request(Some(&placement))),
            ["placement.host"]
        );
    }

    #[test]
    fn debug_output_never_shows_cloud_init_content() {
        let mut request = valid();
        request.cloud_init.as_mut().unwrap().user_data =
            b"#cloud-config\npassword: hunter2\n".to_vec();
        let debug = format!("{request:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("32 bytes redacted"), "{debug}");
    }

    #[test]
    fn map_entry_paths_escape_only_quotes_and_backslashes_and_name_the_entry_whole() {
        assert_eq!(
            map_entry_path("tags", "egressproxy.dev/uid"),
            r#"tags["egressproxy.dev/uid"]"#
        );
        assert_eq!(
            map_entry_path("tags", "a\"b\\c\td\né\0"),
            "tags[\"a\\\"b\\\\c\td\né\0\"]"
        );
        let longest = "k".repeat(MAX_TAG_BYTES);
        assert_eq!(
            map_entry_path("tags", &longest),
            format!("tags[\"{longest}\"]")
        );
        let too_long = "k".repeat(4000);
        assert_eq!(
            map_entry_path("tags", &too_long),
            format!("tags[\"{}…(4000 bytes)\"]", "k".repeat(128))
        );
    }

    #[test]
    fn a_tag_at_the_limit_is_named_whole_by_the_status_a_caller_receives() {
        let mut request = valid();
        let key = format!("\"{}", "k".repeat(MAX_TAG_BYTES - 1));
        request
            .tags
            .insert(key.clone(), "v".repeat(MAX_TAG_BYTES + 1));
        let status = check_create_request(&request).unwrap_err().to_status();
        let decoded = ProviderError::from_status(&status);
        assert_eq!(
            decoded.field_violations[0].field,
            map_entry_path("tags", &key)
        );
    }

    #[test]
    fn string_limits_name_their_fields() {
        let mut request = valid();
        request.name = "n".repeat(MAX_NAME_BYTES + 1);
        request.placement = Some(pb::Placement {
            location: Some(pb::placement::Location::Host(
                "h".repeat(MAX_HOST_BYTES + 1),
            )),
            machine_type: "m".repeat(MAX_STRING_BYTES + 1),
            image: "i".repeat(MAX_STRING_BYTES + 1),
        });
        assert_eq!(
            fields(check_create_request(&request)),
            [
                "name",
                "placement.host",
                "placement.machine_type",
                "placement.image"
            ]
        );
        request.name = "n".repeat(MAX_NAME_BYTES);
        request.placement = Some(pb::Placement {
            location: Some(pb::placement::Location::Host("h".repeat(MAX_HOST_BYTES))),
            machine_type: "m".repeat(MAX_STRING_BYTES),
            image: "i".repeat(MAX_STRING_BYTES),
        });
        check_create_request(&request).unwrap();
    }

    #[test]
    fn a_key_with_a_line_end_is_refused() {
        for key in ["key\n", "key\r\n", "a b", "a/b", "é", "\nkey"] {
            assert!(!is_valid_key(key), "{key:?}");
        }
        assert!(is_valid_key(&"K".repeat(MAX_KEY_LEN)));
    }

    #[test]
    fn an_address_identity_is_a_key_and_a_requested_address_needs_one() {
        let mut request = valid();
        request.address_identity = Some("uid-1".into());
        request.requested_address = Some("192.0.2.10".into());
        check_create_request(&request).unwrap();
        request.address_identity = Some(String::new());
        assert_eq!(fields(check_create_request(&request)), ["address_identity"]);
        request.address_identity = Some("a b".into());
        assert_eq!(fields(check_create_request(&request)), ["address_identity"]);
        request.address_identity = None;
        assert_eq!(
            fields(check_create_request(&request)),
            ["requested_address"]
        );
    }

    #[test]
    fn a_requested_address_must_be_one_an_instance_can_hold() {
        for good in ["192.0.2.10", "10.0.0.1", "2001:db8::10"] {
            assert!(parse_requested_address(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "example.org",
            "192.0.2.10/24",
            "127.0.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "169.254.1.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "ff02::1",
        ] {
            assert!(parse_requested_address(bad).is_err(), "{bad:?}");
        }
        let long = "1".repeat(MAX_ADDRESS_BYTES + 1);
        assert!(
            parse_requested_address(&long)
                .unwrap_err()
                .contains("limit")
        );
    }

    #[test]
    fn user_data_at_the_limit_is_accepted() {
        let mut request = valid();
        request.cloud_init.as_mut().unwrap().user_data = vec![b'a'; MAX_USER_DATA_BYTES];
        check_create_request(&request).unwrap();
    }
}
