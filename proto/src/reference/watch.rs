//! The reference provider's WatchInstances: its [`WatchHub`] serves the streams; what
//! changes with time alone (the end of provisioning, the end of DELETING) is told to the
//! hub by a timer set when the change is scheduled.

use std::time::Duration;

use tonic::Status;

use super::{MemoryProvider, Misbehaviour};
use crate::pb::{self, WatchEventType};
use crate::watch::{WatchHub, WatchStream};

impl MemoryProvider {
    /// Tells the hub instance `id`'s state `after` from now (a little later, so the
    /// state has surely moved on), or that it is gone.
    pub(super) fn refresh_after(&self, id: &str, after: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let provider = self.clone();
        let id = id.to_owned();
        runtime.spawn(async move {
            tokio::time::sleep(after + Duration::from_millis(1)).await;
            provider.refresh(&id);
        });
    }

    /// Tells the hub what instance `id` is now.
    fn refresh(&self, id: &str) {
        let mut state = self.lock();
        self.purge(&mut state);
        if let Some(record) = state.instances.get(id) {
            let now = self.snapshot(record);
            self.hub.updated(now);
        }
    }

    /// The hub every change is told to.
    pub fn watch_hub(&self) -> &WatchHub {
        &self.hub
    }

    /// WatchInstances' stream, as the contract says or as a misbehaviour breaks it.
    pub(super) fn watch_stream(
        &self,
        mut request: pb::WatchInstancesRequest,
    ) -> Result<WatchStream, Status> {
        use futures::StreamExt;
        if self.breaks(Misbehaviour::WatchIgnoresResumeToken) {
            request.resume_token.clear();
        }
        if self.breaks(Misbehaviour::WatchSelectorIgnored) {
            request.tag_selector.clear();
        }
        if self.breaks(Misbehaviour::WatchIdIgnored) {
            request.id.clear();
        }
        let stream = match self.hub.watch(&request) {
            Err(error)
                if self.breaks(Misbehaviour::WatchAcceptsForeignToken)
                    && error
                        .field_violations
                        .iter()
                        .any(|v| v.field == "resume_token") =>
            {
                request.resume_token.clear();
                self.hub.watch(&request)
            }
            other => other,
        }
        .map_err(|error| self.encode(&error))?;
        let drop_deletes = self.breaks(Misbehaviour::WatchMissesDeletes);
        let mut snapshot_dropped = !self.breaks(Misbehaviour::WatchNoSnapshot);
        Ok(Box::pin(stream.filter(move |event| {
            let keep = match event {
                Ok(event) => match event.r#type() {
                    WatchEventType::Deleted => !drop_deletes,
                    WatchEventType::Synced => {
                        snapshot_dropped = true;
                        true
                    }
                    WatchEventType::Updated => snapshot_dropped,
                    _ => true,
                },
                Err(_) => true,
            };
            futures::future::ready(keep)
        })))
    }
}
