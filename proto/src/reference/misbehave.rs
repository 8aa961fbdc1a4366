//! Deliberate contract violations, one per rule, so the conformance suite can be
//! tested against providers it must reject (`reference-provider --misbehave NAME`).
//! Each [`Misbehaviour`] names the check that must catch it.

use tonic::Status;
use tonic_types::{ErrorDetails, StatusExt};

use crate::error::ERROR_DOMAIN;

/// One way to break the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Misbehaviour {
    /// ErrorInfo.domain is `egressproxy.example`.
    WrongErrorDomain,
    /// ErrorInfo.reason is lower case.
    LowercaseReason,
    /// Errors carry no ErrorInfo.
    MissingErrorInfo,
    /// INVALID_ARGUMENT carries no BadRequest.
    MissingBadRequest,
    /// ListInstances ignores `page_size` (pages of 100).
    IgnorePageSize,
    /// A tag selector matches an instance with any of its entries (OR).
    OrTagMatching,
    /// Running instances report the address `not-an-ip`.
    AddressNotAnIp,
    /// Instances report another machine type than requested.
    PlacementNotEchoed,
    /// Instances report proxy_port 3128 whatever was requested.
    WrongProxyPort,
    /// ListInstances says PROVISIONING where GetInstance says RUNNING.
    ListStateDisagrees,
    /// Concurrent Creates of one key each make an instance.
    RacyCreate,
    /// An empty id is NOT_FOUND instead of INVALID_ARGUMENT.
    EmptyIdNotFound,
    /// Deleted instances stay DELETING for ever.
    DeletingForever,
    /// ListInstances returns the same next_page_token for ever.
    CyclingPageToken,
    /// ValidatePlacement works but GetCapabilities does not declare it.
    UndeclaredCapability,
    /// DeleteInstance also deletes the oldest other instance.
    DeletesForeign,
}

impl Misbehaviour {
    /// The conformance check that must fail for this misbehaviour.
    pub fn caught_by(self) -> &'static str {
        match self {
            Misbehaviour::WrongErrorDomain
            | Misbehaviour::LowercaseReason
            | Misbehaviour::MissingErrorInfo => "error-info-on-every-error",
            Misbehaviour::MissingBadRequest => "invalid-argument-names-fields",
            Misbehaviour::IgnorePageSize => "page-size-honoured",
            Misbehaviour::OrTagMatching => "tag-selector-and",
            Misbehaviour::AddressNotAnIp => "addresses-parse",
            Misbehaviour::PlacementNotEchoed | Misbehaviour::WrongProxyPort => "echo",
            Misbehaviour::ListStateDisagrees => "list-get-agree",
            Misbehaviour::RacyCreate => "concurrent-creates-one-key",
            Misbehaviour::EmptyIdNotFound => "empty-id",
            Misbehaviour::DeletingForever => "delete-twice-then-gone",
            Misbehaviour::CyclingPageToken => "paging-walks-once",
            Misbehaviour::UndeclaredCapability => "capabilities-match-behaviour",
            Misbehaviour::DeletesForeign => "foreign-instance-survives",
        }
    }

    /// Every misbehaviour.
    pub fn all() -> &'static [Misbehaviour] {
        <Misbehaviour as clap::ValueEnum>::value_variants()
    }

    /// The command-line name (`wrong-error-domain`).
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map(|value| value.get_name().to_owned())
            .unwrap_or_default()
    }

    /// Rewrites an error the way this misbehaviour breaks errors (others: unchanged).
    pub(crate) fn error(self, status: Status) -> Status {
        let details = status.get_error_details();
        let info = details.error_info();
        let reason = info.map(|i| i.reason.clone()).unwrap_or_default();
        let rebuild = |reason: String, domain: &str, keep_bad_request: bool| {
            let mut rebuilt = ErrorDetails::new();
            rebuilt.set_error_info(reason, domain, std::collections::HashMap::new());
            if keep_bad_request && let Some(bad) = details.bad_request() {
                for v in &bad.field_violations {
                    rebuilt.add_bad_request_violation(&v.field, &v.description);
                }
            }
            Status::with_error_details(status.code(), status.message(), rebuilt)
        };
        match self {
            Misbehaviour::WrongErrorDomain => rebuild(reason, "egressproxy.example", true),
            Misbehaviour::LowercaseReason => rebuild(reason.to_lowercase(), ERROR_DOMAIN, true),
            Misbehaviour::MissingErrorInfo => Status::new(status.code(), status.message()),
            Misbehaviour::MissingBadRequest => rebuild(reason, ERROR_DOMAIN, false),
            _ => status,
        }
    }
}
