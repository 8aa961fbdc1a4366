//! Words for what came back, written for people: status codes by their gRPC names,
//! instances by their fields. Never Rust `Debug` output.

use tonic::Code;
use tonic_types::StatusExt;

use crate::pb;

/// The gRPC name of a code (`NOT_FOUND`).
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `NOT_FOUND "message" (ErrorInfo egressproxy.dev/NOT_FOUND; BadRequest: key)`, the
/// message cut to 200 characters.
pub(crate) fn status(status: &tonic::Status) -> String {
    let mut message: String = status.message().chars().take(200).collect();
    if message.len() < status.message().len() {
        message.push('…');
    }
    let details = status.get_error_details();
    let info = match details.error_info() {
        Some(info) => format!("ErrorInfo {}/{}", info.domain, info.reason),
        None => "no ErrorInfo".to_owned(),
    };
    let fields = details
        .bad_request()
        .map(|bad| {
            let fields: Vec<&str> = bad
                .field_violations
                .iter()
                .map(|v| v.field.as_str())
                .collect();
            format!("; BadRequest: {}", fields.join(", "))
        })
        .unwrap_or_default();
    format!(
        "{} \"{message}\" ({info}{fields})",
        code_name(status.code())
    )
}

/// `host h1` / `zone z` / `no location`, then machine type and image.
pub(crate) fn placement(placement: Option<&pb::Placement>) -> String {
    let Some(placement) = placement else {
        return "no placement".to_owned();
    };
    let location = match &placement.location {
        Some(pb::placement::Location::Host(host)) => format!("host {host}"),
        Some(pb::placement::Location::Zone(zone)) => format!("zone {zone}"),
        None => "no location".to_owned(),
    };
    format!(
        "{location}, machine type {}, image {}",
        placement.machine_type, placement.image
    )
}

/// A state's contract name (`RUNNING`).
pub(crate) fn state(state: i32) -> String {
    pb::InstanceState::try_from(state)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("INSTANCE_STATE_")
                .to_owned()
        })
        .unwrap_or_else(|_| format!("unknown state {state}"))
}

/// The fields callers compare, on one line.
pub(crate) fn instance(instance: &pb::Instance) -> String {
    let addresses: Vec<&str> = instance
        .addresses
        .iter()
        .map(|a| a.address.as_str())
        .collect();
    let mut tags: Vec<String> = instance
        .tags
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    tags.sort();
    format!(
        "instance {} (state {}, addresses [{}], {}, port {}, tags {{{}}})",
        instance.id,
        state(instance.state),
        addresses.join(", "),
        placement(instance.placement.as_ref()),
        instance.proxy_port,
        tags.join(", ")
    )
}
