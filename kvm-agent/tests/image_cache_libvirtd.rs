//! The base image cache against a real private libvirtd reached through a real sshd, with
//! a qcow2 image (made by `qemu-img`) served over HTTP on 127.0.0.1 by the shared test server,
//! which counts its requests and misbehaves on request (no Content-Length, a cut body, a
//! slow body).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::http_server::{Delivery, HttpServer, Reply};
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::config::{ImageConfig, ImageFormat};
use kvm_agent::error::{Error, ErrorClass};
use kvm_agent::images::cache::{
    BaseImage, CacheUsage, ImageCache, ImageCacheOptions, KeptBecause, marker_volume,
};
use kvm_agent::libvirt::naming::base_volume;
use kvm_agent::libvirt::xml::volume::{overlay_volume, raw_volume};
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::{HostPool, Pool};

const GENEROUS: Duration = Duration::from_secs(120);
/// The test image's virtual size; its file is a few MiB.
const VIRTUAL_SIZE: u64 = 64 << 20;

/// A qcow2 image of ~3 MiB of data and a 64 MiB virtual size, made once per test binary.
fn qcow2_image() -> &'static [u8] {
    static IMAGE: OnceLock<Vec<u8>> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("data.raw");
        let data: Vec<u8> = (0..3 << 20)
            .map(|i: u32| (i % 251) as u8 ^ (i >> 12) as u8)
            .collect();
        std::fs::write(&raw, data).unwrap();
        let qcow2 = dir.path().join("image.qcow2");
        run(
            "qemu-img",
            &["convert", "-f", "raw", "-O", "qcow2"],
            &[&raw, &qcow2],
        );
        run(
            "qemu-img",
            &["resize", "-f", "qcow2"],
            &[&qcow2, Path::new("64M")],
        );
        std::fs::read(&qcow2).unwrap()
    })
}

/// A second, different image.
fn other_image() -> Vec<u8> {
    let mut image = qcow2_image().to_vec();
    // The last cluster holds data; flipping a byte there changes the content, not the
    // header.
    let last = image.len() - 1;
    image[last] ^= 0xff;
    image
}

fn run(program: &str, args: &[&str], paths: &[&Path]) {
    let out = std::process::Command::new(program)
        .args(args)
        .args(paths)
        .output()
        .unwrap();
    assert!(out.status.success(), "{program}: {out:?}");
}

/// The expected digest comes from coreutils' `sha256sum`, so the test does not trust
/// any hashing or hex code of the agent, nor of its own.
fn sha256_hex(data: &[u8]) -> String {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success(), "sha256sum: {out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let digest = text.split_whitespace().next().unwrap().to_owned();
    assert_eq!(digest.len(), 64, "sha256sum printed {text:?}");
    digest
}

#[test]
fn the_expected_digests_come_from_sha256sum() {
    // The digest of "abc" as printed by `printf abc | sha256sum`.
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

/// How the server answers a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Normal,
    NoLength,
    /// Half the body on the first request, then normal.
    ShortOnce,
    /// 64 KiB every 40 ms.
    Slow,
    /// Half the body, then nothing, connection kept open.
    Stall,
}

/// The shared test HTTP server on 127.0.0.1, with this test's modes.
struct Server {
    base: String,
    http: HttpServer,
}

impl Server {
    fn start() -> Self {
        let http = HttpServer::start();
        Self {
            base: http.base_url(),
            http,
        }
    }

    fn serve(&self, path: &str, body: Vec<u8>, mode: Mode) -> String {
        let body = Bytes::from(body);
        let delivery = match mode {
            Mode::Normal | Mode::ShortOnce => Delivery::Whole,
            Mode::NoLength => Delivery::NoLength,
            Mode::Slow => Delivery::Slow {
                chunk: 64 * 1024,
                pause: Duration::from_millis(40),
            },
            Mode::Stall => Delivery::Stall,
        };
        self.http.route_with(path, move |_, nth| {
            let delivery = if mode == Mode::ShortOnce && nth == 1 {
                Delivery::Short
            } else {
                delivery
            };
            Reply::Body(body.clone(), delivery)
        })
    }

    fn requests(&self, path: &str) -> usize {
        self.http.requests(path)
    }

