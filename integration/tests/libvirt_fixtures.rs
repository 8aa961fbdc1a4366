//! The private libvirtd and sshd fixtures: isolated, controllable, cleaned up.
//! Needs root and `integration/tools/install-system-packages.sh`.

use std::process::Command;
use std::time::Duration;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::process::{process_tree, wait_until};
use egressproxy_integration::sshd::Sshd;

fn virsh(libvirtd: &Libvirtd, args: &[&str]) -> (bool, String) {
    let out = Command::new("virsh")
        .arg("-c")
        .arg(libvirtd.uri())
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn net_ns_of(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .unwrap()
        .display()
        .to_string()
}

#[test]
fn libvirtd_is_private_controllable_and_cleaned_up() {
    let mut libvirtd = Libvirtd::start().unwrap();
    let (ok, text) = virsh(
        &libvirtd,
        &["pool-create-as", "fixture", "dir", "--target", "/tmp"],
    );
    assert!(ok, "{text}");
    let (ok, text) = virsh(&libvirtd, &["pool-list", "--name"]);
    assert!(ok && text.contains("fixture"), "{text}");
    // Its state lives in its own directory, not the machine's /var/lib/libvirt.
    assert!(libvirtd.dir().join("run").join("libvirt-sock").exists());

    let pid = libvirtd.libvirtd_pid().unwrap();
    let tree = process_tree(pid);
    libvirtd.pause().unwrap();
    // SIGSTOP is delivered asynchronously.
    wait_until("libvirtd stopped", Duration::from_secs(2), || {
        Ok(std::fs::read_to_string(format!("/proc/{pid}/stat"))?.contains(") T "))
    })
    .unwrap();
    libvirtd.resume().unwrap();
    assert!(virsh(&libvirtd, &["version"]).0);

    libvirtd.restart().unwrap();
    let (ok, text) = virsh(&libvirtd, &["version"]);
    assert!(ok, "{text}");
    assert_ne!(libvirtd.libvirtd_pid().unwrap(), pid);

    let dir = libvirtd.dir().to_owned();
    drop(libvirtd);
    assert!(!dir.exists(), "directory removed");
    for p in tree {
        assert!(
            !std::path::Path::new(&format!("/proc/{p}")).exists() || is_zombie(p),
            "process {p} left behind"
        );
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

#[test]
fn libvirtd_in_its_own_network_namespace() {
    let libvirtd = Libvirtd::start_in_new_netns().unwrap();
    let name = libvirtd.netns().unwrap().to_owned();
    let pid = libvirtd.libvirtd_pid().unwrap();
    assert_ne!(net_ns_of(pid), net_ns_of(std::process::id()));
    // Reachable from outside the namespace through the shared filesystem.
    let (ok, text) = virsh(&libvirtd, &["version"]);
    assert!(ok, "{text}");
    let out = libvirtd
        .netns_command("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&out.stdout);
    assert!(links.contains("lo:") && !links.contains("eth0"), "{links}");
    drop(libvirtd);
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains(&name),
        "namespace deleted"
    );
}

#[test]
fn sshd_accepts_its_client_key_and_keeps_key_and_port_across_restart() {
    let mut sshd = Sshd::start().unwrap();
    let client_args = sshd.ssh_client_args();
    let ssh = |args: &[&str]| {
        Command::new("ssh")
            .args(&client_args)
            .args(args)
            .output()
            .unwrap()
    };
    let out = ssh(&["127.0.0.1", "echo hello"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hello");

    sshd.restart().unwrap();
    let out = ssh(&["127.0.0.1", "true"]);
    assert!(out.status.success(), "same host key and port after restart");
    assert!(sshd.host_key_fingerprint().unwrap().starts_with("SHA256:"));
    let log = std::fs::read_to_string(sshd.log()).unwrap();
    assert!(log.contains("Accepted publickey for root"), "{log}");
}

/// A client that connects while sshd restarts must meet either the old sshd, whose
/// sessions all end with it, or the new one: a session the old sshd forked during its
/// shutdown would otherwise log in with the old host key after the restart.
#[test]
fn an_sshd_restart_leaves_no_session_of_the_old_sshd() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let mut sshd = Sshd::start().unwrap();
    let address = sshd.address();
    let done = Arc::new(AtomicBool::new(false));
    let client = std::thread::spawn({
        let done = done.clone();
        move || {
            // Every connection stays open until the end, so its session waits in
            // pre-auth (one whose client left would exit on its own); at most 80, below
            // the fixture's MaxStartups 100, past which sshd drops new ones unforked.
            let mut open = Vec::new();
            while !done.load(Ordering::SeqCst) && open.len() < 80 {
                if let Ok(stream) = std::net::TcpStream::connect(&address) {
                    open.push(stream);
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            open
        }
    });
    let old_sshd = sshd.pid().unwrap();
    wait_until("a session of this sshd", Duration::from_secs(10), || {
        Ok(process_tree(old_sshd).len() > 1)
    })
    .unwrap();
    sshd.restart().unwrap();
    let new_sshd = sshd.pid().unwrap();
    done.store(true, Ordering::SeqCst);
    let _open = client.join().unwrap();
    // A session whose sshd is gone is re-parented to this process (a child subreaper).
    let me = std::process::id().to_string();
    let strays: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| {
            let dir = entry.path();
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            let parent = stat[stat.rfind(')')? + 2..].split(' ').nth(1)?;
            let cmdline = std::fs::read_to_string(dir.join("cmdline")).ok()?;
            let title = cmdline.trim_end_matches('\0').to_owned();
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            (parent == me && pid != new_sshd && is_session(&title)).then_some(title)
        })
        .collect();
    assert!(strays.is_empty(), "sessions of the old sshd: {strays:?}");
}

/// A per-connection sshd, by the title it gives itself (`sshd-session:` from OpenSSH
/// 9.8 on; the listener's title says it is one).
fn is_session(cmdline: &str) -> bool {
    (cmdline.starts_with("sshd:") || cmdline.starts_with("sshd-session:"))
        && !cmdline.contains("[listener]")
}
