//! The one place the apiserver's failures become the contract's error classes.
//!
//! | apiserver answer | class | reason |
//! |---|---|---|
//! | 401, 403 | permanent | `KUBE_FORBIDDEN`: the provider's RBAC lacks a rule |
//! | 400, 422 | permanent | `POD_REJECTED`: the configuration makes a pod the apiserver refuses |
//! | 409 | transient | `KUBE_CONFLICT`: a concurrent change; the retry reads it |
//! | 429, 5xx, other | transient | `KUBE_UNAVAILABLE` |
//! | no answer (connection, TLS, timeout) | transient | `KUBE_UNREACHABLE` |
//!
//! A 404 never gets here: each call decides what a missing object means for it (Get:
//! NOT_FOUND; Delete: done).

use egressproxy_provider::{ErrorClass, ProviderError};

/// `error` of the apiserver call `op` (for example "create pod x") as the contract's
/// error.
pub fn classify(op: &str, error: kube::Error) -> ProviderError {
    let (class, reason) = match &error {
        kube::Error::Api(status) => match status.code {
            401 | 403 => (ErrorClass::Permanent, "KUBE_FORBIDDEN"),
            400 | 422 => (ErrorClass::Permanent, "POD_REJECTED"),
            409 => (ErrorClass::Transient, "KUBE_CONFLICT"),
            _ => (ErrorClass::Transient, "KUBE_UNAVAILABLE"),
        },
        _ => (ErrorClass::Transient, "KUBE_UNREACHABLE"),
    };
    // The apiserver's own message says what was refused and why; kube's Display of an
    // API error repeats it with the whole Status in debug form.
    let message = match &error {
        kube::Error::Api(status) => format!("{op}: {} ({})", status.message, status.code),
        other => format!("{op}: {other}"),
    };
    ProviderError::new(class, message).with_reason(reason)
}

/// Whether `error` is the apiserver's 404.
pub fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

/// Whether `error` is the apiserver's 409 AlreadyExists (not a write conflict).
pub fn is_already_exists(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409 && status.reason == "AlreadyExists")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            reason: reason.into(),
            message: "m".into(),
            ..kube::core::Status::default()
        }))
    }

    /// The module doc's table, row for row.
    #[test]
    fn classes_follow_the_table() {
        let rows = [
            (
                api(401, "Unauthorized"),
                ErrorClass::Permanent,
                "KUBE_FORBIDDEN",
            ),
            (
                api(403, "Forbidden"),
                ErrorClass::Permanent,
                "KUBE_FORBIDDEN",
            ),
            (
                api(400, "BadRequest"),
                ErrorClass::Permanent,
                "POD_REJECTED",
            ),
            (api(422, "Invalid"), ErrorClass::Permanent, "POD_REJECTED"),
            (api(409, "Conflict"), ErrorClass::Transient, "KUBE_CONFLICT"),
            (
                api(429, "TooManyRequests"),
                ErrorClass::Transient,
                "KUBE_UNAVAILABLE",
            ),
            (
                api(503, "ServiceUnavailable"),
                ErrorClass::Transient,
                "KUBE_UNAVAILABLE",
            ),
            (
                kube::Error::TlsRequired,
                ErrorClass::Transient,
                "KUBE_UNREACHABLE",
            ),
        ];
        for (error, class, reason) in rows {
            let classified = classify("op", error);
            assert_eq!(
                (classified.class, classified.reason.as_str()),
                (class, reason)
            );
        }
    }

    #[test]
    fn already_exists_is_told_from_a_write_conflict() {
        assert!(is_already_exists(&api(409, "AlreadyExists")));
        assert!(!is_already_exists(&api(409, "Conflict")));
        assert!(is_not_found(&api(404, "NotFound")));
    }
}
