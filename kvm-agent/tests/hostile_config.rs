//! Property tests of the agent's configuration parser: any YAML (and any text that is
//! not YAML) is parsed and validated without a panic, and every rejection names where
//! the problem is: a field path (`hosts[0].ssh.address`) or, for a document that does
//! not parse, its line and column.
//!
//! The documents are built from the configuration's own field names with hostile
//! values, so that most of them get past the YAML syntax into the field checks, and
//! some are then cut or spliced with arbitrary text to reach the syntax errors.

mod hostile;

use kvm_agent::config::Attachment;
use kvm_agent::config::Config;
use kvm_agent::error::{ConfigError, Error};
use kvm_agent::libvirt::xml::metadata::check_xml_safe;
use proptest::prelude::*;
use serde_norway::{Mapping, Value};

use hostile::hostile_text;

/// Field names of the configuration, at every level, plus a few it does not have.
const FIELDS: &[&str] = &[
    "hosts",
    "name",
    "ssh",
    "local",
    "libvirtSocket",
    "storagePool",
    "network",
    "bridge",
    "domainType",
    "address",
    "user",
    "privateKey",
    "knownHosts",
    "insecureSkipHostKeyVerification",
    "machineTypes",
    "vcpus",
    "memoryMiB",
    "diskGiB",
    "images",
    "url",
    "sha256",
    "format",
    "firmware",
    "guestAgent",
    "transport",
    "sshHandshakeTimeout",
    "sshKeepaliveInterval",
    "libvirtKeepaliveInterval",
    "defaultCallTimeout",
    "imageDownloadTimeout",
    "imageSpoolDir",
    "unknownField",
    "",
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| Value::Number(n.into())),
        any::<u64>().prop_map(|n| Value::Number(n.into())),
        any::<f64>().prop_map(|n| Value::Number(n.into())),
        hostile_text(12).prop_map(Value::String),
        proptest::sample::select(
            &[
                "1s",
                "0s",
                "1m 30s",
                "-1s",
                "18446744073709551615s",
                "kvm",
                "qemu",
                "auto",
                "uefi",
                "bios",
                "raw",
                "qcow2",
                "install",
                "preinstalled",
                "true",
                "~",
                "http://127.0.0.1:9/x",
                "file:///etc/passwd",
                "host:22",
                "[::1]:0",
                "/tmp",
                "/nonexistent/key",
            ][..],
        )
        .prop_map(|s| Value::String(s.into())),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Sequence),
            proptest::collection::vec(
                (
                    prop_oneof![
                        3 => proptest::sample::select(FIELDS).prop_map(str::to_owned),
                        1 => hostile_text(6),
                    ],
                    inner
                ),
                0..6
            )
            .prop_map(|entries| {
                Value::Mapping(
                    entries
                        .into_iter()
                        .map(|(k, v)| (Value::String(k), v))
                        .collect::<Mapping>(),
                )
            }),
        ]
    })
}

/// A document: well-formed YAML from [`value`], sometimes cut or with text spliced in.
fn document() -> impl Strategy<Value = String> {
    let yaml = value()
        .prop_map(|v| serde_norway::to_string(&v).unwrap_or_default())
        .boxed();
    prop_oneof![
        3 => yaml.clone(),
        1 => (yaml.clone(), any::<prop::sample::Index>()).prop_map(|(text, cut)| {
            let mut end = cut.index(text.len() + 1);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text[..end].to_owned()
        }),
        1 => (yaml, any::<prop::sample::Index>(), hostile_text(8)).prop_map(|(text, at, splice)| {
            let mut at = at.index(text.len() + 1);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            format!("{}{splice}{}", &text[..at], &text[at..])
        }),
        1 => hostile_text(64),
    ]
}

/// The names a valid configuration puts into a domain's XML (the placement record and
/// the NIC) all survive the XML unchanged.
fn assert_xml_safe_names(config: &Config) -> Result<(), TestCaseError> {
    let hosts = config.hosts.iter().map(|h| &h.name);
    let devices = config.hosts.iter().map(|h| match h.attachment() {
        Attachment::Network(n) | Attachment::Bridge(n) => n,
    });
    for name in hosts
        .cloned()
        .chain(devices)
        .chain(config.machine_types.keys().cloned())
        .chain(config.images.keys().cloned())
    {
        prop_assert!(check_xml_safe(&name).is_ok(), "accepted {:?}", name);
    }
    Ok(())
}

fn assert_names_where(error: Error) -> Result<(), TestCaseError> {
    let Error::Config(ConfigError { problems }) = &error else {
        return Err(TestCaseError::fail(format!("not a config error: {error}")));
    };
    prop_assert!(!problems.is_empty(), "{}", error);
    for problem in problems {
        prop_assert!(
            !problem.field.is_empty(),
            "a problem without its field: {}",
            problem
        );
        prop_assert!(!problem.message.is_empty(), "{}", problem);
    }
    Ok(())
}

proptest! {
    #![proptest_config(hostile::config(file!()))]

    #[test]
    fn any_document_parses_or_is_refused_naming_where(text in document()) {
        match Config::parse(&text) {
            Err(error) => assert_names_where(error.into())?,
            Ok(config) => match config.validate() {
                Err(error) => assert_names_where(error.into())?,
                Ok(()) => assert_xml_safe_names(&config)?,
            },
        }
    }

    /// A valid configuration with one hostile value in each place a name goes: accepted
    /// (names are the administrator's to choose) or refused naming that field.
    #[test]
    fn hostile_names_in_a_valid_configuration(
        host in hostile_text(12),
        machine in hostile_text(12),
        image in hostile_text(12),
        pool in hostile_text(12),
        network in hostile_text(12),
    ) {
        let mut doc: Value = serde_norway::from_str(
            "hosts: [{name: hv1, local: true}]\n\
             machineTypes: {small: {vcpus: 1, memoryMiB: 512, diskGiB: 1}}\n\
             images: {debian: {url: 'http://127.0.0.1:9/d.qcow2'}}\n",
        )
        .unwrap();
        doc["hosts"][0]["name"] = Value::String(host);
        doc["hosts"][0]["storagePool"] = Value::String(pool);
        doc["hosts"][0]["network"] = Value::String(network);
        let small = doc["machineTypes"]["small"].clone();
        doc["machineTypes"] = Value::Mapping([(Value::String(machine), small)].into_iter().collect());
        let debian = doc["images"]["debian"].clone();
        doc["images"] = Value::Mapping([(Value::String(image), debian)].into_iter().collect());
        let text = serde_norway::to_string(&doc).unwrap();
        match Config::parse(&text) {
            Err(error) => assert_names_where(error.into())?,
            Ok(config) => match config.validate() {
                Err(error) => assert_names_where(error.into())?,
                Ok(()) => assert_xml_safe_names(&config)?,
            },
        }
    }
}
