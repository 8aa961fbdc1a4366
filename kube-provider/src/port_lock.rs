//! Creates of one proxy port, one at a time in this process.
//!
//! The provider binds its pods to a node itself, so it also keeps two of its own pods
//! off one port of one node: a Create holds its port's lock from reading its key's pod
//! and which ports the egress nodes have in use until its pod exists (or failed to be
//! made), so a second Create of that port reads the first one's pod, as its own key's
//! (a repeat) or as holding the port on that node: it chooses another node, or answers
//! `PORT_IN_USE`. Creates of different ports do not wait for each other.
//!
//! The lock is the process's: a second replica of the provider is not kept out by it,
//! and of two pods it places on one port of one node the kubelet admits one; the
//! other's instance is STOPPED with a message naming the port (the chart runs one
//! replica).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

/// A lock per proxy port.
#[derive(Debug, Default)]
pub struct PortLocks {
    ports: Mutex<BTreeMap<u32, Arc<tokio::sync::Mutex<()>>>>,
}

/// Held while a Create of its port chooses a node and makes its pod.
#[derive(Debug)]
pub struct PortGuard {
    _held: OwnedMutexGuard<()>,
}

impl PortLocks {
    /// Waits until no other Create of `port` in this process is choosing or creating.
    pub async fn lock(&self, port: u32) -> PortGuard {
        let lock = {
            let mut ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
            // Forget the locks nobody holds or waits for, so the map holds only the
            // ports being created now.
            ports.retain(|_, lock| Arc::strong_count(lock) > 1);
            Arc::clone(ports.entry(port).or_default())
        };
        PortGuard {
            _held: lock.lock_owned().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_port_waits_and_another_does_not() {
        let locks = Arc::new(PortLocks::default());
        let held = locks.lock(3128).await;
        // Another port is free at once.
        drop(locks.lock(8080).await);

        let (entered_tx, mut entered) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn({
            let locks = Arc::clone(&locks);
            async move {
                let _guard = locks.lock(3128).await;
                let _ = entered_tx.send(());
            }
        });
        // The waiter cannot get in while the port is held.
        tokio::task::yield_now().await;
        assert!(entered.try_recv().is_err());
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter got the port once it was released")
            .unwrap();
        entered.try_recv().unwrap();
        assert!(
            locks
                .ports
                .lock()
                .unwrap()
                .values()
                .all(|l| Arc::strong_count(l) == 1)
        );
    }
}
