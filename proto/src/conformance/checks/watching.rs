//! WatchInstances (since 1.3.0, behind CAPABILITY_WATCH_INSTANCES): a new stream's
//! snapshot (every matching instance, none other, then SYNCED), a stream of one
//! instance by its id (that one alone; an id that names none gets an empty snapshot),
//! the changes of an instance from Create to RUNNING with an address to DELETED, and
//! resuming (a stream reopened with a token goes on after it, or says RESTARTED; a
//! token never issued is refused).
//!
//! Each check watches instances carrying the run's tag and a tag of its own
//! ([`WATCH_TAG`]), so it never waits on another check's instances.

use std::collections::HashMap;
use std::time::Instant;

use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe};
use crate::pb::{self, InstanceState, WatchEventType};

/// The tag each watch check puts on its own instances, valued with the check's part.
const WATCH_TAG: &str = "egressproxy.dev/conformance-watch";

/// An open stream and what it sent so far, in words, for a failure's "got".
pub(super) struct Watch {
    stream: tonic::Streaming<pb::WatchInstancesResponse>,
    seen: Vec<String>,
}

impl Watch {
    /// The next event, or a failure naming `expected` when none comes by `deadline`.
    async fn next(
        &mut self,
        deadline: Instant,
        expected: &str,
    ) -> Result<pb::WatchInstancesResponse, Outcome> {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = match tokio::time::timeout(left, self.stream.message()).await {
            Err(_) => None,
            Ok(Ok(Some(event))) => Some(event),
            Ok(Ok(None)) => {
                self.seen.push("(the stream ended)".into());
                None
            }
            Ok(Err(status)) => {
                self.seen.push(describe::status(&status));
                None
            }
        };
        let Some(event) = event else {
            return Err(Outcome::fail(expected.to_owned(), self.got()));
        };
        self.seen.push(describe_event(&event));
        Ok(event)
    }

    /// Events until one satisfies `done`, each checked by `allowed` on the way.
    pub(super) async fn until(
        &mut self,
        deadline: Instant,
        expected: &str,
        mut allowed: impl FnMut(&pb::WatchInstancesResponse) -> Result<(), String>,
        mut done: impl FnMut(&pb::WatchInstancesResponse) -> bool,
    ) -> Result<pb::WatchInstancesResponse, Outcome> {
        loop {
            let event = self.next(deadline, expected).await?;
            if let Err(problem) = allowed(&event) {
                return Err(Outcome::fail(
                    expected.to_owned(),
                    format!("{problem}, after: {}", self.got()),
                ));
            }
            if done(&event) {
                return Ok(event);
            }
        }
    }

    fn got(&self) -> String {
        if self.seen.is_empty() {
            return "no event".into();
        }
        let last: Vec<&str> = self
            .seen
            .iter()
            .rev()
            .take(12)
            .rev()
            .map(String::as_str)
            .collect();
        format!("events: {}", last.join(", "))
    }
}

fn describe_event(event: &pb::WatchInstancesResponse) -> String {
    let kind = event
        .r#type()
        .as_str_name()
        .trim_start_matches("WATCH_EVENT_TYPE_")
        .to_owned();
    match &event.instance {
        Some(instance) => format!(
            "{kind} {} {}{}",
            instance.id,
            instance
                .state()
                .as_str_name()
                .trim_start_matches("INSTANCE_STATE_"),
            if instance.addresses.is_empty() {
                ""
            } else {
                " (with an address)"
            }
        ),
        None => kind,
    }
}

fn is(event: &pb::WatchInstancesResponse, type_: WatchEventType, id: &str) -> bool {
    event.r#type() == type_ && event.instance.as_ref().is_some_and(|i| i.id == id)
}

