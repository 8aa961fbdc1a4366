//! Errors on the wire: ErrorInfo on every error, BadRequest naming fields exactly,
//! bounded echoes and violations, the server's own deadline, and every error seen
//! during the run well formed.

use std::time::Duration;

use prost::Message;
use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, describe};
use crate::error::ERROR_DOMAIN;
use crate::error::bounded::{
    MAX_DESCRIPTION_BYTES, MAX_DETAILS_BYTES, MAX_MESSAGE_BYTES, MAX_VIOLATIONS,
};
use crate::pb;
use crate::validation::{MAX_TAG_BYTES, map_entry_path};

/// `[A-Z][A-Z0-9_]*`, at most 63 characters.
fn is_upper_snake(reason: &str) -> bool {
    let mut chars = reason.chars();
    chars.next().is_some_and(|c| c.is_ascii_uppercase())
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && reason.len() <= 63
}

/// ErrorInfo is present, its domain exact and its reason UPPER_SNAKE_CASE.
fn check_error_info(status: &tonic::Status, what: &str) -> Checked {
    let details = status.get_error_details();
    let Some(info) = details.error_info() else {
        return Err(Outcome::fail(
            format!("{what}: ErrorInfo in the status details (grpc-status-details-bin)"),
            describe::status(status),
        ));
    };
    if info.domain != ERROR_DOMAIN {
        return Err(Outcome::fail(
            format!("{what}: ErrorInfo.domain exactly {ERROR_DOMAIN:?}"),
            format!("domain {:?}", info.domain),
        ));
    }
    if !is_upper_snake(&info.reason) {
        return Err(Outcome::fail(
            format!("{what}: ErrorInfo.reason in UPPER_SNAKE_CASE ([A-Z][A-Z0-9_]*)"),
            format!("reason {:?}", info.reason),
        ));
    }
    Ok(())
}

/// What is wrong with an error a provider answered, if anything: the details the
/// contract requires for its code, the google.rpc.Status agreeing with the gRPC status,
/// and the bounds on its text.
fn malformed(status: &tonic::Status) -> Option<String> {
    let code = status.code();
    let raw = status.details();
    let details = status.get_error_details();
    match (code, details.error_info()) {
        // The gRPC library answers these itself, without details.
        (Code::Unimplemented | Code::DeadlineExceeded, None) => {}
        (_, None) => return Some("no ErrorInfo".into()),
        (_, Some(info)) if info.domain != ERROR_DOMAIN => {
            return Some(format!("ErrorInfo.domain {:?}", info.domain));
        }
        (_, Some(info)) if !is_upper_snake(&info.reason) => {
            return Some(format!("ErrorInfo.reason {:?}", info.reason));
        }
        _ => {}
    }
    if !raw.is_empty() {
        let Ok(rpc) = tonic_types::Status::decode(raw) else {
            return Some("grpc-status-details-bin that is not a google.rpc.Status".into());
        };
        if rpc.code != code as i32 || rpc.message != status.message() {
            return Some(format!(
                "a google.rpc.Status of code {} and message {:?}, unlike the gRPC status",
                rpc.code,
                rpc.message.chars().take(80).collect::<String>()
            ));
        }
        if raw.len() > MAX_DETAILS_BYTES {
            return Some(format!("{} bytes of status details", raw.len()));
        }
    }
    if details.retry_info().is_some()
        && !matches!(code, Code::Unavailable | Code::ResourceExhausted)
    {
        return Some("RetryInfo on a code that callers do not retry after a delay".into());
    }
    if status.message().len() > MAX_MESSAGE_BYTES {
        return Some(format!("a {}-byte message", status.message().len()));
    }
    let violations = details
        .bad_request()
        .map(|bad| bad.field_violations.clone())
        .unwrap_or_default();
    if code == Code::InvalidArgument && violations.is_empty() {
        return Some("INVALID_ARGUMENT without a BadRequest field violation".into());
    }
    if violations.len() > MAX_VIOLATIONS {
        return Some(format!("{} field violations", violations.len()));
    }
    if let Some(long) = violations
        .iter()
        .find(|v| v.description.len() > MAX_DESCRIPTION_BYTES)
    {
        return Some(format!(
            "a {}-byte description of {}",
            long.description.len(),
            long.field
        ));
    }
    None
}

/// The fields an INVALID_ARGUMENT `status`'s BadRequest names (none without one).
pub(super) fn bad_request_fields(status: &tonic::Status) -> Vec<String> {
    status
        .get_error_details()
        .bad_request()
        .map(|bad| {
            bad.field_violations
                .iter()
                .map(|v| v.field.clone())
                .collect()
        })
        .unwrap_or_default()
}

