//! The contract's error model: one [`ProviderError`] with an [`ErrorClass`], mapped to
//! and from `tonic::Status` in exactly one place ([`ErrorClass::code`] and
//! [`ErrorClass::from_code`]).
//!
//! The table (also in `provider.proto` and `docs/contract.md`):
//!
//! | class              | gRPC code             | details                     | caller does                 |
//! |--------------------|-----------------------|-----------------------------|-----------------------------|
//! | `Transient`        | `UNAVAILABLE`         | ErrorInfo, RetryInfo (opt.) | retry with backoff          |
//! | `DeadlineExceeded` | `DEADLINE_EXCEEDED`   | ErrorInfo                   | retry with backoff          |
//! | `Permanent`        | `FAILED_PRECONDITION` | ErrorInfo                   | report, wait for new spec   |
//! | `InvalidArgument`  | `INVALID_ARGUMENT`    | ErrorInfo, BadRequest       | report field, wait for spec |
//! | `NotFound`         | `NOT_FOUND`           | ErrorInfo                   | treat as gone               |
//! | `AlreadyExists`    | `ALREADY_EXISTS`      | ErrorInfo                   | report, key is taken        |
//! | `QuotaExhausted`   | `RESOURCE_EXHAUSTED`  | ErrorInfo, RetryInfo (opt.) | retry after the hint        |
//! | `Unimplemented`    | `UNIMPLEMENTED`       | none                        | optional call unsupported   |
//!
//! Text echoed from the caller's input is bounded when encoded ([`bounded`]), so an
//! error always fits in the metadata limits of every gRPC client.
//!
//! Codes outside the table (from a foreign or buggy server) are classified by
//! [`ErrorClass::from_code`]: unknown, internal, aborted and cancelled as transient;
//! permission denied, unauthenticated and data loss as permanent; out of range as
//! invalid argument.

pub mod bounded;
mod causes;

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

pub use causes::{append_causes, with_causes};

/// `ErrorInfo.domain` of every error the contract defines.
pub const ERROR_DOMAIN: &str = "egressproxy.dev";

/// `ErrorInfo.reason`s that a caller must tell apart from others of their class.
pub mod reason {
    /// UNAVAILABLE: an earlier instance of the address identity still exists; retry
    /// once it is gone.
    pub const ADDRESS_IDENTITY_IN_USE: &str = "ADDRESS_IDENTITY_IN_USE";
    /// ALREADY_EXISTS: the requested address is held by another identity's instance,
    /// not the key by another instance.
    pub const ADDRESS_TAKEN: &str = "ADDRESS_TAKEN";
    /// FAILED_PRECONDITION from UpdateInstanceTags: the instance's tags are no longer
    /// the expected ones (another caller changed them); read it again and decide anew.
    pub const TAGS_CHANGED: &str = "TAGS_CHANGED";
    /// FAILED_PRECONDITION from UpdateInstanceTags: the instance is being deleted.
    pub const INSTANCE_DELETING: &str = "INSTANCE_DELETING";
}

/// What a caller should do about an error. Carried on the wire by the gRPC code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Might succeed if retried: the infrastructure is unreachable or busy.
    Transient,
    /// The call's deadline passed before the provider finished; retry.
    DeadlineExceeded,
    /// Will fail again until something outside the call changes (usually the spec).
    Permanent,
    /// The request is wrong; field violations say which field and why.
    InvalidArgument,
    /// The instance does not exist.
    NotFound,
    /// The key is taken by an instance with an incompatible spec.
    AlreadyExists,
    /// A quota or capacity limit is reached; retry after the hinted delay.
    QuotaExhausted,
    /// The provider does not implement this optional call.
    Unimplemented,
}

impl ErrorClass {
    /// Every class, in table order.
    pub const ALL: [ErrorClass; 8] = [
        ErrorClass::Transient,
        ErrorClass::DeadlineExceeded,
        ErrorClass::Permanent,
        ErrorClass::InvalidArgument,
        ErrorClass::NotFound,
        ErrorClass::AlreadyExists,
        ErrorClass::QuotaExhausted,
        ErrorClass::Unimplemented,
    ];

