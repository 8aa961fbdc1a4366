//! `kvm-agent check-config` and `check-hosts` as an operator runs them, and `probe
//! --wait` as `helm test` runs it right after an install.

mod common;

use common::kvm_agent;

use std::process::Command;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;

#[test]
fn check_config_names_the_bad_field_and_check_hosts_reaches_libvirt() {
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = format!(
        "hosts:\n\
         - name: hv\n  \
           ssh:\n    address: \"{}\"\n    user: root\n    privateKey: {}\n    knownHosts: {}\n  \
           libvirtSocket: {}\n\
         - name: here\n  local: true\n  libvirtSocket: {}\n\
         machineTypes:\n  small: {{vcpus: 1, memoryMiB: 512, diskGiB: 4}}\n\
         images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
        sshd.address(),
        sshd.client_key().display(),
        sshd.known_hosts().display(),
        libvirtd.socket().display(),
        libvirtd.socket().display(),
    );
    let good_path = dir.path().join("good.yaml");
    std::fs::write(&good_path, &good).unwrap();
    let (ok, stdout, stderr) =
        kvm_agent(&["check-config", "--config", good_path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ok (2 hosts, 1 machine types, 1 images)"),
        "{stdout}"
    );

    let (ok, stdout, stderr) = kvm_agent(&["check-hosts", "--config", good_path.to_str().unwrap()]);
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("hv: ok, libvirt 11."), "{stdout}");
    assert!(stdout.contains("here: ok, libvirt 11."), "{stdout}");

    let bad = good.replace(
        &sshd.client_key().display().to_string(),
        "/nonexistent/id_ed25519",
    );
    let bad_path = dir.path().join("bad.yaml");
    std::fs::write(&bad_path, bad).unwrap();
    let (ok, _, stderr) = kvm_agent(&["check-config", "--config", bad_path.to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("hosts[0].ssh.privateKey"), "{stderr}");
    assert!(stderr.contains("/nonexistent/id_ed25519"), "{stderr}");
}

/// The first ```lang block of section `## title` (or `### title`) of docs/kvm-agent.md.
fn documented_block(title: &str, lang: &str) -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with(title))
        .unwrap_or_else(|| panic!("docs/kvm-agent.md has a {title:?} section"));
    section
        .split(&format!("```{lang}\n"))
        .nth(1)
        .and_then(|b| b.split("```").next())
        .unwrap_or_else(|| panic!("a {lang} block in {title:?}"))
        .to_owned()
}

#[test]
fn the_documented_configuration_reference_passes_check_config() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("id_ed25519");
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let known_hosts = dir.path().join("known_hosts");
    std::fs::write(&known_hosts, format!("hv1.example.org {public}")).unwrap();

    let yaml = documented_block("Configuration reference", "yaml");
    // Only the key files (which check-config reads) and the checksum placeholder change.
    for placeholder in [
        "/keys/id_ed25519",
        "/keys/known_hosts",
        "\"<64 hex digits>\"",
    ] {
        assert!(yaml.contains(placeholder), "{placeholder} not in\n{yaml}");
    }
    let yaml = yaml
        .replace("/keys/id_ed25519", key.to_str().unwrap())
        .replace("/keys/known_hosts", known_hosts.to_str().unwrap())
        .replace("\"<64 hex digits>\"", &"ab".repeat(32));
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    let (ok, stdout, stderr) = kvm_agent(&["check-config", "--config", path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("ok (2 hosts, 1 machine types, 1 images)"),
        "{stdout}"
    );
}

#[test]
fn check_config_fails_when_the_spool_dir_cannot_take_a_file() {
    let dir = tempfile::tempdir().unwrap();
    // Root ignores mode bits: a path under a regular file fails for everyone (ENOTDIR).
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"").unwrap();
    let blocked = file.join("spool");
    let config = dir.path().join("config.yaml");
    let host = "hosts: [{name: here, local: true}]\n";
    std::fs::write(
        &config,
        format!(
            "{host}transport: {{imageSpoolDir: {}}}\n",
            blocked.display()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let (ok, _, stderr) = kvm_agent(&["check-config", "--config", config]);
    assert!(!ok);
    assert!(stderr.contains("transport.imageSpoolDir"), "{stderr}");
    assert!(stderr.contains(&blocked.display().to_string()), "{stderr}");
    assert!(stderr.contains("writable directory"), "{stderr}");
    // `serve` refuses to start the same way.
    let (ok, _, stderr) = kvm_agent(&["serve", "--config", config, "--listen", "127.0.0.1:0"]);
    assert!(!ok);
    assert!(stderr.contains("transport.imageSpoolDir"), "{stderr}");

    // Unset, the spool dir is the temp dir: an unusable TMPDIR is named too.
    let config = dir.path().join("default.yaml");
    std::fs::write(&config, host).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvm-agent"))
        .args(["check-config", "--config", config.to_str().unwrap()])
        .env("TMPDIR", &blocked)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("transport.imageSpoolDir"), "{stderr}");
    assert!(stderr.contains("TMPDIR"), "{stderr}");
    // A writable one passes.
    let (ok, _, stderr) = kvm_agent(&["check-config", "--config", config.to_str().unwrap()]);
    assert!(ok, "{stderr}");
}

