//! WatchInstances as the contract states it (since 1.3.0), for providers to share: a
//! [`WatchHub`] that a provider tells about every change it sees, and that serves every
//! stream.
//!
//! 1. **Changes.** The provider calls [`WatchHub::updated`] with an instance as Get
//!    would answer it whenever it may have changed (after Create, Delete, a libvirt
//!    event, a timer); the hub publishes UPDATED only when the instance differs from
//!    what it last published, so callers may report the same state twice. It calls
//!    [`WatchHub::deleted`] when an instance is gone. Each published change gets the
//!    next sequence number and is kept in a bounded history.
//! 2. **A new stream** gets UPDATED for every matching instance the hub knows, then
//!    SYNCED, then every matching change as it is published. The snapshot and the
//!    subscription are taken under one lock, so no change falls between them.
//! 3. **Resume tokens** name this hub (a random epoch, new at every start) and a
//!    sequence number, with the crate's checksum ([`crate::paging::encode_token`]). A
//!    stream reopened with one replays the kept changes after it, then goes on live.
//!    A token of another epoch (the provider restarted) or older than the history
//!    starts with RESTARTED and a snapshot; one the hub cannot decode is
//!    INVALID_ARGUMENT naming `resume_token`.
//! 4. **A slow reader** that falls behind the live changes by more than the channel
//!    holds is not dropped: its stream restarts (RESTARTED, snapshot, SYNCED).

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use tokio::sync::broadcast;

use crate::pb::{self, WatchEventType};
use crate::validation::{MAX_ID_BYTES, check_list_request};
use crate::{ProviderError, paging};

/// Changes a hub keeps for streams that resume.
pub const DEFAULT_HISTORY: usize = 10_000;
/// Live changes one stream may fall behind by before it restarts.
const LIVE_BUFFER: usize = 1024;
/// Largest accepted `resume_token`, in bytes.
pub const MAX_RESUME_TOKEN_BYTES: usize = 1024;

/// A stream of watch events, as a tonic server method returns it.
pub type WatchStream =
    Pin<Box<dyn Stream<Item = Result<pb::WatchInstancesResponse, tonic::Status>> + Send>>;

/// One published change.
#[derive(Debug, Clone)]
struct Change {
    seq: u64,
    deleted: bool,
    instance: pb::Instance,
}

#[derive(Debug)]
struct HubState {
    next_seq: u64,
    history: VecDeque<Change>,
    current: BTreeMap<String, pb::Instance>,
}

#[derive(Debug)]
struct Inner {
    epoch: String,
    capacity: usize,
    state: Mutex<HubState>,
    live: broadcast::Sender<Change>,
}

/// The changes of one provider's instances and the streams that watch them. Cheap to
/// clone; clones share everything.
#[derive(Debug, Clone)]
pub struct WatchHub {
    inner: Arc<Inner>,
}

impl Default for WatchHub {
    fn default() -> Self {
        Self::new(DEFAULT_HISTORY)
    }
}

/// Which instances a stream wants.
#[derive(Debug, Clone)]
struct Filter {
    selector: Vec<(String, String)>,
    id: String,
}

impl Filter {
    fn matches(&self, instance: &pb::Instance) -> bool {
        (self.id.is_empty() || instance.id == self.id)
            && self
                .selector
                .iter()
                .all(|(key, value)| instance.tags.get(key) == Some(value))
    }
}

/// Where a stream starts.
enum From {
    Start,
    After(u64),
    Restart,
}

