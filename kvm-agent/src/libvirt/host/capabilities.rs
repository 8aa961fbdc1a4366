//! What a hypervisor can run: UEFI firmware, and whether KVM really works.
//!
//! `domainType: auto` must not trust `/dev/kvm`: under nested virtualisation it can exist,
//! pass libvirt's checks, and still hang every guest. So [`detect_virt_type`]:
//! 1. asks libvirt's domain capabilities for `kvm` (x86_64, q35); when libvirt does not
//!    offer it, the answer is `qemu` (TCG);
//! 2. otherwise starts a tiny transient **probe domain** of type `kvm`: SeaBIOS with no
//!    boot device and `rebootTimeout='0'`, so a working vCPU reaches "no bootable device"
//!    within a second and reboots, and `on_reboot='destroy'` ends the domain. If it is
//!    still there after [`PROBE_TIMEOUT`], KVM hangs: the probe is destroyed and the
//!    answer is `qemu`, with the reason. The probe is started with
//!    `VIR_DOMAIN_START_AUTODESTROY`: should its connection close first (a deadline cut
//!    it, the agent died), libvirtd destroys the guest, so no probe is ever left running.
//!
//! [`VirtTypes`] caches the answer per host for the agent's run and runs at most one probe
//! per host at a time, in a task of its own under [`PROBE_DEADLINE`] (not the caller's
//! deadline): callers whose deadline passes first get [`LibvirtError::KvmProbeRunning`]
//! and a later call gets the answer.
//!
//! [`DomainCapabilities::parse`] also tells whether UEFI firmware (OVMF) is available,
//! which UEFI images need.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use virt::connect::Connect;
use virt::domain::Domain;
use virt::error::ErrorNumber;

use crate::config::DomainType;
use crate::libvirt::error::LibvirtError;
use crate::libvirt::naming::probe_domain_name;
use crate::libvirt::xml::XmlError;
use crate::libvirt::xml::capabilities::DomainCapabilities;
use crate::libvirt::xml::domain::VirtType;
use crate::single_flight::{SingleFlight, Waited};
use crate::transport::call::{CallFailure, LibvirtOp};
use crate::transport::error::TransportError;
use crate::transport::pool::HostPool;

/// How long a probe domain may take to run its firmware and reboot.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(15);

/// The deadline of the whole `auto` detection on a host (capabilities, then the probe),
/// whatever the caller's deadline.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(45);

/// A probe's outcome as the waiting callers see it.
type Answer = Result<VirtTypeChoice, Arc<LibvirtError>>;

/// The domain type of each host with `domainType: auto`, probed once per agent run (a
/// failed detection is retried by the next caller); one probe per host at a time, whose
/// flight shows when it ends at the latest. See the module docs.
#[derive(Debug, Default, Clone)]
pub struct VirtTypes {
    known: Arc<Mutex<HashMap<String, VirtTypeChoice>>>,
    probes: Arc<SingleFlight<String, tokio::time::Instant, Answer>>,
}

impl VirtTypes {
    /// The domain type new domains on `host` get.
    pub(crate) async fn for_host(
        &self,
        host: &Arc<HostPool>,
        deadline: tokio::time::Instant,
    ) -> Result<VirtType, LibvirtError> {
        match host.config().domain_type {
            DomainType::Kvm => Ok(VirtType::Kvm),
            DomainType::Qemu => Ok(VirtType::Qemu),
            DomainType::Auto => Ok(self.auto_choice(host, deadline).await?.virt_type),
        }
    }

    /// The `auto` choice for `host` (whatever its configured type): cached, or from the
    /// host's one running probe, started when none runs.
    pub async fn auto_choice(
        &self,
        host: &Arc<HostPool>,
        deadline: tokio::time::Instant,
    ) -> Result<VirtTypeChoice, LibvirtError> {
        if let Some(choice) = self
            .known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(host.name())
        {
            return Ok(choice.clone());
        }
        let probe = self.probes.join_or_start(host.name().to_owned(), || {
            let until = tokio::time::Instant::now() + PROBE_DEADLINE;
            (until, self.probe_task(host.clone(), until))
        });
        match probe.wait(deadline).await {
            Waited::DeadlinePassed => Err(LibvirtError::KvmProbeRunning {
                host: host.name().to_owned(),
                retry_in: probe
                    .meta
                    .saturating_duration_since(tokio::time::Instant::now()),
            }),
            Waited::Lost => Err(LibvirtError::Transport(TransportError::Worker {
                host: host.name().to_owned(),
                op: "virDomainCreateXML",
                reason: "the KVM probe task ended without an answer".into(),
            })),
            Waited::Done(Ok(choice)) => Ok(choice),
            Waited::Done(Err(error)) => Err(LibvirtError::Shared(error)),
        }
    }

