//! Deliberate contract violations, one per rule, so the conformance suite can be
//! tested against providers it must reject (`reference-provider --misbehave NAME`).
//! Each [`Misbehaviour`] names the check that must catch it; every check has at least
//! one (`proto/tests/conformance_suite.rs` runs them all).

use std::collections::HashMap;
use std::time::Duration;

use prost::Message;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::ProviderError;
use crate::error::ERROR_DOMAIN;

/// One way to break the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Misbehaviour {
    /// Health answers NOT_SERVING for the Provider service.
    HealthNotServing,
    /// Reflection does not serve the google.rpc error detail types.
    ReflectionWithoutErrorTypes,
    /// GetPluginInfo's vendor_version is `latest`, not a semantic version.
    NonSemverVersion,
    /// ValidatePlacement works but GetCapabilities does not declare it.
    UndeclaredCapability,
    /// CAPABILITY_VENDOR_DATA is declared, but vendor_data is refused.
    VendorDataRefused,
    /// A call carrying `traceparent` is refused.
    RefusesTraceContext,
    /// ErrorInfo.domain is `egressproxy.example`.
    WrongErrorDomain,
    /// ErrorInfo.reason is lower case.
    LowercaseReason,
    /// Errors carry no ErrorInfo.
    MissingErrorInfo,
    /// INVALID_ARGUMENT carries no BadRequest.
    MissingBadRequest,
    /// A Create without a placement gets a default one instead of INVALID_ARGUMENT.
    MissingPlacementAccepted,
    /// Map entries are named with Rust's `{:?}` escaping (`\t`, `\u{..}`).
    DebugEscapedPaths,
    /// Field paths longer than 128 characters are cut, so they no longer name the entry.
    CutFieldPaths,
    /// Every field violation is sent, descriptions uncut.
    UnboundedViolations,
    /// NOT_FOUND echoes the whole id, however long.
    UnboundedEcho,
    /// No server-side deadline: tonic answers CANCELLED when grpc-timeout passes, and
    /// ListInstances is slow enough to meet it.
    CancelledAtDeadline,
    /// An unset cloud_init and an empty one are different specs (ALREADY_EXISTS).
    UnsetCloudInitDiffers,
    /// An unset vendor_data and an empty one are the same spec.
    UnsetVendorDataEqualsEmpty,
    /// The name is compared in an idempotent Create.
    NameCompared,
    /// The tags are compared in an idempotent Create.
    TagsCompared,
    /// The placement is compared as resolved (with the chosen host), not as requested.
    ResolvedPlacementCompared,
    /// cloud_init is not compared in an idempotent Create.
    CloudInitNotCompared,
    /// The machine type is not compared in an idempotent Create.
    MachineTypeNotCompared,
    /// Get of a missing instance is FAILED_PRECONDITION instead of NOT_FOUND.
    MissingIsPermanent,
    /// An empty id is NOT_FOUND instead of INVALID_ARGUMENT.
    EmptyIdNotFound,
    /// Instances turn RUNNING without an address.
    RunningWithoutAddress,
    /// Running instances report the address `not-an-ip`.
    AddressNotAnIp,
    /// Instances report another machine type than requested.
    PlacementNotEchoed,
    /// Instances report proxy_port 3128 whatever was requested.
    WrongProxyPort,
    /// An instance created without a location reports none (not the one chosen).
    ChosenLocationMissing,
    /// ListInstances ignores the tag selector.
    SelectorIgnored,
    /// A tag selector matches an instance with any of its entries (OR).
    OrTagMatching,
    /// ListInstances says PROVISIONING where GetInstance says RUNNING.
    ListStateDisagrees,
    /// ListInstances leaves out create_time.
    NoCreateTimeInList,
    /// GetInstance leaves out create_time.
    NoCreateTimeInGet,
    /// ListInstances returns the same next_page_token for ever.
    CyclingPageToken,
    /// A page token the provider never issued reads as the first page.
    AcceptsForeignPageToken,
    /// ListInstances ignores `page_size` (pages of 100).
    IgnorePageSize,
    /// Page sizes are capped at 2, below the contract's floor of 1000 for a cap.
    PageSizeCappedLow,
    /// A page_size over 1000 is INVALID_ARGUMENT instead of clamped.
    RefusesLargePageSize,
    /// A Create arriving within a second of another's new instance returns that instance.
    MergesConcurrentCreates,
    /// Creates of one key within a second of each other each make an instance.
    RacyCreate,
    /// A Create cut off by its deadline leaves an instance its key does not find.
    OrphansCancelledCreate,
    /// A 128-character key (the limit) is refused.
    RefusesBoundary,
    /// 65 tags (one past the limit) are accepted.
    AcceptsOnePast,
    /// A key ending in a line feed is accepted (a `$` regular expression).
    LaxKeyCharset,
    /// vendor_data has no size limit.
    VendorDataUnbounded,
    /// ValidatePlacement accepts any placement.
    ValidateAcceptsAnything,
    /// ValidatePlacement answers without a resolved placement.
    ValidateResolvesNothing,
    /// ValidatePlacement without a placement resolves a default one instead of
    /// INVALID_ARGUMENT.
    ValidateMissingPlacementAccepted,
    /// Deleted instances stay DELETING for ever.
    DeletingForever,
    /// DELETING instances are left out of ListInstances.
    DeletingNotListed,
    /// A Create of a key being deleted answers reason INSTANCE_DELETING.
    WrongDeletingReason,
    /// A key whose instance was deleted is ALREADY_EXISTS for ever.
    KeyReuseRefused,
    /// Delete of a missing instance is NOT_FOUND.
    DeleteMissingNotFound,
    /// Delete of a PROVISIONING instance does nothing (instances provision for 5 s).
    DeleteIgnoredWhileProvisioning,
    /// The google.rpc.Status in the details has another code than the gRPC status.
    StatusDetailsMismatch,
    /// The google.rpc.Status in the details has another message than the gRPC status.
    StatusMessageMismatch,
    /// RESOURCE_EXHAUSTED carries no ErrorInfo.
    ExhaustedWithoutErrorInfo,
    /// FAILED_PRECONDITION carries no ErrorInfo.
    PreconditionWithoutErrorInfo,
    /// ALREADY_EXISTS carries a RetryInfo, a code callers do not retry after a delay.
    RetryInfoOnConflict,
    /// The first CreateInstance answers UNAVAILABLE with no details at all.
    TransientWithoutErrorInfo,
    /// DeleteInstance also deletes the oldest other instance.
    DeletesForeign,
    /// ListLocations works but GetCapabilities does not declare it.
    LocationsUndeclared,
    /// ListLocations lists the first location twice.
    DuplicateLocations,
    /// ListLocations puts every host in a zone it does not list.
    HostInUnlistedZone,
    /// ListLocations ignores the machine type and image filters.
    LocationFilterIgnored,
    /// A ListLocations page token the provider never issued reads as the first page.
    LocationsAcceptForeignPageToken,
    /// ListLocations lists a zone that Create and ValidatePlacement refuse.
    UnplaceableLocation,
    /// A Create on a host without room succeeds.
    CreatesWithoutRoom,
    /// WatchInstances works but GetCapabilities does not declare it.
    WatchUndeclared,
    /// A new watch stream sends SYNCED without the instances that exist.
    WatchNoSnapshot,
    /// A watch stream ignores its tag selector.
    WatchSelectorIgnored,
    /// A watch stream ignores its `id`: it tells every instance its selector matches.
    WatchIdIgnored,
    /// A watch stream never reports an instance as DELETED.
    WatchMissesDeletes,
    /// A watch stream reopened with a resume token starts over as a new one.
    WatchIgnoresResumeToken,
    /// A resume token the provider never issued starts a new stream.
    WatchAcceptsForeignToken,
    /// address_identity is accepted and ignored: every instance gets the one address.
    IdentityIgnored,
    /// A Create of a new key with an identity whose instance runs gets its address too.
    IdentitySharedWhileRunning,
    /// A repeated Create of a key with another address identity returns the instance.
    IdentityNotCompared,
    /// An identity stays held after its last instance is gone.
    IdentityNeverReleased,
    /// Address identities are honoured, but neither capability is declared.
    UndeclaredAddressIdentity,
    /// address_identity is not checked: any text, of any length, is an identity.
    IdentityUnchecked,
    /// requested_address is accepted and ignored: the identity gets another address.
    RequestedAddressIgnored,
    /// A requested address held by another identity is granted again.
    TakenAddressGranted,
    /// A requested address outside the provider's range is granted.
    OutOfRangeAccepted,
    /// A loopback, link-local, multicast, unspecified or broadcast requested address is
    /// checked against the ranges (ADDRESS_NOT_IN_RANGE), not refused as unusable.
    UnusableAddressRanged,
    /// requested_address is not compared in an idempotent Create.
    RequestedAddressNotCompared,
    /// requested_address is trimmed of whitespace before it is read: a text past the
    /// 64-byte limit is taken as the address it pads, and checked against the ranges.
    RequestedAddressTrimmed,
    /// UpdateInstanceTags works but GetCapabilities does not declare it.
    TagsUpdateUndeclared,
    /// UpdateInstanceTags ignores expected_tags: the last writer wins.
    TagsUpdateIgnoresExpected,
    /// UpdateInstanceTags compares, waits for another update to compare too (at most
    /// 5 s), then sets without comparing again: concurrent updates from the same tags
    /// both succeed.
    TagsUpdateNotAtomic,
    /// A repeated UpdateInstanceTags (the tags are already the new ones) answers
    /// TAGS_CHANGED.
    TagsUpdateNotIdempotent,
    /// ListInstances matches and shows the tags an instance had before its update.
    TagsUpdateListStale,
    /// UpdateInstanceTags changes the tags of a DELETING instance.
    TagsUpdateWhileDeleting,
    /// UpdateInstanceTags checks only `tags` against the limits, not `expected_tags`.
    ExpectedTagsUnchecked,
    /// UpdateInstanceTags refuses only empty tag keys: no limit on the number of tags or
    /// the length of keys and values, in `tags` or `expected_tags`.
    TagsUpdateUnbounded,
}

