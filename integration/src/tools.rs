//! Locates the pinned test tools that `integration/tools/install-go-tools.sh` builds.
//!
//! Tests never build tools themselves (that would put a cold Go build on the fast test
//! path); they ask for a binary here and get an error that says how to install it.

use std::path::PathBuf;

use anyhow::{Context, bail};

/// The directory the install script writes binaries to: `$EGRESSPROXY_TOOLS_DIR/bin`,
/// else `$XDG_CACHE_HOME/egressproxy/tools/bin`, else `~/.cache/egressproxy/tools/bin`.
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    let cache = if let Some(dir) = std::env::var_os("EGRESSPROXY_TOOLS_DIR") {
        PathBuf::from(dir)
    } else if let Some(xdg) = std::env::var_os("XDG_CACHE_HOME") {
        PathBuf::from(xdg).join("egressproxy/tools")
    } else {
        let home = std::env::var_os("HOME").context("HOME is not set")?;
        PathBuf::from(home).join(".cache/egressproxy/tools")
    };
    Ok(cache.join("bin"))
}

/// Path of the tool `name` (for example `"grpcurl"`), or an error telling how to get it.
pub fn bin(name: &str) -> anyhow::Result<PathBuf> {
    let path = bin_dir()?.join(name);
    if !path.is_file() {
        bail!(
            "test tool {name} not found at {}: run `make setup` (or integration/tools/install-go-tools.sh) first",
            path.display()
        );
    }
    Ok(path)
}