impl WatchHub {
    /// A hub that keeps the last `history` changes for streams that resume.
    pub fn new(history: usize) -> Self {
        let (live, _) = broadcast::channel(LIVE_BUFFER);
        WatchHub {
            inner: Arc::new(Inner {
                epoch: uuid::Uuid::new_v4().simple().to_string(),
                capacity: history.max(1),
                state: Mutex::new(HubState {
                    next_seq: 1,
                    history: VecDeque::new(),
                    current: BTreeMap::new(),
                }),
                live,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish(&self, state: &mut HubState, deleted: bool, instance: pb::Instance) {
        let change = Change {
            seq: state.next_seq,
            deleted,
            instance,
        };
        state.next_seq += 1;
        if state.history.len() == self.inner.capacity {
            state.history.pop_front();
        }
        state.history.push_back(change.clone());
        // No receiver is not an error: nobody watches right now.
        let _ = self.inner.live.send(change);
    }

    /// `instance` as it is now; published as UPDATED when it differs from what was
    /// last published for its id (step 1 of the module docs).
    pub fn updated(&self, instance: pb::Instance) {
        let mut state = self.lock();
        if state.current.get(&instance.id) == Some(&instance) {
            return;
        }
        state.current.insert(instance.id.clone(), instance.clone());
        self.publish(&mut state, false, instance);
    }

    /// Instance `id` is gone; published as DELETED with its last state, once.
    pub fn deleted(&self, id: &str) {
        let mut state = self.lock();
        if let Some(last) = state.current.remove(id) {
            self.publish(&mut state, true, last);
        }
    }

    /// Instance `id` as last published, if the hub knows it.
    pub fn current(&self, id: &str) -> Option<pb::Instance> {
        self.lock().current.get(id).cloned()
    }

    /// Every instance the hub knows, as last published.
    pub fn known(&self) -> Vec<pb::Instance> {
        self.lock().current.values().cloned().collect()
    }

    fn token(&self, seq: u64) -> String {
        paging::encode_token(&format!("watch:{}:{seq}", self.inner.epoch))
    }

    /// Where a stream with `token` starts (step 3 of the module docs).
    fn start_of(&self, token: &str, state: &HubState) -> Result<From, ProviderError> {
        if token.is_empty() {
            return Ok(From::Start);
        }
        let foreign = || {
            ProviderError::invalid_argument(
                "resume_token",
                "not a token this provider issued: pass the resume_token of an event \
                 unchanged, or none to start a new stream",
            )
            .with_reason("INVALID_RESUME_TOKEN")
        };
        if token.len() > MAX_RESUME_TOKEN_BYTES {
            return Err(foreign());
        }
        let decoded = paging::decode_token(token)
            .map_err(|_| foreign())?
            .unwrap_or_default();
        let mut parts = decoded.split(':');
        let (Some("watch"), Some(epoch), Some(seq), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(foreign());
        };
        let seq: u64 = seq.parse().map_err(|_| foreign())?;
        let oldest = state.history.front().map_or(state.next_seq, |c| c.seq);
        if epoch != self.inner.epoch || seq >= state.next_seq || seq + 1 < oldest {
            return Ok(From::Restart);
        }
        Ok(From::After(seq))
    }

    /// The events a stream starts with, and the live changes from then on, taken under
    /// one lock (step 2 of the module docs).
    fn begin(
        &self,
        from: Option<&str>,
        filter: &Filter,
    ) -> Result<(Vec<pb::WatchInstancesResponse>, broadcast::Receiver<Change>), ProviderError> {
        let state = self.lock();
        let start = match from {
            Some(token) => self.start_of(token, &state)?,
            None => From::Restart,
        };
        let receiver = self.inner.live.subscribe();
        let now = self.token(state.next_seq - 1);
        let event = |type_: WatchEventType, instance: Option<pb::Instance>, token: String| {
            pb::WatchInstancesResponse {
                r#type: type_.into(),
                instance,
                resume_token: token,
            }
        };
        let mut events = Vec::new();
        match start {
            From::After(seq) => {
                events.extend(
                    state
                        .history
                        .iter()
                        .filter(|change| change.seq > seq && filter.matches(&change.instance))
                        .map(|change| self.response(change)),
                );
            }
            From::Start | From::Restart => {
                if matches!(start, From::Restart) {
                    events.push(event(WatchEventType::Restarted, None, now.clone()));
                }
                events.extend(
                    state
                        .current
                        .values()
                        .filter(|instance| filter.matches(instance))
                        .map(|instance| {
                            event(WatchEventType::Updated, Some(instance.clone()), now.clone())
                        }),
                );
                events.push(event(WatchEventType::Synced, None, now));
            }
        }
        Ok((events, receiver))
    }

    fn response(&self, change: &Change) -> pb::WatchInstancesResponse {
        pb::WatchInstancesResponse {
            r#type: if change.deleted {
                WatchEventType::Deleted
            } else {
                WatchEventType::Updated
            }
            .into(),
            instance: Some(change.instance.clone()),
            resume_token: self.token(change.seq),
        }
    }

    /// The stream a WatchInstances `request` gets (the module docs say what it holds).
    /// Its task ends when the caller goes away.
    pub fn watch(&self, request: &pb::WatchInstancesRequest) -> Result<WatchStream, ProviderError> {
        check_list_request(&pb::ListInstancesRequest {
            tag_selector: request.tag_selector.clone(),
            ..Default::default()
        })?;
        if request.id.len() > MAX_ID_BYTES {
            return Err(ProviderError::invalid_argument(
                "id",
                format!(
                    "{} bytes is over the {MAX_ID_BYTES}-byte limit",
                    request.id.len()
                ),
            ));
        }
        let filter = Filter {
            selector: request
                .tag_selector
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            id: request.id.clone(),
        };
        let (initial, mut receiver) = self.begin(Some(&request.resume_token), &filter)?;
        let (sender, events) = tokio::sync::mpsc::channel(64);
        let hub = self.clone();
        tokio::spawn(async move {
            let mut pending = initial;
            loop {
                for event in pending.drain(..) {
                    if sender.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
                let change = tokio::select! {
                    _ = sender.closed() => return,
                    change = receiver.recv() => change,
                };
                match change {
                    Ok(change) if filter.matches(&change.instance) => {
                        pending.push(hub.response(&change));
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => match hub.begin(None, &filter) {
                        Ok((restart, fresh)) => {
                            pending = restart;
                            receiver = fresh;
                        }
                        Err(_) => return,
                    },
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(
            events,
        )))
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::ErrorClass;

    fn instance(id: &str, state: pb::InstanceState, tag: &str) -> pb::Instance {
        pb::Instance {
            id: id.into(),
            state: state.into(),
            tags: [("team".to_string(), tag.to_string())].into(),
            ..Default::default()
        }
    }

    fn request(tag: &str, token: &str) -> pb::WatchInstancesRequest {
        pb::WatchInstancesRequest {
            tag_selector: if tag.is_empty() {
                Default::default()
            } else {
                [("team".to_string(), tag.to_string())].into()
            },
            id: String::new(),
            resume_token: token.into(),
        }
    }

    /// The next `n` events, as `TYPE id` (or `TYPE`), with the last one's token.
    async fn next(stream: &mut WatchStream, n: usize) -> (Vec<String>, String) {
        let mut seen = Vec::new();
        let mut token = String::new();
        for _ in 0..n {
            let event = tokio::time::timeout(std::time::Duration::from_secs(5), stream.next())
                .await
                .expect("an event within 5 s")
                .unwrap()
                .unwrap();
            token = event.resume_token.clone();
            let kind = event
                .r#type()
                .as_str_name()
                .trim_start_matches("WATCH_EVENT_TYPE_")
                .to_owned();
            seen.push(match event.instance {
                Some(instance) => format!(
                    "{kind} {} {}",
                    instance.id,
                    instance
                        .state()
                        .as_str_name()
                        .trim_start_matches("INSTANCE_STATE_")
                ),
                None => kind,
            });
        }
        (seen, token)
    }

    #[tokio::test]
    async fn a_new_stream_gets_the_snapshot_then_synced_then_changes_as_they_come() {
        use pb::InstanceState::{Provisioning, Running};
        let hub = WatchHub::default();
        hub.updated(instance("a", Provisioning, "blue"));
        hub.updated(instance("b", Running, "green"));
        let mut blue = hub.watch(&request("blue", "")).unwrap();
        assert_eq!(
            next(&mut blue, 2).await.0,
            ["UPDATED a PROVISIONING", "SYNCED"]
        );
        // The same state again is not a change; a new state is; another team's is not ours.
        hub.updated(instance("a", Provisioning, "blue"));
        hub.updated(instance("b", Provisioning, "green"));
        hub.updated(instance("a", Running, "blue"));
        hub.deleted("a");
        hub.deleted("a");
        assert_eq!(
            next(&mut blue, 2).await.0,
            ["UPDATED a RUNNING", "DELETED a RUNNING"]
        );
        let mut one = hub
            .watch(&pb::WatchInstancesRequest {
                id: "b".into(),
                ..request("", "")
            })
            .unwrap();
        assert_eq!(
            next(&mut one, 2).await.0,
            ["UPDATED b PROVISIONING", "SYNCED"]
        );
    }

    #[tokio::test]
    async fn a_stream_resumes_after_its_token_and_restarts_when_it_cannot() {
        use pb::InstanceState::{Deleting, Provisioning, Running};
        let hub = WatchHub::new(3);
        hub.updated(instance("a", Provisioning, "blue"));
        let mut stream = hub.watch(&request("blue", "")).unwrap();
        let (_, synced) = next(&mut stream, 2).await;
        hub.updated(instance("a", Running, "blue"));
        let (_, running) = next(&mut stream, 1).await;
        drop(stream);
        // Missed while away: DELETING. Resuming after RUNNING replays only that.
        hub.updated(instance("a", Deleting, "blue"));
        let mut resumed = hub.watch(&request("blue", &running)).unwrap();
        assert_eq!(next(&mut resumed, 1).await.0, ["UPDATED a DELETING"]);
        // From the SYNCED token: both changes since.
        let mut from_synced = hub.watch(&request("blue", &synced)).unwrap();
        assert_eq!(
            next(&mut from_synced, 2).await.0,
            ["UPDATED a RUNNING", "UPDATED a DELETING"]
        );
        // Three more changes push the SYNCED point out of the history of 3.
        for n in 0..3 {
            hub.updated(instance(&format!("x{n}"), Running, "red"));
        }
        let mut restarted = hub.watch(&request("blue", &synced)).unwrap();
        assert_eq!(
            next(&mut restarted, 3).await.0,
            ["RESTARTED", "UPDATED a DELETING", "SYNCED"]
        );
        // Another hub (a restarted provider) cannot resume this one's tokens.
        let other = WatchHub::default();
        let mut elsewhere = other.watch(&request("blue", &running)).unwrap();
        assert_eq!(next(&mut elsewhere, 2).await.0, ["RESTARTED", "SYNCED"]);
    }

    #[tokio::test]
    async fn tokens_it_did_not_issue_are_refused_naming_the_field() {
        let hub = WatchHub::default();
        let page_token = paging::encode_token("ref-1");
        for token in ["made-up", page_token.as_str(), &"x".repeat(2000)] {
            let error = hub.watch(&request("", token)).err().unwrap();
            assert_eq!(error.class, ErrorClass::InvalidArgument, "{token}");
            assert_eq!(error.field_violations[0].field, "resume_token");
        }
    }

    #[tokio::test]
    async fn a_reader_that_falls_behind_restarts_with_a_snapshot() {
        use pb::InstanceState::Running;
        let hub = WatchHub::default();
        let mut stream = hub.watch(&request("", "")).unwrap();
        assert_eq!(next(&mut stream, 1).await.0, ["SYNCED"]);
        for n in 0..(LIVE_BUFFER + 200) {
            hub.updated(instance(&format!("i{n:05}"), Running, "blue"));
        }
        // The stream's task forwards 64 at a time; the rest overflowed the live channel.
        let mut seen = Vec::new();
        loop {
            let (events, _) = next(&mut stream, 1).await;
            seen.extend(events);
            if seen.last().is_some_and(|e| e == "SYNCED") {
                break;
            }
        }
        assert!(seen.contains(&"RESTARTED".to_owned()), "{seen:?}");
        let snapshot = seen.iter().skip_while(|e| *e != "RESTARTED").count();
        assert_eq!(
            snapshot,
            LIVE_BUFFER + 200 + 2,
            "RESTARTED, every instance, SYNCED"
        );
    }
}
