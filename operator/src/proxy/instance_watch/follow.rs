//! Following one provider's WatchInstances stream for as long as the operator runs.
//!
//! 1. **Capability.** The provider's handshake must declare
//!    `CAPABILITY_WATCH_INSTANCES`; a provider that does not (or answers UNIMPLEMENTED)
//!    is asked again every [`RECHECK`], and its Proxies are polled meanwhile.
//! 2. **One stream**, selecting this cluster's instances by the cluster tag, with a
//!    deadline of [`WATCH_FOR`] (the contract asks for one as long as the caller means
//!    to watch); a stream that ends is reopened with the last event's resume token, so
//!    it goes on after that event.
//! 3. **Breaks.** A stream that fails, or ends before it lived `HEALTHY_STREAM`, is
//!    reopened after a growing delay (up to `MAX_REOPEN_DELAY`); the watch counts as
//!    down until a stream is open again. A resume token the provider refuses starts a
//!    new stream.
//! 4. **Snapshots.** A new stream, and one that says RESTARTED, first sends every
//!    instance, then SYNCED: an instance this follower knew that the snapshot left out
//!    is gone (it went while no stream could say so).
//!
//! 5. **The operator's own deletes** (a replaced VM going) are not passed on: see
//!    [`crate::providers::Provider::deleted_here`].
//!
//! What it learns goes out as [`Seen`] changes; the token and the instances it knows
//! live in a [`Followed`] that outlives one follower (a reloaded provider config starts
//! a new follower that resumes where the last one stopped).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egressproxy_provider::pb::{self, WatchEventType};
use egressproxy_provider::{ErrorClass, ProviderError};
use tokio::sync::mpsc;

use crate::context::Context;
use crate::proxy::reconcile::tags;
use crate::shared::error::Error;
use crate::shared::tables::shrink_when_sparse;

/// Deadline of one stream; when it passes the stream is reopened with its token.
pub const WATCH_FOR: Duration = Duration::from_secs(30 * 60);
/// How often a provider without the capability is asked again.
pub const RECHECK: Duration = Duration::from_secs(60);
/// A stream that lived this long ended normally (a deadline, a provider's restart of
/// its streams): reopen at once.
const HEALTHY_STREAM: Duration = Duration::from_secs(10);
/// First delay before reopening a broken stream.
const FIRST_REOPEN_DELAY: Duration = Duration::from_millis(200);
/// Longest delay before reopening a broken stream.
const MAX_REOPEN_DELAY: Duration = Duration::from_secs(30);

/// A change one follower saw, for the Proxies to learn.
#[derive(Debug, Clone)]
pub enum Seen {
    /// The instance as it is now.
    Updated(pb::Instance),
    /// The instance is gone; its last known state.
    Gone(pb::Instance),
}

impl Seen {
    /// The instance's id.
    pub fn id(&self) -> &str {
        match self {
            Seen::Updated(instance) | Seen::Gone(instance) => &instance.id,
        }
    }
}

/// What a provider's followers keep between streams.
#[derive(Debug, Default)]
pub struct Followed {
    /// The last event's resume token (empty: none yet).
    token: String,
    /// Every instance the streams reported and did not report gone, by id: its id and
    /// the tags that name its Proxy.
    known: HashMap<String, pb::Instance>,
}

/// Why a stream stopped.
enum Ended {
    /// It ended or failed after `lived`.
    After {
        lived: Duration,
        error: Option<Error>,
    },
    /// The provider does not offer WatchInstances.
    NotOffered,
}

