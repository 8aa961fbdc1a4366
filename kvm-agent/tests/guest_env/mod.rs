//! A hypervisor that can run the agent's guests, for Create tests: a private libvirtd in
//! a network namespace of its own, with a `default` dir pool and an isolated `default`
//! network whose dnsmasq hands out leases (inside that namespace only), reached through
//! a private sshd. Images are served by the shared test
//! [`HttpServer`](egressproxy_integration::http_server::HttpServer).
//!
//! The test image is Debian's iPXE boot image (`ipxe` package) converted to qcow2
//! (2 MiB): booted by SeaBIOS from the virtio disk, iPXE asks the network for a DHCP
//! lease within seconds and then idles, so an instance reaches RUNNING with an address
//! without an operating system, and costs little CPU under TCG.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;

/// Where Debian's `ipxe` package installs its BIOS-bootable image.
pub const IPXE_ISO: &str = "/usr/lib/ipxe/ipxe.iso";

/// A libvirtd with a pool and a DHCP network, behind an sshd.
pub struct GuestHost {
    pub libvirtd: Libvirtd,
    pub sshd: Sshd,
    pub images: PathBuf,
}

/// Runs virsh against `libvirtd` and returns its output; fails the test when virsh does.
fn virsh(libvirtd: &Libvirtd, args: &[&str]) -> String {
    let out = Command::new("virsh")
        .args(["-c", &libvirtd.uri()])
        .args(args)
        .output()
        .expect("virsh (libvirt-clients) is installed");
    assert!(
        out.status.success(),
        "virsh {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The host's `default` network: an isolated bridge whose dnsmasq leases
/// 192.168.200.10-250, with `dhcp_hosts` (`<host …/>` elements) reserved in it.
pub fn network_xml(dhcp_hosts: &str) -> String {
    format!(
        "<network><name>default</name><bridge name='virbr-ep0'/>\
         <ip address='192.168.200.1' netmask='255.255.255.0'>\
         <dhcp><range start='192.168.200.10' end='192.168.200.250'/>{dhcp_hosts}</dhcp>\
         </ip></network>"
    )
}

impl GuestHost {
    /// Starts libvirtd (in a new network namespace) and sshd, and defines the pool and
    /// network the agent's default host configuration uses.
    pub fn start() -> Self {
        let libvirtd = Libvirtd::start_in_new_netns().expect("start libvirtd");
        let images = libvirtd.dir().join("images");
        std::fs::create_dir(&images).unwrap();
        let images_arg = images.display().to_string();
        virsh(
            &libvirtd,
            &["pool-define-as", "default", "dir", "--target", &images_arg],
        );
        virsh(&libvirtd, &["pool-start", "default"]);
        let network = libvirtd.dir().join("network.xml");
        std::fs::write(&network, network_xml("")).unwrap();
        virsh(&libvirtd, &["net-define", &network.display().to_string()]);
        virsh(&libvirtd, &["net-start", "default"]);
        let sshd = Sshd::start().expect("start sshd");
        Self {
            libvirtd,
            sshd,
            images,
        }
    }

    /// Names of the files in the pool's directory, sorted.
    pub fn pool_files(&self) -> Vec<String> {
        let mut files: Vec<String> = std::fs::read_dir(&self.images)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        files
    }

    /// Names of every domain libvirtd has (defined or running), sorted.
    pub fn domains(&self) -> Vec<String> {
        let out = Command::new("virsh")
            .args(["-c", &self.libvirtd.uri(), "list", "--all", "--name"])
            .output()
            .unwrap();
        let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        names.sort();
        names
    }

    /// What a failed boot leaves to read: the DHCP leases dnsmasq recorded, the bridge's
    /// neighbours, the tail of libvirtd's log and of each guest's QEMU log (kept after
    /// the guest is deleted). Printed when a test that waited for a guest fails.
    pub fn diagnostics(&self) -> String {
        let dir = self.libvirtd.dir();
        let mut out = String::new();
        let mut section = |title: &str, body: String| {
            out.push_str(&format!("--- {title}\n{body}\n"));
        };
        section(
            "dnsmasq leases",
            std::fs::read_to_string(dir.join("lib/dnsmasq/virbr-ep0.status")).unwrap_or_default(),
        );
        let neighbours = self
            .libvirtd
            .netns_command("ip")
            .args(["neigh", "show", "dev", "virbr-ep0"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        section("bridge neighbours", neighbours);
        let tail = |path: &Path| {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        };
        section("libvirtd log (tail)", tail(&self.libvirtd.log()));
        if let Ok(entries) = std::fs::read_dir(dir.join("log/qemu")) {
            for entry in entries.flatten() {
                section(
                    &format!("QEMU log {}", entry.file_name().to_string_lossy()),
                    tail(&entry.path()),
                );
            }
        }
        out
    }

    /// `virsh ARGS` against this host's libvirtd: its output; fails the test when virsh
    /// does.
    pub fn virsh(&self, args: &[&str]) -> String {
        virsh(&self.libvirtd, args)
    }

    /// `virsh domstate NAME`.
    pub fn domstate(&self, name: &str) -> String {
        let out = Command::new("virsh")
            .args(["-c", &self.libvirtd.uri(), "domstate", name])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The agent's YAML configuration for this host (reached over SSH), a 128 MiB machine
    /// type `tiny` and the image `ipxe` at `image_url` (BIOS firmware).
    pub fn config_yaml(&self, image_url: &str, image_sha256: &str) -> String {
        format!(
            "hosts:\n\
             - name: hv1\n\
             \x20 ssh:\n\
             \x20   address: \"{address}\"\n\
             \x20   user: {user}\n\
             \x20   privateKey: {key}\n\
             \x20   knownHosts: {known_hosts}\n\
             \x20 libvirtSocket: {socket}\n\
             \x20 domainType: qemu\n\
             machineTypes:\n\
             \x20 tiny: {{vcpus: 1, memoryMiB: 128, diskGiB: 1}}\n\
             images:\n\
             \x20 ipxe:\n\
             \x20   url: {image_url}\n\
             \x20   sha256: {image_sha256}\n\
             \x20   format: qcow2\n\
             \x20   firmware: bios\n\
             transport:\n\
             \x20 defaultCallTimeout: 60s\n",
            address = self.sshd.address(),
            user = self.sshd.user(),
            key = self.sshd.client_key().display(),
            known_hosts = self.sshd.known_hosts().display(),
            socket = self.libvirtd.socket().display(),
        )
    }
}

/// The iPXE image as qcow2 in `dir`; returns its path.
pub fn ipxe_qcow2(dir: &Path) -> PathBuf {
    assert!(
        Path::new(IPXE_ISO).exists(),
        "{IPXE_ISO} missing: run integration/tools/install-system-packages.sh (package ipxe)"
    );
    let path = dir.join("ipxe.qcow2");
    let out = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2", IPXE_ISO])
        .arg(&path)
        .output()
        .expect("qemu-img (qemu-utils) is installed");
    assert!(out.status.success(), "{out:?}");
    path
}

/// SHA-256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(path).unwrap();
    sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `qemu-img info` of a file (`-U`: the file may be in use by a running guest).
pub fn qemu_img_info(path: &Path) -> String {
    let out = Command::new("qemu-img")
        .args(["info", "-U"])
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}
