//! docs/kvm-agent.md, "Preparing a hypervisor", run as written: step 2's shell block
//! creates the `egressproxy` user (with the `libvirt` group and a freshly generated
//! client key), step 3's `Match User egressproxy` block goes verbatim into a private sshd
//! whose global `AllowTcpForwarding` is `no` (so that block is what allows the forward),
//! and a private libvirtd's socket belongs to group `libvirt` with mode 0770. The agent
//! then reaches libvirt as `egressproxy`, root on the same sshd is refused the forward, and
//! `kvm-agent check-host` over that path prints what the section's sample shows.
//!
//! Needs root (useradd), the `libvirt` group (Debian's libvirt-daemon-system), and
//! `integration/tools/install-system-packages.sh`. The user is removed at the end, also
//! on panic.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{config, deadline_in, kvm_agent, ssh_host};
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::{Sshd, SshdOptions};
use kvm_agent::error::{Error, TransportError};
use kvm_agent::transport::pool::Pool;

/// The user the documentation creates.
const USER: &str = "egressproxy";
const GENEROUS: Duration = Duration::from_secs(30);

fn section() -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    doc.split("\n## ")
        .find(|s| s.starts_with("Preparing a hypervisor"))
        .expect("docs/kvm-agent.md has a \"Preparing a hypervisor\" section")
        .to_owned()
}

/// The text of numbered step `n` (`n. **...`) of the section, up to the next step.
fn step(section: &str, n: u32) -> String {
    let start = section
        .find(&format!("\n{n}. **"))
        .unwrap_or_else(|| panic!("step {n} in\n{section}"));
    let rest = &section[start + 1..];
    let end = rest.find(&format!("\n{}. **", n + 1)).unwrap_or(rest.len());
    rest[..end].to_owned()
}

/// The first fenced block opened by exactly ```` ```lang ```` in `text`, with the fence's
/// indentation (a list item's) removed from every line.
fn fenced_block(text: &str, lang: &str) -> String {
    let mut lines = text.lines();
    let fence = format!("```{lang}");
    let open = lines
        .by_ref()
        .find(|l| l.trim_start() == fence)
        .unwrap_or_else(|| panic!("a {fence} block in\n{text}"));
    let indent = open.len() - open.trim_start().len();
    let mut block = String::new();
    for line in lines {
        if line.trim_start() == "```" {
            return block;
        }
        let line = line.get(indent..).unwrap_or("");
        block.push_str(line);
        block.push('\n');
    }
    panic!("unterminated {fence} block in\n{text}");
}

fn run(program: &str, args: &[&str]) -> std::process::Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"))
}

fn user_exists() -> bool {
    run("getent", &["passwd", USER]).status.success()
}

/// Deletes the documented user (and its home and group), if present.
fn remove_user() {
    if user_exists() {
        // Exit status 12 only means no mail spool to remove.
        let _ = run("userdel", &["-r", USER]);
    }
    if run("getent", &["group", USER]).status.success() {
        let _ = run("groupdel", &[USER]);
    }
}

/// Removes the documented user on drop, also when the test panics.
struct UserGuard;

impl Drop for UserGuard {
    fn drop(&mut self) {
        remove_user();
    }
}

/// One line of `check-host` output.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Line {
    /// `NAME: READY|NOT READY`
    Header { host: String, state: String },
    /// `  [MARK] name: detail`
    Check {
        mark: String,
        name: String,
        detail: String,
    },
    /// `         fix: ...`
    Fix(String),
}

fn parse_report(text: &str) -> Vec<Line> {
    text.lines()
        .map(|line| {
            if let Some(fix) = line.strip_prefix("         fix: ") {
                Line::Fix(fix.to_owned())
            } else if let Some(rest) = line.strip_prefix("  [") {
                let (mark, rest) = rest
                    .split_once("] ")
                    .unwrap_or_else(|| panic!("no mark in {line:?}"));
                assert!(
                    ["ok  ", "WARN", "FAIL"].contains(&mark),
                    "unknown mark {mark:?} in {line:?}"
                );
                let (name, detail) = rest
                    .split_once(": ")
                    .unwrap_or_else(|| panic!("no `name: detail` in {line:?}"));
                Line::Check {
                    mark: mark.to_owned(),
                    name: name.to_owned(),
                    detail: detail.to_owned(),
                }
            } else {
                let (host, state) = line
                    .split_once(": ")
                    .unwrap_or_else(|| panic!("a line of no known shape: {line:?}"));
                assert!(
                    !host.starts_with(' ') && ["ready", "NOT READY"].contains(&state),
                    "a line of no known shape: {line:?}"
                );
                Line::Header {
                    host: host.to_owned(),
                    state: state.to_owned(),
                }
            }
        })
        .collect()
}