    /// Detects the type of `host` under `until`; a success is remembered before the
    /// flight ends, so no caller starts a second probe.
    fn probe_task(
        &self,
        host: Arc<HostPool>,
        until: tokio::time::Instant,
    ) -> impl std::future::Future<Output = Answer> + Send + 'static {
        let known = self.known.clone();
        async move {
            // A probe that ended between the caller's look at `known` and this flight's
            // start has left its answer there.
            let remembered = known
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(host.name())
                .cloned();
            if let Some(choice) = remembered {
                return Ok(choice);
            }
            let probe = probe_domain_name();
            let result = host
                .call(LibvirtOp::new("virDomainCreateXML"), until, move |conn| {
                    detect_virt_type(conn, &probe)
                })
                .await;
            match &result {
                Ok(choice) => {
                    tracing::info!(host = host.name(), virt_type = ?choice.virt_type, reason = %choice.reason, "domainType auto");
                    known
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(host.name().to_owned(), choice.clone());
                }
                Err(error) => {
                    tracing::warn!(host = host.name(), %error, "domainType auto: detection failed");
                }
            }
            result.map_err(Arc::new)
        }
    }
}

/// The domain type chosen for `domainType: auto`, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtTypeChoice {
    /// The type new domains get.
    pub virt_type: VirtType,
    /// Why, for the host check's report and the logs.
    pub reason: String,
}