    /// The gRPC code that carries this class.
    pub fn code(self) -> Code {
        match self {
            ErrorClass::Transient => Code::Unavailable,
            ErrorClass::DeadlineExceeded => Code::DeadlineExceeded,
            ErrorClass::Permanent => Code::FailedPrecondition,
            ErrorClass::InvalidArgument => Code::InvalidArgument,
            ErrorClass::NotFound => Code::NotFound,
            ErrorClass::AlreadyExists => Code::AlreadyExists,
            ErrorClass::QuotaExhausted => Code::ResourceExhausted,
            ErrorClass::Unimplemented => Code::Unimplemented,
        }
    }

    /// The class of any gRPC code, including codes outside the table.
    pub fn from_code(code: Code) -> ErrorClass {
        match code {
            Code::DeadlineExceeded => ErrorClass::DeadlineExceeded,
            Code::FailedPrecondition
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::DataLoss => ErrorClass::Permanent,
            Code::InvalidArgument | Code::OutOfRange => ErrorClass::InvalidArgument,
            Code::NotFound => ErrorClass::NotFound,
            Code::AlreadyExists => ErrorClass::AlreadyExists,
            Code::ResourceExhausted => ErrorClass::QuotaExhausted,
            Code::Unimplemented => ErrorClass::Unimplemented,
            Code::Ok
            | Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Aborted
            | Code::Cancelled => ErrorClass::Transient,
        }
    }

    /// The `ErrorInfo.reason` used when no more specific reason is given.
    pub fn default_reason(self) -> &'static str {
        match self {
            ErrorClass::Transient => "TRANSIENT",
            ErrorClass::DeadlineExceeded => "DEADLINE_EXCEEDED",
            ErrorClass::Permanent => "PERMANENT",
            ErrorClass::InvalidArgument => "INVALID_ARGUMENT",
            ErrorClass::NotFound => "NOT_FOUND",
            ErrorClass::AlreadyExists => "ALREADY_EXISTS",
            ErrorClass::QuotaExhausted => "QUOTA_EXHAUSTED",
            ErrorClass::Unimplemented => "UNIMPLEMENTED",
        }
    }

    /// Whether retrying the same request can succeed without a change of spec.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorClass::Transient | ErrorClass::DeadlineExceeded | ErrorClass::QuotaExhausted
        )
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ErrorClass::Transient => "transient",
            ErrorClass::DeadlineExceeded => "deadline exceeded",
            ErrorClass::Permanent => "permanent",
            ErrorClass::InvalidArgument => "invalid argument",
            ErrorClass::NotFound => "not found",
            ErrorClass::AlreadyExists => "already exists",
            ErrorClass::QuotaExhausted => "quota exhausted",
            ErrorClass::Unimplemented => "unimplemented",
        };
        f.write_str(name)
    }
}

/// One request field at fault, named by its proto path (`placement.machine_type`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    /// Proto path of the field, for example `placement.image`.
    pub field: String,
    /// What is wrong and what to do about it.
    pub description: String,
}

/// An error a provider returns, or a caller decodes from a `tonic::Status`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {message}")]
pub struct ProviderError {
    /// What the caller should do.
    pub class: ErrorClass,
    /// Stable UPPER_SNAKE_CASE cause (`ErrorInfo.reason`), for example `HOST_UNREACHABLE`.
    pub reason: String,
    /// Human-readable explanation: what failed and what to do.
    pub message: String,
    /// Retry hint (`RetryInfo`), for transient and quota errors.
    pub retry_after: Option<Duration>,
    /// Fields at fault (`BadRequest`), for invalid arguments.
    pub field_violations: Vec<FieldViolation>,
}

