//! The hypervisor itself.
//!
//! - [`capabilities`]: UEFI firmware and whether KVM really works (`domainType: auto`).
//! - [`check`]: `kvm-agent check-host` and ValidatePlacement's report.

pub mod capabilities;
pub mod check;