    fn completed(&self, path: &str) -> usize {
        self.http.completed(path)
    }
}

/// A private libvirtd with a dir pool `default`, reached through a private sshd.
struct Fixture {
    _libvirtd: Libvirtd,
    _sshd: Sshd,
    _pool: Pool,
    host: Arc<HostPool>,
    images: PathBuf,
    server: Server,
    spool: tempfile::TempDir,
}

impl Fixture {
    async fn start() -> Self {
        let libvirtd = Libvirtd::start().unwrap();
        let sshd = Sshd::start().unwrap();
        let config = config(vec![ssh_host("hv", &sshd, &libvirtd)]);
        let pool = Pool::new(&config).unwrap();
        let host = pool.host("hv").unwrap();
        let images = libvirtd.dir().join("images");
        std::fs::create_dir(&images).unwrap();
        let xml = format!(
            "<pool type='dir'><name>default</name><target><path>{}</path></target></pool>",
            images.display()
        );
        host.call::<_, kvm_agent::TransportError, _>(
            LibvirtOp::new("virStoragePoolCreateXML"),
            deadline_in(GENEROUS),
            move |c| {
                c.create_storage_pool_xml(&xml, 0)?;
                Ok(())
            },
        )
        .await
        .unwrap();
        Self {
            _libvirtd: libvirtd,
            _sshd: sshd,
            _pool: pool,
            host,
            images,
            server: Server::start(),
            spool: tempfile::tempdir().unwrap(),
        }
    }

    /// A cache whose eviction does not spare young bases (every base here is young).
    fn cache(&self) -> ImageCache {
        ImageCache::new(ImageCacheOptions {
            spool_dir: self.spool.path().to_owned(),
            download_timeout: GENEROUS,
            eviction_min_age: Duration::ZERO,
            ..ImageCacheOptions::default()
        })
    }

    /// File names in the pool's directory, sorted.
    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.images)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    async fn ensure(
        &self,
        cache: &ImageCache,
        image: &ImageConfig,
        wait: Duration,
    ) -> Result<BaseImage, Error> {
        cache
            .ensure_base(&self.host, "test-image", image, deadline_in(wait))
            .await
            .map_err(Error::from)
    }

    /// Creates a volume through libvirt, as a killed agent or Create would have left it.
    async fn create_volume(&self, xml: String) {
        self.host
            .call::<_, kvm_agent::TransportError, _>(
                LibvirtOp::new("virStorageVolCreateXML"),
                deadline_in(GENEROUS),
                move |c| {
                    let pool = c.lookup_storage_pool_by_name("default")?;
                    virt::storage_vol::StorageVol::create_xml(&pool, &xml, 0)?;
                    Ok(())
                },
            )
            .await
            .unwrap();
    }

    async fn delete_volume(&self, name: &str) {
        let name = name.to_owned();
        self.host
            .call::<_, kvm_agent::TransportError, _>(
                LibvirtOp::new("virStorageVolDelete"),
                deadline_in(GENEROUS),
                move |c| {
                    let pool = c.lookup_storage_pool_by_name("default")?;
                    pool.lookup_storage_vol_by_name(&name)?.delete(0)?;
                    Ok(())
                },
            )
            .await
            .unwrap();
    }
}

fn image(url: &str, content: &[u8]) -> ImageConfig {
    ImageConfig {
        url: url.to_owned(),
        sha256: Some(sha256_hex(content)),
        format: ImageFormat::Qcow2,
        firmware: Default::default(),
        guest_agent: Default::default(),
    }
}

