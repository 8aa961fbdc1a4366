//! TLS for the HTTPS requests the binaries make to the outside world (an image mirror,
//! an address-echo service): rustls with the `ring` provider, the one every binary of
//! the workspace uses, verifying servers with the platform's verifier, i.e. the system's
//! CA certificates. One place, so the operator and the agent trust the same way.

use std::sync::Arc;

use rustls_platform_verifier::BuilderVerifierExt;

/// A client configuration that trusts the system's CA certificates and presents no
/// client certificate. The error says what failed, for a message a user reads.
pub fn client_config() -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|builder| builder.with_platform_verifier())
        .map_err(|e| format!("cannot set up TLS with the system's CA certificates: {e}"))?
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    #[test]
    fn builds_from_the_system_s_ca_certificates() {
        let config = super::client_config().unwrap();
        assert!(
            config.alpn_protocols.is_empty(),
            "the HTTP client sets ALPN itself"
        );
    }
}