#[test]
fn the_documented_pool_and_network_commands_prepare_a_hypervisor() {
    // A network namespace of its own: `net-start` makes a bridge and runs dnsmasq.
    let libvirtd = Libvirtd::start_in_new_netns().unwrap();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Preparing a hypervisor"))
        .unwrap();
    let commands: Vec<String> = section
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("virsh "))
        .map(|l| l.split(" #").next().unwrap().trim().to_owned())
        .collect();
    assert_eq!(commands.len(), 7, "{commands:?}");
    for command in &commands {
        let args: Vec<&str> = command.split_whitespace().skip(1).collect();
        let out = Command::new("virsh")
            .args(["-c", &libvirtd.uri()])
            .args(&args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{command}: {out:?}");
    }
    let virsh = |args: &[&str]| {
        let out = Command::new("virsh")
            .args(["-c", &libvirtd.uri()])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let pool = virsh(&["pool-info", "default"]);
    assert!(pool.contains("State:          running"), "{pool}");
    assert!(pool.contains("Autostart:      yes"), "{pool}");
    let network = virsh(&["net-info", "default"]);
    assert!(network.contains("Active:         yes"), "{network}");
    assert!(network.contains("Autostart:      yes"), "{network}");
    // The OVMF package the section names holds the firmware libvirt offers.
    assert!(section.contains("`apt install ovmf`"), "{section}");
    let out = Command::new("dpkg-query")
        .args(["-L", "ovmf"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("/usr/share/OVMF/OVMF_CODE"),
        "{out:?}"
    );
}

#[test]
fn the_documented_commands_and_their_options_exist() {
    let block = documented_block("Commands", "sh");
    let mut seen = 0;
    for line in block.lines().filter(|l| l.starts_with("kvm-agent ")) {
        let command = line.split(" #").next().unwrap();
        let words: Vec<&str> = command.split_whitespace().skip(1).collect();
        let Some(sub) = words.iter().find(|w| !w.starts_with('-')) else {
            continue;
        };
        if *sub == "..." {
            // `kvm-agent -v ...`: the global flag.
            let (ok, stdout, _) = kvm_agent(&["--help"]);
            assert!(ok && stdout.contains("--verbose"), "{stdout}");
            continue;
        }
        let (ok, help, stderr) = kvm_agent(&[sub, "--help"]);
        assert!(ok, "{line}: {stderr}");
        for word in &words {
            let flag = word.trim_start_matches('[').trim_end_matches(']');
            if flag.starts_with("--") {
                assert!(help.contains(flag), "{line}: {flag} not in\n{help}");
            } else if flag.chars().all(|c| c.is_ascii_uppercase()) {
                assert!(help.contains(&format!("[{flag}]")), "{line}: {help}");
            }
        }
        seen += 1;
    }
    assert_eq!(seen, 6, "{block}");
}

/// `probe --wait` keeps asking while nothing answers (a Service that does not route yet)
/// and succeeds once a server does; without it, the first refusal fails the probe.
#[test]
fn probe_wait_asks_again_until_the_server_answers() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("127.0.0.1:{port}");
    let (ok, _, stderr) = kvm_agent(&["probe", "--address", &address]);
    assert!(!ok, "a probe of a closed port succeeded");
    assert!(stderr.contains("Connection refused"), "{stderr}");

    let mut probe = Command::new(env!("CARGO_BIN_EXE_kvm-agent"))
        .args(["probe", "--address", &address, "--wait", "60s"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The server starts only once the probe has been refused and said it asks again.
    let mut stderr = BufReader::new(probe.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.contains("asking again in"), "{line}");
    let server =
        egressproxy_integration::reference_provider::workspace_binary("reference-provider")
            .unwrap();
    let mut server = Command::new(server)
        .args(["--listen", &address])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = probe.wait_with_output().unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("SERVING"), "{stdout}");
}
