//! Harnesses for tests that use the real components instead of mocks.
//!
//! - [`tools`]: locates the pinned Go-built test tools (grpcurl, buf, helm).
//! - [`libvirtd`]: a private libvirtd in its own mount namespace.
//! - [`sshd`]: a private sshd on loopback with generated host and client keys.
//! - [`process`]: daemons as process trees: pause, resume, stop on drop.

pub mod tools;
pub mod libvirtd;
pub mod process;
pub mod sshd;
