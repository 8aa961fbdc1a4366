//! Which answers mean "the proxy proxies": the Http health check sent through a
//! stand-in proxy on loopback that answers as squid does (its own error pages carry
//! `X-Squid-Error`), and as a relaying proxy does (the target's answer, unmarked).

use std::net::SocketAddr;

use egressproxy_operator::crd::{HealthCheck, HealthCheckKind};
use egressproxy_operator::probe::health_check::probe;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A proxy that answers every request with `response`.
async fn proxy_answering(response: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut request = vec![0u8; 4096];
            let _ = stream.read(&mut request).await;
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    address
}

fn check() -> HealthCheck {
    HealthCheck {
        kind: HealthCheckKind::Http,
        url: Some("http://target.test/".into()),
        timeout_seconds: 2,
        ..HealthCheck::default()
    }
}

#[tokio::test]
async fn the_proxy_own_refusals_and_errors_fail_and_relayed_answers_pass() {
    // squid with `http_access deny all` answers exactly like this.
    let squid_denied = "HTTP/1.1 403 Forbidden\r\nServer: squid/5.7\r\nMime-Version: 1.0\r\n\
        Content-Type: text/html;charset=utf-8\r\nContent-Length: 0\r\n\
        X-Squid-Error: ERR_ACCESS_DENIED 0\r\nVary: Accept-Language\r\n\
        Content-Language: en\r\nConnection: close\r\n\r\n";
    let squid_dns = "HTTP/1.1 500 Internal Server Error\r\nServer: squid/5.7\r\n\
        X-Squid-Error: ERR_DNS_FAIL 0\r\nContent-Length: 0\r\n\r\n";
    let rfc9209 = "HTTP/1.1 500 Internal Server Error\r\n\
        Proxy-Status: envoy; error=dns_timeout\r\nContent-Length: 0\r\n\r\n";
    let cases: [(&str, &'static str, Option<&str>); 11] = [
        ("squid denies", squid_denied, Some("ERR_ACCESS_DENIED")),
        ("squid cannot resolve", squid_dns, Some("ERR_DNS_FAIL")),
        ("RFC 9209 proxy error", rfc9209, Some("dns_timeout")),
        (
            "credentials required",
            "HTTP/1.1 407 Proxy Authentication Required\r\n\r\n",
            Some("407"),
        ),
        (
            "bad gateway",
            "HTTP/1.1 502 Bad Gateway\r\n\r\n",
            Some("502"),
        ),
        (
            "unavailable",
            "HTTP/1.1 503 Service Unavailable\r\n\r\n",
            Some("503"),
        ),
        (
            "gateway timeout",
            "HTTP/1.1 504 Gateway Timeout\r\n\r\n",
            Some("504"),
        ),
        (
            "relayed 200",
            "HTTP/1.1 200 OK\r\nVia: 1.1 egress (squid/5.7)\r\n\r\n",
            None,
        ),
        (
            "relayed 404",
            "HTTP/1.1 404 Not Found\r\nVia: 1.1 egress (squid/5.7)\r\n\r\n",
            None,
        ),
        (
            "the target's own 403",
            "HTTP/1.1 403 Forbidden\r\nVia: 1.1 egress (squid/5.7)\r\n\r\n",
            None,
        ),
        (
            "not HTTP",
            "SSH-2.0-OpenSSH_10.0\r\n",
            Some("did not answer with HTTP"),
        ),
    ];
    for (case, response, failure) in cases {
        let result = probe(proxy_answering(response).await, &check()).await;
        match failure {
            None => assert_eq!(result, Ok(()), "{case}"),
            Some(expected) => {
                let error = result.expect_err(case);
                assert!(error.contains(expected), "{case}: {error}");
            }
        }
    }
}
