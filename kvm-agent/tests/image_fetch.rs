//! Image downloads from a local HTTP server (127.0.0.1) that misbehaves on request:
//! wrong content, no Content-Length, a connection cut short, error statuses, a redirect.

use std::io::Read;
use std::time::Duration;

use kvm_agent::error::{Error, ErrorClass};
use kvm_agent::images::fetch::{Download, fetch};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

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
async fn serve() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&request);
                let path = text.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let body = body();
                let head = |status: &str, extra: &str| {
                    format!("HTTP/1.1 {status}\r\n{extra}Connection: close\r\n\r\n")
                };
                let length = format!("Content-Length: {SIZE}\r\n");
                if path == "/silent" {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    return;
                }
                if path == "/stall" {
                    let _ = socket.write_all(head("200 OK", &length).as_bytes()).await;
                    let _ = socket.write_all(&body[..SIZE / 2]).await;
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    return;
                }
                // user "user", password "p@ss:w" (RFC 7617 basic).
                let authorized = text
                    .lines()
                    .any(|l| l.eq_ignore_ascii_case("authorization: Basic dXNlcjpwQHNzOnc="));
                let to_other_origin = format!(
                    "Location: http://localhost:{}/private\r\nContent-Length: 0\r\n",
                    address.port()
                );
                let (head, payload): (String, &[u8]) = match path.as_str() {
                    "/private" if authorized => (head("200 OK", &length), &body),
                    "/private" => (head("401 Unauthorized", "Content-Length: 0\r\n"), b""),
                    "/private-moved" => (
                        head("302 Found", "Location: /private\r\nContent-Length: 0\r\n"),
                        b"",
                    ),
                    "/private-elsewhere" => (head("302 Found", &to_other_origin), b""),
                    "/ok" => (head("200 OK", &length), &body),
                    "/no-length" => (head("200 OK", ""), &body),
                    "/short" => (head("200 OK", &length), &body[..SIZE / 2]),
                    "/redirect" => (
                        head("302 Found", "Location: /ok\r\nContent-Length: 0\r\n"),
                        b"",
                    ),
                    "/404" => (head("404 Not Found", "Content-Length: 0\r\n"), b""),
                    "/403" => (head("403 Forbidden", "Content-Length: 0\r\n"), b""),
                    _ => (
                        head("503 Service Unavailable", "Content-Length: 0\r\n"),
                        b"",
                    ),
                };
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(payload).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    format!("http://{address}")
}

/// Reads the download to its end on a blocking thread, as a volume upload does.
async fn read_all(mut download: Download) -> (Result<Vec<u8>, String>, Option<Error>) {
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
    let base = serve().await;
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
    let base = serve().await;
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
        let error = fetch(&url, Some(&digest), IDLE).await.unwrap_err();
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
    let base = serve().await;
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
            matches!(error, Error::ImageChecksum { .. }),
            "{path}: {error}"
        );
        assert_eq!(error.class(), ErrorClass::Permanent);
        assert!(error.to_string().contains(&sha256_hex(&body())), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_transient() {
    let base = serve().await;
    let digest = sha256_hex(&body());
    let (read, failure) = read_all(
        fetch(&format!("{base}/short"), Some(&digest), IDLE)
            .await
            .unwrap(),
    )
    .await;
    assert!(read.is_err());
    let error = failure.unwrap();
    assert!(matches!(error, Error::ImageTruncated { .. }), "{error}");
    assert_eq!(error.class(), ErrorClass::Transient);
    assert!(error.to_string().contains(&format!("of {SIZE}")), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_errors_and_unreachable_servers_are_classified() {
    let base = serve().await;
    for (path, class) in [
        ("/404", ErrorClass::Permanent),
        ("/403", ErrorClass::Permanent),
        ("/503", ErrorClass::Transient),
    ] {
        let error = fetch(&format!("{base}{path}"), None, IDLE)
            .await
            .unwrap_err();
        assert!(matches!(error, Error::ImageHttp { .. }), "{path}: {error}");
        assert_eq!(error.class(), class, "{path}");
    }
    // Credentials and a query (a pre-signed URL's signature) never reach the message.
    let secret_url = format!(
        "{}/x?token=secret",
        base.replace("http://", "http://user:secret@")
    );
    let error = fetch(&secret_url, None, IDLE).await.unwrap_err();
    assert!(matches!(error, Error::ImageHttp { .. }), "{error}");
    assert!(!error.to_string().contains("secret"), "{error}");
    // A port nobody listens on.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
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
            Error::ImageFetch {
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
    let base = serve().await;
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
    assert!(matches!(error, Error::ImageTruncated { .. }), "{error}");
    assert!(error.to_string().contains("cancelled"), "{error}");
    assert_eq!(error.class(), ErrorClass::Transient);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_fails_after_the_idle_time_as_transient() {
    let base = serve().await;
    let idle = Duration::from_millis(500);
    // No response headers.
    let error = fetch(&format!("{base}/silent"), None, idle)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::ImageFetch {
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
    assert!(matches!(error, Error::ImageTruncated { .. }), "{error}");
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
        matches!(failure, Some(Error::ImageChecksum { .. })),
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
