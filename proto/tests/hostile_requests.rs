//! Property tests of the contract's request validation, with hostile values in every
//! field a caller sets (XML metacharacters, `/`, `..`, NUL and other controls,
//! right-to-left marks, long strings, arbitrary bytes):
//! - nothing panics;
//! - a request is refused exactly when one of the documented limits is broken;
//! - a refusal is INVALID_ARGUMENT with a BadRequest violation per bad field, each
//!   named by its proto path (`placement.image`, `tags["k"]`), and still says so after
//!   the trip through a `tonic::Status` (where echoed input is bounded).
//!
//! Case count: `PROPTEST_CASES` (`make fuzz` sets it high), else a small default.

use egressproxy_provider::validation::{
    MAX_HOST_BYTES, MAX_KEY_LEN, MAX_NAME_BYTES, MAX_STRING_BYTES, MAX_TAG_BYTES, MAX_TAGS,
    MAX_USER_DATA_BYTES, check_create_request, check_id, check_placement_request,
};
use egressproxy_provider::{ErrorClass, ProviderError, pb};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};

fn config() -> Config {
    Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(512),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/proptest-regressions/hostile_requests.txt"
        )))),
        ..Config::default()
    }
}

const HOSTILE_CHARS: &[char] = &[
    '<',
    '>',
    '&',
    '"',
    '\'',
    '/',
    '\\',
    '.',
    ' ',
    '\0',
    '\t',
    '\n',
    '\u{1}',
    '\u{7f}',
    '\u{85}',
    '\u{200f}',
    '\u{202e}',
    '\u{feff}',
    '\u{ffff}',
    '\u{1f600}',
    'a',
    'Z',
    '0',
    '-',
    '_',
];

/// Hostile text, sometimes long enough to cross a limit.
fn text() -> impl Strategy<Value = String> {
    let short = proptest::collection::vec(
        prop_oneof![
            3 => proptest::sample::select(HOSTILE_CHARS),
            1 => any::<char>(),
        ],
        0..12,
    )
    .prop_map(String::from_iter);
    prop_oneof![
        8 => short,
        1 => (proptest::sample::select(HOSTILE_CHARS), 120usize..300)
            .prop_map(|(c, n)| c.to_string().repeat(n)),
        1 => Just("..".to_owned()),
    ]
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => (any::<u8>(), (MAX_USER_DATA_BYTES - 2)..(MAX_USER_DATA_BYTES + 2))
            .prop_map(|(b, n)| vec![b; n]),
    ]
}

fn placement() -> impl Strategy<Value = Option<pb::Placement>> {
    use pb::placement::Location;
    proptest::option::weighted(
        0.9,
        (
            proptest::option::of(prop_oneof![
                text().prop_map(Location::Host),
                text().prop_map(Location::Zone),
            ]),
            text(),
            text(),
        )
            .prop_map(|(location, machine_type, image)| pb::Placement {
                location,
                machine_type,
                image,
            }),
    )
}

fn request() -> impl Strategy<Value = pb::CreateInstanceRequest> {
    (
        prop_oneof![text(), "[A-Za-z0-9._-]{0,130}"],
        text(),
        prop_oneof![
            4 => proptest::collection::hash_map(text(), text(), 0..4),
            1 => proptest::collection::hash_map("[a-z]{1,8}", text(), (MAX_TAGS - 1)..(MAX_TAGS + 2)),
        ],
        placement(),
        proptest::option::of((bytes(), proptest::option::of(bytes()))),
        prop_oneof![any::<u32>(), 0u32..=65536],
    )
        .prop_map(|(key, name, tags, placement, cloud_init, proxy_port)| {
            pb::CreateInstanceRequest {
                key,
                name,
                tags,
                placement,
                cloud_init: cloud_init.map(|(user_data, vendor_data)| pb::CloudInit {
                    user_data,
                    vendor_data,
                }),
                proxy_port,
                ..Default::default()
            }
        })
}

/// A map entry's path as the contract states it: the key in double quotes with `"` and
/// `\` escaped, cut to 128 characters and marked when over the key limit.
fn entry_path(key: &str) -> String {
    let shown = if key.len() <= MAX_TAG_BYTES || key.chars().count() <= 128 {
        key.to_owned()
    } else {
        let cut: String = key.chars().take(128).collect();
        format!("{cut}…({} bytes)", key.len())
    };
    format!(
        "tags[\"{}\"]",
        shown.replace('\\', "\\\\").replace('"', "\\\"")
    )
}

