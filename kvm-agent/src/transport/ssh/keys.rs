//! The client's SSH private key.

use std::path::Path;
use std::sync::Arc;

use russh::keys::{HashAlg, PrivateKey};

/// Loads an unencrypted OpenSSH private key; the error says what is wrong and what to do.
///
/// The key's contents never appear in an error or a log line.
pub(crate) fn load_private_key(path: &Path) -> Result<Arc<PrivateKey>, String> {
    if let Err(e) = std::fs::metadata(path) {
        return Err(format!(
            "cannot read private key {}: {e}; point it to the key the agent authenticates with",
            path.display()
        ));
    }
    match russh::keys::load_secret_key(path, None) {
        Ok(key) => Ok(Arc::new(key)),
        Err(russh::keys::Error::KeyIsEncrypted) => Err(format!(
            "private key {} is passphrase-protected; the agent needs an unencrypted key \
             (protect it with file permissions or a Kubernetes Secret instead)",
            path.display()
        )),
        Err(e) => Err(format!(
            "{} is not a usable OpenSSH private key ({e}); generate one with \
             `ssh-keygen -t ed25519 -N '' -f {}`",
            path.display(),
            path.display()
        )),
    }
}

/// `SHA256:...` fingerprint of a private key's public half, for messages.
pub(crate) fn fingerprint(key: &PrivateKey) -> String {
    key.public_key().fingerprint(HashAlg::Sha256).to_string()
}
