//! What a hypervisor has, and what its running domains hold: the figures ListLocations
//! reports and Create places by.
//!
//! One blocking sweep on one connection ([`measure`]):
//! 1. `virNodeGetInfo`: the host's CPUs and memory;
//! 2. `virConnectListAllDomains` (active ones): every running domain's current memory
//!    and vCPUs (`virDomainGetInfo`), the agent's and anyone else's, because all of them
//!    hold the host's memory;
//! 3. the agent's own domains, in any state, counted by their name prefix.
//!
//! Memory is *committed* memory (what running domains were given), not the kernel's
//! free memory: QEMU allocates a guest's memory as the guest touches it, so a VM that
//! just booted looks nearly free, and the page cache makes `virNodeGetFreeMemory` (the
//! kernel's MemFree) a small fraction of what is really available. The figure a new
//! VM can count on is what no running VM was promised.

use virt::connect::Connect;

use crate::libvirt::error::LibvirtError;
use crate::libvirt::naming::INSTANCE_PREFIX;
use crate::transport::call::CallFailure;

/// A host's size and what its domains hold, as [`measure`] read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostFigures {
    /// Host CPUs (`virNodeGetInfo`).
    pub cpus: u32,
    /// Host memory, in bytes.
    pub memory_bytes: u64,
    /// Memory given to running domains (all of them), in bytes.
    pub committed_memory_bytes: u64,
    /// vCPUs of running domains (all of them).
    pub committed_vcpus: u32,
    /// The agent's own domains, in any state.
    pub agent_instances: u32,
}

/// Reads the figures of the host behind `conn`. See the module docs.
pub fn measure(conn: &Connect) -> Result<HostFigures, CallFailure<LibvirtError>> {
    let node = conn.node_info()?;
    let mut figures = HostFigures {
        cpus: node.cpus,
        memory_bytes: node.memory.saturating_mul(1024),
        ..HostFigures::default()
    };
    for domain in conn.list_all_domains(0)? {
        let ours = domain
            .name()
            .is_ok_and(|name| name.starts_with(INSTANCE_PREFIX));
        if ours {
            figures.agent_instances = figures.agent_instances.saturating_add(1);
        }
        // A domain that vanished between the listing and this read holds nothing.
        let Ok(true) = domain.is_active() else {
            continue;
        };
        let Ok(info) = domain.info() else {
            continue;
        };
        figures.committed_memory_bytes = figures
            .committed_memory_bytes
            .saturating_add(info.memory.saturating_mul(1024));
        figures.committed_vcpus = figures.committed_vcpus.saturating_add(info.nr_virt_cpu);
    }
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host of libvirt's test driver, private to this connection: 4 CPUs, 4 GiB, and
    /// a running domain of someone else's holding 1 GiB and 2 vCPUs.
    fn private_host() -> (tempfile::NamedTempFile, Connect) {
        let node = tempfile::Builder::new().suffix(".xml").tempfile().unwrap();
        std::fs::write(
            node.path(),
            "<node><cpu><mhz>2000</mhz><model>x86_64</model><active>4</active><total>4</total>\
             <nodes>1</nodes><sockets>1</sockets><cores>4</cores><threads>1</threads></cpu>\
             <memory>4194304</memory>\
             <domain type='test'><name>other</name><memory unit='MiB'>1024</memory>\
             <vcpu>2</vcpu><os><type>hvm</type></os></domain></node>",
        )
        .unwrap();
        let conn = Connect::open(Some(&format!("test://{}", node.path().display()))).unwrap();
        (node, conn)
    }

    #[test]
    fn every_running_domain_holds_memory_and_the_agents_own_are_counted_in_any_state() {
        let (_node, conn) = private_host();
        let expected = |committed_mib: u64, vcpus: u32, ours: u32| HostFigures {
            cpus: 4,
            memory_bytes: 4 << 30,
            committed_memory_bytes: committed_mib << 20,
            committed_vcpus: vcpus,
            agent_instances: ours,
        };
        assert_eq!(measure(&conn).unwrap(), expected(1024, 2, 0));

        let xml = format!(
            "<domain type='test'><name>{INSTANCE_PREFIX}k1</name><memory unit='MiB'>256</memory>\
             <vcpu>3</vcpu><os><type>hvm</type></os></domain>"
        );
        let domain = conn.define_domain_xml(&xml).unwrap();
        assert_eq!(
            measure(&conn).unwrap(),
            expected(1024, 2, 1),
            "defined, not running"
        );
        domain.create().unwrap();
        assert_eq!(measure(&conn).unwrap(), expected(1280, 5, 1), "running");
        domain.destroy().unwrap();
        assert_eq!(measure(&conn).unwrap(), expected(1024, 2, 1), "shut off");
    }
}