impl Misbehaviour {
    /// The conformance check that must fail for this misbehaviour.
    pub fn caught_by(self) -> &'static str {
        use Misbehaviour as M;
        match self {
            M::HealthNotServing => "health-serving",
            M::ReflectionWithoutErrorTypes => "reflection",
            M::NonSemverVersion => "plugin-info",
            M::UndeclaredCapability | M::VendorDataRefused => "capabilities-match-behaviour",
            M::RefusesTraceContext => "trace-context-accepted",
            M::WrongErrorDomain | M::LowercaseReason | M::MissingErrorInfo => {
                "error-info-on-every-error"
            }
            M::MissingBadRequest | M::MissingPlacementAccepted => "invalid-argument-names-fields",
            M::DebugEscapedPaths | M::CutFieldPaths => "map-entry-paths",
            M::UnboundedViolations => "violations-bounded",
            M::UnboundedEcho => "huge-input-bounded",
            M::CancelledAtDeadline => "server-deadline",
            M::UnsetCloudInitDiffers | M::NameCompared | M::TagsCompared => "create-idempotent",
            M::ResolvedPlacementCompared
            | M::CloudInitNotCompared
            | M::MachineTypeNotCompared
            | M::UnsetVendorDataEqualsEmpty => "create-conflict",
            M::MissingIsPermanent => "get-missing",
            M::EmptyIdNotFound => "empty-id",
            M::RunningWithoutAddress => "becomes-running",
            M::AddressNotAnIp => "addresses-parse",
            M::PlacementNotEchoed
            | M::WrongProxyPort
            | M::ChosenLocationMissing
            | M::NoCreateTimeInGet => "echo",
            M::SelectorIgnored => "list-by-tags",
            M::OrTagMatching => "tag-selector-and",
            M::ListStateDisagrees | M::NoCreateTimeInList => "list-get-agree",
            M::CyclingPageToken => "paging-walks-once",
            M::AcceptsForeignPageToken => "foreign-page-token",
            M::IgnorePageSize | M::RefusesLargePageSize | M::PageSizeCappedLow => {
                "page-size-honoured"
            }
            M::MergesConcurrentCreates => "concurrent-creates-distinct-keys",
            M::RacyCreate => "concurrent-creates-one-key",
            M::OrphansCancelledCreate => "cancelled-create-converges",
            M::RefusesBoundary => "limits-at-boundary",
            M::AcceptsOnePast
            | M::LaxKeyCharset
            | M::VendorDataUnbounded
            | M::IdentityUnchecked
            | M::RequestedAddressTrimmed => "limits-one-past",
            M::ValidateAcceptsAnything
            | M::ValidateResolvesNothing
            | M::ValidateMissingPlacementAccepted => "validate-placement",
            M::DeletingForever | M::DeletingNotListed => "delete-twice-then-gone",
            M::WrongDeletingReason | M::KeyReuseRefused => "key-reuse-after-delete",
            M::DeleteMissingNotFound => "delete-missing",
            M::DeleteIgnoredWhileProvisioning => "delete-while-provisioning",
            M::StatusDetailsMismatch
            | M::StatusMessageMismatch
            | M::TransientWithoutErrorInfo
            | M::ExhaustedWithoutErrorInfo
            | M::PreconditionWithoutErrorInfo
            | M::RetryInfoOnConflict => "errors-well-formed",
            M::DeletesForeign => "foreign-instance-survives",
            M::LocationsUndeclared => "capabilities-match-behaviour",
            M::DuplicateLocations | M::HostInUnlistedZone => "list-locations",
            M::LocationFilterIgnored => "locations-filter",
            M::LocationsAcceptForeignPageToken => "locations-paging",
            M::UnplaceableLocation | M::CreatesWithoutRoom => "locations-placeable",
            M::WatchUndeclared => "capabilities-match-behaviour",
            M::WatchNoSnapshot | M::WatchSelectorIgnored => "watch-snapshot",
            M::WatchIdIgnored => "watch-by-id",
            M::WatchMissesDeletes => "watch-follows-changes",
            M::WatchIgnoresResumeToken | M::WatchAcceptsForeignToken => "watch-resume",
            M::IdentityIgnored
            | M::IdentitySharedWhileRunning
            | M::IdentityNotCompared
            | M::IdentityNeverReleased
            | M::UndeclaredAddressIdentity => "address-identity",
            M::RequestedAddressIgnored
            | M::TakenAddressGranted
            | M::OutOfRangeAccepted
            | M::UnusableAddressRanged
            | M::RequestedAddressNotCompared => "requested-address",
            M::TagsUpdateUndeclared => "capabilities-match-behaviour",
            M::TagsUpdateListStale => "update-tags-replaces",
            M::TagsUpdateIgnoresExpected | M::TagsUpdateNotIdempotent => {
                "update-tags-compare-and-set"
            }
            M::TagsUpdateNotAtomic => "update-tags-concurrent",
            M::TagsUpdateWhileDeleting | M::ExpectedTagsUnchecked | M::TagsUpdateUnbounded => {
                "update-tags-errors"
            }
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

    /// Encodes `error` the way this misbehaviour breaks errors (others: as the
    /// contract says).
    pub(crate) fn encode(self, error: &ProviderError) -> Status {
        match self {
            Misbehaviour::UnboundedViolations => {
                let mut details = ErrorDetails::new();
                details.set_error_info(&error.reason, ERROR_DOMAIN, HashMap::new());
                for v in &error.field_violations {
                    details.add_bad_request_violation(
                        &v.field,
                        format!("{} {}", v.description, "x".repeat(600)),
                    );
                }
                Status::with_error_details(error.class.code(), &error.message, details)
            }
            Misbehaviour::UnboundedEcho => {
                let mut details = ErrorDetails::new();
                details.set_error_info(&error.reason, ERROR_DOMAIN, HashMap::new());
                Status::with_error_details(error.class.code(), &error.message, details)
            }
            _ => self.rewrite(error.to_status()),
        }
    }

    /// Rewrites an encoded error the way this misbehaviour breaks errors.
    fn rewrite(self, status: Status) -> Status {
        let details = status.get_error_details();
        let info = details.error_info();
        let reason = info.map(|i| i.reason.clone()).unwrap_or_default();
        let rebuild = |reason: String, domain: &str, keep_bad_request: bool| {
            let mut rebuilt = ErrorDetails::new();
            rebuilt.set_error_info(reason, domain, HashMap::new());
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
            Misbehaviour::StatusDetailsMismatch => {
                let mut rpc = tonic_types::Status::decode(status.details()).unwrap_or_default();
                rpc.code = tonic::Code::Unknown as i32;
                Status::with_details(status.code(), status.message(), rpc.encode_to_vec().into())
            }
            Misbehaviour::StatusMessageMismatch => {
                let mut rpc = tonic_types::Status::decode(status.details()).unwrap_or_default();
                rpc.message = "an error".into();
                Status::with_details(status.code(), status.message(), rpc.encode_to_vec().into())
            }
            Misbehaviour::ExhaustedWithoutErrorInfo if status.code() == Code::ResourceExhausted => {
                Status::new(status.code(), status.message())
            }
            Misbehaviour::PreconditionWithoutErrorInfo
                if status.code() == Code::FailedPrecondition =>
            {
                Status::new(status.code(), status.message())
            }
            Misbehaviour::RetryInfoOnConflict if status.code() == Code::AlreadyExists => {
                let mut rebuilt = ErrorDetails::new();
                rebuilt.set_error_info(reason, ERROR_DOMAIN, HashMap::new());
                rebuilt.set_retry_info(Some(Duration::from_secs(1)));
                Status::with_error_details(status.code(), status.message(), rebuilt)
            }
            _ => status,
        }
    }
}
