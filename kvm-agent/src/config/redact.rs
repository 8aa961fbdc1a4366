//! How a configured URL is shown in errors, logs and `Debug`: never with its secrets.

/// `url` as errors and logs show it: without credentials (`user:password@`) and without
/// its query (pre-signed URLs carry their signature there).
pub fn redact_url(url: &str) -> String {
    let (without_query, had_query) = match url.find(['?', '#']) {
        Some(at) => (&url[..at], url[at..].starts_with('?')),
        None => (url, false),
    };
    let shown = match without_query.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            match authority.rsplit_once('@') {
                Some((_, host)) => format!("{scheme}://…@{host}{path}"),
                None => without_query.to_owned(),
            }
        }
        None => without_query.to_owned(),
    };
    if had_query {
        format!("{shown}?…")
    } else {
        shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_urls_keep_no_credentials_or_query() {
        for (url, shown) in [
            ("https://example.org/d.qcow2", "https://example.org/d.qcow2"),
            (
                "https://user:secret@example.org:8443/d.qcow2",
                "https://…@example.org:8443/d.qcow2",
            ),
            (
                "https://bucket.s3.example/d.qcow2?X-Amz-Signature=secret",
                "https://bucket.s3.example/d.qcow2?…",
            ),
            ("http://u:p@h?sig=secret#frag", "http://…@h?…"),
            ("http://h/a#frag", "http://h/a"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
