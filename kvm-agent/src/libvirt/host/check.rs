//! `kvm-agent check-host`: verify a hypervisor before anything is created on it.
//!
//! [`check_host`] runs on one libvirt connection (blocking) and returns one line per
//! check, each with what to fix when it fails:
//! 1. libvirt answers, and its version;
//! 2. the storage pool exists, is active, and a volume can be created and deleted in it;
//! 3. the libvirt network exists and is active, or the bridge exists;
//! 4. UEFI firmware (OVMF) is available when an image boots with UEFI;
//! 5. the domain type: `kvm` offered by libvirt, and for `auto` a probe guest that proves
//!    KVM runs (else TCG, with the reason);
//! 6. the security driver confining guests (AppArmor, SELinux), for the record: the agent
//!    uses file disks so that AppArmor's helper labels them.

use std::fmt;

use virt::connect::Connect;
use virt::error::ErrorNumber;

use crate::config::{Attachment, DomainType, HostConfig};
use crate::libvirt::error::LibvirtError;
use crate::libvirt::host::capabilities::{VirtTypeChoice, detect_virt_type, domain_capabilities};
use crate::libvirt::naming::probe_domain_name;
use crate::libvirt::xml::capabilities::confinement_models;
use crate::libvirt::xml::domain::VirtType;
use crate::libvirt::xml::volume::raw_volume;
use crate::transport::call::CallFailure;
use crate::transport::libvirt_error::classify_libvirt;

/// How a check went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but worth knowing (e.g. TCG instead of KVM).
    Warn,
    /// Creating an instance would fail; [`Check::fix`] says what to do.
    Fail,
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked, e.g. `storage pool`.
    pub name: &'static str,
    /// How it went.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do, when it failed or warned.
    pub fix: Option<String>,
}

/// Every check of one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostReport {
    /// The host's name.
    pub host: String,
    /// The checks, in order.
    pub checks: Vec<Check>,
    /// The domain type new instances would get.
    pub virt_type: Option<VirtType>,
}

impl HostReport {
    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }
}

impl fmt::Display for HostReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {}",
            self.host,
            if self.failed() { "NOT READY" } else { "ready" }
        )?;
        for check in &self.checks {
            let mark = match check.status {
                Status::Ok => "ok  ",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
            };
            writeln!(f, "  [{mark}] {}: {}", check.name, check.detail)?;
            if let Some(fix) = &check.fix {
                writeln!(f, "         fix: {fix}")?;
            }
        }
        Ok(())
    }
}

fn ok(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        status: Status::Ok,
        detail: detail.into(),
        fix: None,
    }
}