/// `detail` with each run of digits replaced by `N` (`reachable, version N.N.N`).
fn version_shape(detail: &str) -> String {
    let mut shape = String::new();
    for c in detail.chars() {
        if !c.is_ascii_digit() {
            shape.push(c);
        } else if !shape.ends_with('N') {
            shape.push('N');
        }
    }
    shape
}

fn virsh(libvirtd: &Libvirtd, args: &[&str]) -> String {
    let out = Command::new("virsh")
        .args(["-c", &libvirtd.uri()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "virsh {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn documented_user_and_sshd_match_block_let_the_agent_reach_libvirt() {
    let section = section();
    let user_block = fenced_block(&step(&section, 2), "sh");
    let match_block = fenced_block(&step(&section, 3), "");
    assert!(
        user_block.contains(&format!(
            "useradd --system --create-home --shell /bin/sh {USER}"
        )),
        "step 2 creates {USER}:\n{user_block}"
    );
    assert!(
        match_block.starts_with(&format!("Match User {USER}\n")),
        "step 3's block is a Match block for {USER}:\n{match_block}"
    );

    let libvirt_gid = {
        let out = run("getent", &["group", "libvirt"]);
        assert!(
            out.status.success(),
            "the `libvirt` group does not exist: install libvirt-daemon-system \
             (integration/tools/install-system-packages.sh)"
        );
        let line = String::from_utf8_lossy(&out.stdout).into_owned();
        line.split(':').nth(2).unwrap().parse::<u32>().unwrap()
    };

    // Step 2, as written, in a directory holding the public half of a new client key.
    remove_user();
    assert!(!user_exists(), "could not remove an earlier {USER}");
    let _user = UserGuard;
    let work = tempfile::tempdir().unwrap();
    let key = work.path().join("id_ed25519");
    let out = run(
        "ssh-keygen",
        &["-q", "-t", "ed25519", "-N", "", "-f", key.to_str().unwrap()],
    );
    assert!(out.status.success(), "ssh-keygen: {out:?}");
    let out = Command::new("sh")
        .arg("-e")
        .arg("-c")
        .arg(&user_block)
        .current_dir(work.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "step 2 failed as written:\n{user_block}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let groups = String::from_utf8_lossy(&run("id", &["-nG", USER]).stdout).into_owned();
    assert!(
        groups.split_whitespace().any(|g| g == "libvirt"),
        "{USER} is in libvirt: {groups}"
    );

    // Step 3, verbatim, on an sshd that otherwise refuses TCP and socket forwards.
    let sshd = Sshd::start_with(&SshdOptions {
        allow_tcp_forwarding: Some("no".into()),
        system_users: true,
        extra_config: match_block.clone(),
    })
    .unwrap();
    let libvirtd = Libvirtd::start_with_socket_group("libvirt").unwrap();
    let socket = std::fs::metadata(libvirtd.socket()).unwrap();
    assert_eq!(socket.gid(), libvirt_gid, "the socket's group is libvirt");
    assert_eq!(
        socket.permissions().mode() & 0o777,
        0o770,
        "only root and the libvirt group may use the socket"
    );

    let mut agent = ssh_host("hv1", &sshd, &libvirtd);
    {
        let ssh = agent.ssh.as_mut().unwrap();
        ssh.user = USER.to_owned();
        ssh.private_key = key.clone();
    }
    // Root logs in with the fixture's key, but no Match block allows it a forward.
    let root = ssh_host("hv-root", &sshd, &libvirtd);
    assert_eq!(sshd.user(), "root");
    let pool = Pool::new(&config(vec![agent.clone(), root])).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let version = pool
            .host("hv1")
            .unwrap()
            .lib_version(deadline_in(GENEROUS))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "the agent as {USER} reaches libvirt: {e}\nsshd log:\n{}",
                    std::fs::read_to_string(sshd.log()).unwrap_or_default()
                )
            });
        assert!(version >= 1_000_000, "libvirt {version}");

        let refused: Error = pool
            .host("hv-root")
            .unwrap()
            .lib_version(deadline_in(GENEROUS))
            .await
            .expect_err("root is not in the Match block: its forward is refused")
            .into();
        assert!(
            matches!(
                refused,
                Error::Transport(TransportError::ForwardRefused { .. })
            ),
            "root's forward is refused, not another failure: {refused:?}"
        );
    });
    drop(pool);
    let log = std::fs::read_to_string(sshd.log()).unwrap();
    assert!(
        log.contains(&format!("Accepted publickey for {USER}")),
        "{USER} logged in with the key from ~{USER}/.ssh/authorized_keys:\n{log}"
    );

    // check-host through the same path, on a host like the section's sample: the pool
    // ready, the `default` network defined but not started.
    let images = libvirtd.dir().join("images");
    std::fs::create_dir(&images).unwrap();
    virsh(
        &libvirtd,
        &[
            "pool-define-as",
            "default",
            "dir",
            "--target",
            images.to_str().unwrap(),
        ],
    );
    virsh(&libvirtd, &["pool-start", "default"]);
    virsh(
        &libvirtd,
        &["net-define", "/usr/share/libvirt/networks/default.xml"],
    );
    let ssh = agent.ssh.as_ref().unwrap();
    let yaml = format!(
        "hosts:\n\
         - name: hv1\n  \
           ssh:\n    address: \"{}\"\n    user: {}\n    privateKey: {}\n    knownHosts: {}\n  \
           libvirtSocket: {}\n\
         images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
        ssh.address,
        ssh.user,
        ssh.private_key.display(),
        sshd.known_hosts().display(),
        libvirtd.socket().display(),
    );
    let config_path = work.path().join("config.yaml");
    std::fs::write(&config_path, yaml).unwrap();
    let (succeeded, stdout, stderr) = kvm_agent(&[
        "check-host",
        "--config",
        config_path.to_str().unwrap(),
        "hv1",
    ]);
    assert!(
        !succeeded,
        "an inactive network is not ready\n{stdout}{stderr}"
    );
    assert_report_matches_sample(&fenced_block(&section, ""), &stdout, &stderr);
    assert_no_leftover(&libvirtd.dir().join("images"));
}

