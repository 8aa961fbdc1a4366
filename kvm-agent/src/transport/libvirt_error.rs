//! libvirt's errors, classified once, where the call that met them runs.
//!
//! An error libvirt *reports* (no such domain, bad XML) leaves the connection healthy;
//! an error of the *transport* under it (EOF, reset, RPC failure, or any error on a
//! connection that is no longer alive) means the connection is dead and must be dropped.
//! [`classify_libvirt`] tells them apart and gives each its [`ErrorClass`]; the reason is
//! derived from that by [`TransportError::classify`](super::error::TransportError::classify),
//! and the contract's error by the crate's one mapping (`Error::to_provider_error`).

use virt::error::{ErrorDomain, ErrorNumber};

use crate::classification::ErrorClass;

/// A libvirt error as reported by the library, detached from its FFI types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibvirtFailure {
    /// The `virErrorNumber` (e.g. 42 for `VIR_ERR_NO_DOMAIN`).
    pub code: i32,
    /// The code's name (e.g. `NoDomain`).
    pub code_name: String,
    /// libvirt's message.
    pub message: String,
    /// Whether the failure is the connection's transport, not the operation.
    pub transport: bool,
    /// The class derived from the code.
    pub class: ErrorClass,
}

/// `VIR_ERR_SYSTEM_ERROR`: an OS call failed, on the agent's side (the transport) or on
/// the hypervisor (EACCES, ENOSPC, EROFS, a failed qemu-img).
pub(crate) const SYSTEM_ERROR: i32 = 38;

/// Classifies a libvirt error. `connection_alive` is `virConnectIsAlive` after the failure.
pub fn classify_libvirt(error: &virt::error::Error, connection_alive: bool) -> LibvirtFailure {
    classify_libvirt_parts(
        error.code(),
        error.domain(),
        error.message(),
        connection_alive,
    )
}

/// [`classify_libvirt`] on the error's parts.
///
/// | error | transport (drops the connection) | class |
/// |---|---|---|
/// | any, on a dead connection | yes | transient |
/// | any from the RPC or remote layer (`VIR_FROM_RPC`, `VIR_FROM_REMOTE`) | yes | transient |
/// | `Rpc`, `NoConnect`, `InvalidConn`, `AuthFailed`, `Ssh`, `Libssh` | yes | transient |
/// | `SystemError` from the hypervisor's drivers (storage, qemu) on a live connection | no | transient (`LIBVIRT_HOST_ERROR`: fix the host, e.g. permissions or disk space; retried with backoff) |
/// | `No*` (domain, pool, volume, network, ...) | no | not found |
/// | invalid argument, XML, unsupported, denied, CPU incompatible | no | permanent |
/// | anything else | no | transient |
///
/// A `SystemError` libvirtd reports about the host (its own OS call failed) arrives on a
/// healthy connection: dropping that connection would not help, and an error that is
/// already classified must not cost the other calls on the connection their link. Only the client's own system errors (RPC/remote layer: EOF, reset) and any
/// error on a dead connection are transport failures.
pub fn classify_libvirt_parts(
    code: virt::error::ErrorNumberEnum,
    domain: virt::error::ErrorDomainEnum,
    message: &str,
    connection_alive: bool,
) -> LibvirtFailure {
    use ErrorNumber as N;
    let transport = !connection_alive
        || domain.is_any(vec![ErrorDomain::Rpc, ErrorDomain::Remote])
        || code.is_any(vec![
            N::Rpc,
            N::NoConnect,
            N::InvalidConn,
            N::AuthFailed,
            N::Ssh,
            N::Libssh,
        ]);
    let class = if transport {
        ErrorClass::Transient
    } else if code.is_any(vec![
        N::NoDomain,
        N::NoStoragePool,
        N::NoStorageVolume,
        N::NoNetwork,
        N::NoDomainMetadata,
        N::NoDomainSnapshot,
        N::NoSecret,
        N::NoInterface,
        N::NoNodeDevice,
    ]) {
        ErrorClass::NotFound
    } else if code.is_any(vec![
        N::InvalidArg,
        N::XmlError,
        N::XmlDetail,
        N::XmlInvalidSchema,
        N::ConfigUnsupported,
        N::NoSupport,
        N::ArgumentUnsupported,
        N::OperationUnsupported,
        N::OperationDenied,
        N::AccessDenied,
        N::CpuIncompatible,
    ]) {
        ErrorClass::Permanent
    } else {
        ErrorClass::Transient
    };
    LibvirtFailure {
        code: code.to_raw() as i32,
        code_name: code.to_string(),
        message: message.to_owned(),
        transport,
        class,
    }
}
