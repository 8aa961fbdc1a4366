use std::path::Path;

use super::ssh_address::split_host_port;
use super::*;

#[test]
fn addresses_split_into_host_and_port() {
    assert_eq!(split_host_port("hv1").unwrap(), ("hv1".into(), 22));
    assert_eq!(split_host_port("hv1:2222").unwrap(), ("hv1".into(), 2222));
    assert_eq!(split_host_port("[::1]:2222").unwrap(), ("::1".into(), 2222));
    assert_eq!(split_host_port("[::1]").unwrap(), ("::1".into(), 22));
    assert_eq!(split_host_port("fe80::1").unwrap(), ("fe80::1".into(), 22));
    assert!(split_host_port("hv1:0").is_err());
    assert!(split_host_port("hv1:ssh").is_err());
}

#[test]
fn local_host_gets_user_facing_defaults() {
    let config = Config::parse("hosts:\n- name: here\n  local: true\n").unwrap();
    config.validate().unwrap();
    let host = &config.hosts[0];
    assert_eq!(host.libvirt_socket, Path::new(DEFAULT_LIBVIRT_SOCKET));
    assert_eq!(host.storage_pool, "default");
    assert_eq!(host.domain_type, DomainType::Auto);
    assert_eq!(host.attachment(), Attachment::Network("default".into()));
    assert_eq!(
        config.transport.default_call_timeout,
        Duration::from_secs(30)
    );
    assert_eq!(
        config.transport.image_download_timeout,
        Duration::from_secs(3600)
    );
    assert_eq!(config.transport.image_spool_dir, None);
}

#[test]
fn image_defaults_are_qcow2_and_uefi() {
    let config = Config::parse(
        "hosts: [{name: here, local: true}]\nimages:\n  debian:\n    url: https://example.org/d.qcow2\n",
    )
    .unwrap();
    let image = &config.images["debian"];
    assert_eq!(image.format, ImageFormat::Qcow2);
    assert_eq!(image.firmware, Firmware::Uefi);
}

#[test]
fn unknown_field_is_rejected_with_its_location() {
    let err = Config::parse("hosts:\n- name: here\n  local: true\n  storagepool: x\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `storagepool`"), "{err}");
    assert!(err.contains("line 4"), "{err}");
}

#[test]
fn all_problems_are_reported_with_their_field() {
    let config = Config::parse(
        "hosts:\n\
         - name: a\n  local: true\n  network: n\n  bridge: b\n\
         - name: a\n\
         - name: c\n  ssh: {address: 'c:99999', user: u, privateKey: /nonexistent/key, insecureSkipHostKeyVerification: true, knownHosts: /nonexistent/kh}\n\
         machineTypes:\n  tiny: {vcpus: 0, memoryMiB: 64, diskGiB: 0}\n\
         images:\n  x: {url: ftp://x, sha256: abc}\n",
    )
    .unwrap();
    let err = config.validate().unwrap_err().to_string();
    for field in [
        "hosts[0].bridge",
        "hosts[1].name",
        "hosts[1].ssh",
        "hosts[2].ssh.address",
        "hosts[2].ssh.insecureSkipHostKeyVerification",
        "machineTypes.tiny.vcpus",
        "machineTypes.tiny.memoryMiB",
        "machineTypes.tiny.diskGiB",
        "images.x.url",
        "images.x.sha256",
    ] {
        assert!(err.contains(field), "{field} missing from:\n{err}");
    }
    // Reading the files it names is start-up's (the `startup` module), not the file's.
    assert!(!err.contains("/nonexistent"), "{err}");
}

#[test]
fn image_urls_are_shown_without_credentials() {
    let config = Config::parse(
        "hosts: [{name: here, local: true}]\n\
         images:\n  x: {url: 'ftp://user:hunter2@example.org/x?sig=s3cr3t'}\n",
    )
    .unwrap();
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("images.x.url"), "{err}");
    assert!(err.contains("ftp://…@example.org/x?…"), "{err}");
    let debug = format!("{:?}", config.images["x"]);
    for secret in ["hunter2", "s3cr3t", "user"] {
        assert!(!err.contains(secret), "{err}");
        assert!(!debug.contains(secret), "{debug}");
    }
    assert!(debug.contains("example.org"), "{debug}");
}

#[test]
fn durations_are_human_readable() {
    let config = Config::parse(
        "hosts: [{name: here, local: true}]\ntransport: {defaultCallTimeout: 1m 30s}\n",
    )
    .unwrap();
    assert_eq!(
        config.transport.default_call_timeout,
        Duration::from_secs(90)
    );
    let config = Config::parse(
        "hosts: [{name: here, local: true}]\n\
         transport: {imageDownloadTimeout: 2h, imageSpoolDir: /scratch}\n",
    )
    .unwrap();
    assert_eq!(
        config.transport.image_download_timeout,
        Duration::from_secs(7200)
    );
    assert_eq!(
        config.transport.image_spool_dir.as_deref(),
        Some(Path::new("/scratch"))
    );
    let err = Config::parse("hosts: []\ntransport: {defaultCallTimeout: soon}\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a duration"), "{err}");
}

