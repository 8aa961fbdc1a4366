//! The operator's one error type, and what each error means for retrying.

use std::time::Duration;

use egressproxy_provider::error::reason;
use egressproxy_provider::{ErrorClass, ProviderError};

/// Everything a reconcile can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API failed (network, conflict, permission).
    #[error("Kubernetes API call failed")]
    Kube(#[from] kube::Error),
    /// A provider call failed.
    #[error("provider {provider}: {op} failed")]
    Provider {
        /// The provider's configured name.
        provider: String,
        /// The call, for example `CreateInstance`.
        op: &'static str,
        /// The classified error (boxed: it carries details and is large).
        source: Box<ProviderError>,
    },
    /// `spec.provider` names no configured provider.
    #[error(
        "provider {0:?} is not configured in the operator's provider config: fix spec.provider or add the provider"
    )]
    ProviderNotConfigured(String),
    /// The Proxy is being deleted but its provider is no longer configured.
    #[error(
        "provider {0:?} is no longer configured, so its VM cannot be deleted: restore the provider, \
         or annotate the Proxy egressproxy.dev/abandon-instance=true to delete it and leave the VM behind"
    )]
    ProviderGone(String),
    /// The provider speaks another major version of the contract.
    #[error(
        "provider {provider} implements contract {found}, this operator needs {expected}.x: upgrade one of them"
    )]
    IncompatibleProvider {
        /// The provider's configured name.
        provider: String,
        /// Its contract version.
        found: String,
        /// The major version this operator speaks.
        expected: String,
    },
    /// The cloud-init Secret or key is missing.
    #[error("cloud-init Secret {secret}: {problem}")]
    CloudInitSecret {
        /// `namespace/name`.
        secret: String,
        /// What is wrong and what to do.
        problem: String,
    },
    /// The provider client could not be built (bad endpoint or TLS files).
    #[error("provider {provider}: cannot connect")]
    Connect {
        /// The provider's configured name.
        provider: String,
        /// Why.
        #[source]
        source: egressproxy_provider::client::ConnectError,
    },
    /// A spec field asks for something this Proxy's provider cannot do, or is malformed
    /// in a way the API server's schema cannot catch.
    #[error("{field}: {problem}")]
    UnsupportedSpec {
        /// The field's path, for example `spec.egress.address`.
        field: &'static str,
        /// What is wrong and what to do.
        problem: String,
    },
}

/// What the controller does after an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Retry with exponential backoff.
    Backoff,
    /// Retry after this delay (a provider's quota hint).
    After(Duration),
    /// Wait for the spec to change: the spec itself is at fault.
    OnSpecChange,
    /// Retry rarely: a person must act, but outside the Proxy's spec (the provider's
    /// configuration, its images), so no spec change will announce the fix.
    Slowly,
}

/// The `Ready` reasons of errors a person must fix: a Proxy with one of them is Failed.
pub const PERMANENT_REASONS: [&str; 7] = [
    "InvalidSpec",
    "ProviderRejected",
    "InstanceKeyConflict",
    "AddressTaken",
    "ProviderNotConfigured",
    "IncompatibleProvider",
    "ProviderConfigInvalid",
];

/// Who must act on an error, besides the operator's own retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// Nobody: the retry will most likely succeed on its own.
    NotNeeded,
    /// A person is told (an Event), though the retry may succeed without them (a
    /// cloud-init Secret someone has yet to create).
    Tell,
    /// A person must fix the spec, the config or the provider: the Proxy is Failed and
    /// an Event says why.
    Fix,
}

/// What an error means, decided once ([`Error::classify`]): the `Ready` reason users
/// see, how the controller retries, and who must act.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    /// The condition reason that tells a user what kind of failure this is.
    pub reason: &'static str,
    /// How to retry.
    pub retry: Retry,
    /// Who must act.
    pub attention: Attention,
}

