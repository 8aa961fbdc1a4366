//! Local mode (agent on the hypervisor) and bulk streams on their own connection.

mod common;

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::error::ErrorClass;
use kvm_agent::transport::bulk::upload_volume;
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::Pool;
use tracing::Instrument;

const GENEROUS: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_mode_calls_are_bounded_and_a_stalled_pool_drops_without_blocking() {
    let mut libvirtd = Libvirtd::start().unwrap();
    let config = config(vec![local_host("here", &libvirtd.socket())]);
    config.validate().unwrap();
    let pool = Pool::new(&config).unwrap();
    let host = pool.host("here").unwrap();
    let trace = caller_trace("Get");
    let span = trace.request_span.clone();
    async {
        assert!(host.lib_version(deadline_in(GENEROUS)).await.unwrap() >= 11_000_000);

        libvirtd.pause().unwrap();
        let started = Instant::now();
        let err = host
            .lib_version(deadline_in(Duration::from_millis(500)))
            .await
            .unwrap_err();
        assert_eq!(err.class(), ErrorClass::DeadlineExceeded, "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );

        // Warm a connection that then stalls; dropping the pool must not wait for it.
        libvirtd.resume().unwrap();
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
    }
    .instrument(span)
    .await;
    libvirtd.pause().unwrap();
    drop(host);
    let started = Instant::now();
    drop(pool);
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "dropping a pool with a stalled connection took {:?}",
        started.elapsed()
    );
    libvirtd.resume().unwrap();

    let trace_id = trace.trace_id;
    drop(trace);
    let calls = spans_named(trace_id, "virConnectGetLibVersion");
    assert_eq!(calls.len(), 3);
    assert!(
        calls
            .iter()
            .all(|s| attr(s, "libvirt.host").as_deref() == Some("here"))
    );
    assert_eq!(spans_named(trace_id, "virConnectOpen").len(), 2);
    assert!(spans_named(trace_id, "ssh.connect").is_empty());
}

/// A call whose deadline passed before it began fails at once and leaves the shared
/// connection open (the next call runs on it); a call that returned in time never has
/// its connection cut after it (its watchdog firing a moment later must not cut what the
/// next call uses). The first is exact; for the second, calls with deadlines around
/// their own duration only meet the race now and then: after every one that succeeded,
/// the next call must run on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_returned_in_time_or_never_began_leaves_the_connection_open() {
    let libvirtd = Libvirtd::start().unwrap();
    let config = config(vec![local_host("here", &libvirtd.socket())]);
    let pool = Pool::new(&config).unwrap();
    let host = pool.host("here").unwrap();
    let trace = caller_trace("Get");
    let span = trace.request_span.clone();
    let results = async {
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        let err = host
            .lib_version(tokio::time::Instant::now())
            .await
            .unwrap_err();
        assert_eq!(err.class(), ErrorClass::DeadlineExceeded, "{err}");
        let started = Instant::now();
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        let typical = started.elapsed();
        let mut results = Vec::new();
        for i in 0..200u32 {
            // From a quarter to twice the typical duration.
            let budget = typical * (1 + i % 8) / 4;
            results.push(host.lib_version(deadline_in(budget)).await.is_ok());
        }
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        results
    }
    .instrument(span)
    .await;
    let trace_id = trace.trace_id;
    drop(trace);
    let calls = spans_named(trace_id, "virConnectGetLibVersion");
    let connection = |i: usize| attr(&calls[i], "libvirt.connection");
    assert_eq!(calls.len(), 3 + results.len() + 1);
    assert_eq!(
        connection(2),
        connection(0),
        "the call after the one that never began ran on the same connection"
    );
    let cut_after_success: Vec<usize> = results
        .iter()
        .enumerate()
        .filter(|(i, ok)| **ok && connection(3 + i + 1) != connection(3 + i))
        .map(|(i, _)| i)
        .collect();
    assert!(
        cut_after_success.is_empty(),
        "calls that succeeded and whose connection the next call did not find: {cut_after_success:?} of {results:?}"
    );
    assert!(
        results.iter().any(|ok| *ok),
        "some calls returned in time: {results:?}"
    );
}

/// A socket in front of libvirtd that closes the first `shed` connections unread (as a
/// daemon or sshd shedding load does) and splices the rest to the daemon. Counts them.
fn shedding_socket(
    dir: &std::path::Path,
    daemon: std::path::PathBuf,
    shed: usize,
) -> (std::path::PathBuf, Arc<AtomicUsize>) {
    let socket = dir.join("shedding.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            if count.fetch_add(1, Ordering::SeqCst) < shed {
                drop(client);
                continue;
            }
            let daemon = daemon.clone();
            tokio::spawn(async move {
                let mut upstream = tokio::net::UnixStream::connect(daemon).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            });
        }
    });
    (socket, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_shed_while_opening_is_dialled_once_more_and_a_second_shed_is_reported() {
    let libvirtd = Libvirtd::start().unwrap();
    let dir = tempfile::tempdir().unwrap();

    let once = dir.path().join("once");
    std::fs::create_dir(&once).unwrap();
    let (socket, accepted) = shedding_socket(&once, libvirtd.socket(), 1);
    let pool = Pool::new(&config(vec![local_host("here", &socket)])).unwrap();
    let host = pool.host("here").unwrap();
    assert!(host.lib_version(deadline_in(GENEROUS)).await.unwrap() >= 11_000_000);
    assert_eq!(accepted.load(Ordering::SeqCst), 2);

    let always = dir.path().join("always");
    std::fs::create_dir(&always).unwrap();
    let (socket, accepted) = shedding_socket(&always, libvirtd.socket(), usize::MAX);
    let pool = Pool::new(&config(vec![local_host("here", &socket)])).unwrap();
    let host = pool.host("here").unwrap();
    let err = host.lib_version(deadline_in(GENEROUS)).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Transient, "{err}");
    assert!(err.to_string().contains("virConnectOpen"), "{err}");
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "{err}");
}