/// The base holds exactly `content`, at the content-addressed name, beside its marker.
fn assert_complete(fixture: &Fixture, base: &BaseImage, content: &[u8]) {
    assert_eq!(base.volume, base_volume(&sha256_hex(content)).unwrap());
    assert_eq!(base.format, ImageFormat::Qcow2);
    assert_eq!(
        base.capacity_bytes, VIRTUAL_SIZE,
        "the qcow2's virtual size"
    );
    assert_eq!(Path::new(&base.path), fixture.images.join(&base.volume));
    assert!(
        std::fs::read(&base.path).unwrap() == content,
        "content differs"
    );
    assert!(
        fixture.files().contains(&marker_volume(&base.volume)),
        "{:?}",
        fixture.files()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_fetch_then_cache_hits_without_http_even_after_a_restart() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/debian.qcow2", qcow2_image().to_vec(), Mode::Normal);
    let image = image(&url, qcow2_image());
    let cache = fixture.cache();
    let trace = caller_trace("CreateInstance");
    let base = {
        let _enter = trace.request_span.enter();
        fixture.ensure(&cache, &image, GENEROUS).await.unwrap()
    };
    assert_complete(&fixture, &base, qcow2_image());
    assert_eq!(fixture.server.requests("/debian.qcow2"), 1);
    // Every libvirt call is a span of the caller's trace, named after the API.
    drop(trace.request_span);
    let uploads = spans_named(trace.trace_id, "virStorageVolUpload");
    assert_eq!(uploads.len(), 1);
    assert_eq!(
        attr(&uploads[0], "libvirt.bytes"),
        Some(qcow2_image().len().to_string())
    );
    assert_eq!(
        spans_named(trace.trace_id, "virStorageVolCreateXML").len(),
        2,
        "the base and its marker"
    );

    assert_eq!(
        fixture.ensure(&cache, &image, GENEROUS).await.unwrap(),
        base
    );
    // A new cache (an agent restart) trusts the marker on the host.
    let restarted = fixture.cache();
    assert_eq!(
        fixture.ensure(&restarted, &image, GENEROUS).await.unwrap(),
        base
    );
    assert_eq!(fixture.server.requests("/debian.qcow2"), 1, "cache hits");
    assert_eq!(
        fixture.files(),
        [base.volume.clone(), marker_volume(&base.volume)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_share_one_download() {
    let fixture = Arc::new(Fixture::start().await);
    let url = fixture
        .server
        .serve("/shared.qcow2", qcow2_image().to_vec(), Mode::Slow);
    let image = image(&url, qcow2_image());
    let cache = Arc::new(fixture.cache());
    let callers: Vec<_> = (0..5)
        .map(|_| {
            let (fixture, cache, image) = (fixture.clone(), cache.clone(), image.clone());
            tokio::spawn(async move { fixture.ensure(&cache, &image, GENEROUS).await })
        })
        .collect();
    let mut bases = Vec::new();
    for caller in callers {
        bases.push(caller.await.unwrap().unwrap());
    }
    assert!(bases.iter().all(|b| *b == bases[0]), "{bases:?}");
    assert_complete(&fixture, &bases[0], qcow2_image());
    assert_eq!(fixture.server.requests("/shared.qcow2"), 1, "one download");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_is_permanent_and_leaves_no_volume() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/tampered.qcow2", other_image(), Mode::Normal);
    let cache = fixture.cache();
    let error = fixture
        .ensure(&cache, &image(&url, qcow2_image()), GENEROUS)
        .await
        .unwrap_err();
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert_eq!(error.to_provider_error().reason, "IMAGE_CHECKSUM_MISMATCH");
    assert!(
        error.to_string().contains(&sha256_hex(&other_image())),
        "{error}"
    );
    assert!(fixture.files().is_empty(), "{:?}", fixture.files());
    // The same through the spool (no Content-Length): nothing reaches the pool.
    let url = fixture
        .server
        .serve("/tampered-chunked.qcow2", other_image(), Mode::NoLength);
    let error = fixture
        .ensure(&cache, &image(&url, qcow2_image()), GENEROUS)
        .await
        .unwrap_err();
    assert_eq!(
        error.to_provider_error().reason,
        "IMAGE_CHECKSUM_MISMATCH",
        "{error}"
    );
    assert!(fixture.files().is_empty(), "{:?}", fixture.files());
    assert_eq!(std::fs::read_dir(fixture.spool.path()).unwrap().count(), 0);
    // 404 is permanent too, and makes no volume.
    let missing = format!("{}/missing.qcow2", fixture.server.base);
    let error = fixture
        .ensure(&cache, &image(&missing, qcow2_image()), GENEROUS)
        .await
        .unwrap_err();
    assert_eq!(
        error.to_provider_error().reason,
        "IMAGE_NOT_FOUND",
        "{error}"
    );
    assert!(fixture.files().is_empty(), "{:?}", fixture.files());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_download_is_transient_leaves_no_volume_and_the_next_attempt_succeeds() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/flaky.qcow2", qcow2_image().to_vec(), Mode::ShortOnce);
    let image = image(&url, qcow2_image());
    let cache = fixture.cache();
    let error = fixture.ensure(&cache, &image, GENEROUS).await.unwrap_err();
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
    assert_eq!(error.to_provider_error().reason, "IMAGE_TRUNCATED");
    assert!(fixture.files().is_empty(), "{:?}", fixture.files());
    let base = fixture.ensure(&cache, &image, GENEROUS).await.unwrap();
    assert_complete(&fixture, &base, qcow2_image());
    assert_eq!(fixture.server.requests("/flaky.qcow2"), 2);
}

/// `mount ARGS` in libvirtd's mount namespace (where it writes its pools).
fn mount_in_libvirtds_namespace(libvirtd: &Libvirtd, args: &[&str], dir: &Path) {
    let pid = libvirtd.libvirtd_pid().unwrap().to_string();
    let out = std::process::Command::new("nsenter")
        .args(["-t", &pid, "-m", "--", "mount"])
        .args(args)
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "mount {args:?}: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_is_named_leaves_no_volume_and_a_grown_one_takes_the_base() {
    let fixture = Fixture::start().await;
    // The pool's directory becomes a 1 MiB tmpfs, as libvirtd sees it: smaller than the
    // image. libvirt alone reports only its upload helper's end of file.
    mount_in_libvirtds_namespace(
        &fixture._libvirtd,
        &["-t", "tmpfs", "-o", "size=1m", "tmpfs-full-pool"],
        &fixture.images,
    );
    let pid = fixture._libvirtd.libvirtd_pid().unwrap();
    let seen_by_libvirtd = Path::new(&format!("/proc/{pid}/root"))
        .join(fixture.images.strip_prefix("/").unwrap())
        .to_owned();
    let url = fixture
        .server
        .serve("/big.qcow2", qcow2_image().to_vec(), Mode::Normal);
    let image = image(&url, qcow2_image());
    let cache = fixture.cache();
    let error = fixture.ensure(&cache, &image, GENEROUS).await.unwrap_err();
    let mapped = error.to_provider_error();
    assert_eq!(
        (mapped.class, mapped.reason.as_str()),
        (egressproxy_provider::ErrorClass::Transient, "POOL_FULL"),
        "{error}"
    );
    assert!(
        mapped
            .message
            .starts_with("storage pool default on host hv is full: "),
        "{}",
        mapped.message
    );
    assert!(
        mapped.message.contains("image test-image needs"),
        "{}",
        mapped.message
    );
    let left: Vec<_> = std::fs::read_dir(&seen_by_libvirtd).unwrap().collect();
    assert!(left.is_empty(), "nothing is left in the pool: {left:?}");
    mount_in_libvirtds_namespace(
        &fixture._libvirtd,
        &["-o", "remount,size=16m"],
        &fixture.images,
    );
    let base = fixture.ensure(&cache, &image, GENEROUS).await.unwrap();
    assert!(base.volume.starts_with("egressproxy-base-"), "{base:?}");
    assert_eq!(std::fs::read_dir(&seen_by_libvirtd).unwrap().count(), 2);
}

/// What `/metrics` reports of the cache: complete bases only (a base without its marker
/// is half-written), by the bytes they take on the hypervisor's disk; nothing once
/// evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_counts_complete_bases_by_the_bytes_they_take_on_disk() {
    use std::os::unix::fs::MetadataExt;
    let fixture = Fixture::start().await;
    let cache = fixture.cache();
    let usage = || cache.usage(&fixture.host, deadline_in(GENEROUS));
    assert_eq!(
        usage().await.unwrap(),
        CacheUsage::default(),
        "an empty pool"
    );

    let half_written = base_volume(&sha256_hex(&other_image())).unwrap();
    fixture
        .create_volume(raw_volume(&half_written, 1 << 20).unwrap())
        .await;
    assert_eq!(
        usage().await.unwrap(),
        CacheUsage::default(),
        "a base without its marker is not held"
    );

    let url = fixture
        .server
        .serve("/debian.qcow2", qcow2_image().to_vec(), Mode::Normal);
    let base = fixture
        .ensure(&cache, &image(&url, qcow2_image()), GENEROUS)
        .await
        .unwrap();
    let on_disk = std::fs::metadata(&base.path).unwrap().blocks() * 512;
    assert!(on_disk > 0);
    assert_eq!(
        usage().await.unwrap(),
        CacheUsage {
            images: 1,
            bytes: on_disk
        }
    );

    cache
        .evict_unused(&fixture.host, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(
        usage().await.unwrap(),
        CacheUsage::default(),
        "after eviction"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_base_without_marker_is_deleted_and_fetched_again() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/debian.qcow2", qcow2_image().to_vec(), Mode::Normal);
    let image = image(&url, qcow2_image());
    // What an agent killed mid-upload leaves: the base, wrong content, no marker.
    let base_name = base_volume(&sha256_hex(qcow2_image())).unwrap();
    fixture
        .create_volume(raw_volume(&base_name, 1 << 20).unwrap())
        .await;
    let base = fixture
        .ensure(&fixture.cache(), &image, GENEROUS)
        .await
        .unwrap();
    assert_complete(&fixture, &base, qcow2_image());
    assert_eq!(fixture.server.requests("/debian.qcow2"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_image_gets_a_new_base_and_eviction_spares_the_old_one_while_used() {
    let fixture = Fixture::start().await;
    let cache = fixture.cache();
    let old_url = fixture
        .server
        .serve("/v1.qcow2", qcow2_image().to_vec(), Mode::Normal);
    let old = fixture
        .ensure(&cache, &image(&old_url, qcow2_image()), GENEROUS)
        .await
        .unwrap();
    // A VM's overlay on the old base.
    let overlay = "egressproxy-uid-1.root.qcow2";
    fixture
        .create_volume(
            overlay_volume(
                overlay,
                VIRTUAL_SIZE,
                Path::new(&old.path),
                ImageFormat::Qcow2,
            )
            .unwrap(),
        )
        .await;
    // The image's URL and checksum change: a new base beside the old.
    let new_content = other_image();
    let new_url = fixture
        .server
        .serve("/v2.qcow2", new_content.clone(), Mode::Normal);
    let new = fixture
        .ensure(&cache, &image(&new_url, &new_content), GENEROUS)
        .await
        .unwrap();
    assert_complete(&fixture, &new, &new_content);
    assert_ne!(new.volume, old.volume);
    assert_complete(&fixture, &old, qcow2_image());
    // Without a checksum, the name is the digest of the URL.
    let unpinned = ImageConfig {
        sha256: None,
        ..image(&new_url, &new_content)
    };
    let by_url = fixture.ensure(&cache, &unpinned, GENEROUS).await.unwrap();
    assert_eq!(
        by_url.volume,
        base_volume(&sha256_hex(new_url.as_bytes())).unwrap()
    );

    // Eviction: the base the overlay uses stays; the unused ones go, markers too.
    let report = cache
        .evict_unused(&fixture.host, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(
        report.kept[&old.volume],
        KeptBecause::UsedBy(vec![overlay.to_owned()])
    );
    let mut expected = vec![
        overlay.to_owned(),
        old.volume.clone(),
        marker_volume(&old.volume),
    ];
    expected.sort();
    assert_eq!(fixture.files(), expected, "{report}");
    assert_eq!(report.deleted.len(), 4, "{report}");
    // The overlay still opens on its backing file.
    run(
        "qemu-img",
        &["check", "-U"],
        &[&fixture.images.join(overlay)],
    );

    fixture.delete_volume(overlay).await;
    let report = cache
        .evict_unused(&fixture.host, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(report.deleted.len(), 2, "{report}");
    assert!(fixture.files().is_empty(), "{:?}", fixture.files());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_without_content_length_is_spooled_then_uploaded() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/chunked.qcow2", qcow2_image().to_vec(), Mode::NoLength);
    let base = fixture
        .ensure(&fixture.cache(), &image(&url, qcow2_image()), GENEROUS)
        .await
        .unwrap();
    assert_complete(&fixture, &base, qcow2_image());
    // The spool file was unnamed: nothing is left in the spool directory.
    assert_eq!(std::fs::read_dir(fixture.spool.path()).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_whose_deadline_passes_gets_a_transient_error_while_the_download_goes_on() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/slow.qcow2", qcow2_image().to_vec(), Mode::Slow);
    let image = image(&url, qcow2_image());
    let cache = fixture.cache();
    let error = fixture
        .ensure(&cache, &image, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
    let mapped = error.to_provider_error();
    assert_eq!(mapped.reason, "IMAGE_DOWNLOADING");
    let hint = mapped.retry_after.expect("a retry hint");
    assert!(
        (Duration::from_secs(1)..=Duration::from_secs(60)).contains(&hint),
        "{hint:?}"
    );
    let text = error.to_string();
    assert!(
        text.starts_with("image test-image still downloading on host hv: ")
            && text.ends_with(&format!(" of {} bytes", qcow2_image().len())),
        "{text}"
    );
    // The download finishes without any caller waiting: the server sends the last byte,
    // then the agent uploads it and writes the marker last.
    eventually("the download to complete", GENEROUS, || {
        std::future::ready(match fixture.server.completed("/slow.qcow2") {
            0 => Err("not completed"),
            _ => Ok(()),
        })
    })
    .await;
    let marker = marker_volume(&base_volume(&sha256_hex(qcow2_image())).unwrap());
    eventually("the upload to write its marker", GENEROUS, || {
        let files = fixture.files();
        std::future::ready(match files.contains(&marker) {
            true => Ok(()),
            false => Err(format!("{files:?}")),
        })
    })
    .await;
    let started = std::time::Instant::now();
    let base = fixture
        .ensure(&cache, &image, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_complete(&fixture, &base, qcow2_image());
    assert_eq!(
        fixture.server.requests("/slow.qcow2"),
        1,
        "{:?}",
        fixture.server.http.seen("/slow.qcow2")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_fails_the_download_and_leaves_no_volume() {
    // The agent's log goes with a failure: it says why a volume stayed.
    let log_from = captured_log().len();
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/stalled.qcow2", qcow2_image().to_vec(), Mode::Stall);
    let image = image(&url, qcow2_image());
    // Silent past the idle timeout: transient, long before the download timeout.
    let cache = ImageCache::new(ImageCacheOptions {
        spool_dir: fixture.spool.path().to_owned(),
        idle_timeout: Duration::from_secs(1),
        ..ImageCacheOptions::default()
    });
    let started = std::time::Instant::now();
    let error = fixture.ensure(&cache, &image, GENEROUS).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
    assert_eq!(error.to_provider_error().reason, "IMAGE_TRUNCATED");
    assert!(
        error.to_string().contains("the server sent nothing for 1s"),
        "{error}"
    );
    // Deleted on the spot, not left for the next attempt.
    assert!(
        fixture.files().is_empty(),
        "{:?}\n{}",
        fixture.files(),
        captured_log().get(log_from..).unwrap_or_default()
    );

    // A server that trickles past the download timeout is cut there.
    let cache = ImageCache::new(ImageCacheOptions {
        spool_dir: fixture.spool.path().to_owned(),
        download_timeout: Duration::from_secs(3),
        ..ImageCacheOptions::default()
    });
    let error = fixture.ensure(&cache, &image, GENEROUS).await.unwrap_err();
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
    assert!(
        error
            .to_string()
            .contains("imageDownloadTimeout (3s) passed"),
        "{error}"
    );
    assert!(
        fixture.files().is_empty(),
        "{:?}\n{}",
        fixture.files(),
        captured_log().get(log_from..).unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_url_image_is_uploaded_from_the_agents_filesystem() {
    let fixture = Fixture::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("debian.qcow2");
    std::fs::write(&path, qcow2_image()).unwrap();
    let url = format!("file://{}", path.display());
    let base = fixture
        .ensure(&fixture.cache(), &image(&url, qcow2_image()), GENEROUS)
        .await
        .unwrap();
    assert_complete(&fixture, &base, qcow2_image());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_timing_out_mid_upload_deletes_its_volume_on_the_spot() {
    let fixture = Fixture::start().await;
    // Bytes arrive all the time (64 KiB every 40 ms): the timeout finds the upload busy,
    // and the half-written volume is deleted once the upload has let go of it.
    let url = fixture
        .server
        .serve("/trickle.qcow2", qcow2_image().to_vec(), Mode::Slow);
    let image = image(&url, qcow2_image());
    for timeout_ms in [400, 700, 1000, 1300, 1600] {
        let cache = ImageCache::new(ImageCacheOptions {
            spool_dir: fixture.spool.path().to_owned(),
            download_timeout: Duration::from_millis(timeout_ms),
            ..ImageCacheOptions::default()
        });
        let error = fixture.ensure(&cache, &image, GENEROUS).await.unwrap_err();
        assert_eq!(error.class(), ErrorClass::Transient, "{error}");
        assert!(
            error.to_string().contains("imageDownloadTimeout"),
            "{error}"
        );
        assert!(
            fixture.files().is_empty(),
            "after {timeout_ms} ms: {:?}",
            fixture.files()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_timing_out_while_its_volume_is_created_leaves_no_volume() {
    let fixture = Fixture::start().await;
    // Timeouts a few milliseconds apart, from before the volume is created to after:
    // some fire while the creating call is still running on the hypervisor, whose
    // volume appears after the download has given up.
    let url = fixture
        .server
        .serve("/creating.qcow2", qcow2_image().to_vec(), Mode::Slow);
    let image = image(&url, qcow2_image());
    for timeout_ms in 1..=120 {
        let cache = ImageCache::new(ImageCacheOptions {
            spool_dir: fixture.spool.path().to_owned(),
            download_timeout: Duration::from_millis(timeout_ms),
            ..ImageCacheOptions::default()
        });
        let error = fixture.ensure(&cache, &image, GENEROUS).await.unwrap_err();
        // The shortest timeouts pass during the first lookup, before any volume.
        assert!(
            matches!(
                error.class(),
                ErrorClass::Transient | ErrorClass::DeadlineExceeded
            ),
            "{error}"
        );
        assert!(
            fixture.files().is_empty(),
            "after {timeout_ms} ms: {:?}",
            fixture.files()
        );
    }
}

/// What docs/kvm-agent.md and ADR 0003 say of eviction racing a Create that found an old
/// base: the overlay step fails (transient) and the retry fetches the base again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlay_on_an_evicted_base_fails_transient_and_a_retry_fetches_the_base_again() {
    let fixture = Fixture::start().await;
    let url = fixture
        .server
        .serve("/old.qcow2", qcow2_image().to_vec(), Mode::Normal);
    let image = image(&url, qcow2_image());
    let cache = fixture.cache();
    // A Create's cache hit...
    let base = fixture.ensure(&cache, &image, GENEROUS).await.unwrap();
    // ...then eviction, before that Create made its overlay.
    let report = cache
        .evict_unused(&fixture.host, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(report.deleted.len(), 2, "{report}");
    let overlay = |base: &BaseImage| {
        let xml = overlay_volume(
            "egressproxy-uid-1.root.qcow2",
            VIRTUAL_SIZE,
            Path::new(&base.path),
            ImageFormat::Qcow2,
        )
        .unwrap();
        fixture.host.call::<_, kvm_agent::TransportError, _>(
            LibvirtOp::new("virStorageVolCreateXML"),
            deadline_in(GENEROUS),
            move |c| {
                let pool = c.lookup_storage_pool_by_name("default")?;
                virt::storage_vol::StorageVol::create_xml(&pool, &xml, 0)?;
                Ok(())
            },
        )
    };
    let error = overlay(&base).await.unwrap_err();
    assert_eq!(error.class(), ErrorClass::Transient, "{error}");
    assert!(
        error.to_string().contains("inaccessible backing store"),
        "{error}"
    );
    assert!(fixture.files().is_empty(), "{:?}", fixture.files());
    // The retry's cache lookup finds no base and fetches it again, at the same path.
    let again = fixture.ensure(&cache, &image, GENEROUS).await.unwrap();
    assert_eq!(again, base);
    assert_eq!(fixture.server.requests("/old.qcow2"), 2);
    overlay(&again).await.unwrap();
}
