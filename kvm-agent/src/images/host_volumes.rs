//! The libvirt side of the image cache: one bounded, traced call per step, each a closure
//! run by [`HostPool::call`] (or deleted best-effort after a failure).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use virt::error::ErrorNumber;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;

use super::base_volume::BaseNames;
use crate::config::{ImageConfig, ImageFormat, redact_url};
use crate::images::error::ImageError;
use crate::libvirt::LibvirtError;
use crate::libvirt::volumes::lookup_volume;
use crate::libvirt::xml::volume::{VolumeFacts, sparse_raw_volume};
use crate::transport::call::{CallFailure, LibvirtOp};
use crate::transport::pool::HostPool;

/// Deadline of the clean-up of a failed download (deleting the half-written volume).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Attempts, and the pause between them, to delete a volume libvirt reports in use.
const IN_USE_RETRIES: u32 = 50;
const IN_USE_PAUSE: Duration = Duration::from_millis(100);

pub(super) fn is(error: &virt::error::Error, code: ErrorNumber) -> bool {
    error.code().is_any(vec![code])
}

/// `virStoragePoolRefresh`, retried while libvirt refuses because another volume of the
/// pool is being built.
pub(super) fn refresh_pool(pool: &StoragePool) -> Result<(), virt::error::Error> {
    let mut attempts = 0;
    loop {
        match pool.refresh(0) {
            Err(e) if attempts < 50 && e.message().contains("asynchronous jobs") => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

/// The bytes free in `pool`, after a refresh (libvirt's figure is otherwise that of
/// the last refresh).
pub(super) async fn pool_available(
    host: &Arc<HostPool>,
    pool: &str,
    deadline: Instant,
) -> Result<u64, ImageError> {
    let pool = pool.to_owned();
    let op = LibvirtOp::new("virStoragePoolGetInfo");
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        refresh_pool(&pool)?;
        Ok(pool.info()?.available)
    })
    .await
}

/// What step 3 found.
pub(super) enum Existing {
    Complete { path: String, capacity: u64 },
    Absent,
}

/// Step 3: a complete base, or nothing (after deleting a half-written base or a stray
/// marker).
pub(super) async fn check_existing(
    host: &Arc<HostPool>,
    pool: &str,
    names: &BaseNames,
    deadline: Instant,
) -> Result<Existing, ImageError> {
    let (pool, names) = (pool.to_owned(), names.clone());
    let op = LibvirtOp::new("virStorageVolLookupByName").volume(names.base.clone());
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        let base = lookup_volume(&pool, &names.base)?;
        let marker = lookup_volume(&pool, &names.marker)?;
        match (base, marker) {
            (Some(base), Some(_)) => Ok(Existing::Complete {
                path: base.path()?,
                capacity: base.info()?.capacity,
            }),
            (Some(base), None) => {
                tracing::warn!(
                    volume = %names.base,
                    "deleting a base volume without completion marker (an earlier download was interrupted)"
                );
                base.delete(0)?;
                Ok(Existing::Absent)
            }
            (None, Some(marker)) => {
                marker.delete(0)?;
                Ok(Existing::Absent)
            }
            (None, None) => Ok(Existing::Absent),
        }
    })
    .await
}

pub(super) async fn create_upload_target(
    host: &Arc<HostPool>,
    pool: &str,
    volume: &str,
    length: u64,
    deadline: Instant,
) -> Result<(), ImageError> {
    let xml = sparse_raw_volume(volume, length)
        .map_err(|e| ImageError::from(LibvirtError::xml(format!("volume XML for {volume}"), e)))?;
    let pool = pool.to_owned();
    let op = LibvirtOp::new("virStorageVolCreateXML")
        .volume(volume)
        .bytes(length);
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        StorageVol::create_xml(&pool, &xml, 0)?;
        Ok(())
    })
    .await
}

pub(super) async fn create_marker(
    host: &Arc<HostPool>,
    pool: &str,
    marker: &str,
    deadline: Instant,
) -> Result<(), ImageError> {
    let xml = sparse_raw_volume(marker, 0)
        .map_err(|e| ImageError::from(LibvirtError::xml(format!("volume XML for {marker}"), e)))?;
    let pool = pool.to_owned();
    let op = LibvirtOp::new("virStorageVolCreateXML").volume(marker);
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        match StorageVol::create_xml(&pool, &xml, 0) {
            Ok(_) => Ok(()),
            Err(e) if is(&e, ErrorNumber::StorageVolExist) => Ok(()),
            Err(e) => Err(e.into()),
        }
    })
    .await
}

/// What libvirt's probe says about an uploaded base.
#[derive(Debug)]
pub(super) struct Inspected {
    pub(super) path: String,
    pub(super) capacity: u64,
    format: Option<String>,
    backing_path: Option<String>,
}

/// Step 7: refresh the pool so libvirt probes the file, then read the volume back.
pub(super) async fn inspect(
    host: &Arc<HostPool>,
    pool: &str,
    volume: &str,
    deadline: Instant,
) -> Result<Inspected, ImageError> {
    let (pool, volume) = (pool.to_owned(), volume.to_owned());
    let op = LibvirtOp::new("virStoragePoolRefresh").volume(volume.clone());
    let host_name = host.name().to_owned();
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        refresh_pool(&pool)?;
        let vol = pool.lookup_storage_vol_by_name(&volume)?;
        let xml = vol.xml_desc(0)?;
        let facts = VolumeFacts::parse(&xml).map_err(|e| {
            CallFailure::Agent(ImageError::from(LibvirtError::xml(
                format!("host {host_name}: the XML of volume {volume}"),
                e,
            )))
        })?;
        Ok(Inspected {
            path: vol.path()?,
            capacity: vol.info()?.capacity,
            format: facts.format,
            backing_path: facts.backing_path,
        })
    })
    .await
}

