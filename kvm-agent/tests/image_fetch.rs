//! Image downloads from a local HTTP server (127.0.0.1) that misbehaves on request:
//! wrong content, no Content-Length, a connection cut short, error statuses, redirects of
//! every form, credentials, silence.

use std::io::Read;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use egressproxy_integration::http_server::{Delivery, HttpServer, Reply};
use kvm_agent::error::{Error, ErrorClass};
use kvm_agent::images::ImageError;
use kvm_agent::images::fetch::{Download, fetch};
use sha2::{Digest, Sha256};

const SIZE: usize = 3 * 1024 * 1024 + 17;
/// Silence allowed from the server, where a test does not exercise it.
const IDLE: Duration = Duration::from_secs(30);

fn body() -> Vec<u8> {
    (0..SIZE)
        .map(|i| (i % 251) as u8 ^ (i / 4096) as u8)
        .collect()
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Serves one scenario per path until the test ends.
fn serve() -> HttpServer {
    let server = HttpServer::start();
    let body = Bytes::from(body());
    let whole = Reply::Body(body.clone(), Delivery::Whole);
    server.route("/ok", whole.clone());
    server.route("/no-length", Reply::Body(body.clone(), Delivery::NoLength));
    server.route("/short", Reply::Body(body.clone(), Delivery::Short));
    server.route("/stall", Reply::Body(body.clone(), Delivery::Stall));
    server.route("/silent", Reply::Silent);
    server.route("/redirect", Reply::Redirect(302, "/ok".into()));
    server.route("/404", Reply::Status(404));
    server.route("/403", Reply::Status(403));
    server.route("/503", Reply::Status(503));
    // user "user", password "p@ss:w" (RFC 7617 basic).
    server.route_with("/private", move |seen, _| {
        match seen.authorization.as_deref() {
            Some("Basic dXNlcjpwQHNzOnc=") => whole.clone(),
            _ => Reply::Status(401),
        }
    });
    server.route("/private-moved", Reply::Redirect(302, "/private".into()));
    let elsewhere = format!("http://localhost:{}/private", server.port());
    server.route("/private-elsewhere", Reply::Redirect(302, elsewhere));
    server
}

/// Reads the download to its end on a blocking thread, as a volume upload does.
async fn read_all(mut download: Download) -> (Result<Vec<u8>, String>, Option<ImageError>) {
    let failure = download.failure();
    let read = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        download
            .read_to_end(&mut out)
            .map(|_| out)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap();
    let failure = failure.lock().unwrap().take();
    (read, failure)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_download_streams_every_byte() {
    let server = serve();
    let base = server.base_url();
    let digest = sha256_hex(&body());
    for path in ["/ok", "/no-length", "/redirect"] {
        let download = fetch(&format!("{base}{path}"), Some(&digest), IDLE)
            .await
            .unwrap();
        let announced = download.length();
        let (read, failure) = read_all(download).await;
        assert_eq!(read.unwrap(), body(), "{path}");
        assert!(failure.is_none(), "{path}: {failure:?}");
        assert_eq!(
            announced,
            (path != "/no-length").then_some(SIZE as u64),
            "{path}"
        );
    }
    // No checksum configured: the bytes still arrive.
    let (read, _) = read_all(fetch(&format!("{base}/ok"), None, IDLE).await.unwrap()).await;
    assert_eq!(read.unwrap().len(), SIZE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_the_url_are_sent_as_basic_auth_to_its_origin_only() {
    let server = serve();
    let base = server.base_url();
    let digest = sha256_hex(&body());
    let with_credentials = base.replace("http://", "http://user:p%40ss%3Aw@");
    for path in ["/private", "/private-moved"] {
        let url = format!("{with_credentials}{path}");
        let (read, failure) = read_all(fetch(&url, Some(&digest), IDLE).await.unwrap()).await;
        assert_eq!(read.unwrap(), body(), "{path}");
        assert!(failure.is_none(), "{path}: {failure:?}");
    }
    // Without credentials, and after a redirect to another origin (localhost is not
    // 127.0.0.1), the server refuses: permanent, and the message shows no credentials.
    for url in [
        format!("{base}/private"),
        format!("{with_credentials}/private-elsewhere"),
    ] {
        let error = Error::from(fetch(&url, Some(&digest), IDLE).await.unwrap_err());
        assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
        assert_eq!(
            error.to_provider_error().reason,
            "IMAGE_FORBIDDEN",
            "{error}"
        );
        assert!(!error.to_string().contains("p%40ss"), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_checksum_is_permanent_and_the_last_bytes_are_withheld() {
    let server = serve();
    let base = server.base_url();
    let wrong = "00".repeat(32);
    for path in ["/ok", "/no-length"] {
        let download = fetch(&format!("{base}{path}"), Some(&wrong), IDLE)
            .await
            .unwrap();
        let mut download = download;
        let failure = download.failure();
        let delivered = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; 64 * 1024];
            let mut delivered = 0usize;
            loop {
                match download.read(&mut buf) {
                    Ok(0) => return Ok(delivered),
                    Ok(n) => delivered += n,
                    Err(_) => return Err(delivered),
                }
            }
        })
        .await
        .unwrap();
        let delivered = delivered.unwrap_err();
        if path == "/ok" {
            assert!(delivered < SIZE, "{path}: every byte was handed out");
        }
        let error = failure.lock().unwrap().take().unwrap();
        assert!(
            matches!(error, ImageError::Checksum { .. }),
            "{path}: {error}"
        );
        assert_eq!(error.class(), ErrorClass::Permanent);
        assert!(error.to_string().contains(&sha256_hex(&body())), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_transient() {
    let server = serve();
    let base = server.base_url();
    let digest = sha256_hex(&body());
    let (read, failure) = read_all(
        fetch(&format!("{base}/short"), Some(&digest), IDLE)
            .await
            .unwrap(),
    )
    .await;
    assert!(read.is_err());
    let error = failure.unwrap();
    assert!(matches!(error, ImageError::Truncated { .. }), "{error}");
    assert_eq!(error.class(), ErrorClass::Transient);
    assert!(error.to_string().contains(&format!("of {SIZE}")), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_errors_and_unreachable_servers_are_classified() {
    let server = serve();
    let base = server.base_url();
    for (path, class) in [
        ("/404", ErrorClass::Permanent),
        ("/403", ErrorClass::Permanent),
        ("/503", ErrorClass::Transient),
    ] {
        let error = fetch(&format!("{base}{path}"), None, IDLE)
            .await
            .unwrap_err();
        assert!(matches!(error, ImageError::Http { .. }), "{path}: {error}");
        assert_eq!(error.class(), class, "{path}");
    }
    // Credentials and a query (a pre-signed URL's signature) never reach the message.
    let secret_url = format!(
        "{}/x?token=secret",
        base.replace("http://", "http://user:secret@")
    );
    let error = fetch(&secret_url, None, IDLE).await.unwrap_err();
    assert!(matches!(error, ImageError::Http { .. }), "{error}");
    assert!(!error.to_string().contains("secret"), "{error}");
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = closed.local_addr().unwrap();
    drop(closed);
    let error = tokio::time::timeout(
        Duration::from_secs(10),
        fetch(&format!("http://{address}/x"), None, IDLE),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(
        matches!(
            error,
            ImageError::Fetch {
                permanent: false,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(error.class(), ErrorClass::Transient);
    for url in [
        "not a url",
        "file:///nonexistent/debian.qcow2",
        "ftp://example.org/x",
    ] {
        let error = fetch(url, None, IDLE).await.unwrap_err();
        assert_eq!(error.class(), ErrorClass::Permanent, "{url}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_download_frees_a_reader_blocked_on_a_stalled_server() {
    let server = serve();
    let base = server.base_url();
    let download = fetch(&format!("{base}/stall"), None, IDLE).await.unwrap();
    let canceller = download.canceller();
    let reader = tokio::spawn(read_all(download));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !reader.is_finished(),
        "the reader waits for the stalled server"
    );
    canceller.cancel();
    let (read, failure) = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the reader returns once cancelled")
        .unwrap();
    assert!(read.is_err());
    let error = failure.unwrap();
    assert!(matches!(error, ImageError::Truncated { .. }), "{error}");
    assert!(error.to_string().contains("cancelled"), "{error}");
    assert_eq!(error.class(), ErrorClass::Transient);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_fails_after_the_idle_time_as_transient() {
    let server = serve();
    let base = server.base_url();
    let idle = Duration::from_millis(500);
    // No response headers.
    let error = fetch(&format!("{base}/silent"), None, idle)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            ImageError::Fetch {
                permanent: false,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("no response within 500ms"),
        "{error}"
    );
    // Half the body, then silence.
    let download = fetch(&format!("{base}/stall"), None, idle).await.unwrap();
    let (read, failure) = tokio::time::timeout(Duration::from_secs(5), read_all(download))
        .await
        .expect("the silence ends the download");
    assert!(read.is_err());
    let error = failure.unwrap();
    assert!(matches!(error, ImageError::Truncated { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("the server sent nothing for 500ms"),
        "{error}"
    );
    assert_eq!(error.class(), ErrorClass::Transient);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_url_reads_a_file_of_the_agent_through_the_same_checks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("image.qcow2");
    std::fs::write(&path, body()).unwrap();
    let url = format!("file://{}", path.display());
    let download = fetch(&url, Some(&sha256_hex(&body())), IDLE).await.unwrap();
    assert_eq!(download.length(), Some(SIZE as u64));
    let (read, failure) = read_all(download).await;
    assert_eq!(read.unwrap(), body());
    assert!(failure.is_none(), "{failure:?}");
    // A wrong digest is caught as for HTTP.
    let download = fetch(&url, Some(&"00".repeat(32)), IDLE).await.unwrap();
    let (read, failure) = read_all(download).await;
    assert!(read.is_err());
    assert!(
        matches!(failure, Some(ImageError::Checksum { .. })),
        "{failure:?}"
    );
    // Missing or relative: permanent, naming the path.
    for url in [
        format!("file://{}/missing.qcow2", dir.path().display()),
        "file://relative/image.qcow2".to_owned(),
    ] {
        let error = fetch(&url, None, IDLE).await.unwrap_err();
        assert_eq!(error.class(), ErrorClass::Permanent, "{url}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_of_every_form_lead_to_the_image() {
    let server = serve();
    let port = server.port();
    let image = Bytes::from(body());
    server.route(
        "/dir/image.qcow2",
        Reply::Body(image.clone(), Delivery::Whole),
    );
    // Only the host the redirect names serves this path: a request that went to
    // 127.0.0.1 instead is refused.
    server.route_with("/on-localhost", move |seen, _| {
        if seen.host.as_deref() == Some(format!("localhost:{port}").as_str()) {
            Reply::Body(image.clone(), Delivery::Whole)
        } else {
            Reply::Status(421)
        }
    });
    let redirects = [
        ("/dir/relative", "image.qcow2".to_owned()),
        ("/dir/dot-relative", "./image.qcow2".to_owned()),
        ("/absolute-path", "/dir/image.qcow2".to_owned()),
        (
            "/protocol-relative",
            format!("//localhost:{port}/on-localhost"),
        ),
        ("/absolute", format!("http://localhost:{port}/on-localhost")),
    ];
    let digest = sha256_hex(&body());
    for (path, location) in redirects {
        server.route(path, Reply::Redirect(301, location.clone()));
        let url = format!("{}{path}", server.base_url());
        let download = fetch(&url, Some(&digest), IDLE)
            .await
            .unwrap_or_else(|e| panic!("{path} -> {location}: {e}"));
        let (read, failure) = read_all(download).await;
        assert_eq!(read.unwrap(), body(), "{path} -> {location}");
        assert!(failure.is_none(), "{path}: {failure:?}");
    }
    assert_eq!(server.requests("/dir/image.qcow2"), 3);
    assert_eq!(server.requests("/on-localhost"), 2);
    assert!(
        server
            .seen("/on-localhost")
            .iter()
            .all(|s| s.host == Some(format!("localhost:{port}"))),
        "{:?}",
        server.seen("/on-localhost")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_reach_the_urls_origin_and_no_other() {
    let server = serve();
    let port = server.port();
    let with_credentials = |path: &str| format!("http://user:p%40ss%3Aw@127.0.0.1:{port}{path}");
    let basic = Some("Basic dXNlcjpwQHNzOnc=".to_owned());
    let digest = sha256_hex(&body());

    // The same origin, after a redirect too: the credentials go along.
    let (read, _) = read_all(
        fetch(&with_credentials("/private-moved"), Some(&digest), IDLE)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(read.unwrap(), body());
    let seen = server.seen("/private-moved");
    assert_eq!(seen[0].authorization, basic);
    assert_eq!(server.seen("/private")[0].authorization, basic);

    // Another origin (localhost is not 127.0.0.1): not a trace of them.
    let error = Error::from(
        fetch(&with_credentials("/private-elsewhere"), None, IDLE)
            .await
            .unwrap_err(),
    );
    assert_eq!(
        error.to_provider_error().reason,
        "IMAGE_FORBIDDEN",
        "{error}"
    );
    assert_eq!(server.seen("/private-elsewhere")[0].authorization, basic);
    let followed = server.seen("/private").pop().unwrap();
    assert_eq!(followed.host, Some(format!("localhost:{port}")));
    assert_eq!(followed.authorization, None, "sent to another origin");

    // RFC 7617's example, %-escapes decoded before encoding.
    let aladdin = server.route_with("/aladdin", |_, _| Reply::Status(204));
    let url = aladdin.replace("http://", "http://Aladdin:open%20sesame@");
    fetch(&url, None, IDLE).await.unwrap();
    assert_eq!(
        server.seen("/aladdin")[0].authorization.as_deref(),
        Some("Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==")
    );
    // A broken %-escape is the URL's fault: permanent, and nothing is sent.
    let error = fetch(
        &with_credentials("/ok").replace("p%40ss", "p%zzss"),
        None,
        IDLE,
    )
    .await
    .unwrap_err();
    assert_eq!(error.class(), ErrorClass::Permanent, "{error}");
    assert!(error.to_string().contains("%-escape"), "{error}");
    assert!(!error.to_string().contains("zzss"), "{error}");
    assert_eq!(server.requests("/ok"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_redirects_stop_at_the_limit_with_a_permanent_error() {
    let server = serve();
    server.route_with("/loop", |_, n| {
        Reply::Redirect(302, format!("/loop?hop={n}"))
    });
    let url = format!(
        "{}/loop?sig=secret",
        server.base_url().replace("http://", "http://user:secret@")
    );
    let error = Error::from(fetch(&url, None, IDLE).await.unwrap_err());
    assert!(
        matches!(
            error,
            Error::Image(ImageError::Fetch {
                permanent: true,
                ..
            })
        ),
        "{error}"
    );
    assert_eq!(error.to_provider_error().reason, "IMAGE_URL_INVALID");
    let text = error.to_string();
    assert!(
        text.contains("more than 5 redirects; set the image's url to where the redirects end"),
        "{text}"
    );
    assert!(!text.contains("secret") && !text.contains("hop="), "{text}");
    assert_eq!(
        server.requests("/loop"),
        6,
        "the first request and 5 redirects"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_is_not_the_servers_silence() {
    let server = serve();
    let idle = Duration::from_millis(300);
    let digest = sha256_hex(&body());
    let mut download = fetch(&format!("{}/ok", server.base_url()), Some(&digest), idle)
        .await
        .unwrap();
    let failure = download.failure();
    let read = tokio::task::spawn_blocking(move || {
        let mut out = vec![0u8; 4096];
        let first = download.read(&mut out)?;
        out.truncate(first);
        // An upload that pauses longer than the server may stay silent.
        std::thread::sleep(idle * 4);
        download.read_to_end(&mut out).map(|_| out)
    })
    .await
    .unwrap();
    assert_eq!(read.unwrap(), body());
    assert!(failure.lock().unwrap().is_none());
}

/// Everything logged at any level in this test binary from the moment of the first
/// call, the libraries' `log` records (reqwest's) included, for the test that looks for
/// secrets in it.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::<Mutex<Vec<u8>>>::default();
        let sink = logs.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || Capture(sink.clone()))
            .try_init()
            .expect("the only subscriber of this test binary");
        logs
    })
    .clone()
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_credentials_reach_no_log_and_no_error() {
    let logs = captured_logs();
    let server = serve();
    server.route_with("/loop", |_, n| {
        Reply::Redirect(302, format!("/loop?hop={n}"))
    });
    let password = "pw-7f3a9c";
    // base64 of "agent:pw-7f3a9c", as an Authorization header would carry it.
    let encoded = "YWdlbnQ6cHctN2YzYTlj";
    let base = server
        .base_url()
        .replace("http://", &format!("http://agent:{password}@"));
    let mut messages = Vec::new();
    let (read, _) = read_all(fetch(&format!("{base}/ok"), None, IDLE).await.unwrap()).await;
    assert_eq!(read.unwrap().len(), SIZE);
    for path in ["/private-elsewhere", "/loop", "/404", "/silent"] {
        let idle = Duration::from_millis(300);
        let error = fetch(&format!("{base}{path}"), None, idle)
            .await
            .unwrap_err();
        // As the cache reports a failed download.
        tracing::warn!(error = %error, "image download failed");
        messages.push(error.to_string());
        messages.push(format!("{error:?}"));
    }
    let logged = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(
        logged.contains("starting new connection"),
        "reqwest's own records are captured too: {logged}"
    );
    for text in messages.iter().chain([&logged]) {
        assert!(
            !text.contains(password) && !text.contains(encoded),
            "a credential leaked: {text}"
        );
    }
}

/// A TLS endpoint on 127.0.0.1 with a self-signed certificate for `localhost` that no
/// system store holds: it completes handshakes only, which is all the test needs.
fn untrusted_tls_endpoint() -> u16 {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let key =
        rustls::pki_types::PrivateKeyDer::try_from(certified.signing_key.serialize_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![certified.cert.der().clone()], key)
        .unwrap();
    let config = Arc::new(config);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut socket in listener.incoming().flatten() {
            let mut tls = rustls::ServerConnection::new(config.clone()).unwrap();
            // The client refuses the certificate and closes; nothing to do with that.
            let _ = tls.complete_io(&mut socket);
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_checks_the_servers_certificate_against_the_system_store() {
    let port = untrusted_tls_endpoint();
    let url = format!("https://user:secret@localhost:{port}/image.qcow2?sig=secret");
    let error = Error::from(fetch(&url, None, IDLE).await.unwrap_err());
    assert!(
        matches!(
            error,
            Error::Image(ImageError::Fetch {
                permanent: false,
                ..
            })
        ),
        "{error}"
    );
    assert_eq!(error.to_provider_error().reason, "IMAGE_UNREACHABLE");
    let text = error.to_string();
    assert!(text.contains("certificate"), "{text}");
    assert!(!text.contains("secret"), "{text}");
}
