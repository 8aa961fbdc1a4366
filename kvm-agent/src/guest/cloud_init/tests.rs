use super::*;
use crate::classification::ErrorClass;

const BOOTSTRAP: &str = "#cloud-config\npackages:\n  - qemu-guest-agent\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n";

fn seed(user: &[u8]) -> SeedDocuments {
    seed_documents(user, None, GuestAgent::Install).unwrap()
}

fn text(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap()
}

/// The field at fault; the one mapping sends it as the contract's field violation.
fn field_of(err: &GuestError) -> String {
    assert_eq!(err.classify().class, ErrorClass::InvalidArgument, "{err}");
    err.field_violations()[0].0.clone()
}

#[test]
fn the_users_document_is_the_first_part_unchanged_and_the_bootstrap_the_last() {
    let user =
        "#cloud-config\npackages: [[squid, \"1:5.7\"], curl]  # comment\nruncmd:\n  - echo 'on'\n";
    let docs = seed(user.as_bytes());
    let multipart = text(&docs.user_data);
    assert!(
        multipart.starts_with("Content-Type: multipart/mixed; boundary=\"==egressproxy-"),
        "{multipart}"
    );
    let user_at = multipart.find(user).expect("the user's document, verbatim");
    let bootstrap_at = multipart.find(BOOTSTRAP).expect("the bootstrap");
    assert!(user_at < bootstrap_at, "{multipart}");
    assert!(
        multipart.contains(&format!("X-Merge-Type: {MERGE_TYPE}\n")),
        "{multipart}"
    );
    assert_eq!(
        multipart
            .matches("Content-Type: text/cloud-config\n")
            .count(),
        2
    );
    assert_eq!(docs.vendor_data, None);
}

#[test]
fn text_that_is_not_plain_ascii_goes_in_base64() {
    use base64::Engine;
    for user in [
        &b"#cloud-config\r\nhostname: crlf\r\n"[..],
        "#cloud-config\nhostname: caf\u{e9}\n".as_bytes(),
    ] {
        let multipart = seed(user).user_data;
        let encoded = base64::engine::general_purpose::STANDARD.encode(user);
        assert!(text(&multipart).contains(&encoded), "{}", text(&multipart));
        assert!(text(&multipart).contains("Content-Transfer-Encoding: base64\n"));
    }
}

#[test]
fn nothing_to_add_leaves_the_user_data_exactly_as_given() {
    for user in [
        "#cloud-config\npackages: [qemu-guest-agent]\nruncmd:\n  - systemctl enable --now qemu-guest-agent\n",
        "#cloud-config\npackages:\n  - [qemu-guest-agent, 1:7.2]\nruncmd: [[systemctl, start, qemu-guest-agent]]",
    ] {
        assert_eq!(seed(user.as_bytes()).user_data, user.as_bytes());
    }
}

#[test]
fn only_the_missing_item_is_added() {
    let docs = seed(b"#cloud-config\npackages: [qemu-guest-agent]\n");
    let multipart = text(&docs.user_data);
    assert!(
        multipart
            .contains("#cloud-config\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n"),
        "{multipart}"
    );
    assert!(!multipart.contains("packages:\n  - qemu"), "{multipart}");
}

#[test]
fn a_preinstalled_agent_is_only_started() {
    let runcmd_only = "#cloud-config\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n";
    let docs = seed_documents(b"", None, GuestAgent::Preinstalled).unwrap();
    assert_eq!(text(&docs.user_data), runcmd_only);
    let docs = seed_documents(b"#!/bin/sh\necho hi\n", None, GuestAgent::Preinstalled).unwrap();
    assert!(text(&docs.user_data).contains(runcmd_only));
    assert!(!text(&docs.user_data).contains("packages"));
    let started = b"#cloud-config\nruncmd: [systemctl restart qemu-guest-agent]\n";
    let docs = seed_documents(started, None, GuestAgent::Preinstalled).unwrap();
    assert_eq!(docs.user_data, started);
}

#[test]
fn blank_user_data_becomes_the_bootstrap() {
    for user in [&b""[..], b"\n \n"] {
        assert_eq!(text(&seed(user).user_data), BOOTSTRAP);
    }
}

#[test]
fn each_kind_of_document_is_typed_as_cloud_init_types_it() {
    for (user, content_type) in [
        (&b"#!/bin/sh\necho hi\n"[..], "text/x-shellscript"),
        (b"## template: jinja\n#cloud-config\n", "text/jinja2"),
        (b"#include\nhttp://127.0.0.1/x\n", "text/x-include-url"),
        (
            b"#cloud-config-archive\n- type: text/x-shellscript\n",
            "text/cloud-config-archive",
        ),
        (b"just words\n", "text/x-not-multipart"),
    ] {
        let multipart = seed(user).user_data;
        let header = format!("Content-Type: {content_type}\nMIME-Version: 1.0\n");
        assert!(text(&multipart).contains(&header), "{}", text(&multipart));
        assert!(
            text(&multipart).contains(text(user)),
            "{}",
            text(&multipart)
        );
    }
}

