//! The documented limits (`provider.proto`, `docs/contract.md`), at the boundary and
//! one past it, and the key's character set.

use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe};
use crate::pb;
use crate::validation::{
    MAX_KEY_LEN, MAX_NAME_BYTES, MAX_TAG_BYTES, MAX_TAGS, MAX_USER_DATA_BYTES,
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

        for (what, field, request) in cases {
            let result = self.create_raw(request).await;
            let status = expect_code(
                result,
                Code::InvalidArgument,
                &format!("Create with {what}"),
            )?;
            let named = status.get_error_details().bad_request().is_some_and(|bad| {
                bad.field_violations.iter().any(|v| {
                    if field.starts_with("tags[\"") {
                        v.field.starts_with(&field) && v.field.ends_with("\"]")
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
        }
        Ok(())
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
