use super::*;
use egressproxy_provider::ErrorClass;

const RUNCMD: &str = "[systemctl, enable, --now, qemu-guest-agent]";

fn user_data(text: &str) -> String {
    let docs = seed_documents(text.as_bytes(), None).unwrap();
    assert_eq!(docs.vendor_data, None);
    String::from_utf8(docs.user_data).unwrap()
}

fn field_of(err: &ProviderError) -> &str {
    assert_eq!(err.class, ErrorClass::InvalidArgument, "{err}");
    &err.field_violations[0].field
}

/// cloud-init's own schema validation (`cloud-init schema`, Debian package cloud-init).
fn assert_cloud_init_accepts(documents: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    for (i, doc) in documents.iter().enumerate() {
        let path = dir.path().join(format!("user-data-{i}"));
        std::fs::write(&path, doc).unwrap();
        let out = std::process::Command::new("cloud-init")
            .args(["schema", "--config-file"])
            .arg(&path)
            .output()
            .expect("cloud-init is installed (apt-get install cloud-init)");
        assert!(
            out.status.success(),
            "cloud-init rejects:\n{doc}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn block_lists_get_the_bootstrap_appended_and_comments_stay() {
    let input = "#cloud-config
# the proxy
write_files:
  - path: /etc/squid/conf.d/egress.conf
    content: |
      http_access allow localnet
packages:
  - squid   # the proxy itself
  # more later
runcmd:
  - |
    echo multi
    echo line
# trailing comment
hostname: proxy
";
    let want = format!(
        "#cloud-config
# the proxy
write_files:
  - path: /etc/squid/conf.d/egress.conf
    content: |
      http_access allow localnet
packages:
  - squid   # the proxy itself
  - qemu-guest-agent
  # more later
runcmd:
  - |
    echo multi
    echo line
  - {RUNCMD}
# trailing comment
hostname: proxy
"
    );
    let merged = user_data(input);
    assert_eq!(merged, want);
    assert_cloud_init_accepts(&[&merged]);
}

#[test]
fn zero_indented_flow_and_empty_lists() {
    let merged = user_data("#cloud-config\npackages:\n- squid\nruncmd: [[echo, hi]]\n");
    assert_eq!(
        merged,
        format!(
            "#cloud-config\npackages:\n- squid\n- qemu-guest-agent\nruncmd: [[echo, hi], {RUNCMD}]\n"
        )
    );
    let merged = user_data("#cloud-config\npackages: []\nruncmd:\n");
    assert_eq!(
        merged,
        format!("#cloud-config\npackages: [qemu-guest-agent]\nruncmd:\n  - {RUNCMD}\n")
    );
    assert_cloud_init_accepts(&[&merged]);
}

#[test]
fn missing_keys_are_added_at_the_end() {
    let merged = user_data("#cloud-config\nhostname: proxy");
    assert_eq!(
        merged,
        format!(
            "#cloud-config\nhostname: proxy\npackages:\n  - qemu-guest-agent\nruncmd:\n  - {RUNCMD}\n"
        )
    );
    let merged = user_data("#cloud-config\n");
    assert_eq!(merged, bootstrap_document());
    assert_cloud_init_accepts(&[&merged]);
}

#[test]
fn bootstrap_already_present_is_not_duplicated() {
    for input in [
        "#cloud-config\npackages: [qemu-guest-agent]\nruncmd:\n  - systemctl enable --now qemu-guest-agent\n",
        "#cloud-config\npackages:\n  - [qemu-guest-agent, 1:7.2]\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n",
    ] {
        assert_eq!(user_data(input), input);
    }
}

#[test]
fn layouts_the_line_edit_cannot_handle_are_rewritten_correctly() {
    for input in [
        "#cloud-config\nbase: &pk [squid]\npackages: *pk\n",
        "#cloud-config\npackages: [squid,\n  curl]\n",
        "#cloud-config\n\"packages\": [squid]\n",
        "#cloud-config\npackages: [squid]\n...\n",
    ] {
        let merged = user_data(input);
        assert!(merged.starts_with("#cloud-config\n"), "{merged}");
        let value: Value = serde_yaml::from_str(&merged).unwrap();
        let packages: Vec<&str> = value["packages"]
            .as_sequence()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(packages.last(), Some(&GUEST_AGENT_PACKAGE), "{merged}");
        assert!(packages.contains(&"squid"), "{merged}");
        assert_eq!(value["runcmd"][0], runcmd_value(), "{merged}");
        assert_cloud_init_accepts(&[&merged]);
    }
}

#[test]
fn a_cloud_config_that_is_not_a_mapping_is_invalid_without_echoing_it() {
    for input in [
        "#cloud-config\n- password: hunter2\n",
        "#cloud-config\nhunter2\n",
        "#cloud-config\npassword: [hunter2\n",
    ] {
        let err = seed_documents(input.as_bytes(), None).unwrap_err();
        assert_eq!(field_of(&err), "cloud_init.user_data");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(!format!("{err:?}").contains("hunter2"), "{err:?}");
    }
    let err = seed_documents(b"#cloud-config\npackages: squid\n", None).unwrap_err();
    assert!(err.message.contains("`packages` must be a list"), "{err}");
    let err = seed_documents(b"#!/bin/sh\n", Some(b"#cloud-config\n[1]\n")).unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.vendor_data");
}

#[test]
fn other_user_data_passes_through_and_the_bootstrap_becomes_vendor_data() {
    for input in [
        &b"#!/bin/sh\necho hi\n"[..],
        b"#cloud-config-archive\n- type: text/x-shellscript\n",
        b"## template: jinja\n#cloud-config\n",
        b"\x1f\x8b\x08\x00gzip",
    ] {
        let docs = seed_documents(input, None).unwrap();
        assert_eq!(docs.user_data, input);
        assert_eq!(docs.vendor_data.unwrap(), bootstrap_document().as_bytes());
    }
}

#[test]
fn caller_vendor_data_is_merged_or_combined() {
    let docs = seed_documents(b"#!/bin/sh\n", Some(b"#cloud-config\npackages: [squid]\n")).unwrap();
    assert_eq!(
        String::from_utf8(docs.vendor_data.unwrap()).unwrap(),
        "#cloud-config\npackages: [squid, qemu-guest-agent]\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n"
    );

    let docs = seed_documents(b"#!/bin/sh\n", Some(b"#!/bin/sh\necho vendor\n")).unwrap();
    let vendor = String::from_utf8(docs.vendor_data.unwrap()).unwrap();
    assert!(
        vendor.starts_with("Content-Type: multipart/mixed; boundary="),
        "{vendor}"
    );
    assert!(vendor.contains(&bootstrap_document()), "{vendor}");
    assert!(vendor.contains("#!/bin/sh\necho vendor\n"), "{vendor}");
    assert_eq!(
        vendor.matches("Content-Type: text/x-not-multipart").count(),
        2
    );

    // A cloud-config user-data leaves the caller's vendor-data alone.
    let docs = seed_documents(b"#cloud-config\n", Some(b"#!/bin/sh\n")).unwrap();
    assert_eq!(docs.vendor_data.as_deref(), Some(&b"#!/bin/sh\n"[..]));
}

#[test]
fn size_limit_is_enforced_on_both_documents() {
    let big = vec![b'#'; MAX_USER_DATA_BYTES + 1];
    let err = seed_documents(&big, None).unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.user_data");
    let err = seed_documents(b"", Some(&big)).unwrap_err();
    assert_eq!(field_of(&err), "cloud_init.vendor_data");
    let mut at_limit = b"#cloud-config\n".to_vec();
    at_limit.resize(MAX_USER_DATA_BYTES, b'\n');
    seed_documents(&at_limit, None).unwrap();
}

#[test]
fn debug_output_never_shows_the_documents() {
    let docs = seed_documents(b"#cloud-config\npassword: hunter2\n", None).unwrap();
    let debug = format!("{docs:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(debug.contains("user_data_bytes"), "{debug}");
}

#[test]
fn crlf_documents_merge() {
    let merged = user_data("#cloud-config\r\npackages:\r\n  - squid\r\n");
    let value: Value = serde_yaml::from_str(&merged).unwrap();
    assert_eq!(value["packages"][1], Value::from(GUEST_AGENT_PACKAGE));
    assert!(
        merged.contains("  - squid\r\n  - qemu-guest-agent\n"),
        "{merged:?}"
    );
}
