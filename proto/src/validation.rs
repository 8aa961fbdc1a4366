//! Request checks every provider applies the same way, so callers see one set of
//! limits and field names whatever the infrastructure. Each check collects every
//! violation, so a user fixes a request in one round.

use crate::ProviderError;
use crate::pb;

/// Largest accepted `cloud_init.user_data` (and `vendor_data`), in bytes.
pub const MAX_USER_DATA_BYTES: usize = 64 * 1024;
/// Longest accepted idempotency key.
pub const MAX_KEY_LEN: usize = 128;
/// Largest accepted tag key or value, in bytes.
pub const MAX_TAG_BYTES: usize = 256;
/// Most tags on one instance.
pub const MAX_TAGS: usize = 64;

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
    if request.tags.len() > MAX_TAGS {
        violations.add(
            "tags",
            format!("at most {MAX_TAGS} tags, got {}", request.tags.len()),
        );
    }
    for (key, value) in &request.tags {
        if key.is_empty() || key.len() > MAX_TAG_BYTES || value.len() > MAX_TAG_BYTES {
            violations.add(
                format!("tags[{key:?}]"),
                format!(
                    "tag keys must be 1 to {MAX_TAG_BYTES} bytes and values at most {MAX_TAG_BYTES}"
                ),
            );
        }
    }
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
    violations.into_result()
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

fn check_key(key: &str, violations: &mut Violations) {
    let valid_chars = key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if key.is_empty() || key.len() > MAX_KEY_LEN || !valid_chars {
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
    fn user_data_at_the_limit_is_accepted() {
        let mut request = valid();
        request.cloud_init.as_mut().unwrap().user_data = vec![b'a'; MAX_USER_DATA_BYTES];
        check_create_request(&request).unwrap();
    }
}
