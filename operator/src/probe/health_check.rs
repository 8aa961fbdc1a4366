//! The proxy health check: does the VM's proxy really proxy?
//!
//! - `Tcp`: a TCP connection to the proxy port opens within the timeout.
//! - `Http`: an HTTP `GET <url>` sent *through* the proxy (absolute-form request, as
//!   a client configured with this proxy sends it) gets an answer within the timeout,
//!   and that answer is the target's, relayed ([`verdict`]):
//!   - the proxy's own refusal or error fails the check: `407` (the proxy wants
//!     credentials), `502`/`503`/`504` (it could not reach or hear from the target),
//!     and any answer the proxy itself wrote, which squid marks with `X-Squid-Error`
//!     and RFC 9209 proxies with a `Proxy-Status` that carries `error=` (a `403` from
//!     `http_access deny` is one);
//!   - every other answer passes, whatever its status: the target answered and the
//!     proxy relayed it (a `404` or `403` of the target's own proves the path works).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::crd::{HealthCheck, HealthCheckKind};

/// Longest response head read; a longer one is not a proxy's answer.
const MAX_HEAD: usize = 16 * 1024;

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
    let head = read_head(stream).await?;
    verdict(&head, url)
}

/// Reads until the end of the response head (or the connection's end).
async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|error| format!("reading the answer: {error}"))?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    Ok(head)
}

/// Whether a response head is the target's answer relayed by the proxy (`Ok`) or the
/// proxy's own refusal or error (`Err`, saying which).
pub fn verdict(head: &[u8], url: &str) -> Result<(), String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut headers);
    let first_line = || {
        String::from_utf8_lossy(head)
            .lines()
            .next()
            .unwrap_or("")
            .to_owned()
    };
    let parsed = response.parse(head);
    let code = match (parsed, response.code) {
        (Ok(_), Some(code)) => code,
        _ => {
            return Err(format!(
                "the proxy did not answer with HTTP (got {:?})",
                first_line()
            ));
        }
    };
    let header = |name: &str| {
        response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).into_owned())
    };
    if let Some(error) = header("X-Squid-Error") {
        return Err(format!(
            "the proxy refused or failed the request for {url}: {code} with X-Squid-Error {error}"
        ));
    }
    if let Some(status) = header("Proxy-Status").filter(|s| s.contains("error=")) {
        return Err(format!(
            "the proxy failed the request for {url}: {code} with Proxy-Status {status}"
        ));
    }
    match code {
        407 => Err(format!(
            "the proxy answered 407 for {url}: it requires credentials the check does not send"
        )),
        502..=504 => Err(format!(
            "the proxy answered {code} for {url}: it cannot reach the URL"
        )),
        _ => Ok(()),
    }
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
