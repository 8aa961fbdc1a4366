//! The SSH transport against a real sshd and a real libvirtd (both private, on loopback).
//!
//! Needs root, `integration/tools/install-system-packages.sh`, and unshare (mount namespaces).

mod common;

use std::time::{Duration, Instant};

use common::*;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::error::{Error, ErrorClass, TransportError};
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::Pool;
use opentelemetry::trace::Status;
use tracing::Instrument;

const GENEROUS: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_round_trips_over_the_forward_and_is_traced_under_the_callers_trace() {
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let mut rsa = ssh_host("hv-rsa", &sshd, &libvirtd);
    rsa.ssh.as_mut().unwrap().private_key = sshd.client_rsa_key();
    let config = config(vec![ssh_host("hv", &sshd, &libvirtd), rsa]);
    kvm_agent::startup::check_config(&config)
        .expect("the fixture's config is valid, keys included");
    let pool = Pool::new(&config).unwrap();
    let host = pool.host("hv").unwrap();

    let trace = caller_trace("Create");
    async {
        let version = host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        assert!(version >= 11_000_000, "libvirt {version}");
        let missing = host
            .call::<_, kvm_agent::TransportError, _>(
                LibvirtOp::new("virDomainLookupByName").domain("absent"),
                deadline_in(GENEROUS),
                |c| {
                    c.lookup_domain_by_name("absent")?;
                    Ok(())
                },
            )
            .await
            .unwrap_err();
        assert_eq!(missing.class(), ErrorClass::NotFound, "{missing}");
        assert!(!missing.drops_connection());
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        // RSA client keys authenticate with rsa-sha2.
        pool.host("hv-rsa")
            .unwrap()
            .lib_version(deadline_in(GENEROUS))
            .await
            .unwrap();
    }
    .instrument(trace.request_span.clone())
    .await;
    let trace_id = trace.trace_id;
    let caller = trace.caller_span_id;
    drop(trace);

    let request = spans_named(trace_id, "Create");
    assert_eq!(request.len(), 1);
    assert_eq!(
        request[0].parent_span_id, caller,
        "request span continues the caller's trace"
    );
    let request_id = request[0].span_context.span_id();

    let calls: Vec<_> = spans_named(trace_id, "virConnectGetLibVersion")
        .into_iter()
        .filter(|s| attr(s, "libvirt.host").as_deref() == Some("hv"))
        .collect();
    assert_eq!(calls.len(), 2);
    for call in &calls {
        assert_eq!(
            call.parent_span_id, request_id,
            "libvirt span is a child of the request"
        );
        assert!(attr(call, "libvirt.duration_ms").is_some());
        assert_eq!(call.status, Status::Unset);
    }
    // The reported error kept the connection: both calls used connection 1, opened once.
    assert_eq!(
        attr(&calls[0], "libvirt.connection"),
        attr(&calls[1], "libvirt.connection")
    );
    let opens: Vec<_> = spans_named(trace_id, "virConnectOpen")
        .into_iter()
        .filter(|s| attr(s, "libvirt.host").as_deref() == Some("hv"))
        .collect();
    assert_eq!(opens.len(), 1);

    let lookup = &spans_named(trace_id, "virDomainLookupByName")[0];
    assert_eq!(attr(lookup, "libvirt.domain").as_deref(), Some("absent"));
    assert_eq!(attr(lookup, "libvirt.error_code").as_deref(), Some("42"));
    assert!(matches!(lookup.status, Status::Error { .. }));
    assert_eq!(
        spans_named(trace_id, "ssh.connect").len(),
        2,
        "one SSH session per host"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_or_changed_host_key_is_rejected_naming_host_and_fingerprint() {
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let fingerprint = sshd.host_key_fingerprint().unwrap();
    let mut unknown = ssh_host("hv-unknown", &sshd, &libvirtd);
    unknown.ssh.as_mut().unwrap().known_hosts = Some(sshd.empty_known_hosts());
    let mut changed = ssh_host("hv-changed", &sshd, &libvirtd);
    changed.ssh.as_mut().unwrap().known_hosts = Some(sshd.other_host_key_known_hosts());
    let mut insecure = ssh_host("hv-insecure", &sshd, &libvirtd);
    insecure.ssh.as_mut().unwrap().known_hosts = None;
    insecure
        .ssh
        .as_mut()
        .unwrap()
        .insecure_skip_host_key_verification = true;
    let config = config(vec![unknown, changed, insecure]);

    let problems = kvm_agent::startup::check_config(&config)
        .unwrap_err()
        .to_string();
    assert!(problems.contains("hosts[0].ssh.knownHosts"), "{problems}");
    assert!(
        problems.contains("has no key for [127.0.0.1]"),
        "{problems}"
    );

    let pool = Pool::new(&config).unwrap();
    let err: Error = pool
        .host("hv-unknown")
        .unwrap()
        .lib_version(deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .into();
    assert!(
        matches!(err, Error::Transport(TransportError::HostKeyUnknown { .. })),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Permanent);
    let message = err.to_string();
    assert!(
        message.contains("hv-unknown") && message.contains(&fingerprint),
        "{message}"
    );
    // Retried at once: the agent backs off, and the rejection stays permanent.
    let again: Error = pool
        .host("hv-unknown")
        .unwrap()
        .lib_version(deadline_in(Duration::from_millis(50)))
        .await
        .unwrap_err()
        .into();
    assert!(
        matches!(
            again,
            Error::Transport(TransportError::SshBackingOff { .. })
        ),
        "{again:?}"
    );
    assert_eq!(again.class(), ErrorClass::Permanent);
    assert!(again.to_string().contains(&fingerprint), "{again}");

    let err: Error = pool
        .host("hv-changed")
        .unwrap()
        .lib_version(deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .into();
    assert!(
        matches!(
            err,
            Error::Transport(TransportError::HostKeyChanged { line: 1, .. })
        ),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("hv-changed") && message.contains(&fingerprint),
        "{message}"
    );

    // Verification off is explicit and works.
    pool.host("hv-insecure")
        .unwrap()
        .lib_version(deadline_in(GENEROUS))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_client_key_is_rejected() {
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let mut host = ssh_host("hv", &sshd, &libvirtd);
    host.ssh.as_mut().unwrap().private_key = sshd.unauthorized_key();
    let pool = Pool::new(&config(vec![host])).unwrap();
    let err: Error = pool
        .host("hv")
        .unwrap()
        .lib_version(deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .into();
    assert!(
        matches!(
            err,
            Error::Transport(TransportError::SshAuthRejected { .. })
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Permanent);
    assert!(err.to_string().contains("\"root\""), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_forward_reports_the_socket_not_a_reset() {
    let libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let mut host = ssh_host("hv", &sshd, &libvirtd);
    host.libvirt_socket = "/nonexistent/libvirt-sock".into();
    let pool = Pool::new(&config(vec![host])).unwrap();
    let err: Error = pool
        .host("hv")
        .unwrap()
        .lib_version(deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .into();
    assert!(
        matches!(err, Error::Transport(TransportError::ForwardRefused { .. })),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains("/nonexistent/libvirt-sock"), "{message}");
    assert!(message.contains("AllowTcpForwarding"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_libvirtd_fails_within_deadline_and_next_call_uses_a_fresh_connection() {
    let mut libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let pool = Pool::new(&config(vec![ssh_host("hv", &sshd, &libvirtd)])).unwrap();
    let host = pool.host("hv").unwrap();
    let trace = caller_trace("Get");
    let span = trace.request_span.clone();
    async {
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        libvirtd.pause().unwrap();

        let (returned, blocked_call_returned) = std::sync::mpsc::channel();
        let started = Instant::now();
        let err = host
            .call::<_, kvm_agent::TransportError, _>(
                LibvirtOp::new("virConnectGetLibVersion"),
                deadline_in(Duration::from_secs(1)),
                move |c| {
                    let version = c.lib_version();
                    let _ = returned.send(());
                    Ok(version?)
                },
            )
            .await
            .unwrap_err();
        let elapsed = started.elapsed();
        assert_eq!(err.class(), ErrorClass::DeadlineExceeded, "{err}");
        assert!(
            elapsed >= Duration::from_secs(1) && elapsed < Duration::from_millis(1500),
            "{elapsed:?}"
        );
        // Cutting the relay made the blocked libvirt call return: no worker stays pinned.
        blocked_call_returned
            .recv_timeout(Duration::from_secs(1))
            .expect("the blocked libvirt call returned after its relay was cut");

        libvirtd.resume().unwrap();
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
    }
    .instrument(span)
    .await;
    let trace_id = trace.trace_id;
    drop(trace);
    let opens = spans_named(trace_id, "virConnectOpen");
    assert_eq!(
        opens.len(),
        2,
        "the call after the hang dialled a fresh connection"
    );
    assert_ne!(
        attr(&opens[0], "libvirt.connection"),
        attr(&opens[1], "libvirt.connection")
    );
    assert_eq!(
        spans_named(trace_id, "ssh.connect").len(),
        1,
        "the SSH session survived"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_sshd_fails_within_deadline_keepalive_closes_the_session_and_resume_recovers() {
    let libvirtd = Libvirtd::start().unwrap();
    let mut sshd = Sshd::start().unwrap();
    let pool = Pool::new(&config(vec![ssh_host("hv", &sshd, &libvirtd)])).unwrap();
    let host = pool.host("hv").unwrap();
    let trace = caller_trace("Get");
    let span = trace.request_span.clone();
    async {
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        sshd.pause().unwrap();
        let started = Instant::now();
        let err = host
            .lib_version(deadline_in(Duration::from_secs(1)))
            .await
            .unwrap_err();
        let elapsed = started.elapsed();
        assert_eq!(err.class(), ErrorClass::DeadlineExceeded, "{err}");
        assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
        // SSH keepalive (500 ms x 3 unanswered) closes the dead session meanwhile.
        until("keepalive closes the SSH session to the hung sshd", || {
            client_sockets_to(&sshd.address()).is_empty()
        })
        .await;
        sshd.resume().unwrap();
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
    }
    .instrument(span)
    .await;
    let trace_id = trace.trace_id;
    drop(trace);
    assert_eq!(
        spans_named(trace_id, "ssh.connect").len(),
        2,
        "keepalive closed the hung session and the next call dialled a new one"
    );
    assert_eq!(spans_named(trace_id, "virConnectOpen").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_sshd_is_redialled() {
    let libvirtd = Libvirtd::start().unwrap();
    let mut sshd = Sshd::start().unwrap();
    let pool = Pool::new(&config(vec![ssh_host("hv", &sshd, &libvirtd)])).unwrap();
    let host = pool.host("hv").unwrap();
    let trace = caller_trace("Get");
    let span = trace.request_span.clone();
    async {
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
        sshd.restart().unwrap();
        host.lib_version(deadline_in(GENEROUS)).await.unwrap();
    }
    .instrument(span)
    .await;
    let trace_id = trace.trace_id;
    drop(trace);
    assert_eq!(spans_named(trace_id, "ssh.connect").len(), 2);
    assert_eq!(spans_named(trace_id, "virConnectOpen").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_host_does_not_delay_another() {
    let libvirtd = Libvirtd::start().unwrap();
    let mut hung_sshd = Sshd::start().unwrap();
    let healthy_sshd = Sshd::start().unwrap();
    let mut config = config(vec![
        ssh_host("hung", &hung_sshd, &libvirtd),
        ssh_host("healthy", &healthy_sshd, &libvirtd),
    ]);
    // Let the deadline, not SSH keepalive, end the hung calls here.
    config.transport.ssh_keepalive_interval = Duration::from_secs(10);
    let pool = Pool::new(&config).unwrap();
    let hung = pool.host("hung").unwrap();
    let healthy = pool.host("healthy").unwrap();
    hung.lib_version(deadline_in(GENEROUS)).await.unwrap();
    healthy.lib_version(deadline_in(GENEROUS)).await.unwrap();

    hung_sshd.pause().unwrap();
    let hung_since = Instant::now();
    let stuck = {
        let hung = hung.clone();
        tokio::spawn(async move { hung.lib_version(deadline_in(Duration::from_secs(3))).await })
    };
    // A second caller on the hung host waits too; neither may hold anything the other
    // host needs.
    let stuck_too = {
        let hung = hung.clone();
        tokio::spawn(async move { hung.lib_version(deadline_in(Duration::from_secs(3))).await })
    };
    // The hung host's kernel queues what its stopped sshd does not read: the calls are
    // on their way and stuck.
    until("the hung host's calls reach its stopped sshd", || {
        server_unread_bytes(&hung_sshd.address()) > 0
    })
    .await;
    let mut slowest = Duration::ZERO;
    for _ in 0..50 {
        let started = Instant::now();
        healthy.lib_version(deadline_in(GENEROUS)).await.unwrap();
        slowest = slowest.max(started.elapsed());
    }
    assert!(
        !stuck.is_finished(),
        "the hung host's call is still pending meanwhile"
    );
    assert!(
        slowest < Duration::from_millis(500),
        "slowest healthy call {slowest:?}"
    );
    // The first deadline to pass cuts the shared connection; the other caller learns why.
    for task in [stuck, stuck_too] {
        let err = Error::from(task.await.unwrap().unwrap_err());
        assert!(
            matches!(
                err,
                Error::Transport(TransportError::DeadlineExceeded { .. })
                    | Error::Transport(TransportError::ConnectionCut { .. })
            ),
            "{err:?}"
        );
    }
    assert!(
        hung_since.elapsed() < Duration::from_millis(3500),
        "{:?}",
        hung_since.elapsed()
    );
    hung_sshd.resume().unwrap();
}

/// On a current-thread runtime calls go to the blocking pool instead of running in place;
/// a hung call is bounded there too, and the runtime's only thread stays free meanwhile.
#[tokio::test(flavor = "current_thread")]
async fn hung_call_on_a_current_thread_runtime_fails_within_deadline() {
    let mut libvirtd = Libvirtd::start().unwrap();
    let sshd = Sshd::start().unwrap();
    let pool = Pool::new(&config(vec![ssh_host("hv", &sshd, &libvirtd)])).unwrap();
    let host = pool.host("hv").unwrap();
    host.lib_version(deadline_in(GENEROUS)).await.unwrap();
    libvirtd.pause().unwrap();

    let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    let started = Instant::now();
    let err = host
        .lib_version(deadline_in(Duration::from_secs(1)))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    ticker.abort();
    assert_eq!(err.class(), ErrorClass::DeadlineExceeded, "{err}");
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_millis(1500),
        "{elapsed:?}"
    );
    assert!(
        ticks.load(std::sync::atomic::Ordering::Relaxed) >= 10,
        "the runtime's thread kept running other tasks during the hung call"
    );

    libvirtd.resume().unwrap();
    host.lib_version(deadline_in(GENEROUS)).await.unwrap();
}

/// Looks at `ready` until it holds; panics after a minute.
async fn until(what: &str, mut ready: impl FnMut() -> bool) {
    eventually(what, Duration::from_secs(60), || {
        std::future::ready(if ready() { Ok(()) } else { Err("not yet") })
    })
    .await
}

/// One IPv4 TCP socket of this network namespace: (local, remote, state, unread bytes).
fn tcp_sockets() -> Vec<(String, String, u8, u64)> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let address = |hex: &str| {
        let (ip, port) = hex.split_once(':').unwrap();
        let ip = u32::from_str_radix(ip, 16).unwrap().to_le_bytes();
        let port = u16::from_str_radix(port, 16).unwrap();
        format!("{}.{}.{}.{}:{port}", ip[0], ip[1], ip[2], ip[3])
    };
    text.lines()
        .skip(1)
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let rx_queue = fields[4].split_once(':').unwrap().1;
            (
                address(fields[1]),
                address(fields[2]),
                u8::from_str_radix(fields[3], 16).unwrap(),
                u64::from_str_radix(rx_queue, 16).unwrap(),
            )
        })
        .collect()
}

const TCP_ESTABLISHED: u8 = 1;

/// The agent's established connections to `server` (`ip:port`).
fn client_sockets_to(server: &str) -> Vec<String> {
    tcp_sockets()
        .into_iter()
        .filter(|(_, remote, state, _)| remote == server && *state == TCP_ESTABLISHED)
        .map(|(local, ..)| local)
        .collect()
}

/// Bytes the kernel holds for `server`'s accepted connections that it has not read.
fn server_unread_bytes(server: &str) -> u64 {
    tcp_sockets()
        .into_iter()
        .filter(|(local, _, state, _)| local == server && *state == TCP_ESTABLISHED)
        .map(|(.., unread)| unread)
        .sum()
}
