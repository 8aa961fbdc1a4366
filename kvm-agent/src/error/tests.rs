use super::*;
use examples::{contract_only_table, mapping_table};

mod examples;

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
    let downloading = Error::Image(ImageError::Downloading {
        image: "debian".into(),
        host: "hv".into(),
        received: 1,
        expected: None,
        retry_in: Duration::from_secs(7),
    });
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

/// What the contract crate's request checks answer goes out whole, its own reason and
/// fields included.
#[test]
fn contract_rules_pass_through_the_mapping_whole() {
    let refused = egressproxy_provider::paging::decode_token("not a token").unwrap_err();
    let mapped = Error::from(refused.clone()).to_provider_error();
    assert_eq!(mapped, refused);
    assert_eq!(mapped.reason, "INVALID_PAGE_TOKEN");
    assert_eq!(
        Error::from(refused).class(),
        egressproxy_provider::ErrorClass::InvalidArgument
    );
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
    let unreadable = Error::from(LibvirtError::xml(
        "domain d",
        crate::libvirt::xml::domain::DomainFacts::parse("<domain").unwrap_err(),
    ));
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
        include_str!("../libvirt/error.rs"),
        include_str!("../images/error.rs"),
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