impl Suite<'_> {
    pub(super) async fn error_info_on_every_error(&mut self) -> Checked {
        let missing = format!("missing-{}", self.run_id());
        let result = self.get_raw(&missing).await;
        let status = expect_code(result, Code::NotFound, "Get of a missing instance")?;
        check_error_info(&status, "NOT_FOUND")?;

        let mut invalid = self.request("x");
        invalid.key.clear();
        let result = self.create_raw(invalid).await;
        let status = expect_code(result, Code::InvalidArgument, "Create with an empty key")?;
        check_error_info(&status, "INVALID_ARGUMENT")?;

        self.create(self.request("conflict-info")).await?;
        let mut conflicting = self.request("conflict-info");
        conflicting.proxy_port = 3129;
        let result = self.create_raw(conflicting).await;
        let status = expect_code(
            result,
            Code::AlreadyExists,
            "Create of a taken key with another port",
        )?;
        check_error_info(&status, "ALREADY_EXISTS")
    }

    pub(super) async fn invalid_argument_names_fields(&mut self) -> Checked {
        let mut empty_key = self.request("x");
        empty_key.key.clear();
        let mut bad_machine = self.request("bad-machine");
        if let Some(placement) = bad_machine.placement.as_mut() {
            placement.machine_type = "no-such-machine-type-0".into();
        }
        let mut bad_tag = self.request("bad-tag");
        bad_tag.tags.insert(String::new(), "v".into());
        let mut no_placement = self.request("no-placement");
        no_placement.placement = None;
        for (request, field, what) in [
            (empty_key, "key", "Create with an empty key"),
            (no_placement, "placement", "Create without a placement"),
            (
                bad_machine,
                "placement.machine_type",
                "Create with an unknown machine type",
            ),
            (bad_tag, "tags[\"\"]", "Create with an empty tag key"),
        ] {
            let result = self.create_raw(request).await;
            let status = expect_code(result, Code::InvalidArgument, what)?;
            let fields = bad_request_fields(&status);
            if !fields.iter().any(|f| f == field) {
                return Err(Outcome::fail(
                    format!("{what}: BadRequest with a field violation on {field}"),
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn map_entry_paths(&mut self) -> Checked {
        // Quotes and backslashes escaped, everything else (a tab, a non-ASCII letter) as
        // it is; and a key at the 256-byte limit named whole.
        let odd = "egressproxy.dev/a\"b\\c\td-é".to_owned();
        let longest = format!("egressproxy.dev/{}", "k".repeat(MAX_TAG_BYTES - 16));
        for key in [odd, longest] {
            let mut request = self.request("map-path");
            request
                .tags
                .insert(key.clone(), "v".repeat(MAX_TAG_BYTES + 1));
            let path = map_entry_path("tags", &key);
            let what = format!(
                "Create with a {}-byte value for tag {path}",
                MAX_TAG_BYTES + 1
            );
            let status = expect_code(self.create_raw(request).await, Code::InvalidArgument, &what)?;
            if !bad_request_fields(&status).contains(&path) {
                return Err(Outcome::fail(
                    format!("{what}: a field violation naming exactly {path}"),
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn violations_bounded(&mut self) -> Checked {
        let mut request = self.request("many-violations");
        for n in 0..12 {
            request
                .tags
                .insert(format!("egressproxy.dev/bad-{n:02}"), "v".repeat(4000));
        }
        let what = "Create with 12 tag values over the limit";
        let status = expect_code(self.create_raw(request).await, Code::InvalidArgument, what)?;
        let fields = bad_request_fields(&status);
        if fields.is_empty() || fields.len() > MAX_VIOLATIONS {
            return Err(Outcome::fail(
                format!(
                    "{what}: 1 to {MAX_VIOLATIONS} field violations (the message says how many more)"
                ),
                format!("{} field violations", fields.len()),
            ));
        }
        if let Some(problem) = malformed(&status) {
            return Err(Outcome::fail(
                format!(
                    "{what}: descriptions of at most {MAX_DESCRIPTION_BYTES} bytes, a message of at most {MAX_MESSAGE_BYTES}, details of at most {MAX_DETAILS_BYTES}"
                ),
                problem,
            ));
        }
        Ok(())
    }

    pub(super) async fn errors_well_formed(&mut self) -> Checked {
        for (call, status) in &self.observed {
            if let Some(problem) = malformed(status) {
                return Err(Outcome::fail(
                    format!(
                        "every error answered during the run carries the contract's details ({call} answered {})",
                        describe::code_name(status.code())
                    ),
                    format!("{problem}: {}", describe::status(status)),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn huge_input_bounded(&mut self) -> Checked {
        let huge = "x".repeat(4000);
        let result = self.get_raw(&huge).await;
        let status = match result {
            Ok(_) => {
                return Err(Outcome::fail(
                    "Get of a 4,000-character id: NOT_FOUND or INVALID_ARGUMENT",
                    "success",
                ));
            }
            Err(status) => status,
        };
        if !matches!(status.code(), Code::NotFound | Code::InvalidArgument) {
            return Err(Outcome::fail(
                "Get of a 4,000-character id: NOT_FOUND or INVALID_ARGUMENT",
                describe::status(&status),
            ));
        }
        if status.message().len() > 1024 {
            return Err(Outcome::fail(
                "an error message of at most 1 KiB: echoed input cut to 128 characters",
                format!("a {}-byte message", status.message().len()),
            ));
        }
        let details_size = status.details().len();
        if details_size > 4096 {
            return Err(Outcome::fail(
                "status details of at most 4 KiB for one bad id",
                format!("{details_size} bytes of details"),
            ));
        }
        Ok(())
    }

    pub(super) async fn server_deadline(&mut self) -> Checked {
        // A raw grpc-timeout over a bare HTTP/2 connection: no client library keeps
        // time, so whatever ends the call is the server. 1 ms is too short for most
        // calls; answering in time is fine, anything but DEADLINE_EXCEEDED is not.
        let Some(authority) = self.plaintext_authority.clone() else {
            return Err(Outcome::Skip(
                "the raw HTTP/2 deadline check needs a plaintext (http://) endpoint".into(),
            ));
        };
        let request = prost::Message::encode_to_vec(&pb::ListInstancesRequest {
            tag_selector: self.ledger.selector(),
            page_size: Some(1),
            page_token: String::new(),
        });
        let deadline = std::time::Instant::now() + self.target.running_timeout;
        let mut answered = 0;
        while answered < 10 {
            let status = super::super::raw_call::unary(
                &authority,
                "/egressproxy.provider.v1.Provider/ListInstances",
                &request,
                "1m",
                Duration::from_secs(10),
            )
            .await
            .map_err(|got| Outcome::fail("an answer by the call's 1 ms grpc-timeout", got))?;
            if status.code() != Code::Ok {
                self.observe("ListInstances", &status);
            }
            let retry_later = !matches!(status.code(), Code::Ok | Code::DeadlineExceeded)
                && crate::ErrorClass::from_code(status.code()).is_retryable()
                && std::time::Instant::now() < deadline;
            if retry_later {
                // An answer callers retry (a quota, a busy provider): ask again.
                tokio::time::sleep(super::POLL_INTERVAL).await;
                continue;
            }
            answered += 1;
            match status.code() {
                Code::Ok => {}
                Code::DeadlineExceeded => {
                    if status.get_error_details().error_info().is_some() {
                        check_error_info(&status, "DEADLINE_EXCEEDED")?;
                    }
                }
                _ => {
                    return Err(Outcome::fail(
                        "a call past its grpc-timeout answers DEADLINE_EXCEEDED (or succeeds in time)",
                        describe::status(&status),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) async fn get_missing(&mut self) -> Checked {
        let missing = format!("missing-{}", self.run_id());
        let result = self.get_raw(&missing).await;
        expect_code(result, Code::NotFound, "Get of a missing instance").map(|_| ())
    }

    pub(super) async fn empty_id(&mut self) -> Checked {
        let result = self.get_raw("").await;
        let status = expect_code(result, Code::InvalidArgument, "Get with an empty id")?;
        if !bad_request_fields(&status).iter().any(|f| f == "id") {
            return Err(Outcome::fail(
                "Get with an empty id: BadRequest naming id",
                describe::status(&status),
            ));
        }
        let result = self
            .client
            .delete_instance(pb::DeleteInstanceRequest { id: String::new() })
            .await;
        let status = expect_code(result, Code::InvalidArgument, "Delete with an empty id")?;
        if !bad_request_fields(&status).iter().any(|f| f == "id") {
            return Err(Outcome::fail(
                "Delete with an empty id: BadRequest naming id",
                describe::status(&status),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::is_upper_snake;

    #[test]
    fn reasons_are_upper_snake_case() {
        for good in ["NOT_FOUND", "HOST_NOT_READY", "V2_ONLY"] {
            assert!(is_upper_snake(good), "{good}");
        }
        for bad in ["", "not_found", "NotFound", "_X", "1X", "A-B"] {
            assert!(!is_upper_snake(bad), "{bad}");
        }
    }
}
