use super::*;

#[test]
fn config_error_lists_every_problem_with_its_field() {
    let err = Error::config(vec![
        ConfigProblem::new("hosts[0].name", "is empty"),
        ConfigProblem::new("hosts[1].ssh.user", "is empty"),
    ]);
    let text = err.to_string();
    assert!(text.contains("  - hosts[0].name: is empty"), "{text}");
    assert!(text.contains("  - hosts[1].ssh.user: is empty"), "{text}");
    assert_eq!(err.class(), ErrorClass::Permanent);
}

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
    Error::ImageHttp {
        url: "https://example.org/i.qcow2".into(),
        status,
    }
}

/// One error of every kind the mapping tells apart, with its contract class and reason.
fn mapping_table() -> Vec<(Error, egressproxy_provider::ErrorClass, &'static str)> {
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
                source: russh::Error::Disconnect,
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
        (Error::io("relay", io()), C::Transient, "AGENT_IO_FAILED"),
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
            Error::ImageFetch {
                url: "u".into(),
                reason: "refused".into(),
                permanent: false,
            },
            C::Transient,
            "IMAGE_UNREACHABLE",
        ),
        (
            Error::ImageFetch {
                url: "u".into(),
                reason: "bad url".into(),
                permanent: true,
            },
            C::Permanent,
            "IMAGE_URL_INVALID",
        ),
        (
            Error::ImageTruncated {
                url: "u".into(),
                received: 1,
                expected: Some(2),
                reason: "eof".into(),
            },
            C::Transient,
            "IMAGE_TRUNCATED",
        ),
        (
            Error::ImageChecksum {
                url: "u".into(),
                expected: "a".into(),
                actual: "b".into(),
            },
            C::Permanent,
            "IMAGE_CHECKSUM_MISMATCH",
        ),
        (
            Error::ImageDownloading {
                image: "debian".into(),
                host: "hv".into(),
                received: 1,
                expected: Some(2),
                retry_in: Duration::from_secs(7),
            },
            C::Transient,
            "IMAGE_DOWNLOADING",
        ),
        (
            Error::PoolFull {
                host: "hv".into(),
                pool: "default".into(),
                image: "debian".into(),
                needed: 2 << 20,
                available: 1 << 20,
            },
            C::Transient,
            "POOL_FULL",
        ),
        (
            Error::ImageFormat {
                url: "u".into(),
                problem: "libvirt found raw, the configuration says qcow2".into(),
            },
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
            Error::KvmProbeRunning {
                host: "hv".into(),
                retry_in: Duration::from_secs(9),
            },
            C::Transient,
            "KVM_PROBE_RUNNING",
        ),
        (
            Error::Shared(std::sync::Arc::new(image_http(404))),
            C::Permanent,
            "IMAGE_NOT_FOUND",
        ),
        (
            Error::Shared(std::sync::Arc::new(image_http(503))),
            C::Transient,
            "IMAGE_SERVER_ERROR",
        ),
    ];
    table
}

#[test]
fn every_error_maps_to_one_contract_class_and_reason() {
    use egressproxy_provider::ErrorClass as C;
    let backing_off = |last_class| {
        Error::Transport(TransportError::SshBackingOff {
            host: "hv".into(),
            retry_in: Duration::from_secs(3),
            last_error: "refused".into(),
            last_class,
        })
    };
    let table = mapping_table();
    for (error, class, reason) in table {
        let mapped = error.to_provider_error();
        assert_eq!(
            (mapped.class, mapped.reason.as_str()),
            (class, reason),
            "{error}"
        );
        assert_eq!(mapped.message, error.to_string());
        // The layer's own class is the contract's, except that a missing libvirt object
        // is not a missing instance.
        match error.class() {
            ErrorClass::NotFound => assert_eq!(class, C::Permanent, "{error}"),
            own => assert_eq!(class, own, "{error}"),
        }
        // Round trip through the wire mapping.
        let status = mapped.to_status();
        assert_eq!(ProviderError::from_status(&status), mapped, "{error}");
    }
    assert_eq!(
        backing_off(ErrorClass::Transient)
            .to_provider_error()
            .retry_after,
        Some(Duration::from_secs(3))
    );
    let downloading = Error::ImageDownloading {
        image: "debian".into(),
        host: "hv".into(),
        received: 1,
        expected: None,
        retry_in: Duration::from_secs(7),
    };
    assert_eq!(
        downloading.to_provider_error().retry_after,
        Some(Duration::from_secs(7))
    );
}