impl Error {
    /// What this error means: the one place errors are classified.
    pub fn classify(&self) -> Classification {
        use Attention::{Fix, NotNeeded, Tell};
        use Retry::{After, Backoff, OnSpecChange, Slowly};
        let class = |reason, retry, attention| Classification {
            reason,
            retry,
            attention,
        };
        match self {
            Error::Provider { source, .. } => match source.class {
                // The identity's earlier instance is being deleted: it goes on its own.
                ErrorClass::Transient if source.reason == reason::ADDRESS_IDENTITY_IN_USE => {
                    class("WaitingForOldInstance", Backoff, NotNeeded)
                }
                ErrorClass::AlreadyExists if source.reason == reason::ADDRESS_TAKEN => {
                    class("AddressTaken", Slowly, Fix)
                }
                ErrorClass::Transient | ErrorClass::DeadlineExceeded => {
                    class("ProviderUnavailable", Backoff, NotNeeded)
                }
                ErrorClass::QuotaExhausted => class(
                    "QuotaExhausted",
                    source.retry_after.map_or(Backoff, After),
                    NotNeeded,
                ),
                // The provider names a field of the request: only a new spec helps.
                ErrorClass::InvalidArgument => class("InvalidSpec", OnSpecChange, Fix),
                // The cause lies at the provider (a bad image checksum in its config, a
                // missing capability, a key taken): its operators may fix it at any
                // time, and no spec change would announce that, so retry slowly.
                ErrorClass::AlreadyExists => class("InstanceKeyConflict", Slowly, Fix),
                ErrorClass::Permanent | ErrorClass::Unimplemented => {
                    class("ProviderRejected", Slowly, Fix)
                }
                ErrorClass::NotFound => class("InstanceNotFound", Backoff, NotNeeded),
            },
            // A config or provider fix does not change the Proxy, so these retry (slowly,
            // as the backoff grows) instead of waiting for a spec change.
            Error::ProviderNotConfigured(_) | Error::ProviderGone(_) => {
                class("ProviderNotConfigured", Backoff, Fix)
            }
            Error::IncompatibleProvider { .. } => class("IncompatibleProvider", Backoff, Fix),
            Error::Connect { .. } => class("ProviderConfigInvalid", Backoff, Fix),
            Error::CloudInitSecret { .. } => class("CloudInitSecretUnavailable", Backoff, Tell),
            Error::UnsupportedSpec { .. } => class("InvalidSpec", OnSpecChange, Fix),
            Error::Kube(_) => class("KubernetesApiError", Backoff, NotNeeded),
        }
    }

    /// How to retry after this error.
    pub fn retry(&self) -> Retry {
        self.classify().retry
    }

    /// The condition reason that tells a user what kind of failure this is.
    pub fn reason(&self) -> &'static str {
        self.classify().reason
    }

    /// Whether a person must act (fix the spec, the config or the provider): the
    /// Proxy is then Failed and an Event says why.
    pub fn is_permanent(&self) -> bool {
        self.classify().attention == Attention::Fix
    }

    /// Whether an Event should tell a person.
    pub fn needs_a_person(&self) -> bool {
        self.classify().attention != Attention::NotNeeded
    }

    /// The error and its sources, for messages users read. A provider's field
    /// violations are added when its message does not already name the field.
    pub fn describe(&self) -> String {
        let mut text = with_causes(self);
        if let Error::Provider { source, .. } = self {
            let missing: Vec<String> = source
                .field_violations
                .iter()
                .filter(|v| !source.message.contains(&v.field))
                .map(|v| format!("{}: {}", v.field, v.description))
                .collect();
            if !missing.is_empty() {
                text.push_str(&format!(" (field {})", missing.join("; ")));
            }
        }
        text
    }

    /// The class label for metrics.
    pub fn class_label(&self) -> &'static str {
        let classification = self.classify();
        match classification.retry {
            _ if classification.attention == Attention::Fix => "permanent",
            Retry::After(_) => "quota",
            _ => "transient",
        }
    }
}

