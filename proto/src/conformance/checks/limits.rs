//! The documented limits (`provider.proto`, `docs/contract.md`), at the boundary and
//! one past it, and the key's character set; one past the limits of `address_identity`
//! and `requested_address` too, when the provider declares their capabilities.

use tonic::Code;
use tonic_types::StatusExt;

use super::address_identity::OUTSIDE_V4;
use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe};
use crate::pb;
use crate::validation::{
    MAX_ADDRESS_BYTES, MAX_KEY_LEN, MAX_NAME_BYTES, MAX_TAG_BYTES, MAX_TAGS, MAX_USER_DATA_BYTES,
};

/// A valid `#cloud-config` (an empty mapping) padded with comments to `len` bytes.
fn user_data_of(len: usize) -> Vec<u8> {
    let mut data = b"#cloud-config\n{}\n".to_vec();
    while data.len() < len {
        let line = (len - data.len()).min(80);
        if line == 1 {
            data.push(b'\n');
        } else {
            data.push(b'#');
            data.extend(std::iter::repeat_n(b'x', line - 2));
            data.push(b'\n');
        }
    }
    data
}

impl Suite<'_> {
    /// A request with every limit at its boundary (vendor_data only when the provider
    /// takes it).
    fn boundary_request(&self, vendor_data: bool) -> pb::CreateInstanceRequest {
        let mut request = self.request("limits");
        let padding = MAX_KEY_LEN - request.key.len();
        request.key.push_str(&"x".repeat(padding));
        let padding = MAX_NAME_BYTES - request.name.len();
        request.name.push_str(&"n".repeat(padding));
        let long_key = format!("egressproxy.dev/{}", "k".repeat(MAX_TAG_BYTES - 16));
        request.tags.insert(long_key, "v".repeat(MAX_TAG_BYTES));
        for n in request.tags.len()..MAX_TAGS {
            request
                .tags
                .insert(format!("egressproxy.dev/limit-{n}"), "x".into());
        }
        let user_data = if self.target.cloud_init {
            user_data_of(MAX_USER_DATA_BYTES)
        } else {
            Vec::new()
        };
        request.cloud_init = Some(pb::CloudInit {
            user_data,
            vendor_data: vendor_data.then(|| user_data_of(MAX_USER_DATA_BYTES)),
        });
        request.proxy_port = 65535;
        request
    }

    /// Without cloud-init: user-data is INVALID_ARGUMENT naming `cloud_init.user_data`,
    /// reason `CLOUD_INIT_UNSUPPORTED`, never accepted and ignored.
    async fn user_data_refused(&mut self) -> Checked {
        let mut request = self.request("user-data-refused");
        request.cloud_init = Some(pb::CloudInit {
            user_data: user_data_of(MAX_USER_DATA_BYTES),
            vendor_data: None,
        });
        let what = "Create with user-data on a provider without cloud-init";
        let status = expect_code(self.create_raw(request).await, Code::InvalidArgument, what)?;
        let details = status.get_error_details();
        let named = details.bad_request().is_some_and(|bad| {
            bad.field_violations
                .iter()
                .any(|v| v.field == "cloud_init.user_data")
        });
        let reason = details
            .error_info()
            .is_some_and(|info| info.reason == "CLOUD_INIT_UNSUPPORTED");
        if !named || !reason {
            return Err(Outcome::fail(
                format!(
                    "{what}: BadRequest naming cloud_init.user_data, reason CLOUD_INIT_UNSUPPORTED"
                ),
                describe::status(&status),
            ));
        }
        Ok(())
    }

    async fn takes_vendor_data(&mut self) -> Result<bool, Outcome> {
        Ok(self
            .capabilities()
            .await?
            .contains(&pb::Capability::VendorData))
    }

    pub(super) async fn limits_at_boundary(&mut self) -> Checked {
        let vendor_data = self.takes_vendor_data().await?;
        let request = self.boundary_request(vendor_data);
        let created = self.create_raw(request).await.map_err(|status| {
            Outcome::fail(
                format!(
                    "a Create with a {MAX_KEY_LEN}-character key, a {MAX_NAME_BYTES}-byte name, {MAX_TAGS} tags, a {MAX_TAG_BYTES}-byte tag key and value, {}{} and proxy_port 65535 succeeds",
                    if self.target.cloud_init {
                        format!("{MAX_USER_DATA_BYTES} bytes of user_data")
                    } else {
                        "no user_data (no cloud-init)".to_owned()
                    },
                    if vendor_data { " and of vendor_data" } else { "" }
                ),
                describe::status(&status),
            )
        })?;
        if created.tags.len() != MAX_TAGS || !created.tags.contains_key(TAG) {
            return Err(Outcome::fail(
                format!("all {MAX_TAGS} tags stored"),
                format!("{} tags", created.tags.len()),
            ));
        }
        if !self.target.cloud_init {
            self.user_data_refused().await?;
        }
        Ok(())
    }

    pub(super) async fn limits_one_past(&mut self) -> Checked {
        let vendor_data = self.takes_vendor_data().await?;
        let boundary = self.boundary_request(false);
        let mut cases: Vec<(&str, String, pb::CreateInstanceRequest)> = Vec::new();

        let mut request = boundary.clone();
        request.key.push('x');
        cases.push(("a key one character too long", "key".into(), request));

        for (what, suffix) in [
            ("a key ending in a line feed", "nl\n"),
            ("a key with a space", "a b"),
            ("a key with a slash", "a/b"),
            ("a key with a non-ASCII letter", "é"),
        ] {
            let mut request = self.request("charset");
            request.key.push_str(suffix);
            cases.push((what, "key".into(), request));
        }

        let mut request = self.request("long-name");
        request.name = "n".repeat(MAX_NAME_BYTES + 1);
        cases.push(("a name one byte too long", "name".into(), request));

        let mut request = boundary.clone();
        request
            .tags
            .insert("egressproxy.dev/one-too-many".into(), "x".into());
        cases.push(("one tag too many", "tags".into(), request));

        let mut request = self.request("long-tag-key");
        let key = "k".repeat(MAX_TAG_BYTES + 1);
        request.tags.insert(key.clone(), "v".into());
        cases.push(("a tag key one byte too long", "tags[\"kk".into(), request));

        let mut request = self.request("long-tag-value");
        request
            .tags
            .insert("egressproxy.dev/v".into(), "v".repeat(MAX_TAG_BYTES + 1));
        cases.push((
            "a tag value one byte too long",
            "tags[\"egressproxy.dev/v\"]".into(),
            request,
        ));

        let mut request = self.request("big-user-data");
        request.cloud_init = Some(pb::CloudInit {
            user_data: user_data_of(MAX_USER_DATA_BYTES + 1),
            vendor_data: None,
        });
        cases.push((
            "user_data one byte too large",
            "cloud_init.user_data".into(),
            request,
        ));

        if vendor_data {
            let mut request = self.request("big-vendor-data");
            request.cloud_init = Some(pb::CloudInit {
                user_data: self.target.user_data.clone(),
                vendor_data: Some(user_data_of(MAX_USER_DATA_BYTES + 1)),
            });
            cases.push((
                "vendor_data one byte too large",
                "cloud_init.vendor_data".into(),
                request,
            ));
        }

        for port in [0, 65536] {
            let mut request = self.request("bad-port");
            request.proxy_port = port;
            cases.push(("a proxy_port outside 1-65535", "proxy_port".into(), request));
        }

        let capabilities = self.capabilities().await?;
        if capabilities.contains(&pb::Capability::AddressIdentity) {
            cases.extend(self.address_identity_cases());
        }
        for (what, field, request) in cases {
            self.refused_naming(what, &field, request).await?;
        }
        if capabilities.contains(&pb::Capability::RequestedAddress) {
            self.requested_address_one_past().await?;
        }
        Ok(())
    }

    /// Past the limits of `address_identity` (1 to 128 characters of
    /// `[A-Za-z0-9._-]`), for a provider that takes the field.
    fn address_identity_cases(&self) -> Vec<(&'static str, String, pb::CreateInstanceRequest)> {
        let mut too_long = self.request("long-identity");
        too_long.address_identity = Some(format!(
            "{:x<width$}",
            self.identity("long-identity"),
            width = MAX_KEY_LEN + 1
        ));
        let mut slash = self.request("identity-charset");
        slash.address_identity = Some(format!("{}/a", self.identity("identity-charset")));
        vec![
            (
                "an address_identity one character too long",
                "address_identity".into(),
                too_long,
            ),
            (
                "an address_identity with a slash",
                "address_identity".into(),
                slash,
            ),
        ]
    }

    /// A `requested_address` one byte past its 64 bytes: a documentation address
    /// padded with spaces, so no IP address in its textual form. It is refused naming
    /// the field, and as no address at all: a provider that answers ADDRESS_NOT_IN_RANGE
    /// has read the padded text as the address.
    async fn requested_address_one_past(&mut self) -> Checked {
        let mut request = self.request("long-requested-address");
        request.address_identity = Some(self.identity("long-requested-address"));
        request.requested_address = Some(format!(
            "{:>width$}",
            OUTSIDE_V4[0],
            width = MAX_ADDRESS_BYTES + 1
        ));
        let what = format!(
            "a requested_address of {} bytes (an address padded with spaces)",
            MAX_ADDRESS_BYTES + 1
        );
        let status = self
            .refused_naming(&what, "requested_address", request)
            .await?;
        let reason = status
            .get_error_details()
            .error_info()
            .map(|i| i.reason.clone());
        if reason.as_deref() == Some("ADDRESS_NOT_IN_RANGE") {
            return Err(Outcome::fail(
                format!(
                    "Create with {what}: INVALID_ARGUMENT naming requested_address as no \
                     address (a reason other than ADDRESS_NOT_IN_RANGE)"
                ),
                describe::status(&status),
            ));
        }
        Ok(())
    }

    /// A Create of `request` (which has `what`) is INVALID_ARGUMENT naming `field`; for
    /// a map entry, `field` is the start of its path (a key over its limit is cut).
    async fn refused_naming(
        &mut self,
        what: &str,
        field: &str,
        request: pb::CreateInstanceRequest,
    ) -> Result<tonic::Status, Outcome> {
        let result = self.create_raw(request).await;
        let status = expect_code(
            result,
            Code::InvalidArgument,
            &format!("Create with {what}"),
        )?;
        let named = status.get_error_details().bad_request().is_some_and(|bad| {
            bad.field_violations.iter().any(|v| {
                if field.starts_with("tags[\"") {
                    v.field.starts_with(field) && v.field.ends_with("\"]")
                } else {
                    v.field == field
                }
            })
        });
        if !named {
            return Err(Outcome::fail(
                format!("Create with {what}: BadRequest naming {field}"),
                describe::status(&status),
            ));
        }
        Ok(status)
    }
}

#[cfg(test)]
mod tests {
    use super::user_data_of;

    #[test]
    fn padded_user_data_has_the_exact_length() {
        for len in [20, 81, 82, 65536, 65537] {
            assert_eq!(user_data_of(len).len(), len);
        }
    }
}
