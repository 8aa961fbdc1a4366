//! What a run created, so that it deletes exactly that: the ids its Creates returned,
//! plus instances found by this run's tag (a Create cancelled mid-way leaves one whose
//! id the suite never saw). Nothing without the run's tag is ever deleted.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{TAG, describe, walk};
use crate::client::Client;
use crate::pb;

/// The instances of one run. Cheap to clone; clones share the record.
#[derive(Debug, Clone)]
pub struct Ledger {
    client: Client,
    run_id: String,
    created: Arc<Mutex<BTreeSet<String>>>,
}

impl Ledger {
    /// A new run with a fresh run id.
    pub fn new(client: Client) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Ledger {
            client,
            run_id: id[..12].to_owned(),
            created: Arc::default(),
        }
    }

    /// The value of the run's tag.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The client the run uses.
    pub(crate) fn client(&self) -> Client {
        self.client.clone()
    }

    /// The selector that finds this run's instances.
    pub(crate) fn selector(&self) -> HashMap<String, String> {
        HashMap::from([(TAG.to_owned(), self.run_id.clone())])
    }

    pub(crate) fn record(&self, id: &str) {
        self.lock().insert(id.to_owned());
    }

    /// The ids recorded and not yet forgotten.
    pub(crate) fn recorded(&self) -> BTreeSet<String> {
        self.lock().clone()
    }

    pub(crate) fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.created.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deletes every instance of this run; returns what could not be deleted.
    pub async fn cleanup(&self) -> Vec<String> {
        let mut client = self.client.clone();
        let mut ids: BTreeSet<String> = std::mem::take(&mut *self.lock());
        // Instances whose Create never answered: found by the run's tag. A broken
        // List must not stop the deletes of what is known.
        if let Ok(found) = walk::list_all(&mut client, self.selector(), Some(100)).await {
            ids.extend(
                found
                    .into_iter()
                    .filter(|i| i.tags.get(TAG) == Some(&self.run_id))
                    .map(|i| i.id),
            );
        }
        let mut failures = Vec::new();
        for id in ids {
            let mut request = tonic::Request::new(pb::DeleteInstanceRequest { id: id.clone() });
            request.set_timeout(Duration::from_secs(60));
            if let Err(status) = client.delete_instance(request).await {
                failures.push(format!("{id}: {}", describe::status(&status)));
            }
        }
        failures
    }
}