/// The fields a request breaks, by the contract's documented limits (a second reading
/// of the rules, written independently of the validation).
fn broken_fields(r: &pb::CreateInstanceRequest) -> Vec<String> {
    use pb::placement::Location;
    let mut broken = Vec::new();
    let key_ok = (1..=MAX_KEY_LEN).contains(&r.key.len())
        && r.key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !key_ok {
        broken.push("key".to_owned());
    }
    if r.name.len() > MAX_NAME_BYTES {
        broken.push("name".to_owned());
    }
    if r.tags.len() > MAX_TAGS {
        broken.push("tags".to_owned());
    }
    let mut bad_tags: Vec<String> = r
        .tags
        .iter()
        .filter(|(k, v)| k.is_empty() || k.len() > MAX_TAG_BYTES || v.len() > MAX_TAG_BYTES)
        .map(|(k, _)| entry_path(k))
        .collect();
    bad_tags.sort();
    broken.extend(bad_tags);
    match &r.placement {
        None => broken.push("placement".to_owned()),
        Some(p) => {
            if p.machine_type.is_empty() {
                broken.push("placement.machine_type".to_owned());
            }
            if p.image.is_empty() {
                broken.push("placement.image".to_owned());
            }
            match &p.location {
                Some(Location::Host(h)) if h.is_empty() || h.len() > MAX_HOST_BYTES => {
                    broken.push("placement.host".into())
                }
                Some(Location::Zone(z)) if z.is_empty() || z.len() > MAX_STRING_BYTES => {
                    broken.push("placement.zone".into())
                }
                _ => {}
            }
            if p.machine_type.len() > MAX_STRING_BYTES {
                broken.push("placement.machine_type".to_owned());
            }
            if p.image.len() > MAX_STRING_BYTES {
                broken.push("placement.image".to_owned());
            }
        }
    }
    if let Some(c) = &r.cloud_init {
        if c.user_data.len() > MAX_USER_DATA_BYTES {
            broken.push("cloud_init.user_data".to_owned());
        }
        if c.vendor_data
            .as_ref()
            .is_some_and(|v| v.len() > MAX_USER_DATA_BYTES)
        {
            broken.push("cloud_init.vendor_data".to_owned());
        }
    }
    if !(1..=65535).contains(&r.proxy_port) {
        broken.push("proxy_port".to_owned());
    }
    broken.sort();
    broken
}

/// A refusal as the contract describes it, on both sides of the wire.
fn check_refusal(error: &ProviderError) -> Result<Vec<String>, TestCaseError> {
    prop_assert_eq!(error.class, ErrorClass::InvalidArgument, "{}", error);
    prop_assert!(!error.field_violations.is_empty(), "{}", error);
    let status = error.to_status();
    prop_assert_eq!(status.code(), tonic::Code::InvalidArgument);
    // Small enough for C-core clients' 16 KiB metadata limit, whatever was echoed.
    prop_assert!(
        status.message().len() + status.details().len() < 16 * 1024,
        "{} + {} bytes",
        status.message().len(),
        status.details().len()
    );
    let decoded = ProviderError::from_status(&status);
    prop_assert_eq!(decoded.class, ErrorClass::InvalidArgument);
    prop_assert!(!decoded.field_violations.is_empty());
    for (sent, received) in error.field_violations.iter().zip(&decoded.field_violations) {
        prop_assert!(!received.field.is_empty());
        if sent.field.len() <= 1024 {
            prop_assert_eq!(&sent.field, &received.field);
        }
    }
    let mut fields: Vec<String> = error
        .field_violations
        .iter()
        .map(|v| v.field.clone())
        .collect();
    fields.sort();
    Ok(fields)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_request_is_refused_exactly_when_it_breaks_a_limit_naming_each_field(r in request()) {
        let broken = broken_fields(&r);
        match check_create_request(&r) {
            Ok(()) => prop_assert!(broken.is_empty(), "accepted but breaks {:?}", broken),
            Err(error) => prop_assert_eq!(check_refusal(&error)?, broken),
        }
    }

    #[test]
    fn placements_and_ids_are_refused_naming_the_field(p in placement(), id in text()) {
        if let Err(error) = check_placement_request(p.as_ref()) {
            for field in check_refusal(&error)? {
                prop_assert!(field.starts_with("placement"), "{}", field);
            }
        }
        match check_id(&id) {
            Ok(()) => prop_assert!(!id.is_empty()),
            Err(error) => prop_assert_eq!(check_refusal(&error)?, vec!["id".to_owned()]),
        }
    }
}

/// A 1 MiB value in every string field at once: each is named, and the status stays
/// small.
#[test]
fn megabyte_values_are_named_and_bounded() {
    let huge = "\u{202e}<&>".repeat(1 << 18);
    let request = pb::CreateInstanceRequest {
        key: huge.clone(),
        name: huge.clone(),
        tags: [(huge.clone(), huge.clone())].into(),
        placement: Some(pb::Placement {
            location: Some(pb::placement::Location::Host(huge.clone())),
            machine_type: huge.clone(),
            image: huge.clone(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: vec![0xff; 1 << 20],
            vendor_data: Some(vec![0; 1 << 20]),
        }),
        proxy_port: 3128,
        ..Default::default()
    };
    let error = check_create_request(&request).unwrap_err();
    let fields = check_refusal(&error).unwrap();
    assert_eq!(fields, broken_fields(&request));
}
