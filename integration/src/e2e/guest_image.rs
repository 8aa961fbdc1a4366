//! The guest image: built from Debian's packages by `integration/guest-image/build.sh`,
//! which caches it by the hash of its recipe (a warm call returns at once).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// The build script, relative to the workspace root.
pub const BUILD_SCRIPT: &str = "integration/guest-image/build.sh";

/// Builds the image if its recipe has no cached build, and returns the cached path.
/// The script's progress goes to this process's stderr.
pub fn guest_image() -> anyhow::Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(BUILD_SCRIPT);
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{BUILD_SCRIPT} failed ({}): see its output above",
            out.status
        );
    }
    let path = String::from_utf8(out.stdout).context("image path is not UTF-8")?;
    Ok(PathBuf::from(path.trim()))
}