#[test]
fn the_users_own_mime_document_is_nested_as_it_is() {
    let user = "Content-Type: multipart/mixed; boundary=\"XYZ\"\nMIME-Version: 1.0\n\n\
                --XYZ\nContent-Type: text/cloud-config\n\n#cloud-config\npackages: [squid]\n\
                --XYZ--\n";
    let multipart = seed(user.as_bytes()).user_data;
    let multipart = text(&multipart);
    let nested_at = multipart
        .find(&format!("\n{user}"))
        .expect("nested verbatim");
    assert!(nested_at < multipart.find(BOOTSTRAP).unwrap());
}

#[test]
fn gzip_is_sent_as_gzip_and_checked_as_what_it_holds() {
    use std::io::Write;
    let gzip = |data: &[u8]| {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    };
    let multipart = seed(&gzip(b"#cloud-config\npackages: [squid]\n")).user_data;
    assert!(text(&multipart).contains("Content-Type: application/x-gzip\n"));
    let err = seed_documents(
        &gzip(b"#cloud-config\n- a list\n"),
        None,
        GuestAgent::Install,
    )
    .unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.user_data");
    assert_eq!(err.classify().reason, "INVALID_CLOUD_CONFIG");
    let already = gzip(b"#cloud-config\npackages: [qemu-guest-agent]\nruncmd: [systemctl start qemu-guest-agent]\n");
    assert_eq!(seed(&already).user_data, already);
    // A bomb is refused before it is inspected any further.
    let bomb = gzip(&vec![b'#'; 17 * MAX_USER_DATA_BYTES]);
    assert!(bomb.len() < MAX_USER_DATA_BYTES);
    let err = seed_documents(&bomb, None, GuestAgent::Install).unwrap_err();
    assert!(
        err.to_string().contains("decompresses to more than"),
        "{err}"
    );
}

#[test]
fn a_broken_cloud_config_is_invalid_without_echoing_it() {
    for input in [
        "#cloud-config\n- password: hunter2\n",
        "#cloud-config\nhunter2\n",
        "#cloud-config\npassword: [hunter2\n",
        "#cloud-config\npackages: hunter2\n",
        "#cloud-config\nruncmd: {hunter2: 1}\n",
        "#cloud-config\npackages:\n# hunter2\n",
    ] {
        let err = seed_documents(input.as_bytes(), None, GuestAgent::Install).unwrap_err();
        assert_eq!(field_of(&err), "cloud_init.user_data");
        assert_eq!(err.classify().reason, "INVALID_CLOUD_CONFIG");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
    }
    let err = seed_documents(
        b"#cloud-config\npackages: squid\n",
        None,
        GuestAgent::Install,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("`packages` must be a list"),
        "{err}"
    );
    let err = seed_documents(b"#cloud-config\nruncmd:\n", None, GuestAgent::Install).unwrap_err();
    assert!(err.to_string().contains("write `runcmd: []`"), "{err}");
    let err = seed_documents(b"#cloud-config\na: [\n", None, GuestAgent::Install).unwrap_err();
    assert!(err.to_string().contains("at line 3 column 1"), "{err}");
}

#[test]
fn the_callers_vendor_data_is_checked_and_passed_on_with_what_belongs_there() {
    // Vendor-data's `packages` reaches the guest (user-data sets none): the package goes
    // there, after the vendor's document; the command goes to user-data.
    let vendor = b"#cloud-config\npackages: [squid]\n";
    let docs = seed_documents(b"#!/bin/sh\n", Some(vendor), GuestAgent::Install).unwrap();
    let vendor_data = text(docs.vendor_data.as_deref().unwrap());
    let vendor_at = vendor_data
        .find(text(vendor))
        .expect("the vendor's document, verbatim");
    let package_at = vendor_data
        .find("#cloud-config\npackages:\n  - qemu-guest-agent\n\n")
        .expect("the package alone");
    assert!(vendor_at < package_at, "{vendor_data}");
    let user_data = text(&docs.user_data);
    assert!(
        user_data.contains("#cloud-config\nruncmd:\n"),
        "{user_data}"
    );
    assert!(!user_data.contains("packages:"), "{user_data}");
    // Nothing of the bootstrap belongs in a script: passed on unchanged.
    let docs = seed_documents(b"", Some(b"#!/bin/sh\n"), GuestAgent::Install).unwrap();
    assert_eq!(docs.vendor_data.as_deref(), Some(&b"#!/bin/sh\n"[..]));
    let err = seed_documents(
        b"#!/bin/sh\n",
        Some(b"#cloud-config\n[1]\n"),
        GuestAgent::Install,
    )
    .unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.vendor_data");
}

#[test]
fn size_limit_is_enforced_on_both_documents() {
    let big = vec![b'#'; MAX_USER_DATA_BYTES + 1];
    let err = seed_documents(&big, None, GuestAgent::Install).unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.user_data");
    let err = seed_documents(b"", Some(&big), GuestAgent::Install).unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.vendor_data");
    let mut at_limit = b"#cloud-config\n".to_vec();
    at_limit.resize(MAX_USER_DATA_BYTES, b'\n');
    seed(&at_limit);
}

#[test]
fn the_same_documents_always_give_the_same_seed() {
    let user = b"#cloud-config\nhostname: proxy\n";
    assert_eq!(seed(user).user_data, seed(user).user_data);
}

#[test]
fn debug_output_never_shows_the_documents() {
    let docs = seed(b"#cloud-config\npassword: hunter2\n");
    let debug = format!("{docs:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(debug.contains("user_data_bytes"), "{debug}");
}
