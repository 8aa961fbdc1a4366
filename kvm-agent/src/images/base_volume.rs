//! A base image's volumes, named by content: the digest that names them, the base volume
//! and its completion marker, and the verified base a Create builds on. Step 1 of
//! [`super::cache`]'s docs.

use sha2::{Digest, Sha256};

use crate::config::error::{ConfigError, ConfigProblem};
use crate::config::{ImageConfig, ImageFormat};
use crate::images::error::ImageError;
use crate::libvirt::naming;

/// Suffix of a base volume's completion marker.
pub(crate) const MARKER_SUFFIX: &str = ".complete";

/// A verified base volume on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseImage {
    /// libvirt volume name in the host's storage pool.
    pub volume: String,
    /// Its file path on the host (disks are file-type: libvirt's AppArmor helper only
    /// allows file sources with a path).
    pub path: String,
    /// Its disk format, as configured and checked by libvirt's probe.
    pub format: ImageFormat,
    /// Virtual size of the base: an overlay must be at least this large.
    pub capacity_bytes: u64,
}

/// The completion marker volume of base volume `base`.
pub fn marker_volume(base: &str) -> String {
    format!("{base}{MARKER_SUFFIX}")
}

/// The digest that names `image`'s base volume: its configured SHA-256 (lowercased), or
/// the SHA-256 of its URL when none is configured. See the module docs.
pub(crate) fn image_digest(image: &ImageConfig) -> String {
    match &image.sha256 {
        Some(sum) => sum.to_ascii_lowercase(),
        None => hex::encode(Sha256::digest(image.url.as_bytes())),
    }
}

/// Names of one image's volumes.
#[derive(Debug, Clone)]
pub(super) struct BaseNames {
    pub(super) digest: String,
    pub(super) base: String,
    pub(super) marker: String,
}

impl BaseNames {
    pub(super) fn for_image(image_name: &str, image: &ImageConfig) -> Result<Self, ImageError> {
        let digest = image_digest(image);
        let base = naming::base_volume(&digest).map_err(|e| {
            ImageError::from(ConfigError::new(vec![ConfigProblem::new(
                format!("images.{image_name}.sha256"),
                e.to_string(),
            )]))
        })?;
        Ok(Self {
            digest,
            marker: marker_volume(&base),
            base,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_the_checksum_or_the_urls() {
        let mut image = ImageConfig {
            url: "http://127.0.0.1/i.qcow2".into(),
            sha256: Some("AB".repeat(32)),
            format: ImageFormat::Qcow2,
            firmware: Default::default(),
            guest_agent: Default::default(),
        };
        assert_eq!(image_digest(&image), "ab".repeat(32));
        image.sha256 = None;
        // printf %s http://127.0.0.1/i.qcow2 | sha256sum
        assert_eq!(
            image_digest(&image),
            "07773b3835d5fa1ab34335a91d3e8085b01e8f4e3a212d164018bc402b90e77a"
        );
        let names = BaseNames::for_image("i", &image).unwrap();
        assert_eq!(names.marker, format!("{}.complete", names.base));
        assert!(super::super::eviction::is_base(&names.base));
        assert!(!super::super::eviction::is_base(&names.marker));
    }
}
