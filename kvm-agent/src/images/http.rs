//! The HTTP(S) side of [`super::fetch`]: one GET with reqwest, its answer classified, and
//! its body forwarded chunk by chunk to the reader's bounded channel.
//!
//! reqwest does what the agent must not get wrong by hand: it resolves every form of
//! `Location` (absolute, `/path`, `//host/path`, relative), turns the URL's
//! `user:password@` into HTTP basic authentication and drops that header when a redirect
//! leaves the URL's scheme, host and port. The agent adds the bounds: at most
//! [`MAX_REDIRECTS`] redirects, `idle` of silence for the response headers and between
//! body chunks, and error messages that never show the URL (only
//! [`crate::config::redact_url`]'s form of it), since reqwest's own carry it, query and
//! all.

use std::time::Duration;

use bytes::Bytes;
use egressproxy_provider::error::with_causes;
use tokio::sync::mpsc;

use crate::images::error::ImageError;

/// Redirects followed; one more fails the download as permanent.
pub(super) const MAX_REDIRECTS: usize = 5;

/// What the body task hands the reader: a chunk, or why the body ended early.
pub(super) type Chunk = Result<Bytes, String>;

/// Sends the GET for `url` (shown as `shown`) and returns the response once its status
/// is a success; the body is left to [`forward_body`].
pub(super) async fn get(
    url: &str,
    shown: &str,
    idle: Duration,
) -> Result<reqwest::Response, ImageError> {
    let invalid = |reason: String| ImageError::Fetch {
        url: shown.to_owned(),
        reason,
        permanent: true,
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| invalid(format!("not a valid URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid(
            "only http://, https:// and file:// URLs are fetched".into(),
        ));
    }
    check_credentials(&parsed).map_err(invalid)?;
    let client = client().map_err(invalid)?;
    // The whole wait for the response headers, redirects included, is bounded here
    // rather than with reqwest's read timeout: see `forward_body` for why.
    let response = tokio::time::timeout(idle, client.get(parsed).send())
        .await
        .map_err(|_| ImageError::Fetch {
            url: shown.to_owned(),
            reason: format!("no response within {}", humantime::format_duration(idle)),
            permanent: false,
        })?
        .map_err(|e| request_error(shown, e))?;
    let status = response.status();
    if !status.is_success() {
        return Err(ImageError::Http {
            url: shown.to_owned(),
            status: status.as_u16(),
        });
    }
    Ok(response)
}

/// Forwards the body of `response` to `tx` until it ends, the server stays silent for
/// `idle`, or the reader goes away.
///
/// Only the wait for the server is timed: `send` waits for the reader (the upload), and a
/// slow upload must never count as the server's silence. reqwest's `read_timeout` runs
/// its clock between the polls of the body too, so it would fail a download whose upload
/// paused for longer than `idle`.
pub(super) async fn forward_body(
    mut response: reqwest::Response,
    idle: Duration,
    tx: mpsc::Sender<Chunk>,
) {
    loop {
        let Ok(chunk) = tokio::time::timeout(idle, response.chunk()).await else {
            let silence = humantime::format_duration(idle);
            let _ = tx
                .send(Err(format!("the server sent nothing for {silence}")))
                .await;
            return;
        };
        match chunk {
            Ok(None) => return,
            Ok(Some(data)) => {
                if tx.send(Ok(data)).await.is_err() {
                    // The reader is gone: stop downloading.
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Err(with_causes(&e.without_url()))).await;
                return;
            }
        }
    }
}

/// A client for one download. TLS trusts the system's CA certificates (the contract
/// crate's `system_tls`, as the operator's address echo does). No
/// proxy from the environment is used, as before reqwest: an image mirror is reached
/// directly from the agent.
fn client() -> Result<reqwest::Client, String> {
    let tls = egressproxy_provider::system_tls::client_config()?;
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::limited(MAX_REDIRECTS))
        .no_proxy()
        .user_agent(concat!("egressproxy-kvm-agent/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {}", with_causes(&e)))
}

/// Refuses credentials with a broken `%`-escape, which reqwest would send as typed
/// (the server would then answer 401 with no hint that the URL is at fault).
fn check_credentials(url: &reqwest::Url) -> Result<(), String> {
    let broken = |text: &str| {
        text.split('%').skip(1).any(|after| {
            after.len() < 2 || !after.as_bytes()[..2].iter().all(u8::is_ascii_hexdigit)
        })
    };
    if broken(url.username()) || url.password().is_some_and(broken) {
        return Err(
            "a bad %-escape in the URL's credentials; write a literal % as %25 in the image's url"
                .into(),
        );
    }
    Ok(())
}

/// The error of a request that got no usable answer: too many redirects and a URL
/// reqwest cannot send are permanent, network and TLS failures transient.
fn request_error(shown: &str, error: reqwest::Error) -> ImageError {
    let error = error.without_url();
    if error.is_redirect() {
        return ImageError::Fetch {
            url: shown.to_owned(),
            reason: format!(
                "more than {MAX_REDIRECTS} redirects; set the image's url to where the \
                 redirects end"
            ),
            permanent: true,
        };
    }
    ImageError::Fetch {
        url: shown.to_owned(),
        reason: with_causes(&error),
        permanent: error.is_builder(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_with_a_broken_escape_are_refused() {
        for (url, ok) in [
            ("http://Aladdin:open%20sesame@h:8080/i?x", true),
            ("https://h/i", true),
            ("http://u%41:p@h/", true),
            ("http://u:%zz@h/", false),
            ("http://u:p%2@h/", false),
            ("http://u%:p@h/", false),
        ] {
            let parsed = reqwest::Url::parse(url).unwrap();
            assert_eq!(check_credentials(&parsed).is_ok(), ok, "{url}");
        }
    }
}
