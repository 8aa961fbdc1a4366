//! Asking an echo service, through a Proxy's proxy, which source address it sees.
//!
//! 1. One `GET <check URL>` is sent through the proxy (reqwest with the proxy as its
//!    only proxy: an absolute-form request for `http://`, a `CONNECT` tunnel for
//!    `https://`), so the echo service sees the connection the proxy opens, from the
//!    address every destination of the proxy sees. TLS trusts the system's CA
//!    certificates (`egressproxy_provider::system_tls`).
//! 2. The answer must be a success whose body is one IP address, optionally with
//!    whitespace around it: what `https://api.ipify.org`, `https://ifconfig.me/ip`,
//!    `https://checkip.amazonaws.com` and `https://icanhazip.com` answer. A longer body
//!    is not read past [`MAX_BODY`].
//! 3. Messages never show the URL's credentials or query ([`redact_url`]): both may
//!    carry a token, and the messages end up in Events and logs. reqwest's own errors
//!    carry the URL, so they are shown without it.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use egressproxy_provider::error::with_causes;

/// The longest body read: an address in text is at most 45 bytes.
pub const MAX_BODY: usize = 256;

/// The source address the echo service at `url` sees, asked through the proxy listening
/// at `proxy`, within `timeout`. `Err` says what failed, with the URL redacted.
pub async fn egress_address(
    proxy: SocketAddr,
    url: &str,
    timeout: Duration,
) -> Result<IpAddr, String> {
    let shown = redact_url(url);
    let parsed = reqwest::Url::parse(url)
        .map_err(|error| format!("the egress check URL {shown} is not a valid URL: {error}"))?;
    let client = client(proxy)?;
    let ask = async {
        let mut response = client
            .get(parsed)
            .send()
            .await
            .map_err(|error| describe(error, &shown, proxy))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!(
                "{shown} answered {status} through the proxy at {proxy}"
            ));
        }
        let mut body = Vec::new();
        while body.len() < MAX_BODY {
            match response.chunk().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                Ok(None) => break,
                Err(error) => return Err(describe(error, &shown, proxy)),
            }
        }
        address_in(&body).map_err(|problem| format!("{shown} answered {problem}"))
    };
    tokio::time::timeout(timeout, ask).await.map_err(|_| {
        format!("{shown} did not answer through the proxy at {proxy} within {timeout:?}")
    })?
}

/// The address an echo service's `body` holds.
fn address_in(body: &[u8]) -> Result<IpAddr, String> {
    let text = String::from_utf8_lossy(body);
    let trimmed = text.trim();
    trimmed.parse().map_err(|_| {
        let shown: String = trimmed.chars().take(64).collect();
        format!(
            "{shown:?}, not an IP address: use an echo service that answers the caller's address alone"
        )
    })
}

fn describe(error: reqwest::Error, shown: &str, proxy: SocketAddr) -> String {
    let cause = with_causes(&error.without_url());
    format!("asking {shown} through the proxy at {proxy}: {cause}")
}

/// A client whose one proxy is `proxy`, never one from the environment, and which
/// follows no redirect (a redirect to a login page is not an address).
fn client(proxy: SocketAddr) -> Result<reqwest::Client, String> {
    let tls = egressproxy_provider::system_tls::client_config()?;
    let through = reqwest::Proxy::all(format!("http://{proxy}"))
        .map_err(|e| format!("the proxy address {proxy}: {}", with_causes(&e)))?;
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .proxy(through)
        .user_agent(concat!("egressproxy-operator/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {}", with_causes(&e)))
}

/// `url` as messages show it: without `user:password@` and with the query replaced by
/// `?…`; a URL that does not parse is not shown at all.
pub fn redact_url(url: &str) -> String {
    let Ok(mut parsed) = reqwest::Url::parse(url) else {
        return "(an unparsable URL)".into();
    };
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    let had_query = parsed.query().is_some();
    parsed.set_query(None);
    parsed.set_fragment(None);
    let mut shown = parsed.to_string();
    if had_query {
        shown.push_str("?…");
    }
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_and_queries_never_show() {
        let cases = [
            (
                "https://user:s3cret@echo.example/ip",
                "https://echo.example/ip",
            ),
            (
                "http://token@echo.example:8080/",
                "http://echo.example:8080/",
            ),
            (
                "https://echo.example/ip?key=s3cret",
                "https://echo.example/ip?…",
            ),
            ("https://echo.example/ip#s3cret", "https://echo.example/ip"),
            ("not a url s3cret", "(an unparsable URL)"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact_url(url), shown);
        }
    }

    #[test]
    fn a_body_is_one_address_with_optional_whitespace() {
        assert_eq!(
            address_in(b"203.0.113.7\n"),
            Ok("203.0.113.7".parse().unwrap())
        );
        assert_eq!(
            address_in(b" 2001:db8::7 "),
            Ok("2001:db8::7".parse().unwrap())
        );
        let error = address_in(b"<html>your address is 203.0.113.7</html>").unwrap_err();
        assert!(error.contains("not an IP address"), "{error}");
    }

    #[tokio::test]
    async fn an_unparsable_url_fails_without_showing_it() {
        let proxy: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let error = egress_address(proxy, "http://a:s3cret@[::1", Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(!error.contains("s3cret"), "{error}");
    }
}