fn problem(
    name: &'static str,
    status: Status,
    detail: impl Into<String>,
    fix: impl Into<String>,
) -> Check {
    Check {
        name,
        status,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}

/// Checks `host` on `conn`; `needs_uefi` when any configured image boots with UEFI.
/// Blocks for up to the KVM probe's timeout when the domain type is `auto`.
pub fn check_host(
    conn: &Connect,
    host: &HostConfig,
    needs_uefi: bool,
) -> Result<HostReport, CallFailure<LibvirtError>> {
    check_host_with(conn, host, needs_uefi, None)
}

/// [`check_host`] with the `auto` domain type already known (`auto`, e.g. from
/// [`crate::libvirt::host::capabilities::VirtTypes`]), so that it does not probe again.
pub(crate) fn check_host_with(
    conn: &Connect,
    host: &HostConfig,
    needs_uefi: bool,
    auto: Option<VirtTypeChoice>,
) -> Result<HostReport, CallFailure<LibvirtError>> {
    let mut checks = Vec::new();
    let version = conn.lib_version()?;
    checks.push(ok(
        "libvirt",
        format!(
            "reachable, version {}.{}.{}",
            version / 1_000_000,
            version / 1000 % 1000,
            version % 1000
        ),
    ));
    checks.push(check_pool(conn, &host.storage_pool)?);
    checks.push(check_attachment(conn, &host.attachment())?);

    let qemu = domain_capabilities(conn, VirtType::Qemu)?;
    checks.push(match (&qemu, needs_uefi) {
        (None, _) => problem(
            "firmware",
            Status::Fail,
            "libvirt offers no QEMU x86_64 q35 guests",
            "install the QEMU driver and emulator (Debian: libvirt-daemon-driver-qemu qemu-system-x86)",
        ),
        (Some(caps), true) if !caps.supports_uefi() => problem(
            "firmware",
            Status::Fail,
            "no UEFI firmware found, and an image boots with UEFI",
            "install OVMF (Debian: ovmf) or set `firmware: bios` on the image",
        ),
        (Some(caps), _) => ok(
            "firmware",
            format!(
                "UEFI {}",
                if caps.supports_uefi() { "available" } else { "not available (no image needs it)" }
            ),
        ),
    });

    let (virt_type, check) = match host.domain_type {
        DomainType::Qemu => (
            Some(VirtType::Qemu),
            ok("domain type", "qemu (software emulation), as configured"),
        ),
        DomainType::Kvm => match domain_capabilities(conn, VirtType::Kvm)? {
            Some(_) => (
                Some(VirtType::Kvm),
                ok("domain type", "kvm, as configured; libvirt offers it"),
            ),
            None => (
                None,
                problem(
                    "domain type",
                    Status::Fail,
                    "kvm is configured but libvirt offers no KVM here",
                    "enable virtualisation (kvm module, /dev/kvm readable by libvirt) or set `domainType: qemu`",
                ),
            ),
        },
        DomainType::Auto => {
            let choice = match auto {
                Some(choice) => choice,
                None => detect_virt_type(conn, &probe_domain_name())?,
            };
            let status = if choice.virt_type == VirtType::Kvm {
                Status::Ok
            } else {
                Status::Warn
            };
            let check = Check {
                name: "domain type",
                status,
                detail: format!(
                    "auto: {} ({})",
                    match choice.virt_type {
                        VirtType::Kvm => "kvm",
                        VirtType::Qemu => "qemu",
                    },
                    choice.reason
                ),
                fix: (status == Status::Warn).then(|| {
                    "guests run much slower under TCG; fix KVM or accept it with `domainType: qemu`"
                        .to_owned()
                }),
            };
            (Some(choice.virt_type), check)
        }
    };
    checks.push(check);
    checks.push(check_confinement(conn)?);
    Ok(HostReport {
        host: host.name.clone(),
        checks,
        virt_type,
    })
}

fn check_pool(conn: &Connect, name: &str) -> Result<Check, CallFailure<LibvirtError>> {
    const NAME: &str = "storage pool";
    let pool = match conn.lookup_storage_pool_by_name(name) {
        Ok(pool) => pool,
        Err(e) if e.code().is(ErrorNumber::NoStoragePool) => {
            return Ok(problem(
                NAME,
                Status::Fail,
                format!("{name:?} does not exist"),
                format!(
                    "define it, e.g. `virsh pool-define-as {name} dir --target /var/lib/libvirt/images && virsh pool-start {name} && virsh pool-autostart {name}`, or set storagePool"
                ),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    if !pool.is_active()? {
        return Ok(problem(
            NAME,
            Status::Fail,
            format!("{name:?} exists but is not active"),
            format!("`virsh pool-start {name} && virsh pool-autostart {name}`"),
        ));
    }
    let probe = probe_volume_name();
    let created = virt::storage_vol::StorageVol::create_xml(
        &pool,
        &raw_volume(&probe, 4096).expect("fixed volume XML"),
        0,
    );
    match created {
        Ok(vol) => match vol.delete(0) {
            // Deleted by someone else in between (e.g. a pool refresh and cleanup): fine.
            Err(e) if !e.code().is(ErrorNumber::NoStorageVolume) => Err(e.into()),
            _ => Ok(ok(NAME, format!("{name:?} active and writable"))),
        },
        // The transport failed: the caller reports the connection's error.
        Err(e) if classify_libvirt(&e, conn.is_alive().unwrap_or(false)).transport => Err(e.into()),
        // libvirtd reported it (EACCES, EROFS, ENOSPC arrive as a system error).
        Err(e) => Ok(problem(
            NAME,
            Status::Fail,
            format!("{name:?} is not writable: {}", e.message()),
            format!(
                "give libvirt write access to the pool's directory (`virsh pool-dumpxml {name}` \
                 shows it; check that it is mounted read-write and has free space), or use \
                 another pool"
            ),
        )),
    }
}

/// A probe volume name no concurrent check shares: this process and a counter (checks
/// from other processes differ in the pid).
fn probe_volume_name() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "egressproxy-check-host-{}-{}.probe",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

fn check_attachment(
    conn: &Connect,
    attachment: &Attachment,
) -> Result<Check, CallFailure<LibvirtError>> {
    const NAME: &str = "network";
    match attachment {
        Attachment::Network(name) => match conn.lookup_network_by_name(name) {
            Ok(network) if network.is_active()? => {
                Ok(ok(NAME, format!("libvirt network {name:?} active")))
            }
            Ok(_) => Ok(problem(
                NAME,
                Status::Fail,
                format!("libvirt network {name:?} is not active"),
                format!("`virsh net-start {name} && virsh net-autostart {name}`"),
            )),
            Err(e) if e.code().is(ErrorNumber::NoNetwork) => Ok(problem(
                NAME,
                Status::Fail,
                format!("libvirt network {name:?} does not exist"),
                "define it (`virsh net-define`), set `network` to an existing one, or use `bridge`",
            )),
            Err(e) => Err(e.into()),
        },
        Attachment::Bridge(name) => match conn.lookup_interface_by_name(name) {
            Ok(_) => Ok(ok(NAME, format!("bridge {name:?} exists"))),
            Err(e) if e.code().is(ErrorNumber::NoInterface) => Ok(problem(
                NAME,
                Status::Fail,
                format!("bridge {name:?} does not exist"),
                "create the bridge on the hypervisor, or set `bridge` to an existing one",
            )),
            Err(e) if classify_libvirt(&e, conn.is_alive().unwrap_or(false)).transport => {
                Err(e.into())
            }
            Err(e) => Ok(problem(
                NAME,
                Status::Warn,
                format!("cannot verify bridge {name:?}: {}", e.message()),
                format!("check on the hypervisor that `ip link show {name}` lists it"),
            )),
        },
    }
}

fn check_confinement(conn: &Connect) -> Result<Check, CallFailure<LibvirtError>> {
    let xml = conn.capabilities()?;
    let models = match confinement_models(&xml) {
        Ok(models) => models,
        Err(e) => {
            return Ok(problem(
                "confinement",
                Status::Warn,
                format!("cannot read the host capabilities: {e}"),
                "check `virsh capabilities`",
            ));
        }
    };
    Ok(if models.is_empty() {
        ok(
            "confinement",
            "no AppArmor or SELinux confinement of guests",
        )
    } else {
        ok(
            "confinement",
            format!(
                "{}: guests are confined; the agent's file disks are labelled by libvirt",
                models.join(", ")
            ),
        )
    })
}
