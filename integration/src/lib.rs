//! Harnesses for tests that use the real components instead of mocks.
//!
//! - [`tools`]: locates the pinned Go-built test tools (grpcurl, buf, helm).

pub mod tools;