/// Shorthand for operator results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `error` followed by each of its sources: the whole story in one line, for messages and
/// logs (the contract crate's one walker of error chains).
pub(crate) use egressproxy_provider::error::with_causes;

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(error: ProviderError) -> Error {
        Error::Provider {
            provider: "p".into(),
            op: "CreateInstance",
            source: Box::new(error),
        }
    }

    /// The contract's error table tells callers what to do per class; the operator's
    /// retry policy must be what it says. Before, the table said permanent errors and
    /// ALREADY_EXISTS are retried only after a spec change, while the operator retries
    /// them slowly (a fix outside the spec announces itself no other way).
    #[test]
    fn the_contracts_error_table_says_what_the_operator_does() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/contract.md"))
                .unwrap();
        // The class table: | class | gRPC code | details | caller does |.
        let caller_does = |code: &str| -> String {
            doc.lines()
                .map(|line| line.split('|').map(str::trim).collect::<Vec<_>>())
                .find(|cells| cells.len() == 6 && cells[2] == format!("`{code}`"))
                .map(|cells| cells[4].to_lowercase())
                .unwrap_or_else(|| panic!("docs/contract.md's error table has no row for {code}"))
        };
        for (class, code) in [
            (ErrorClass::Transient, "UNAVAILABLE"),
            (ErrorClass::DeadlineExceeded, "DEADLINE_EXCEEDED"),
            (ErrorClass::Permanent, "FAILED_PRECONDITION"),
            (ErrorClass::InvalidArgument, "INVALID_ARGUMENT"),
            (ErrorClass::AlreadyExists, "ALREADY_EXISTS"),
            (ErrorClass::QuotaExhausted, "RESOURCE_EXHAUSTED"),
        ] {
            let error = ProviderError::new(class, "x").with_retry_after(
                (class == ErrorClass::QuotaExhausted).then_some(Duration::from_secs(30)),
            );
            let wanted = match provider(error).retry() {
                Retry::Backoff => "backoff",
                Retry::After(_) => "retryinfo",
                Retry::Slowly => "slowly",
                Retry::OnSpecChange => "new request",
            };
            let said = caller_does(code);
            assert!(
                said.contains(wanted),
                "{code}: the contract says {said:?}, the operator does {wanted:?}"
            );
        }
    }

    #[test]
    fn provider_error_classes_map_to_retry_policies() {
        let cases = [
            (
                ProviderError::transient("x"),
                Retry::Backoff,
                "ProviderUnavailable",
            ),
            (
                ProviderError::deadline_exceeded("x"),
                Retry::Backoff,
                "ProviderUnavailable",
            ),
            (
                ProviderError::permanent("x"),
                Retry::Slowly,
                "ProviderRejected",
            ),
            (
                ProviderError::invalid_argument("placement.image", "x"),
                Retry::OnSpecChange,
                "InvalidSpec",
            ),
            (
                ProviderError::already_exists("x"),
                Retry::Slowly,
                "InstanceKeyConflict",
            ),
            (
                ProviderError::quota_exhausted("x", Some(Duration::from_secs(7))),
                Retry::After(Duration::from_secs(7)),
                "QuotaExhausted",
            ),
            (
                ProviderError::quota_exhausted("x", None),
                Retry::Backoff,
                "QuotaExhausted",
            ),
            (
                ProviderError::already_exists("x").with_reason(reason::ADDRESS_TAKEN),
                Retry::Slowly,
                "AddressTaken",
            ),
            (
                ProviderError::transient("x").with_reason(reason::ADDRESS_IDENTITY_IN_USE),
                Retry::Backoff,
                "WaitingForOldInstance",
            ),
        ];
        for (error, retry, reason) in cases {
            let error = provider(error);
            assert_eq!((error.retry(), error.reason()), (retry, reason), "{error}");
        }
    }

    #[test]
    fn the_failed_phase_follows_exactly_the_permanent_errors() {
        let errors = [
            provider(ProviderError::transient("x")),
            provider(ProviderError::permanent("x")),
            provider(ProviderError::invalid_argument("f", "x")),
            provider(ProviderError::already_exists("x")),
            provider(ProviderError::already_exists("x").with_reason(reason::ADDRESS_TAKEN)),
            provider(ProviderError::transient("x").with_reason(reason::ADDRESS_IDENTITY_IN_USE)),
            provider(ProviderError::quota_exhausted("x", None)),
            provider(ProviderError::not_found("x")),
            provider(ProviderError::unimplemented("x")),
            Error::ProviderNotConfigured("x".into()),
            Error::ProviderGone("x".into()),
            Error::IncompatibleProvider {
                provider: "p".into(),
                found: "2.0.0".into(),
                expected: "1".into(),
            },
            Error::CloudInitSecret {
                secret: "ns/s".into(),
                problem: "missing".into(),
            },
            Error::UnsupportedSpec {
                field: "spec.egress.address",
                problem: "x".into(),
            },
        ];
        for error in errors {
            assert_eq!(
                PERMANENT_REASONS.contains(&error.reason()),
                error.is_permanent(),
                "{error}"
            );
        }
    }

    #[test]
    fn field_violations_reach_the_message() {
        let rejected = ProviderError::new(ErrorClass::InvalidArgument, "request rejected")
            .with_violation("placement.image", "unknown image \"x\": use debian-12")
            .with_violation("proxy_port", "must be 1..65535");
        let message = provider(rejected).describe();
        assert!(
            message.contains("request rejected")
                && message.contains("placement.image: unknown image \"x\": use debian-12")
                && message.contains("proxy_port: must be 1..65535"),
            "{message}"
        );
        // A message that already names its field is not repeated.
        let named = provider(ProviderError::invalid_argument(
            "placement.image",
            "unknown",
        ));
        assert_eq!(named.describe().matches("placement.image").count(), 1);
    }

    #[test]
    fn configuration_errors_wait_for_a_change() {
        assert!(Error::ProviderNotConfigured("x".into()).is_permanent());
        let secret = Error::CloudInitSecret {
            secret: "ns/s".into(),
            problem: "missing".into(),
        };
        assert!(!secret.is_permanent(), "a Secret may be created later");
    }
}