/// Follows provider `name`'s instances for ever, sending what it sees to `changes`.
pub async fn follow(
    ctx: Arc<Context>,
    name: String,
    followed: Arc<Mutex<Followed>>,
    changes: mpsc::Sender<Seen>,
) {
    let mut delay = FIRST_REOPEN_DELAY;
    loop {
        match one_stream(&ctx, &name, &followed, &changes).await {
            Ended::NotOffered => {
                ctx.metrics.forget_provider_watch(&name);
                tokio::time::sleep(RECHECK).await;
                continue;
            }
            Ended::After { lived, error } => {
                ctx.metrics.set_provider_watch_up(&name, false);
                match error {
                    // The stream's own deadline passed: reopened at once, nothing broke.
                    Some(error) if lived >= HEALTHY_STREAM && ran_out(&error) => {
                        tracing::debug!(provider = %name, "watch stream reached its deadline: reopening");
                    }
                    Some(error) => {
                        tracing::warn!(provider = %name, error = %error.describe(), retry_in = ?delay,
                            "watch of instances broken: Proxies are polled until it is back");
                    }
                    None => {}
                }
                if lived >= HEALTHY_STREAM {
                    delay = FIRST_REOPEN_DELAY;
                    continue;
                }
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_REOPEN_DELAY);
    }
}

/// Opens one stream and follows it until it ends.
async fn one_stream(
    ctx: &Context,
    name: &str,
    followed: &Mutex<Followed>,
    changes: &mpsc::Sender<Seen>,
) -> Ended {
    let failed = |error| Ended::After {
        lived: Duration::ZERO,
        error: Some(error),
    };
    let provider = match ctx.providers.get(name) {
        Ok(provider) => provider,
        Err(error) => return failed(error),
    };
    match provider.handshake().await {
        Ok(info) if info.capabilities.contains(&pb::Capability::WatchInstances) => {}
        Ok(_) => return Ended::NotOffered,
        Err(error) => return failed(error),
    }
    let token = lock(followed).token.clone();
    let request = pb::WatchInstancesRequest {
        tag_selector: [(tags::CLUSTER.to_owned(), ctx.cluster_name.clone())].into(),
        id: String::new(),
        resume_token: token.clone(),
    };
    let mut stream = match provider.watch(request, WATCH_FOR).await {
        Ok(stream) => stream,
        Err(error) => {
            return match provider_error(&error).map(|e| e.class) {
                Some(ErrorClass::Unimplemented) => Ended::NotOffered,
                Some(ErrorClass::InvalidArgument) if refuses_token(&error) => {
                    tracing::info!(provider = %name,
                        "the provider no longer accepts the watch's resume token: starting a new stream");
                    lock(followed).token.clear();
                    failed(error)
                }
                _ => failed(error),
            };
        }
    };
    ctx.metrics.set_provider_watch_up(name, true);
    tracing::info!(provider = %name, resumed = !token.is_empty(), "watching instances");
    let opened = Instant::now();
    // The ids a snapshot sent so far, while one is being sent.
    let mut snapshot: Option<HashSet<String>> = token.is_empty().then(HashSet::new);
    let error = loop {
        let event = match stream.message().await {
            Ok(Some(event)) => event,
            Ok(None) => break None,
            Err(status) => {
                break Some(Error::Provider {
                    provider: name.to_owned(),
                    op: "WatchInstances",
                    source: Box::new(ProviderError::from(status)),
                });
            }
        };
        let type_ = event.r#type();
        ctx.metrics.provider_watch_event(name, type_);
        let seen = {
            let mut state = lock(followed);
            let seen = take_in(&mut state, &mut snapshot, type_, event.instance);
            if !event.resume_token.is_empty() {
                state.token = event.resume_token;
            }
            seen
        };
        for change in seen {
            // What a Delete of this operator caused (a replacement's old VM going) is
            // not news: a reconcile it started could read the Proxy's status from
            // before that replacement was recorded, and replace again.
            if provider.deleted_here(change.id()) {
                continue;
            }
            // Nobody listens once the controller stopped; its end stops this too.
            let _ = changes.send(change).await;
        }
    };
    Ended::After {
        lived: opened.elapsed(),
        error,
    }
}

/// Records one event in `state`; the changes it means for the Proxies.
fn take_in(
    state: &mut Followed,
    snapshot: &mut Option<HashSet<String>>,
    type_: WatchEventType,
    instance: Option<pb::Instance>,
) -> Vec<Seen> {
    match (type_, instance) {
        (WatchEventType::Updated, Some(instance)) if !instance.id.is_empty() => {
            if let Some(ids) = snapshot {
                ids.insert(instance.id.clone());
            }
            state.known.insert(instance.id.clone(), identity(&instance));
            vec![Seen::Updated(instance)]
        }
        (WatchEventType::Deleted, Some(instance)) if !instance.id.is_empty() => {
            state.known.remove(&instance.id);
            shrink_when_sparse(&mut state.known);
            vec![Seen::Gone(instance)]
        }
        (WatchEventType::Restarted, _) => {
            *snapshot = Some(HashSet::new());
            Vec::new()
        }
        (WatchEventType::Synced, _) => {
            let Some(sent) = snapshot.take() else {
                return Vec::new();
            };
            let missing: Vec<String> = state
                .known
                .keys()
                .filter(|id| !sent.contains(*id))
                .cloned()
                .collect();
            let gone = missing
                .into_iter()
                .filter_map(|id| state.known.remove(&id))
                .map(Seen::Gone)
                .collect();
            shrink_when_sparse(&mut state.known);
            gone
        }
        // A type this operator does not know (a newer provider's), or an event
        // without the instance it must carry: nothing to learn, the token still counts.
        _ => Vec::new(),
    }
}

/// What is kept of a known instance: its id and the tags that name its Proxy, all that
/// an instance found gone needs (memory follows the instance count, not their size).
fn identity(instance: &pb::Instance) -> pb::Instance {
    pb::Instance {
        id: instance.id.clone(),
        tags: instance
            .tags
            .iter()
            .filter(|(key, _)| [tags::NAMESPACE, tags::NAME, tags::UID].contains(&key.as_str()))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect(),
        ..pb::Instance::default()
    }
}

fn provider_error(error: &Error) -> Option<&ProviderError> {
    match error {
        Error::Provider { source, .. } => Some(source),
        _ => None,
    }
}

fn ran_out(error: &Error) -> bool {
    provider_error(error).is_some_and(|e| e.class == ErrorClass::DeadlineExceeded)
}

fn refuses_token(error: &Error) -> bool {
    provider_error(error).is_some_and(|e| {
        e.field_violations
            .iter()
            .any(|violation| violation.field == "resume_token")
    })
}

fn lock(followed: &Mutex<Followed>) -> std::sync::MutexGuard<'_, Followed> {
    followed.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(id: &str) -> Option<pb::Instance> {
        Some(pb::Instance {
            id: id.into(),
            ..pb::Instance::default()
        })
    }

    fn names(seen: &[Seen]) -> Vec<String> {
        seen.iter()
            .map(|s| match s {
                Seen::Updated(i) => format!("updated {}", i.id),
                Seen::Gone(i) => format!("gone {}", i.id),
            })
            .collect()
    }

    #[test]
    fn a_restart_snapshot_reports_what_it_left_out_as_gone() {
        use WatchEventType::{Deleted, Restarted, Synced, Unspecified, Updated};
        let mut state = Followed::default();
        let mut snapshot = Some(HashSet::new());
        let mut feed =
            |type_, instance| names(&take_in(&mut state, &mut snapshot, type_, instance));
        assert_eq!(feed(Updated, instance("a")), ["updated a"]);
        assert_eq!(feed(Updated, instance("b")), ["updated b"]);
        assert!(
            feed(Synced, None).is_empty(),
            "a first snapshot forgets nothing"
        );
        assert_eq!(feed(Updated, instance("c")), ["updated c"]);
        assert_eq!(feed(Deleted, instance("a")), ["gone a"]);
        assert!(
            feed(Unspecified, instance("x")).is_empty(),
            "unknown types are skipped"
        );
        // The provider restarted: only c is left.
        assert!(feed(Restarted, None).is_empty());
        assert_eq!(feed(Updated, instance("c")), ["updated c"]);
        assert_eq!(feed(Synced, None), ["gone b"]);
        // A SYNCED outside a snapshot changes nothing.
        assert!(feed(Synced, None).is_empty());
        assert_eq!(state.known.keys().collect::<Vec<_>>(), ["c"]);
    }
}