pub(super) fn check_format(image: &ImageConfig, inspected: &Inspected) -> Result<(), ImageError> {
    let found = inspected.format.as_deref().unwrap_or("unknown");
    let expected_ok = match image.format {
        ImageFormat::Qcow2 => found == "qcow2",
        // A raw disk may look like an ISO or carry no recognisable header; any format
        // with a header of its own would be misread as raw bytes.
        ImageFormat::Raw => matches!(found, "raw" | "iso" | "unknown"),
    };
    let configured = match image.format {
        ImageFormat::Qcow2 => "qcow2",
        ImageFormat::Raw => "raw",
    };
    if !expected_ok {
        return Err(ImageError::Format {
            url: redact_url(&image.url),
            problem: format!(
                "libvirt probed the file as {found}, the configuration says {configured}"
            ),
        });
    }
    if let Some(backing) = &inspected.backing_path {
        return Err(ImageError::Format {
            url: redact_url(&image.url),
            problem: format!(
                "the image names a backing file ({backing}); a base image must be self-contained"
            ),
        });
    }
    Ok(())
}

/// Deletes a base whose download failed; on failure the next attempt deletes it (step 3).
pub(super) async fn delete_half_written(host: &Arc<HostPool>, pool: &str, volume: &str) {
    let (pool_name, name) = (pool.to_owned(), volume.to_owned());
    let op = LibvirtOp::new("virStorageVolDelete").volume(volume);
    let deleted: Result<(), ImageError> = host
        .call(op, Instant::now() + CLEANUP_TIMEOUT, move |c| {
            let pool = c.lookup_storage_pool_by_name(&pool_name)?;
            let mut attempts = 0;
            loop {
                let Some(vol) = lookup_volume(&pool, &name)? else {
                    return Ok(());
                };
                match vol.delete(0) {
                    // "still in use": the server side of a cut upload stream lets go of
                    // the volume a moment after the client side returned.
                    Err(e)
                        if is(&e, ErrorNumber::OperationInvalid) && attempts < IN_USE_RETRIES =>
                    {
                        attempts += 1;
                        std::thread::sleep(IN_USE_PAUSE);
                    }
                    Err(e) if is(&e, ErrorNumber::NoStorageVolume) => return Ok(()),
                    other => return other.map_err(Into::into),
                }
            }
        })
        .await;
    if let Err(e) = deleted {
        tracing::warn!(volume, error = %e, "cannot delete a half-written base volume; the next attempt will");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A volume an upload stream still writes is deleted: libvirt 11 allows it on a dir
    /// pool (the stream writes on into the unlinked file); versions that refuse with
    /// OPERATION_INVALID get retries until the stream lets go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_half_written_volume_is_deleted_while_its_upload_still_holds_it() {
        use egressproxy_integration::libvirtd::Libvirtd;

        let libvirtd = Libvirtd::start().unwrap();
        let images = libvirtd.dir().join("images");
        std::fs::create_dir(&images).unwrap();
        let config = crate::config::Config::parse(&format!(
            "hosts:\n- name: here\n  local: true\n  libvirtSocket: {}\n",
            libvirtd.socket().display()
        ))
        .unwrap();
        let pool = crate::transport::pool::Pool::new(&config).unwrap();
        let host = pool.host("here").unwrap();
        // An upload in progress, on a connection of its own (as the bulk one).
        virt::error::clear_error_callback();
        let conn = virt::connect::Connect::open(Some(&libvirtd.uri())).unwrap();
        let xml = format!(
            "<pool type='dir'><name>default</name><target><path>{}</path></target></pool>",
            images.display()
        );
        let storage = conn.create_storage_pool_xml(&xml, 0).unwrap();
        let length = 1 << 20;
        let vol = StorageVol::create_xml(
            &storage,
            &crate::libvirt::xml::volume::raw_volume("half.img", length).unwrap(),
            0,
        )
        .unwrap();
        let stream = virt::stream::Stream::new(&conn, 0).unwrap();
        vol.upload(&stream, 0, length, 0).unwrap();
        stream.send(&[7u8; 4096]).unwrap();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            stream.abort().unwrap();
            drop((vol, storage, conn));
        });
        delete_half_written(&host, "default", "half.img").await;
        assert!(!images.join("half.img").exists());
        releaser.join().unwrap();
        assert_eq!(std::fs::read_dir(&images).unwrap().count(), 0);
    }

    #[test]
    fn a_format_other_than_configured_or_a_backing_file_is_refused() {
        let image = |format| ImageConfig {
            url: "u".into(),
            sha256: None,
            format,
            firmware: Default::default(),
            guest_agent: Default::default(),
        };
        let inspected = |format: &str, backing: Option<&str>| Inspected {
            path: "/p".into(),
            capacity: 1,
            format: Some(format.into()),
            backing_path: backing.map(str::to_owned),
        };
        check_format(&image(ImageFormat::Qcow2), &inspected("qcow2", None)).unwrap();
        check_format(&image(ImageFormat::Raw), &inspected("raw", None)).unwrap();
        for (format, found, backing) in [
            (ImageFormat::Qcow2, "raw", None),
            (ImageFormat::Raw, "qcow2", None),
            (ImageFormat::Qcow2, "qcow2", Some("/etc/shadow")),
        ] {
            let err = check_format(&image(format), &inspected(found, backing)).unwrap_err();
            assert_eq!(
                err.class(),
                crate::classification::ErrorClass::Permanent,
                "{err}"
            );
        }
    }
}