/// Which libvirt errors are the transport's (the connection is dropped) and which
/// libvirtd reports about the host on a healthy connection.
#[test]
fn libvirt_errors_classify_by_code_domain_and_liveness() {
    use virt::error::{ErrorDomain as D, ErrorNumber as N};
    let table: Vec<(N, D, bool, bool, ErrorClass, &str)> = vec![
        // (code, domain, alive) -> (transport, class, reason)
        // libvirtd's own OS errors (EACCES, ENOSPC, EROFS, qemu-img) on a live
        // connection: the connection stays, the host needs fixing, retried.
        (
            N::SystemError,
            D::Storage,
            true,
            false,
            ErrorClass::Transient,
            "LIBVIRT_HOST_ERROR",
        ),
        (
            N::SystemError,
            D::Qemu,
            true,
            false,
            ErrorClass::Transient,
            "LIBVIRT_HOST_ERROR",
        ),
        // The client's socket failed (EOF, reset): the RPC/remote layer reports it.
        (
            N::SystemError,
            D::Rpc,
            true,
            true,
            ErrorClass::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        (
            N::SystemError,
            D::Remote,
            true,
            true,
            ErrorClass::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        // Any error on a dead connection is the transport's.
        (
            N::SystemError,
            D::Storage,
            false,
            true,
            ErrorClass::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        (
            N::NoDomain,
            D::Dom,
            false,
            true,
            ErrorClass::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        (
            N::Rpc,
            D::None,
            true,
            true,
            ErrorClass::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        (
            N::NoConnect,
            D::None,
            true,
            true,
            ErrorClass::Transient,
            "LIBVIRT_CONNECTION_FAILED",
        ),
        (
            N::NoDomain,
            D::Qemu,
            true,
            false,
            ErrorClass::NotFound,
            "LIBVIRT_OBJECT_MISSING",
        ),
        (
            N::NoStorageVolume,
            D::Storage,
            true,
            false,
            ErrorClass::NotFound,
            "LIBVIRT_OBJECT_MISSING",
        ),
        (
            N::XmlError,
            D::Dom,
            true,
            false,
            ErrorClass::Permanent,
            "LIBVIRT_REJECTED",
        ),
        (
            N::OperationInvalid,
            D::Qemu,
            true,
            false,
            ErrorClass::Transient,
            "LIBVIRT_FAILED",
        ),
    ];
    for (code, domain, alive, transport, class, reason) in table {
        let failure = classify_libvirt_parts(code.into(), domain.into(), "m", alive);
        let case = format!("{code:?} from {domain:?}, alive {alive}");
        assert_eq!(
            (failure.transport, failure.class),
            (transport, class),
            "{case}"
        );
        let error = Error::Transport(TransportError::Libvirt {
            host: "hv".into(),
            op: "virStorageVolCreateXML",
            failure,
        });
        assert_eq!(error.drops_connection(), transport, "{case}");
        assert_eq!(error.to_provider_error().reason, reason, "{case}");
    }
}

/// A Create that waits past its deadline for another Create of the same key is told
/// so (transient, CREATE_IN_PROGRESS), not that libvirt timed out.
#[tokio::test]
async fn a_busy_key_is_create_in_progress() {
    let locks = crate::provider::sync::KeyLocks::default();
    let soon = || tokio::time::Instant::now() + Duration::from_millis(50);
    let _first = locks.lock("hv", "k", soon()).await.unwrap();
    let err = locks.lock("hv", "k", soon()).await.unwrap_err();
    let mapped = err.to_provider_error();
    assert_eq!(
        (mapped.class, mapped.reason.as_str()),
        (
            egressproxy_provider::ErrorClass::Transient,
            "CREATE_IN_PROGRESS"
        ),
        "{err}"
    );
    assert!(err.to_string().contains("key k on host hv"), "{err}");
    // Another key is not held up.
    assert!(locks.lock("hv", "other", soon()).await.is_ok());
}

#[test]
fn reported_libvirt_error_keeps_the_connection() {
    let err = Error::Transport(TransportError::Libvirt {
        host: "hv".into(),
        op: "virDomainLookupByName",
        failure: LibvirtFailure {
            code: 42,
            code_name: "NoDomain".into(),
            message: "no domain".into(),
            transport: false,
            class: ErrorClass::NotFound,
        },
    });
    assert!(!err.drops_connection());
    assert_eq!(err.class(), ErrorClass::NotFound);
    assert_eq!(err.libvirt_code(), Some(42));
}

/// Errors the mapping tells apart that the table above leaves out: their contract
/// class has no counterpart in [`ErrorClass`] (an instance, not a libvirt object, is
/// missing) or they only exist on the contract's side.
fn contract_only_table() -> Vec<(Error, egressproxy_provider::ErrorClass, &'static str)> {
    use egressproxy_provider::ErrorClass as C;
    let unreadable = || crate::libvirt::xml::volume::VolumeFacts::parse("<volume>").unwrap_err();
    let unbuildable = XmlError::Serialize(quick_xml::SeError::Custom("no".into()));
    vec![
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
            Error::InvalidArgument {
                field: "id",
                reason: "bad".into(),
            },
            C::InvalidArgument,
            "INVALID_ARGUMENT",
        ),
        (
            Error::xml("domain egressproxy-k", unreadable()),
            C::Permanent,
            "LIBVIRT_XML_UNREADABLE",
        ),
        (
            Error::xml("volume XML for v", unbuildable),
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

/// Invalid arguments carry every field at fault, from whichever layer found them.
#[test]
fn invalid_arguments_name_each_field() {
    let error = Error::InvalidFields {
        violations: vec![
            ("placement.image".into(), "unknown".into()),
            ("name".into(), "not XML-safe".into()),
        ],
    }
    .to_provider_error();
    assert_eq!(error.message, "placement.image: unknown");
    let fields: Vec<_> = error.field_violations.iter().map(|v| &v.field).collect();
    assert_eq!(fields, ["placement.image", "name"]);
    let error = Error::from(GuestError::InvalidCloudConfig {
        field: "cloud_init.user_data".into(),
        description: "bad".into(),
    })
    .to_provider_error();
    assert_eq!(error.field_violations.len(), 1);
    assert_eq!(error.field_violations[0].field, "cloud_init.user_data");
}

#[test]
fn contract_only_errors_map_through_the_one_mapping() {
    for (error, class, reason) in contract_only_table() {
        let mapped = error.to_provider_error();
        assert_eq!(
            (mapped.class, mapped.reason.as_str()),
            (class, reason),
            "{error}"
        );
        assert_eq!(mapped.message, error.to_string());
    }
    // XML libvirt returned that cannot be read is not a transient I/O failure.
    let unreadable = Error::xml(
        "domain d",
        crate::libvirt::xml::domain::DomainFacts::parse("<domain").unwrap_err(),
    );
    assert_eq!(unreadable.class(), ErrorClass::Permanent);
}

/// The reason codes in the error table of docs/kvm-agent.md are exactly those the
/// agent answers with.
#[test]
fn the_documented_error_table_lists_every_reason_and_no_other() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n## Errors\n")
        .nth(1)
        .expect("docs/kvm-agent.md has an Errors section");
    let section = section.split("\n## ").next().unwrap();
    let documented: std::collections::BTreeSet<String> = section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .flat_map(|line| {
            let first_column = line.split('|').nth(1).unwrap_or_default();
            first_column
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    let produced: std::collections::BTreeSet<String> = mapping_table()
        .into_iter()
        .chain(contract_only_table())
        .map(|(_, _, reason)| reason.to_owned())
        .collect();
    assert_eq!(
        documented, produced,
        "the error table of docs/kvm-agent.md and the code disagree"
    );
    assert_eq!(
        documented,
        reasons_in_the_classifications(),
        "a layer's classification answers with a reason the error table does not list \
         (or the table lists one no classification gives)"
    );
}

/// Every reason a layer's `classify` can give, read from the source: the string after
/// each `C::Class, ` or `ErrorClass::Class, ` in the files that classify.
fn reasons_in_the_classifications() -> std::collections::BTreeSet<String> {
    let sources = [
        include_str!("../error.rs"),
        include_str!("../transport/error.rs"),
        include_str!("../config/error.rs"),
        include_str!("../guest/error.rs"),
        include_str!("../libvirt/xml/mod.rs"),
    ];
    let mut reasons = std::collections::BTreeSet::new();
    for source in sources {
        let mut rest = source;
        while let Some(at) = rest.find(", \"") {
            let before = &rest[..at];
            let after = &rest[at + 3..];
            let class = before
                .rsplit(|c: char| !(c.is_alphanumeric() || c == ':' || c == '_'))
                .next()
                .unwrap_or_default();
            if class.starts_with("C::") || class.starts_with("ErrorClass::") {
                let reason = &after[..after.find('"').unwrap()];
                reasons.insert(reason.to_owned());
            }
            rest = after;
        }
    }
    reasons
}
