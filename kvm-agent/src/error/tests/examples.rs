//! One example of every error the mapping tells apart, with its contract class and
//! reason: the tables the mapping tests and the documented error table are checked
//! against.

use std::time::Duration;

use super::super::*;
use crate::libvirt::xml::XmlError;

fn libvirt(class: ErrorClass, transport: bool) -> Error {
    Error::Transport(TransportError::Libvirt {
        host: "hv".into(),
        op: "virStoragePoolLookupByName",
        failure: LibvirtFailure {
            code: 49,
            code_name: "NoStoragePool".into(),
            message: "no pool".into(),
            transport,
            class,
        },
    })
}

fn image_http(status: u16) -> Error {
    image_http_error(status).into()
}

fn image_http_error(status: u16) -> ImageError {
    ImageError::Http {
        url: "https://example.org/i.qcow2".into(),
        status,
    }
}

/// One error of every kind the mapping tells apart, with its contract class and reason.
pub(super) fn mapping_table() -> Vec<(Error, egressproxy_provider::ErrorClass, &'static str)> {
    use egressproxy_provider::ErrorClass as C;
    use virt::error::{ErrorDomain as D, ErrorNumber as N};
    let io = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    let backing_off = |last_class| {
        Error::Transport(TransportError::SshBackingOff {
            host: "hv".into(),
            retry_in: Duration::from_secs(3),
            last_error: "refused".into(),
            last_class,
        })
    };
    let table: Vec<(Error, C, &str)> = vec![
        (Error::config(vec![]), C::Permanent, "AGENT_CONFIG_INVALID"),
        (
            Error::Transport(TransportError::UnknownHost {
                host: "gone".into(),
            }),
            C::Permanent,
            "HOST_NOT_CONFIGURED",
        ),
        (
            Error::Transport(TransportError::SshConnect {
                host: "hv".into(),
                address: "hv:22".into(),
                source: io(),
            }),
            C::Transient,
            "HOST_UNREACHABLE",
        ),
        (
            Error::Transport(TransportError::SshHandshakeTimeout {
                host: "hv".into(),
                after: Duration::from_secs(10),
            }),
            C::Transient,
            "HOST_UNREACHABLE",
        ),
        (
            Error::Transport(TransportError::SshSessionClosed { host: "hv".into() }),
            C::Transient,
            "HOST_UNREACHABLE",
        ),
        (
            Error::Transport(TransportError::LocalSocket {
                host: "hv".into(),
                socket: "/s".into(),
                source: io(),
            }),
            C::Transient,
            "HOST_UNREACHABLE",
        ),
        (
            Error::Transport(TransportError::Ssh {
                host: "hv".into(),
                source: Box::new(russh::Error::Disconnect),
            }),
            C::Transient,
            "SSH_FAILED",
        ),
        (
            Error::Transport(TransportError::HostKeyUnknown {
                host: "hv".into(),
                fingerprint: "SHA256:x".into(),
                known_hosts: "/kh".into(),
            }),
            C::Permanent,
            "SSH_HOST_KEY_UNKNOWN",
        ),
        (
            Error::Transport(TransportError::HostKeyChanged {
                host: "hv".into(),
                fingerprint: "SHA256:x".into(),
                known_hosts: "/kh".into(),
                line: 3,
            }),
            C::Permanent,
            "SSH_HOST_KEY_CHANGED",
        ),
        (
            Error::Transport(TransportError::SshAuthRejected {
                host: "hv".into(),
                user: "u".into(),
                key_fingerprint: "SHA256:k".into(),
            }),
            C::Permanent,
            "SSH_AUTH_REJECTED",
        ),
        (
            backing_off(ErrorClass::Transient),
            C::Transient,
            "SSH_BACKING_OFF",
        ),
        (
            backing_off(ErrorClass::Permanent),
            C::Permanent,
            "SSH_BACKING_OFF",
        ),
        (
            Error::Transport(TransportError::ForwardRefused {
                host: "hv".into(),
                socket: "/s".into(),
                reason: "denied".into(),
            }),
            C::Transient,
            "LIBVIRT_FORWARD_REFUSED",
        ),
        (
            libvirt(ErrorClass::Transient, true),
            C::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        (
            libvirt(ErrorClass::NotFound, false),
            C::Permanent,
            "LIBVIRT_OBJECT_MISSING",
        ),
        (
            libvirt(ErrorClass::Permanent, false),
            C::Permanent,
            "LIBVIRT_REJECTED",
        ),
        (
            libvirt(ErrorClass::Transient, false),
            C::Transient,
            "LIBVIRT_FAILED",
        ),
        (
            Error::Transport(TransportError::DeadlineExceeded {
                host: "hv".into(),
                op: "virDomainCreate",
                after: Duration::from_secs(1),
            }),
            C::DeadlineExceeded,
            "LIBVIRT_DEADLINE",
        ),
        (
            Error::Transport(TransportError::ConnectionCut {
                host: "hv".into(),
                op: "virDomainCreate",
                cause: "x".into(),
            }),
            C::Transient,
            "LIBVIRT_CONNECTION_CUT",
        ),
        (
            TransportError::io("relay", io()).into(),
            C::Transient,
            "AGENT_IO_FAILED",
        ),
        (
            Error::Transport(TransportError::Worker {
                host: "hv".into(),
                op: "virDomainCreate",
                reason: "panic".into(),
            }),
            C::Transient,
            "AGENT_WORKER_FAILED",
        ),
        (image_http(404), C::Permanent, "IMAGE_NOT_FOUND"),
        (image_http(410), C::Permanent, "IMAGE_NOT_FOUND"),
        (image_http(403), C::Permanent, "IMAGE_FORBIDDEN"),
        (image_http(401), C::Permanent, "IMAGE_FORBIDDEN"),
        (image_http(500), C::Transient, "IMAGE_SERVER_ERROR"),
        (image_http(503), C::Transient, "IMAGE_SERVER_ERROR"),
        (image_http(429), C::Transient, "IMAGE_SERVER_ERROR"),
        (image_http(408), C::Transient, "IMAGE_SERVER_ERROR"),
        (image_http(400), C::Permanent, "IMAGE_HTTP_ERROR"),
        (image_http(304), C::Permanent, "IMAGE_HTTP_ERROR"),
        (
            Error::Image(ImageError::Fetch {
                url: "u".into(),
                reason: "refused".into(),
                permanent: false,
            }),
            C::Transient,
            "IMAGE_UNREACHABLE",
        ),
        (
            Error::Image(ImageError::Fetch {
                url: "u".into(),
                reason: "bad url".into(),
                permanent: true,
            }),
            C::Permanent,
            "IMAGE_URL_INVALID",
        ),
        (
            Error::Image(ImageError::Truncated {
                url: "u".into(),
                received: 1,
                expected: Some(2),
                reason: "eof".into(),
            }),
            C::Transient,
            "IMAGE_TRUNCATED",
        ),
        (
            Error::Image(ImageError::Checksum {
                url: "u".into(),
                expected: "a".into(),
                actual: "b".into(),
            }),
            C::Permanent,
            "IMAGE_CHECKSUM_MISMATCH",
        ),
        (
            Error::Image(ImageError::PoolFull {
                host: "hv".into(),
                pool: "default".into(),
                image: "debian".into(),
                needed: 2 << 20,
                available: 1 << 20,
            }),
            C::Transient,
            "POOL_FULL",
        ),
        (
            Error::Image(ImageError::Downloading {
                image: "debian".into(),
                host: "hv".into(),
                received: 1,
                expected: Some(2),
                retry_in: Duration::from_secs(7),
            }),
            C::Transient,
            "IMAGE_DOWNLOADING",
        ),
        (
            Error::Image(ImageError::Format {
                url: "u".into(),
                problem: "libvirt found raw, the configuration says qcow2".into(),
            }),
            C::Permanent,
            "IMAGE_FORMAT_MISMATCH",
        ),
        (
            Error::Transport(TransportError::Libvirt {
                host: "hv".into(),
                op: "virStorageVolCreateXML",
                failure: classify_libvirt_parts(
                    N::SystemError.into(),
                    D::Storage.into(),
                    "cannot create file: Read-only file system",
                    true,
                ),
            }),
            C::Transient,
            "LIBVIRT_HOST_ERROR",
        ),
        (
            Error::DomainNameTaken {
                host: "hv".into(),
                key: "k".into(),
                domain: "egressproxy-k".into(),
            },
            C::AlreadyExists,
            "DOMAIN_NAME_TAKEN",
        ),
        (
            Error::DomainXmlInvalid {
                domain: "egressproxy-k".into(),
                reason: "bad".into(),
            },
            C::Permanent,
            "DOMAIN_XML_INVALID",
        ),
        (
            Error::HostNotReady {
                host: "hv".into(),
                failures: vec!["network: missing".into()],
            },
            C::Permanent,
            "HOST_NOT_READY",
        ),
        (
            Error::CreateInProgress {
                host: "hv".into(),
                key: "k".into(),
                waited: Duration::from_secs(1),
            },
            C::Transient,
            "CREATE_IN_PROGRESS",
        ),
        (
            Error::Libvirt(LibvirtError::KvmProbeRunning {
                host: "hv".into(),
                retry_in: Duration::from_secs(9),
            }),
            C::Transient,
            "KVM_PROBE_RUNNING",
        ),
        (
            Error::Image(ImageError::Shared(std::sync::Arc::new(image_http_error(
                404,
            )))),
            C::Permanent,
            "IMAGE_NOT_FOUND",
        ),
        (
            Error::Image(ImageError::Shared(std::sync::Arc::new(image_http_error(
                503,
            )))),
            C::Transient,
            "IMAGE_SERVER_ERROR",
        ),
    ];
    table
}

/// Errors the mapping tells apart that the table above leaves out: their contract
/// class has no counterpart in [`ErrorClass`] (an instance, not a libvirt object, is
/// missing) or they only exist on the contract's side.
pub(super) fn contract_only_table() -> Vec<(Error, egressproxy_provider::ErrorClass, &'static str)>
{
    use egressproxy_provider::ErrorClass as C;
    let unreadable = || crate::libvirt::xml::volume::VolumeFacts::parse("<volume>").unwrap_err();
    let unbuildable = XmlError::Serialize(quick_xml::SeError::Custom("no".into()));
    vec![
        (
            Error::NoRoom {
                machine_type: "small (1 vCPU, 1024 MiB)".into(),
                asked: "zone z1".into(),
                lacks: vec!["hv1: 512 MiB free".into()],
            },
            C::QuotaExhausted,
            "CAPACITY_EXHAUSTED",
        ),
        (
            Error::Libvirt(LibvirtError::NoDhcpRange {
                network: "default".into(),
            }),
            C::Permanent,
            "NETWORK_WITHOUT_DHCP",
        ),
        (
            Error::Libvirt(LibvirtError::AddressesExhausted {
                network: "default".into(),
            }),
            C::QuotaExhausted,
            "ADDRESSES_EXHAUSTED",
        ),
        (
            Error::AddressIdentityInUse {
                identity: "uid".into(),
                holder: "hv/k".into(),
            },
            C::Transient,
            "ADDRESS_IDENTITY_IN_USE",
        ),
        (
            Error::AddressNotInRange {
                requested: "198.51.100.7".into(),
                host: "hv".into(),
                range: "192.0.2.10-192.0.2.20/24".into(),
            },
            C::InvalidArgument,
            "ADDRESS_NOT_IN_RANGE",
        ),
        (
            Error::AddressTaken {
                requested: "192.0.2.11".into(),
                holder: "hv/k".into(),
            },
            C::AlreadyExists,
            "ADDRESS_TAKEN",
        ),
        (
            Error::StaticAddressesExhausted {
                host: "hv".into(),
                range: "192.0.2.10-192.0.2.20/24".into(),
            },
            C::QuotaExhausted,
            "ADDRESSES_EXHAUSTED",
        ),
        (
            Error::Libvirt(LibvirtError::AllocationTableUnreadable),
            C::Transient,
            "ALLOCATION_TABLE_UNREADABLE",
        ),
        (
            Error::IdentityMacShared {
                identity: "a".into(),
                other: "b".into(),
                host: "hv".into(),
            },
            C::Permanent,
            "IDENTITY_MAC_SHARED",
        ),
        (
            Error::SpecMismatch {
                host: "hv".into(),
                key: "k".into(),
            },
            C::AlreadyExists,
            "SPEC_MISMATCH",
        ),
        (
            Error::InstanceNotFound {
                id: "hv/k".into(),
                detail: "no domain egressproxy-k on host hv".into(),
            },
            C::NotFound,
            "INSTANCE_NOT_FOUND",
        ),
        (
            Error::TagsChanged { id: "hv/k".into() },
            C::Permanent,
            "TAGS_CHANGED",
        ),
        (
            Error::InstanceVanished {
                domain: "egressproxy-k".into(),
            },
            C::Transient,
            "INSTANCE_VANISHED",
        ),
        (
            Error::CreateTaskFailed {
                key: "k".into(),
                reason: "panic".into(),
            },
            C::Transient,
            "AGENT_WORKER_FAILED",
        ),
        (
            Error::from(egressproxy_provider::validation::check_id("").unwrap_err()),
            C::InvalidArgument,
            "INVALID_ARGUMENT",
        ),
        (
            Error::InvalidArgument {
                field: "id",
                reason: "bad".into(),
            },
            C::InvalidArgument,
            "INVALID_ARGUMENT",
        ),
        (
            Error::from(LibvirtError::xml("domain egressproxy-k", unreadable())),
            C::Permanent,
            "LIBVIRT_XML_UNREADABLE",
        ),
        (
            Error::from(LibvirtError::xml("volume XML for v", unbuildable)),
            C::Permanent,
            "LIBVIRT_XML_UNBUILDABLE",
        ),
        (
            Error::InvalidFields {
                violations: vec![
                    ("placement.image".into(), "unknown".into()),
                    ("name".into(), "not XML-safe".into()),
                ],
            },
            C::InvalidArgument,
            "INVALID_ARGUMENT",
        ),
        (
            GuestError::InvalidCloudConfig {
                field: "cloud_init.user_data".into(),
                description: "line 2 column 1: not YAML".into(),
            }
            .into(),
            C::InvalidArgument,
            "INVALID_CLOUD_CONFIG",
        ),
        (
            GuestError::TooLarge {
                field: "cloud_init.user_data".into(),
                description: "too large".into(),
            }
            .into(),
            C::InvalidArgument,
            "INVALID_ARGUMENT",
        ),
    ]
}