impl ProviderError {
    /// An error of `class` with the class's default reason.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        ProviderError {
            class,
            reason: class.default_reason().to_owned(),
            message: message.into(),
            retry_after: None,
            field_violations: Vec::new(),
        }
    }

    /// A transient error: retry with backoff.
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Transient, message)
    }

    /// A permanent error: retrying the same request will not help.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Permanent, message)
    }

    /// An invalid request field, named by its proto path.
    pub fn invalid_argument(field: impl Into<String>, description: impl Into<String>) -> Self {
        let field = field.into();
        let description = description.into();
        let mut error = Self::new(
            ErrorClass::InvalidArgument,
            format!("{field}: {description}"),
        );
        error
            .field_violations
            .push(FieldViolation { field, description });
        error
    }

    /// The instance does not exist.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::NotFound, message)
    }

    /// The key is taken by an instance with an incompatible spec.
    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::AlreadyExists, message)
    }

    /// A quota is exhausted; `retry_after` hints when to try again.
    pub fn quota_exhausted(message: impl Into<String>, retry_after: Option<Duration>) -> Self {
        Self::new(ErrorClass::QuotaExhausted, message).with_retry_after(retry_after)
    }

    /// The call's deadline passed.
    pub fn deadline_exceeded(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::DeadlineExceeded, message)
    }

    /// The optional call is not implemented.
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Unimplemented, message)
    }

    /// Replaces the reason with a more specific UPPER_SNAKE_CASE identifier.
    pub fn with_reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = reason.into();
        self
    }

    /// Sets the retry hint.
    pub fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Adds one more field at fault.
    pub fn with_violation(
        mut self,
        field: impl Into<String>,
        description: impl Into<String>,
    ) -> Self {
        self.field_violations.push(FieldViolation {
            field: field.into(),
            description: description.into(),
        });
        self
    }

    /// Encodes this error as a status with the table's code and rich details, its
    /// text bounded ([`bounded`]).
    pub fn to_status(&self) -> Status {
        let mut details = ErrorDetails::new();
        if self.class != ErrorClass::Unimplemented {
            let reason = bounded::bound(&self.reason, bounded::MAX_ECHO_CHARS);
            details.set_error_info(reason, ERROR_DOMAIN, HashMap::new());
        }
        if let Some(delay) = self.retry_after {
            details.set_retry_info(Some(delay));
        }
        let mut details_bytes = self.message.len().min(bounded::MAX_MESSAGE_BYTES) + 128;
        let mut sent = 0;
        for violation in self.field_violations.iter().take(bounded::MAX_VIOLATIONS) {
            let field = bounded::field_path(&violation.field);
            let description =
                bounded::bound(&violation.description, bounded::MAX_DESCRIPTION_BYTES);
            // Each violation costs its two strings and a few bytes of framing.
            details_bytes += field.len() + description.len() + 8;
            if sent > 0 && details_bytes > bounded::MAX_DETAILS_BYTES {
                break;
            }
            details.add_bad_request_violation(field, description);
            sent += 1;
        }
        let mut message = self.message.clone();
        let unsent = self.field_violations.len() - sent;
        if unsent > 0 {
            message.push_str(&format!(
                " ({unsent} more field violations not shown: fix these first)"
            ));
        }
        let message = bounded::bound(&message, bounded::MAX_MESSAGE_BYTES);
        Status::with_error_details(self.class.code(), message, details)
    }

    /// Decodes a status from any server: the class from its code, the rest from its
    /// details when present.
    pub fn from_status(status: &Status) -> Self {
        let class = ErrorClass::from_code(status.code());
        let details = status.get_error_details();
        let reason = details
            .error_info()
            .filter(|info| !info.reason.is_empty())
            .map_or_else(
                || class.default_reason().to_owned(),
                |info| info.reason.clone(),
            );
        let retry_after = details.retry_info().and_then(|info| info.retry_delay);
        let field_violations = details
            .bad_request()
            .map(|bad_request| {
                bad_request
                    .field_violations
                    .iter()
                    .map(|v| FieldViolation {
                        field: v.field.clone(),
                        description: v.description.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        ProviderError {
            class,
            reason,
            message: status.message().to_owned(),
            retry_after,
            field_violations,
        }
    }
}

impl From<ProviderError> for Status {
    fn from(error: ProviderError) -> Status {
        error.to_status()
    }
}

impl From<Status> for ProviderError {
    fn from(status: Status) -> ProviderError {
        ProviderError::from_status(&status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(class: ErrorClass) -> ProviderError {
        match class {
            ErrorClass::InvalidArgument => {
                ProviderError::invalid_argument("placement.image", "unknown image \"x\"")
                    .with_violation("proxy_port", "must be 1..65535")
            }
            ErrorClass::QuotaExhausted => {
                ProviderError::quota_exhausted("host full", Some(Duration::from_secs(30)))
            }
            ErrorClass::Transient => ProviderError::transient("host unreachable")
                .with_reason("HOST_UNREACHABLE")
                .with_retry_after(Some(Duration::from_millis(1500))),
            other => ProviderError::new(other, format!("a {other} error")),
        }
    }

    #[test]
    fn every_class_round_trips_through_status() {
        for class in ErrorClass::ALL {
            let error = sample(class);
            let status = error.to_status();
            assert_eq!(status.code(), class.code(), "{class}");
            assert_eq!(ProviderError::from_status(&status), error, "{class}");
        }
    }

    #[test]
    fn round_trip_survives_the_wire_encoding() {
        for class in ErrorClass::ALL {
            let error = sample(class);
            let response = error.to_status().into_http::<tonic::body::Body>();
            let decoded = Status::from_header_map(response.headers()).expect("status decodes");
            assert_eq!(ProviderError::from(decoded), error, "{class}");
        }
    }

    #[test]
    fn every_code_has_a_class_and_table_codes_map_back() {
        for class in ErrorClass::ALL {
            assert_eq!(ErrorClass::from_code(class.code()), class);
        }
        assert_eq!(ErrorClass::from_code(Code::Internal), ErrorClass::Transient);
        assert_eq!(ErrorClass::from_code(Code::Unknown), ErrorClass::Transient);
        assert_eq!(
            ErrorClass::from_code(Code::PermissionDenied),
            ErrorClass::Permanent
        );
        assert_eq!(
            ErrorClass::from_code(Code::OutOfRange),
            ErrorClass::InvalidArgument
        );
    }

    #[test]
    fn a_plain_status_decodes_with_default_reason() {
        let error = ProviderError::from_status(&Status::unavailable("connection refused"));
        assert_eq!(error.class, ErrorClass::Transient);
        assert_eq!(error.reason, "TRANSIENT");
        assert_eq!(error.message, "connection refused");
        assert!(error.field_violations.is_empty());
    }

    #[test]
    fn only_transient_deadline_and_quota_are_retryable() {
        let retryable: Vec<_> = ErrorClass::ALL
            .into_iter()
            .filter(|c| c.is_retryable())
            .collect();
        assert_eq!(
            retryable,
            [
                ErrorClass::Transient,
                ErrorClass::DeadlineExceeded,
                ErrorClass::QuotaExhausted
            ]
        );
    }

    #[test]
    fn maximal_field_paths_are_sent_whole_and_the_details_stay_bounded() {
        let key = "\"".repeat(crate::validation::MAX_TAG_BYTES);
        let path = crate::validation::map_entry_path("tags", &key);
        let mut error = ProviderError::invalid_argument(path.clone(), "é".repeat(400));
        for n in 0..20 {
            error = error.with_violation(
                crate::validation::map_entry_path("tags", &format!("{n:\"<256}")),
                "too long ".repeat(70),
            );
        }
        let status = error.to_status();
        assert!(
            status.details().len() <= bounded::MAX_DETAILS_BYTES,
            "{} bytes of details",
            status.details().len()
        );
        let response = status.into_http::<tonic::body::Body>();
        let size: usize = response
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum();
        assert!(size < 14 * 1024, "{size} bytes of metadata");
        let decoded = ProviderError::from(Status::from_header_map(response.headers()).unwrap());
        assert_eq!(decoded.field_violations[0].field, path);
        let sent = decoded.field_violations.len();
        assert!((1..bounded::MAX_VIOLATIONS).contains(&sent), "{sent} sent");
        assert!(
            decoded
                .message
                .contains(&format!("{} more field violations", 21 - sent)),
            "{}",
            decoded.message
        );
    }

    #[test]
    fn echoed_input_of_any_size_fits_in_a_clients_metadata_limit() {
        let id = "i".repeat(4000);
        let mut error = ProviderError::invalid_argument(format!("tags[{id}]"), id.clone());
        error.message = format!("instance {id} {id} does not exist");
        for n in 0..100 {
            error = error.with_violation(format!("tags[{n}{id}]"), format!("bad {id}"));
        }
        let response = error.to_status().into_http::<tonic::body::Body>();
        let size: usize = response
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum();
        assert!(size < 12 * 1024, "{size} bytes of metadata");
        let decoded = ProviderError::from(Status::from_header_map(response.headers()).unwrap());
        assert_eq!(decoded.class, ErrorClass::InvalidArgument);
        assert_eq!(decoded.field_violations.len(), bounded::MAX_VIOLATIONS);
        assert!(
            decoded.message.contains("91 more field violations"),
            "{}",
            decoded.message
        );
        assert!(decoded.message.len() <= bounded::MAX_MESSAGE_BYTES);
        assert!(
            decoded.field_violations[0].field.ends_with("…(4006 bytes)"),
            "{}",
            decoded.field_violations[0].field
        );
    }
}
