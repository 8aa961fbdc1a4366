//! The documented limits (`provider.proto`, `docs/contract.md`), at the boundary and
//! one past it.

use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe};
use crate::pb;
use crate::validation::{MAX_KEY_LEN, MAX_TAG_BYTES, MAX_TAGS, MAX_USER_DATA_BYTES};

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
    /// A request with every limit at its boundary.
    fn boundary_request(&self) -> pb::CreateInstanceRequest {
        let mut request = self.request("limits");
        let padding = MAX_KEY_LEN - request.key.len();
        request.key.push_str(&"x".repeat(padding));
        let long_key = format!("egressproxy.dev/{}", "k".repeat(MAX_TAG_BYTES - 16));
        request.tags.insert(long_key, "v".repeat(MAX_TAG_BYTES));
        for n in request.tags.len()..MAX_TAGS {
            request
                .tags
                .insert(format!("egressproxy.dev/limit-{n}"), "x".into());
        }
        request.cloud_init = Some(pb::CloudInit {
            user_data: user_data_of(MAX_USER_DATA_BYTES),
            vendor_data: None,
        });
        request.proxy_port = 65535;
        request
    }

    pub(super) async fn limits_at_boundary(&mut self) -> Checked {
        let request = self.boundary_request();
        let created = self.create_raw(request).await.map_err(|status| {
            Outcome::fail(
                format!(
                    "a Create with a {MAX_KEY_LEN}-character key, {MAX_TAGS} tags, a {MAX_TAG_BYTES}-byte tag key and value, {MAX_USER_DATA_BYTES} bytes of user_data and proxy_port 65535 succeeds"
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
        Ok(())
    }

    pub(super) async fn limits_one_past(&mut self) -> Checked {
        let boundary = self.boundary_request();
        let mut cases: Vec<(&str, String, pb::CreateInstanceRequest)> = Vec::new();

        let mut request = boundary.clone();
        request.key.push('x');
        cases.push(("a key one character too long", "key".into(), request));

        let mut request = boundary.clone();
        request
            .tags
            .insert("egressproxy.dev/one-too-many".into(), "x".into());
        cases.push(("one tag too many", "tags".into(), request));

        let mut request = self.request("long-tag-key");
        let key = "k".repeat(MAX_TAG_BYTES + 1);
        request.tags.insert(key.clone(), "v".into());
        cases.push(("a tag key one byte too long", "tags[\"".into(), request));

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
                        v.field.starts_with(&field)
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