/// `length` bytes of a position-dependent pattern, so misplaced chunks are detected.
struct Pattern {
    position: u64,
    length: u64,
}

impl Read for Pattern {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = usize::try_from(self.length - self.position)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        for (i, byte) in buf[..n].iter_mut().enumerate() {
            *byte = pattern_byte(self.position + i as u64);
        }
        self.position += n as u64;
        Ok(n)
    }
}

fn pattern_byte(position: u64) -> u8 {
    (position / 4096 % 251) as u8 ^ (position % 256) as u8
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_streams_on_its_own_connection_while_cheap_calls_proceed() {
    const LENGTH: u64 = 32 * 1024 * 1024;
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let pool = Pool::new(&config(vec![ssh_host("hv", &sshd, &libvirtd)])).unwrap();
    let host = pool.host("hv").unwrap();
    let images = libvirtd.dir().join("images");
    std::fs::create_dir(&images).unwrap();
    let pool_xml = format!(
        "<pool type='dir'><name>up</name><target><path>{}</path></target></pool>",
        images.display()
    );
    let volume_xml = format!(
        "<volume><name>v.raw</name><capacity unit='bytes'>{LENGTH}</capacity>\
         <target><format type='raw'/></target></volume>"
    );
    let trace = caller_trace("Create");
    let span = trace.request_span.clone();
    async {
        host.call::<_, kvm_agent::TransportError, _>(
            LibvirtOp::new("virStoragePoolCreateXML"),
            deadline_in(GENEROUS),
            move |c| {
                let pool = c.create_storage_pool_xml(&pool_xml, 0)?;
                virt::storage_vol::StorageVol::create_xml(&pool, &volume_xml, 0)?;
                Ok(())
            },
        )
        .await
        .unwrap();

        let upload = {
            let host = host.clone();
            let source = Pattern {
                position: 0,
                length: LENGTH,
            };
            tokio::spawn(
                async move {
                    upload_volume(
                        &host,
                        "up",
                        "v.raw",
                        source,
                        LENGTH,
                        deadline_in(Duration::from_secs(120)),
                    )
                    .await
                }
                .in_current_span(),
            )
        };
        let mut during_upload = Vec::new();
        while !upload.is_finished() {
            let started = Instant::now();
            host.lib_version(deadline_in(GENEROUS)).await.unwrap();
            let took = started.elapsed();
            if !upload.is_finished() {
                during_upload.push(took);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(upload.await.unwrap().unwrap(), LENGTH);
        assert!(
            during_upload.len() >= 3,
            "cheap calls completed during the upload: {}",
            during_upload.len()
        );
        let slowest = during_upload.iter().max().unwrap();
        assert!(
            *slowest < Duration::from_millis(250),
            "slowest cheap call during upload {slowest:?}"
        );
    }
    .instrument(span)
    .await;

    let mut written = Vec::new();
    std::fs::File::open(images.join("v.raw"))
        .unwrap()
        .read_to_end(&mut written)
        .unwrap();
    assert_eq!(written.len() as u64, LENGTH);
    let first_bad = written
        .iter()
        .enumerate()
        .find(|(i, b)| **b != pattern_byte(*i as u64))
        .map(|(i, _)| i);
    assert_eq!(first_bad, None, "uploaded content differs");

    let trace_id = trace.trace_id;
    drop(trace);
    let uploads = spans_named(trace_id, "virStorageVolUpload");
    assert_eq!(uploads.len(), 1);
    assert_eq!(
        attr(&uploads[0], "libvirt.volume").as_deref(),
        Some("v.raw")
    );
    assert_eq!(attr(&uploads[0], "libvirt.bytes"), Some(LENGTH.to_string()));
    let cheap = &spans_named(trace_id, "virConnectGetLibVersion")[0];
    assert_ne!(
        attr(&uploads[0], "libvirt.connection"),
        attr(cheap, "libvirt.connection"),
        "the upload has its own connection"
    );
    let mut purposes: Vec<_> = spans_named(trace_id, "ssh.connect")
        .iter()
        .filter_map(|s| attr(s, "ssh.purpose"))
        .collect();
    purposes.sort();
    assert_eq!(
        purposes,
        ["bulk", "calls"],
        "the upload has its own SSH session"
    );
}