/// The sample and the real report have the same lines in the same order: the same
/// statuses, names and fixes; the same details except where they depend on the host
/// (libvirt's version, why `auto` chose qemu, the security driver).
fn assert_report_matches_sample(sample: &str, stdout: &str, stderr: &str) {
    let expected = parse_report(sample);
    let actual = parse_report(stdout);
    let context = format!("docs sample:\n{sample}\nkvm-agent check-host:\n{stdout}{stderr}");
    assert_eq!(expected.len(), actual.len(), "line count\n{context}");
    for (want, got) in expected.iter().zip(&actual) {
        match (want, got) {
            (
                Line::Check {
                    mark: want_mark,
                    name: want_name,
                    detail: want_detail,
                },
                Line::Check { mark, name, detail },
            ) => {
                assert_eq!(
                    (want_mark, want_name),
                    (mark, name),
                    "check line\n{context}"
                );
                match name.as_str() {
                    "libvirt" => assert_eq!(
                        version_shape(want_detail),
                        version_shape(detail),
                        "libvirt line\n{context}"
                    ),
                    "domain type" => {
                        for d in [want_detail, detail] {
                            assert!(d.starts_with("auto: qemu ("), "{d:?}\n{context}");
                        }
                    }
                    // apparmor in the sample; the fixture runs without a security driver.
                    "confinement" => {}
                    _ => assert_eq!(want_detail, detail, "{name} line\n{context}"),
                }
            }
            _ => assert_eq!(want, got, "line\n{context}"),
        }
    }
}

/// check-host deleted its probe volume.
fn assert_no_leftover(images: &Path) {
    let left: Vec<_> = std::fs::read_dir(images)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "check-host left {left:?}");
}
