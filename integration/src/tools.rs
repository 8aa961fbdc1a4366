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

/// The Python of the virtualenv `integration/tools/install-python-tools.sh` makes
/// (grpcio, grpcio-tools, reflection, health and status), or an error telling how to
/// get it.
pub fn python() -> anyhow::Result<PathBuf> {
    let path = bin_dir()?
        .parent()
        .context("tools directory has no parent")?
        .join("python/bin/python");
    if !path.is_file() {
        bail!(
            "the tools' Python virtualenv is missing at {}: run `make setup` (or integration/tools/install-python-tools.sh) first",
            path.display()
        );
    }
    Ok(path)
}

/// Runs a script under `integration/python/` with the tools' Python and returns its
/// standard output parsed as JSON; fails with its standard error otherwise.
pub fn run_python_json(script: &str, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let output = std::process::Command::new(python()?)
        .arg(&script)
        .args(args)
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}): {}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "{} printed no JSON: {}",
            script.display(),
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// A container image that `integration/tools/build-images.sh` wrote to the tools cache.
#[derive(Debug, Clone)]
pub struct ImageArchive {
    /// The docker-archive file (`ctr images import` takes it).
    pub path: PathBuf,
    /// The name (and tag) the image carries inside the archive.
    pub name: String,
}

/// The image archive `short` (for example `"pause"`), or an error telling how to build it.
pub fn image_archive(short: &str) -> anyhow::Result<ImageArchive> {
    let dir = bin_dir()?
        .parent()
        .context("tools directory has no parent")?
        .join("images");
    let path = dir.join(format!("{short}.tar"));
    let name = std::fs::read_to_string(dir.join(format!("{short}.name")));
    match name {
        Ok(name) if path.is_file() => Ok(ImageArchive {
            path,
            name: name.trim().to_owned(),
        }),
        _ => bail!(
            "container image {short} not found at {}: run `make setup` (or \
             integration/tools/build-images.sh) first",
            path.display()
        ),
    }
}