impl Suite<'_> {
    async fn require_watch(&mut self) -> Checked {
        if self
            .capabilities()
            .await?
            .contains(&pb::Capability::WatchInstances)
        {
            Ok(())
        } else {
            Err(Outcome::Skip(
                "the provider does not declare CAPABILITY_WATCH_INSTANCES".into(),
            ))
        }
    }

    /// The selector of this check's instances: the run's tag and `part`.
    fn watch_selector(&self, part: &str) -> HashMap<String, String> {
        HashMap::from([
            (TAG.to_owned(), self.run_id().to_owned()),
            (WATCH_TAG.to_owned(), part.to_owned()),
        ])
    }

    /// A Create request carrying the watch tag `part`.
    fn watched(&self, suffix: &str, part: &str) -> pb::CreateInstanceRequest {
        let mut request = self.request(suffix);
        request.tags.insert(WATCH_TAG.to_owned(), part.to_owned());
        request
    }

    /// Opens a stream of every instance `tag_selector` matches, retrying what callers
    /// retry.
    pub(super) async fn open_watch(
        &mut self,
        tag_selector: HashMap<String, String>,
        resume_token: &str,
    ) -> Result<Watch, tonic::Status> {
        self.open_watch_request(pb::WatchInstancesRequest {
            tag_selector,
            id: String::new(),
            resume_token: resume_token.to_owned(),
        })
        .await
    }

    /// Opens a stream of `request`, retrying what callers retry.
    async fn open_watch_request(
        &mut self,
        request: pb::WatchInstancesRequest,
    ) -> Result<Watch, tonic::Status> {
        let stream = self
            .retrying("WatchInstances", |mut client| {
                let request = request.clone();
                async move { client.watch_instances(request).await }
            })
            .await?
            .into_inner();
        Ok(Watch {
            stream,
            seen: Vec::new(),
        })
    }

    async fn watch(&mut self, part: &str) -> Result<Watch, Outcome> {
        let selector = self.watch_selector(part);
        self.open_watch(selector, "").await.map_err(|status| {
            Outcome::fail("WatchInstances opens a stream", describe::status(&status))
        })
    }

    pub(super) fn watch_deadline(&self) -> Instant {
        Instant::now() + self.target.running_timeout
    }

    pub(super) async fn watch_snapshot(&mut self) -> Checked {
        self.require_watch().await?;
        let mine = self.create(self.watched("watch-snap", "snapshot")).await?;
        let other = self
            .create(self.watched("watch-other", "not-watched"))
            .await?;
        let mut watch = self.watch("snapshot").await?;
        self.read_snapshot(
            &mut watch,
            &mine.id,
            (&other.id, "its tags do not match"),
            &format!(
                "a new stream sends UPDATED for {} (it matches the selector), nothing about \
                 instances that do not match, then SYNCED",
                mine.id
            ),
        )
        .await
    }

    /// Reads a new stream's snapshot: UPDATED for `mine` and nothing about `excluded.0`
    /// (whose sending would be wrong because `excluded.1`), then SYNCED; `expected`
    /// says so in the check's words.
    async fn read_snapshot(
        &self,
        watch: &mut Watch,
        mine: &str,
        excluded: (&str, &str),
        expected: &str,
    ) -> Checked {
        let (other, why_not) = excluded;
        let mut listed = false;
        watch
            .until(
                self.watch_deadline(),
                expected,
                |event| {
                    if event.instance.as_ref().is_some_and(|i| i.id == other) {
                        return Err(format!("{other} was sent ({why_not})"));
                    }
                    if is(event, WatchEventType::Updated, mine) {
                        listed = true;
                    }
                    if event.r#type() == WatchEventType::Synced && !listed {
                        return Err(format!("SYNCED before {mine}"));
                    }
                    Ok(())
                },
                |event| event.r#type() == WatchEventType::Synced,
            )
            .await?;
        Ok(())
    }

    /// A new stream of one `id` whose selector matches another instance too: only
    /// the one instance, in its snapshot and in its changes; an id that names no
    /// instance is no error, only an empty snapshot.
    pub(super) async fn watch_by_id(&mut self) -> Checked {
        self.require_watch().await?;
        let mine = self.create(self.watched("watch-id", "by-id")).await?;
        let other = self.create(self.watched("watch-id-other", "by-id")).await?;
        let mut watch = self.watch_id("by-id", &mine.id).await?;
        let not_other = |event: &pb::WatchInstancesResponse| match &event.instance {
            Some(instance) if instance.id == other.id => Err(format!(
                "{} was sent (it matches the selector, but not the id)",
                other.id
            )),
            _ => Ok(()),
        };
        self.read_snapshot(
            &mut watch,
            &mine.id,
            (&other.id, "it matches the selector, but not the id"),
            &format!(
                "a new stream with id {} sends UPDATED for it, nothing about {} (its tags \
                 match the selector too), then SYNCED",
                mine.id, other.id
            ),
        )
        .await?;
        // Both change now; the stream tells only the one it watches.
        self.delete(&other.id).await?;
        self.delete(&mine.id).await?;
        watch
            .until(
                self.watch_deadline(),
                &format!(
                    "DELETED {} within {} of its Delete, and nothing about {} (deleted \
                     just before it)",
                    mine.id,
                    humantime::format_duration(self.target.running_timeout),
                    other.id
                ),
                not_other,
                |event| is(event, WatchEventType::Deleted, &mine.id),
            )
            .await?;
        self.ledger.forget(&mine.id);
        drop(watch);
        // A filter, not a lookup: an instance with the id may yet come.
        let unknown = format!("cf-{}-no-such-instance", self.run_id());
        let mut watch = self.watch_id("by-id", &unknown).await?;
        watch
            .until(
                self.watch_deadline(),
                &format!(
                    "a new stream with id {unknown}, which names no instance, sends SYNCED \
                     with nothing before it (an id is a filter, not a lookup)"
                ),
                |event| match event.r#type() {
                    WatchEventType::Updated | WatchEventType::Deleted => {
                        Err("an instance was sent before SYNCED".to_owned())
                    }
                    _ => Ok(()),
                },
                |event| event.r#type() == WatchEventType::Synced,
            )
            .await?;
        Ok(())
    }

    /// A new stream of the instance `id`, with the selector of this check's `part`.
    async fn watch_id(&mut self, part: &str, id: &str) -> Result<Watch, Outcome> {
        let request = pb::WatchInstancesRequest {
            tag_selector: self.watch_selector(part),
            id: id.to_owned(),
            resume_token: String::new(),
        };
        self.open_watch_request(request).await.map_err(|status| {
            Outcome::fail(
                format!(
                    "WatchInstances with id {id} opens a stream (also when the id names no \
                     instance)"
                ),
                describe::status(&status),
            )
        })
    }

    pub(super) async fn watch_follows_changes(&mut self) -> Checked {
        self.require_watch().await?;
        let mut watch = self.watch("follow").await?;
        let deadline = self.watch_deadline();
        watch
            .until(
                deadline,
                "SYNCED first",
                |_| Ok(()),
                |e| e.r#type() == WatchEventType::Synced,
            )
            .await?;
        let id = self
            .create(self.watched("watch-follow", "follow"))
            .await?
            .id;
        let running = watch
            .until(
                self.watch_deadline(),
                &format!(
                    "UPDATED {id} as it provisions, then RUNNING with an address within {}",
                    humantime::format_duration(self.target.running_timeout)
                ),
                |event| {
                    let state = event.instance.as_ref().map(pb::Instance::state);
                    match state {
                        Some(InstanceState::Stopped | InstanceState::Deleting) => {
                            Err(format!("{id} reported {state:?} before anyone deleted it"))
                        }
                        Some(InstanceState::Running)
                            if event
                                .instance
                                .as_ref()
                                .is_some_and(|i| i.addresses.is_empty()) =>
                        {
                            Err(format!("{id} RUNNING without an address"))
                        }
                        _ => Ok(()),
                    }
                },
                |event| {
                    is(event, WatchEventType::Updated, &id)
                        && event
                            .instance
                            .as_ref()
                            .is_some_and(|i| i.state() == InstanceState::Running)
                },
            )
            .await?
            .instance
            .unwrap_or_default();
        let got = self.get(&id).await?;
        if got.addresses != running.addresses || got.state() != InstanceState::Running {
            return Err(Outcome::fail(
                "GetInstance tells what the stream told: RUNNING with the same addresses",
                describe::instance(&got),
            ));
        }
        self.delete(&id).await?;
        watch
            .until(
                self.watch_deadline(),
                &format!(
                    "DELETED {id} within {} of its Delete (UPDATED DELETING before it is fine)",
                    humantime::format_duration(self.target.running_timeout)
                ),
                |_| Ok(()),
                |event| is(event, WatchEventType::Deleted, &id),
            )
            .await?;
        self.ledger.forget(&id);
        Ok(())
    }

    pub(super) async fn watch_resume(&mut self) -> Checked {
        self.require_watch().await?;
        let mut watch = self.watch("resume").await?;
        watch
            .until(
                self.watch_deadline(),
                "SYNCED first",
                |_| Ok(()),
                |e| e.r#type() == WatchEventType::Synced,
            )
            .await?;
        let first = self
            .create(self.watched("watch-resume-1", "resume"))
            .await?
            .id;
        let token = watch
            .until(
                self.watch_deadline(),
                &format!("UPDATED {first}"),
                |_| Ok(()),
                |e| is(e, WatchEventType::Updated, &first),
            )
            .await?
            .resume_token;
        drop(watch);
        // Made while nobody watched: the resumed stream must tell it as a change.
        let missed = self
            .create(self.watched("watch-resume-2", "resume"))
            .await?
            .id;
        let selector = self.watch_selector("resume");
        let mut resumed = self
            .open_watch(selector.clone(), &token)
            .await
            .map_err(|status| {
                Outcome::fail(
                    "WatchInstances reopened with a resume token it issued opens a stream",
                    describe::status(&status),
                )
            })?;
        let mut restarted = false;
        let mut allowed = |event: &pb::WatchInstancesResponse| {
            match event.r#type() {
            WatchEventType::Restarted => {
                restarted = true;
                Ok(())
            }
            WatchEventType::Synced if !restarted => Err(
                "SYNCED without RESTARTED: the stream started over instead of going on after the token"
                    .to_owned(),
            ),
            _ => Ok(()),
        }
        };
        resumed
            .until(
                self.watch_deadline(),
                &format!(
                    "the resumed stream goes on after the token: UPDATED {missed} (made while \
                     nobody watched), or RESTARTED and a snapshot"
                ),
                &mut allowed,
                |e| is(e, WatchEventType::Updated, &missed),
            )
            .await?;
        // A change after the reopen: a stream that started over has sent SYNCED by now.
        let later = self
            .create(self.watched("watch-resume-3", "resume"))
            .await?
            .id;
        resumed
            .until(
                self.watch_deadline(),
                &format!("UPDATED {later}, with no SYNCED before it unless RESTARTED came first"),
                &mut allowed,
                |e| is(e, WatchEventType::Updated, &later),
            )
            .await?;
        drop(resumed);
        for (what, bad) in [
            ("a made-up resume token", "not-a-resume-token".to_owned()),
            (
                "an issued resume token with a character added",
                format!("{token}0"),
            ),
        ] {
            let result = self.open_watch(selector.clone(), &bad).await;
            let status = expect_code(
                result.map(|_| ()),
                Code::InvalidArgument,
                &format!("WatchInstances with {what}"),
            )?;
            let named = status
                .get_error_details()
                .bad_request()
                .is_some_and(|b| b.field_violations.iter().any(|v| v.field == "resume_token"));
            if !named {
                return Err(Outcome::fail(
                    format!("WatchInstances with {what}: BadRequest naming resume_token"),
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }
}