/// Domain capabilities of `virt_type` for q35 on x86_64; `None` when libvirt does not
/// offer that type on this host.
pub fn domain_capabilities(
    conn: &Connect,
    virt_type: VirtType,
) -> Result<Option<DomainCapabilities>, CallFailure<LibvirtError>> {
    let kind = match virt_type {
        VirtType::Kvm => "kvm",
        VirtType::Qemu => "qemu",
    };
    match conn.domain_capabilities(None, Some("x86_64"), Some("q35"), Some(kind), 0) {
        Ok(xml) => DomainCapabilities::parse(&xml)
            .map(Some)
            .map_err(|e| CallFailure::Agent(LibvirtError::xml(format!("{kind} domain"), e))),
        Err(e)
            if e.code().is_any(vec![
                ErrorNumber::InvalidArg,
                ErrorNumber::ConfigUnsupported,
                ErrorNumber::OperationUnsupported,
                ErrorNumber::NoSupport,
            ]) =>
        {
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// Chooses `kvm` or `qemu` for `domainType: auto`. See the module docs. Blocks up to
/// [`PROBE_TIMEOUT`] (run it on a blocking thread, with a deadline longer than that).
pub fn detect_virt_type(
    conn: &Connect,
    probe_name: &str,
) -> Result<VirtTypeChoice, CallFailure<LibvirtError>> {
    if domain_capabilities(conn, VirtType::Kvm)?.is_none() {
        return Ok(VirtTypeChoice {
            virt_type: VirtType::Qemu,
            reason: "libvirt offers no KVM on this host; using software emulation (TCG)".into(),
        });
    }
    Ok(
        match probe(conn, VirtType::Kvm, probe_name, PROBE_TIMEOUT)? {
            ProbeOutcome::Ran(after) => VirtTypeChoice {
                virt_type: VirtType::Kvm,
                reason: format!("a KVM probe guest ran its firmware in {after:?}"),
            },
            ProbeOutcome::Hung => VirtTypeChoice {
                virt_type: VirtType::Qemu,
                reason: format!(
                    "KVM is offered but a probe guest made no progress in {PROBE_TIMEOUT:?} \
                 (nested KVM?); using software emulation (TCG). Set domainType: kvm or qemu \
                 to skip the probe"
                ),
            },
            ProbeOutcome::Failed(message) => VirtTypeChoice {
                virt_type: VirtType::Qemu,
                reason: format!(
                    "KVM is offered but a probe guest did not start ({message}); using software \
                 emulation (TCG)"
                ),
            },
        },
    )
}

/// What became of a probe domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// It ran its firmware and ended, after this long.
    Ran(Duration),
    /// It was still running at the timeout (and was destroyed).
    Hung,
    /// libvirt refused to start it.
    Failed(String),
}

/// Runs a probe domain of `virt_type` named `name` for at most `timeout`.
pub fn probe(
    conn: &Connect,
    virt_type: VirtType,
    name: &str,
    timeout: Duration,
) -> Result<ProbeOutcome, CallFailure<LibvirtError>> {
    let xml = probe_domain_xml(name, virt_type)
        .map_err(|e| CallFailure::Agent(LibvirtError::xml(format!("probe domain {name}"), e)))?;
    let started = Instant::now();
    let domain = match start_probe_domain(conn, &xml)? {
        Ok(domain) => domain,
        Err(message) => return Ok(ProbeOutcome::Failed(message)),
    };
    while started.elapsed() < timeout {
        match domain.is_active() {
            Ok(false) => return Ok(ProbeOutcome::Ran(started.elapsed())),
            Err(e) if e.code().is(ErrorNumber::NoDomain) => {
                return Ok(ProbeOutcome::Ran(started.elapsed()));
            }
            Ok(true) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => {
                let _ = domain.destroy();
                return Err(e.into());
            }
        }
    }
    match domain.destroy() {
        Ok(()) => Ok(ProbeOutcome::Hung),
        // It ended between the last look and the destroy.
        Err(e)
            if e.code()
                .is_any(vec![ErrorNumber::NoDomain, ErrorNumber::OperationInvalid]) =>
        {
            Ok(ProbeOutcome::Ran(started.elapsed()))
        }
        Err(e) => Err(e.into()),
    }
}

/// Starts the transient probe domain `xml`, destroyed by libvirtd when `conn` closes
/// (`VIR_DOMAIN_START_AUTODESTROY`); `Err(message)` when libvirt refuses it.
pub fn start_probe_domain(
    conn: &Connect,
    xml: &str,
) -> Result<Result<Domain, String>, CallFailure<LibvirtError>> {
    match conn.create_domain_xml(xml, virt::sys::VIR_DOMAIN_START_AUTODESTROY) {
        Ok(domain) => Ok(Ok(domain)),
        Err(e)
            if crate::transport::libvirt_error::classify_libvirt(
                &e,
                conn.is_alive().unwrap_or(false),
            )
            .transport =>
        {
            Err(e.into())
        }
        Err(e) => Ok(Err(e.message().to_owned())),
    }
}

/// A transient domain that boots SeaBIOS with nothing to boot and ends on the reboot
/// that follows.
pub fn probe_domain_xml(name: &str, virt_type: VirtType) -> Result<String, XmlError> {
    #[derive(Serialize)]
    #[serde(rename = "domain")]
    struct Probe<'a> {
        #[serde(rename = "@type")]
        kind: &'static str,
        name: &'a str,
        memory: Memory,
        vcpu: u32,
        os: ProbeOs,
        on_poweroff: &'static str,
        on_reboot: &'static str,
        on_crash: &'static str,
        devices: ProbeDevices,
    }
    #[derive(Serialize)]
    struct Memory {
        #[serde(rename = "@unit")]
        unit: &'static str,
        #[serde(rename = "$text")]
        value: u32,
    }
    use crate::libvirt::xml::domain::OsType;
    #[derive(Serialize)]
    struct ProbeOs {
        #[serde(rename = "type")]
        os_type: OsType,
        bios: Bios,
    }
    #[derive(Serialize)]
    struct Bios {
        #[serde(rename = "@rebootTimeout")]
        reboot_timeout: u32,
    }
    #[derive(Serialize)]
    struct ProbeDevices {
        memballoon: Model,
    }
    #[derive(Serialize)]
    struct Model {
        #[serde(rename = "@model")]
        model: &'static str,
    }
    Ok(quick_xml::se::to_string(&Probe {
        kind: match virt_type {
            VirtType::Kvm => "kvm",
            VirtType::Qemu => "qemu",
        },
        name,
        memory: Memory {
            unit: "MiB",
            value: 32,
        },
        vcpu: 1,
        os: ProbeOs {
            os_type: OsType {
                arch: "x86_64",
                machine: "q35",
                value: "hvm",
            },
            bios: Bios { reboot_timeout: 0 },
        },
        on_poweroff: "destroy",
        on_reboot: "destroy",
        on_crash: "destroy",
        devices: ProbeDevices {
            memballoon: Model { model: "none" },
        },
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libvirt's own schema accepts the probe domain.
    #[test]
    fn probe_domain_validates() {
        let xml = probe_domain_xml("egressproxy-probe-<x>", VirtType::Kvm).unwrap();
        assert!(xml.contains(r#"<bios rebootTimeout="0"/>"#), "{xml}");
        assert!(xml.contains("<on_reboot>destroy</on_reboot>"), "{xml}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("probe.xml");
        std::fs::write(&path, &xml).unwrap();
        let out = std::process::Command::new("virt-xml-validate")
            .arg(&path)
            .arg("domain")
            .output()
            .expect("virt-xml-validate (libvirt-clients) is installed");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