#[test]
fn a_bad_duration_names_its_own_field_and_line() {
    let text = "hosts: [{name: here, local: true}]\n\
                transport:\n\
                \x20 sshHandshakeTimeout: 5s\n\
                \x20 sshKeepaliveMax: 3\n\
                \x20 defaultCallTimeout: 5 parsecs\n\
                \x20 imageDownloadTimeout: 1h\n";
    assert_eq!(text.lines().nth(4), Some("  defaultCallTimeout: 5 parsecs"));
    let err = Config::parse(text).unwrap_err().to_string();
    assert!(err.contains("transport.defaultCallTimeout"), "{err}");
    assert!(err.contains("line 5"), "{err}");
    assert!(!err.contains("line 4"), "{err}");
    assert!(err.contains("\"5 parsecs\" is not a duration"), "{err}");
    // A value that is not even a string says what it wanted.
    let err = Config::parse("hosts: []\ntransport:\n  sshKeepaliveInterval: [1]\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("transport.sshKeepaliveInterval"), "{err}");
    assert!(err.contains("line 3"), "{err}");
    assert!(err.contains("a duration such as"), "{err}");
}

#[test]
fn durations_outside_their_range_name_the_field_and_the_limit() {
    let config = Config::parse(
        "hosts: [{name: here, local: true}]\n\
         transport:\n\
         \x20 sshHandshakeTimeout: 90000s\n\
         \x20 sshKeepaliveInterval: 1ms\n\
         \x20 libvirtKeepaliveInterval: 500ms\n\
         \x20 defaultCallTimeout: 0s\n\
         \x20 imageDownloadTimeout: 30d\n",
    )
    .unwrap();
    let err = config.validate().unwrap_err().to_string();
    for expected in [
        "transport.sshHandshakeTimeout: 1day 1h is above the maximum 10m",
        "transport.sshKeepaliveInterval: 1ms is below the minimum 100ms",
        "transport.libvirtKeepaliveInterval: 500ms is below the minimum 1s; libvirt counts \
         keepalives in whole seconds",
        "transport.defaultCallTimeout: must be longer than zero; use 100ms to 1h",
        "transport.imageDownloadTimeout: 30days is above the maximum 1day",
    ] {
        assert!(err.contains(expected), "{expected:?} missing from:\n{err}");
    }
}

#[test]
fn durations_at_their_limits_are_accepted() {
    let config = Config::parse(
        "hosts: [{name: here, local: true}]\n\
         transport:\n\
         \x20 sshHandshakeTimeout: 10m\n\
         \x20 sshKeepaliveInterval: 100ms\n\
         \x20 libvirtKeepaliveInterval: 1s\n\
         \x20 defaultCallTimeout: 1h\n\
         \x20 imageDownloadTimeout: 1m\n",
    )
    .unwrap();
    config.validate().unwrap();
}

#[test]
fn names_that_xml_cannot_keep_are_refused_with_their_field() {
    let config = Config::parse(
        "hosts:\n\
         - {name: \"hv\\n1\", local: true, network: \"net\\x7f\"}\n\
         - {name: hv2, local: true, bridge: \"br\\t0\"}\n\
         machineTypes: {\"small\\r\": {vcpus: 1, memoryMiB: 512, diskGiB: 1}}\n\
         images: {\"deb\\0\": {url: 'https://example.org/d.qcow2'}}\n",
    )
    .unwrap();
    let ConfigError { problems } = config.validate().unwrap_err();
    let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "hosts[0].name",
            "hosts[0].network",
            "hosts[1].bridge",
            "machineTypes.small\\r",
            "images.deb\\0"
        ]
    );
    assert!(
        problems[0].message.contains("U+000A"),
        "{}",
        problems[0].message
    );
}

#[test]
fn a_static_address_block_is_read_and_checked_with_its_fields() {
    let config = Config::parse(
        "hosts:\n\
         - name: a\n  local: true\n  bridge: br0\n  staticAddresses:\n    first: 192.0.2.10\n    last: 192.0.2.20\n    prefixLength: 24\n    gateway: 192.0.2.1\n    dns: [192.0.2.1, 2001:db8::53]\n\
         - name: b\n  local: true\n  staticAddresses: {first: 192.0.2.30, last: 192.0.2.20, prefixLength: 24, gateway: 192.0.2.25}\n",
    )
    .unwrap();
    let block = config.hosts[0].static_block().unwrap();
    assert_eq!(block.size(), 11);
    assert_eq!(block.dns.len(), 2);
    assert_eq!(config.hosts[1].static_block(), None, "no bridge, no block");
    let err = config.validate().unwrap_err();
    let fields: Vec<_> = err.problems.iter().map(|p| p.field.as_str()).collect();
    assert_eq!(
        fields,
        ["hosts[1].staticAddresses", "hosts[1].staticAddresses.last",],
        "{err}"
    );
    let typo = Config::parse(
        "hosts:\n- name: a\n  local: true\n  bridge: br0\n  staticAddresses: {first: 192.0.2.10, last: 192.0.2.20, prefix: 24}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(typo.contains("unknown field `prefix`"), "{typo}");
    let not_an_address = Config::parse(
        "hosts:\n- name: a\n  local: true\n  bridge: br0\n  staticAddresses: {first: 192.0.2.x, last: 192.0.2.20, prefixLength: 24}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(not_an_address.contains("line 5"), "{not_an_address}");
}
