//! The proxy health check: does the VM's proxy really answer?
//!
//! - `Tcp`: a TCP connection to the proxy port opens within the timeout.
//! - `Http`: an HTTP `GET <url>` sent *through* the proxy (absolute-form request, as
//!   a client configured with this proxy sends it) gets an HTTP response below 500
//!   within the timeout. A 5xx means the proxy answered but could not reach the URL.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::crd::{HealthCheck, HealthCheckKind};

/// Runs `check` against the proxy at `address`; `Err` says what failed.
pub async fn probe(address: SocketAddr, check: &HealthCheck) -> Result<(), String> {
    let timeout = Duration::from_secs(u64::from(check.timeout_seconds));
    let attempt = async {
        let mut stream = TcpStream::connect(address)
            .await
            .map_err(|error| format!("cannot connect to the proxy at {address}: {error}"))?;
        match check.kind {
            HealthCheckKind::Tcp => Ok(()),
            HealthCheckKind::Http => {
                let url = check.url.as_deref().unwrap_or_default();
                http_through_proxy(&mut stream, url).await
            }
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| format!("the proxy at {address} did not answer within {timeout:?}"))?
}

async fn http_through_proxy(stream: &mut TcpStream, url: &str) -> Result<(), String> {
    let host = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .filter(|host| !host.is_empty())
        .ok_or_else(|| format!("healthCheck.url {url:?} is not an absolute http:// URL"))?;
    let request = format!(
        "GET {url} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: egressproxy-operator\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|error| format!("sending the request: {error}"))?;
    let mut head = [0u8; 64];
    let mut read = 0;
    while read < 12 {
        let n = stream
            .read(&mut head[read..])
            .await
            .map_err(|error| format!("reading the answer: {error}"))?;
        if n == 0 {
            break;
        }
        read += n;
    }
    let line = String::from_utf8_lossy(&head[..read]);
    let code: u16 = line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            format!(
                "the proxy did not answer with HTTP (got {:?})",
                line.lines().next().unwrap_or("")
            )
        })?;
    if code >= 500 {
        return Err(format!(
            "the proxy answered {code} for {url}: it cannot reach the URL"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn proxy_answering(status_line: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut request = vec![0u8; 1024];
                let n = stream.read(&mut request).await.unwrap();
                assert!(
                    String::from_utf8_lossy(&request[..n])
                        .starts_with("GET http://example.test/ HTTP/1.1\r\n")
                );
                stream.write_all(status_line.as_bytes()).await.unwrap();
            }
        });
        address
    }

    fn http_check() -> HealthCheck {
        HealthCheck {
            kind: HealthCheckKind::Http,
            url: Some("http://example.test/".into()),
            timeout_seconds: 2,
            ..HealthCheck::default()
        }
    }

    #[tokio::test]
    async fn http_check_passes_on_a_proxied_answer_and_fails_on_5xx() {
        let healthy = proxy_answering("HTTP/1.1 200 OK\r\n\r\n").await;
        probe(healthy, &http_check()).await.unwrap();
        let broken = proxy_answering("HTTP/1.1 503 Service Unavailable\r\n\r\n").await;
        let error = probe(broken, &http_check()).await.unwrap_err();
        assert!(error.contains("503"), "{error}");
    }

    #[tokio::test]
    async fn tcp_check_fails_when_nothing_listens() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        probe(address, &HealthCheck::default()).await.unwrap();
        drop(listener);
        let error = probe(address, &HealthCheck::default()).await.unwrap_err();
        assert!(error.contains("cannot connect"), "{error}");
    }

    #[tokio::test]
    async fn a_silent_proxy_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let check = HealthCheck {
            timeout_seconds: 1,
            ..http_check()
        };
        let error = probe(address, &check).await.unwrap_err();
        assert!(error.contains("did not answer"), "{error}");
        drop(listener);
    }
}
