//! A Create request checked against what a pod can be: the contract's limits (the
//! shared [`validation`]), then this provider's own refusals, every field at fault
//! named at once.
//!
//! - **Cloud-init does not exist for pods.** Non-empty `cloud_init.user_data` is
//!   INVALID_ARGUMENT naming the field, reason [`CLOUD_INIT_UNSUPPORTED`]; running a pod
//!   while dropping the user's boot configuration would be ignoring it silently, which
//!   the contract forbids for vendor-data. `vendor_data` is refused as by every
//!   provider without `CAPABILITY_VENDOR_DATA`. An empty user-data (what the operator
//!   sends for a Proxy without `cloudInit`) is accepted. The proxy's settings come from
//!   the image the configuration names instead.
//! - **No address identities**: their capabilities are not declared, so both fields are
//!   refused, naming each.
//! - **UpdateInstanceTags**: the contract crate's own check
//!   (`validation::check_update_tags_request`): the id, and both tag maps within the
//!   contract's limits.
//! - **Names the configuration offers**: an unknown machine type or image is
//!   INVALID_ARGUMENT on `placement.machine_type` or `placement.image`.

use egressproxy_provider::{ProviderError, pb, validation};

use crate::config::Config;

/// The reason of a Create refused because it carries cloud-init user-data.
pub const CLOUD_INIT_UNSUPPORTED: &str = "CLOUD_INIT_UNSUPPORTED";

/// Checks `request`; on success its placement is set and names what `config` offers.
pub fn check_create(
    config: &Config,
    request: &pb::CreateInstanceRequest,
) -> Result<(), ProviderError> {
    validation::check_create_request(request)?;
    let mut refused: Vec<(&str, String)> = Vec::new();
    let mut reason = None;
    if let Some(cloud_init) = &request.cloud_init {
        if !cloud_init.user_data.is_empty() {
            refused.push((
                "cloud_init.user_data",
                "proxies of this provider are pods, which have no cloud-init: leave user-data \
                 empty and configure the proxy through the provider's image"
                    .into(),
            ));
            reason = Some(CLOUD_INIT_UNSUPPORTED);
        }
        if cloud_init.vendor_data.is_some() {
            refused.push((
                "cloud_init.vendor_data",
                "this provider does not take vendor-data (no CAPABILITY_VENDOR_DATA): leave it unset".into(),
            ));
        }
    }
    for (field, set) in [
        ("address_identity", request.address_identity.is_some()),
        ("requested_address", request.requested_address.is_some()),
    ] {
        if set {
            refused.push((
                field,
                format!("this provider does not offer address identities: leave {field} unset"),
            ));
        }
    }
    let placement = request
        .placement
        .as_ref()
        .expect("validated: placement is set");
    if !config.machine_types.contains_key(&placement.machine_type) {
        refused.push((
            "placement.machine_type",
            unknown(
                "machine type",
                &placement.machine_type,
                config.machine_types.keys(),
            ),
        ));
    }
    if !config.images.contains_key(&placement.image) {
        refused.push((
            "placement.image",
            unknown("image", &placement.image, config.images.keys()),
        ));
    }
    let mut refused = refused.into_iter();
    let Some((field, description)) = refused.next() else {
        return Ok(());
    };
    let error = refused.fold(
        ProviderError::invalid_argument(field, description),
        |error, (field, description)| error.with_violation(field, description),
    );
    Err(match reason {
        Some(reason) => error.with_reason(reason),
        None => error,
    })
}

fn unknown<'a>(what: &str, name: &str, offered: impl Iterator<Item = &'a String>) -> String {
    let offered: Vec<&str> = offered.map(String::as_str).collect();
    format!(
        "unknown {what} {name:?}: this provider offers {}",
        offered.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use egressproxy_provider::ErrorClass;

    use super::*;

    fn config() -> Config {
        Config::parse("namespace: e\nmachine_types: {small: {}}\nimages: {squid: {image: s}}\n")
            .unwrap()
    }

    fn request() -> pb::CreateInstanceRequest {
        pb::CreateInstanceRequest {
            key: "k".into(),
            placement: Some(pb::Placement {
                location: None,
                machine_type: "small".into(),
                image: "squid".into(),
            }),
            proxy_port: 3128,
            ..pb::CreateInstanceRequest::default()
        }
    }

    fn fields(error: &ProviderError) -> Vec<&str> {
        error
            .field_violations
            .iter()
            .map(|v| v.field.as_str())
            .collect()
    }

    #[test]
    fn empty_cloud_init_is_accepted() {
        check_create(&config(), &request()).unwrap();
        let mut empty = request();
        empty.cloud_init = Some(pb::CloudInit::default());
        check_create(&config(), &empty).unwrap();
    }

    #[test]
    fn user_data_is_refused_with_its_own_reason() {
        let mut with_user_data = request();
        with_user_data.cloud_init = Some(pb::CloudInit {
            user_data: b"#cloud-config\n{}\n".to_vec(),
            vendor_data: None,
        });
        let error = check_create(&config(), &with_user_data).unwrap_err();
        assert_eq!(error.class, ErrorClass::InvalidArgument);
        assert_eq!(error.reason, CLOUD_INIT_UNSUPPORTED);
        assert_eq!(fields(&error), ["cloud_init.user_data"]);
    }

    #[test]
    fn every_refused_field_is_named() {
        let mut bad = request();
        bad.cloud_init = Some(pb::CloudInit {
            user_data: Vec::new(),
            vendor_data: Some(Vec::new()),
        });
        bad.address_identity = Some("a".into());
        bad.placement.as_mut().unwrap().image = "nope".into();
        let error = check_create(&config(), &bad).unwrap_err();
        assert_eq!(error.reason, "INVALID_ARGUMENT");
        assert_eq!(
            fields(&error),
            [
                "cloud_init.vendor_data",
                "address_identity",
                "placement.image"
            ]
        );
    }
}
