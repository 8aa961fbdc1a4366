//! One unary gRPC call over a bare HTTP/2 connection, carrying a `grpc-timeout` header
//! and nothing else that keeps time. Every gRPC client library (tonic's channel
//! included) also enforces the header itself and would end the call first, so only a
//! bare connection shows what the *server* does when the deadline passes.

use std::time::Duration;

use bytes::Bytes;

/// Calls `path` (`/package.Service/Method`) on `authority` (`host:port`, plaintext)
/// with an encoded `message` and a raw `grpc-timeout`; `guard` only bounds the wait
/// for a server that never answers. Returns the status (OK included) from the
/// response's headers or trailers.
pub async fn unary(
    authority: &str,
    path: &str,
    message: &[u8],
    grpc_timeout: &str,
    guard: Duration,
) -> Result<tonic::Status, String> {
    tokio::time::timeout(guard, call(authority, path, message, grpc_timeout))
        .await
        .map_err(|_| {
            format!(
                "no answer within {}: the server does not end calls at their grpc-timeout",
                humantime::format_duration(guard)
            )
        })?
}

async fn call(
    authority: &str,
    path: &str,
    message: &[u8],
    grpc_timeout: &str,
) -> Result<tonic::Status, String> {
    let tcp = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
    let (client, connection) = h2::client::handshake(tcp)
        .await
        .map_err(|e| format!("HTTP/2 handshake with {authority} failed: {e}"))?;
    tokio::spawn(connection);
    let mut client = client
        .ready()
        .await
        .map_err(|e| format!("HTTP/2 connection to {authority} closed: {e}"))?;
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{authority}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", grpc_timeout)
        .body(())
        .map_err(|e| e.to_string())?;
    let (response, mut send) = client
        .send_request(request, false)
        .map_err(|e| format!("sending the request failed: {e}"))?;
    let mut frame = Vec::with_capacity(message.len() + 5);
    frame.push(0);
    frame.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    frame.extend_from_slice(message);
    // A server may answer as soon as it has the headers (a deadline this short can pass
    // before the body arrives) and reset the stream; sending the body then fails, but the
    // answer stands: only a call with no answer at all is an error.
    let unsent = send.send_data(Bytes::from(frame), true).err();
    let response = response.await.map_err(|e| match &unsent {
        Some(send) => format!("sending the request failed: {send}; then no response: {e}"),
        None => format!("the stream ended without a response: {e}"),
    })?;
    let (parts, mut body) = response.into_parts();
    if let Some(status) = status_from(&parts.headers)? {
        return Ok(status);
    }
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| format!("reading the response failed: {e}"))?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body
        .trailers()
        .await
        .map_err(|e| format!("reading the trailers failed: {e}"))?
        .ok_or("a response without trailers (no grpc-status)")?;
    status_from(&trailers)?.ok_or_else(|| "trailers without grpc-status".into())
}

/// The status in `headers`, if any. tonic panics on a `grpc-status-details-bin` that is
/// not base64; from a provider under test that is a finding, not a crash of the suite.
fn status_from(headers: &http::HeaderMap) -> Result<Option<tonic::Status>, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tonic::Status::from_header_map(headers)
    }))
    .map_err(|_| "a grpc-status-details-bin trailer that is not base64".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every call with a trailers-only DEADLINE_EXCEEDED as soon
    /// as it has the request's headers, without reading the body.
    async fn answers_on_headers() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(tcp).await.unwrap();
                    while let Some(Ok((_request, mut respond))) = connection.accept().await {
                        let response = http::Response::builder()
                            .status(200)
                            .header("content-type", "application/grpc")
                            .header("grpc-status", "4")
                            .header("grpc-message", "deadline passed")
                            .body(())
                            .unwrap();
                        // Ending the stream with the body unread: h2 resets it
                        // (NO_ERROR) once the answer is written.
                        let _ = respond.send_response(response, true);
                    }
                });
            }
        });
        authority
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_before_the_body_is_sent_is_the_calls_status() {
        let authority = answers_on_headers().await;
        for _ in 0..50 {
            let status = unary(
                &authority,
                "/egressproxy.provider.v1.Provider/ListInstances",
                &[0; 64],
                "1m",
                Duration::from_secs(10),
            )
            .await
            .unwrap();
            assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
        }
    }
}
