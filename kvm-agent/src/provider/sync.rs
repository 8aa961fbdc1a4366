//! Coordination inside one agent process.
//!
//! [`KeyLocks`]: Create is idempotent on its key, but two concurrent Creates of the same
//! key would both find no domain and both build one. The lock makes the second wait for
//! the first and then find what it made. It is the key's, whatever host a request names:
//! a key names one instance on any host. The map holds weak references, so a key's entry
//! lives only while someone holds or waits for its lock.
//!
//! [`AllocationLocks`]: on a host with a static address block, a Create chooses its
//! address from what the domains hold and records it by defining its domain; two
//! Creates choosing at once would both see the same address free. The host's lock is
//! held from the choice until the domain is defined.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::time::Instant;

use crate::error::Error;

/// One Create at a time per instance key in this agent; others wait their turn and then
/// find the domain the first one made.
#[derive(Debug, Default)]
pub(crate) struct KeyLocks(Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>);

impl KeyLocks {
    /// Waits (until `deadline`) for the lock of `key`; `host` is the one the caller
    /// works on, named in the error when the wait times out.
    pub(crate) async fn lock(
        &self,
        host: &str,
        key: &str,
        deadline: Instant,
    ) -> Result<tokio::sync::OwnedMutexGuard<()>, Error> {
        let lock = {
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, weak| weak.strong_count() > 0);
            match map.get(key).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    map.insert(key.to_owned(), Arc::downgrade(&lock));
                    lock
                }
            }
        };
        let waited_from = Instant::now();
        tokio::time::timeout_at(deadline, lock.lock_owned())
            .await
            .map_err(|_| Error::CreateInProgress {
                host: host.to_owned(),
                key: key.to_owned(),
                waited: waited_from.elapsed(),
            })
    }
}

/// One static address choice at a time per host in this agent: held from reading what
/// the domains hold until the new domain, which records its address, is defined.
#[derive(Debug, Default)]
pub(crate) struct AllocationLocks(KeyLocks);

impl AllocationLocks {
    /// Waits (until `deadline`) for `host`'s lock; `key` is the Create's, named in the
    /// error when the wait times out.
    pub(crate) async fn lock(
        &self,
        host: &str,
        key: &str,
        deadline: Instant,
    ) -> Result<tokio::sync::OwnedMutexGuard<()>, Error> {
        self.0
            .lock(host, host, deadline)
            .await
            .map_err(|error| match error {
                Error::CreateInProgress { host, waited, .. } => Error::CreateInProgress {
                    host,
                    key: key.to_owned(),
                    waited,
                },
                other => other,
            })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_static_choice_per_host_at_a_time() {
        let locks = AllocationLocks::default();
        let soon = || Instant::now() + Duration::from_millis(50);
        let held = locks.lock("hv1", "k1", soon()).await.unwrap();
        // Another host's choice does not wait.
        drop(locks.lock("hv2", "k2", soon()).await.unwrap());
        // The same host's waits, and past its deadline names its own key.
        match locks.lock("hv1", "k3", soon()).await {
            Err(Error::CreateInProgress { host, key, .. }) => {
                assert_eq!((host.as_str(), key.as_str()), ("hv1", "k3"));
            }
            other => panic!("{other:?}"),
        }
        drop(held);
        drop(locks.lock("hv1", "k3", soon()).await.unwrap());
    }
}
