//! The hypervisor itself.
//!
//! - [`capabilities`]: UEFI firmware and whether KVM really works (`domainType: auto`).
//! - [`capacity`]: the host's CPUs and memory and what its running domains hold.
//! - [`check`]: `kvm-agent check-host` and ValidatePlacement's report.

pub mod capabilities;
pub mod capacity;
pub mod check;
