//! UpdateInstanceTags (since 1.5.0, behind CAPABILITY_UPDATE_TAGS): compare-and-set of
//! an instance's tags, the step by which a caller hands an instance to another owner
//! (a booted spare to the Proxy that adopts it). Two callers must never both win, and
//! a caller that retries must not lose to itself.
//!
//! Each check makes its own instance, tagged with the run's tag and an owner tag
//! ([`OWNER_TAG`]) that the update replaces; the run's tag stays, so the run's cleanup
//! finds the instance whatever its owner. Without the capability the checks are
//! skipped; `capabilities-match-behaviour` checks that such a provider answers the call
//! UNIMPLEMENTED.

use std::collections::HashMap;

use futures::future::join_all;
use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::ErrorClass;
use crate::conformance::{Outcome, TAG, describe};
use crate::error::reason;
use crate::pb::{self, WatchEventType};
use crate::validation::{MAX_TAG_BYTES, MAX_TAGS, map_entry_path};

/// The tag whose value says which (pretend) owner an instance of these checks has.
const OWNER_TAG: &str = "egressproxy.dev/conformance-owner";
/// How many updates `update-tags-concurrent` sends at once.
const CONCURRENT_UPDATES: usize = 8;

fn reason_of(status: &tonic::Status) -> Option<String> {
    status
        .get_error_details()
        .error_info()
        .map(|info| info.reason.clone())
}

/// Whether `status` is FAILED_PRECONDITION with `expected` as its reason.
fn is_precondition(status: &tonic::Status, expected: &str) -> bool {
    status.code() == Code::FailedPrecondition && reason_of(status).as_deref() == Some(expected)
}

fn describe_tags(tags: &HashMap<String, String>) -> String {
    let mut entries: Vec<String> = tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
    entries.sort();
    format!("{{{}}}", entries.join(", "))
}

impl Suite<'_> {
    /// A skip when the provider does not declare CAPABILITY_UPDATE_TAGS.
    async fn require_update_tags(&mut self) -> Checked {
        if self
            .capabilities()
            .await?
            .contains(&pb::Capability::UpdateTags)
        {
            Ok(())
        } else {
            Err(Outcome::Skip(
                "the provider does not declare CAPABILITY_UPDATE_TAGS".into(),
            ))
        }
    }

    /// The tags of an instance of this run owned by `owner`.
    fn owned_by(&self, owner: &str) -> HashMap<String, String> {
        HashMap::from([
            (TAG.to_owned(), self.run_id().to_owned()),
            (OWNER_TAG.to_owned(), owner.to_owned()),
        ])
    }

    /// A Create request for an instance owned by `owner`.
    fn owned_request(&self, suffix: &str, owner: &str) -> pb::CreateInstanceRequest {
        let mut request = self.request(suffix);
        request.tags = self.owned_by(owner);
        request
    }

    /// One UpdateInstanceTags, retrying what callers retry (a retry of an update whose
    /// answer was lost answers OK: the call is idempotent).
    async fn update_tags_raw(
        &mut self,
        id: &str,
        expected_tags: &HashMap<String, String>,
        tags: &HashMap<String, String>,
    ) -> Result<pb::Instance, tonic::Status> {
        let request = pb::UpdateInstanceTagsRequest {
            id: id.to_owned(),
            expected_tags: expected_tags.clone(),
            tags: tags.clone(),
        };
        let answer = self
            .retrying("UpdateInstanceTags", |mut client| {
                let request = request.clone();
                async move { client.update_instance_tags(request).await }
            })
            .await?;
        super::instance_in(answer.into_inner().instance, "UpdateInstanceTags")
    }

    /// An update that must succeed and answer the instance with the new tags.
    async fn update_tags(
        &mut self,
        what: &str,
        id: &str,
        expected_tags: &HashMap<String, String>,
        tags: &HashMap<String, String>,
    ) -> Result<pb::Instance, Outcome> {
        let expected = format!(
            "{what}: UpdateInstanceTags of {id} from {} to {} succeeds",
            describe_tags(expected_tags),
            describe_tags(tags)
        );
        let instance = self
            .update_tags_raw(id, expected_tags, tags)
            .await
            .map_err(|status| Outcome::fail(&expected, describe::status(&status)))?;
        if instance.tags != *tags || instance.id != id {
            return Err(Outcome::fail(
                format!("{expected}, answering the instance with the new tags"),
                format!(
                    "instance {} with tags {}",
                    instance.id,
                    describe_tags(&instance.tags)
                ),
            ));
        }
        Ok(instance)
    }

    /// An update that must answer FAILED_PRECONDITION, reason TAGS_CHANGED, and change
    /// nothing: the instance keeps `holds`.
    async fn update_refused_as_changed(
        &mut self,
        what: &str,
        id: &str,
        expected_tags: &HashMap<String, String>,
        holds: &HashMap<String, String>,
    ) -> Checked {
        let tags = self.owned_by("late-adopter");
        let expected = format!(
            "{what}: UpdateInstanceTags of {id} expecting {} while it holds {}: \
             FAILED_PRECONDITION, reason TAGS_CHANGED, nothing changed",
            describe_tags(expected_tags),
            describe_tags(holds)
        );
        match self.update_tags_raw(id, expected_tags, &tags).await {
            Ok(instance) => {
                return Err(Outcome::fail(
                    expected,
                    format!("success, tags now {}", describe_tags(&instance.tags)),
                ));
            }
            Err(status) if !is_precondition(&status, reason::TAGS_CHANGED) => {
                return Err(Outcome::fail(expected, describe::status(&status)));
            }
            Err(_) => {}
        }
        self.holds_tags(&expected, id, holds).await
    }

    /// GetInstance says the instance holds `tags`.
    async fn holds_tags(
        &mut self,
        expected: &str,
        id: &str,
        tags: &HashMap<String, String>,
    ) -> Checked {
        let now = self.get(id).await?;
        if now.tags != *tags {
            return Err(Outcome::fail(
                format!(
                    "{expected}; GetInstance then shows tags {}",
                    describe_tags(tags)
                ),
                format!("tags {}", describe_tags(&now.tags)),
            ));
        }
        Ok(())
    }

    /// Whether ListInstances with `selector` lists instance `id` (with `tags`, when
    /// listed).
    async fn listed_with(
        &mut self,
        selector: HashMap<String, String>,
        id: &str,
        tags: &HashMap<String, String>,
    ) -> Result<bool, Outcome> {
        let shown = describe_tags(&selector);
        let listed = self.list(selector).await?;
        match listed.iter().find(|i| i.id == id) {
            None => Ok(false),
            Some(instance) if instance.tags == *tags => Ok(true),
            Some(instance) => Err(Outcome::fail(
                format!(
                    "ListInstances ({shown}) shows instance {id} with its new tags {}",
                    describe_tags(tags)
                ),
                format!("tags {}", describe_tags(&instance.tags)),
            )),
        }
    }

    pub(super) async fn update_tags_replaces(&mut self) -> Checked {
        self.require_update_tags().await?;
        let spare = self.owned_by("spare");
        let adopter = self.owned_by("adopter");
        let request = self.owned_request("tags-replace", "spare");
        let created = self.create(request.clone()).await?;
        let id = created.id.clone();
        let watching = self
            .capabilities()
            .await?
            .contains(&pb::Capability::WatchInstances);
        let mut watch = None;
        if watching {
            let opened = self
                .open_watch(adopter.clone(), "")
                .await
                .map_err(|status| {
                    Outcome::fail("WatchInstances opens a stream", describe::status(&status))
                })?;
            watch = Some(opened);
        }

        self.update_tags("a spare handed over", &id, &spare, &adopter)
            .await?;
        let now = self.get(&id).await?;
        let same = now.key == created.key
            && now.id == created.id
            && now.create_time == created.create_time
            && now.tags == adopter;
        if !same {
            return Err(Outcome::fail(
                format!(
                    "after UpdateInstanceTags, GetInstance shows the new tags {} and the same key, id and create_time",
                    describe_tags(&adopter)
                ),
                format!(
                    "before: {}; after: {}",
                    describe::instance(&created),
                    describe::instance(&now)
                ),
            ));
        }
        let by_new = adopter.clone();
        if !self.listed_with(by_new.clone(), &id, &adopter).await? {
            return Err(Outcome::fail(
                format!(
                    "ListInstances with the new tags as selector ({}) lists the instance",
                    describe_tags(&by_new)
                ),
                format!("{id} not listed"),
            ));
        }
        let by_old = HashMap::from([(OWNER_TAG.to_owned(), "spare".to_owned())]);
        if self.listed_with(by_old.clone(), &id, &adopter).await? {
            return Err(Outcome::fail(
                format!(
                    "ListInstances by a tag only the old tags had ({}) no longer lists the instance",
                    describe_tags(&by_old)
                ),
                format!("{id} listed"),
            ));
        }
        let again = self.create_raw(request).await.map_err(|status| {
            Outcome::fail(
                "a repeated Create of the key (with the old tags) returns the instance: tags are not compared",
                describe::status(&status),
            )
        })?;
        if again.id != id || again.tags != adopter {
            return Err(Outcome::fail(
                format!(
                    "a repeated Create of the key returns instance {id} with its new tags {}",
                    describe_tags(&adopter)
                ),
                format!(
                    "instance {} with tags {}",
                    again.id,
                    describe_tags(&again.tags)
                ),
            ));
        }
        if let Some(mut watch) = watch {
            let deadline = self.watch_deadline();
            watch
                .until(
                    deadline,
                    &format!(
                        "WatchInstances with the new tags as selector sends UPDATED for {id} with tags {}",
                        describe_tags(&adopter)
                    ),
                    |_| Ok(()),
                    |event| {
                        event.r#type() == WatchEventType::Updated
                            && event
                                .instance
                                .as_ref()
                                .is_some_and(|i| i.id == id && i.tags == adopter)
                    },
                )
                .await?;
        }
        self.delete(&id).await
    }

    pub(super) async fn update_tags_compare_and_set(&mut self) -> Checked {
        self.require_update_tags().await?;
        let spare = self.owned_by("spare");
        let adopter = self.owned_by("adopter");
        let id = self
            .create(self.owned_request("tags-cas", "spare"))
            .await?
            .id;
        let stale = self.owned_by("someone-else");
        self.update_refused_as_changed("a stale expectation", &id, &stale, &spare)
            .await?;
        self.update_tags("the current tags expected", &id, &spare, &adopter)
            .await?;
        self.update_tags(
            "the same update repeated (a retry whose answer was lost)",
            &id,
            &spare,
            &adopter,
        )
        .await?;
        self.holds_tags("after a repeated update", &id, &adopter)
            .await?;
        self.update_refused_as_changed(
            "a second adopter that read the spare before the first took it",
            &id,
            &spare,
            &adopter,
        )
        .await?;
        self.delete(&id).await
    }

    pub(super) async fn update_tags_concurrent(&mut self) -> Checked {
        self.require_update_tags().await?;
        let spare = self.owned_by("spare");
        let id = self
            .create(self.owned_request("tags-race", "spare"))
            .await?
            .id;
        let wanted: Vec<HashMap<String, String>> = (0..CONCURRENT_UPDATES)
            .map(|n| self.owned_by(&format!("adopter-{n}")))
            .collect();
        let calls = wanted.iter().map(|tags| {
            let mut client = self.client.clone();
            let request = pb::UpdateInstanceTagsRequest {
                id: id.clone(),
                expected_tags: spare.clone(),
                tags: tags.clone(),
            };
            async move {
                client
                    .update_instance_tags(request)
                    .await
                    .map(|answer| answer.into_inner().instance)
            }
        });
        let first_answers = join_all(calls).await;
        let expected = format!(
            "{CONCURRENT_UPDATES} concurrent UpdateInstanceTags from the same tags to different ones: \
             exactly one succeeds, the others answer FAILED_PRECONDITION, reason TAGS_CHANGED"
        );
        let mut winners = Vec::new();
        for (tags, answer) in wanted.iter().zip(first_answers) {
            // A retried update ends as the first would have: the one that won answers
            // OK again, the others TAGS_CHANGED.
            let answer = match answer {
                Err(status) if ErrorClass::from_code(status.code()).is_retryable() => {
                    self.observe("UpdateInstanceTags", &status);
                    self.update_tags_raw(&id, &spare, tags).await.map(Some)
                }
                other => other,
            };
            match answer {
                Ok(_) => winners.push(tags.clone()),
                Err(status) if is_precondition(&status, reason::TAGS_CHANGED) => {
                    self.observe("UpdateInstanceTags", &status);
                }
                Err(status) => {
                    self.observe("UpdateInstanceTags", &status);
                    return Err(Outcome::fail(expected, describe::status(&status)));
                }
            }
        }
        let [winner] = winners.as_slice() else {
            return Err(Outcome::fail(
                expected,
                format!(
                    "{} succeeded: {}",
                    winners.len(),
                    winners
                        .iter()
                        .map(describe_tags)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        let winner = winner.clone();
        self.holds_tags("the winner's tags stay", &id, &winner)
            .await?;
        self.delete(&id).await
    }

    pub(super) async fn update_tags_errors(&mut self) -> Checked {
        self.require_update_tags().await?;
        let spare = self.owned_by("spare");
        let adopter = self.owned_by("adopter");
        let unknown = format!("cf-{}-no-such-instance", self.run_id());
        let result = self.update_tags_raw(&unknown, &spare, &adopter).await;
        expect_code(
            result,
            Code::NotFound,
            &format!("UpdateInstanceTags of id {unknown}, which names no instance"),
        )?;
        let result = self.update_tags_raw("", &spare, &adopter).await;
        let status = expect_code(
            result,
            Code::InvalidArgument,
            "UpdateInstanceTags with no id",
        )?;
        names_field(&status, "id", "UpdateInstanceTags with no id")?;

        let id = self
            .create(self.owned_request("tags-errors", "spare"))
            .await?
            .id;
        for bad in tag_limit_cases(&spare, &adopter) {
            let result = self
                .update_tags_raw(&id, &bad.expected_tags, &bad.tags)
                .await;
            let status = expect_code(result, Code::InvalidArgument, &bad.what)?;
            names_field(&status, &bad.field, &bad.what)?;
            self.holds_tags(&format!("{} changes nothing", bad.what), &id, &spare)
                .await?;
        }

        self.delete(&id).await?;
        let expected = "UpdateInstanceTags of an instance after DeleteInstance answered: \
                        FAILED_PRECONDITION, reason INSTANCE_DELETING (or NOT_FOUND once it is gone)";
        match self.update_tags_raw(&id, &spare, &adopter).await {
            Ok(instance) => Err(Outcome::fail(
                expected,
                format!("success ({})", describe::instance(&instance)),
            )),
            Err(status)
                if status.code() == Code::NotFound
                    || is_precondition(&status, reason::INSTANCE_DELETING) =>
            {
                Ok(())
            }
            Err(status) => Err(Outcome::fail(expected, describe::status(&status))),
        }
    }
}

/// An update that breaks the limits of tags, and the field it must be refused naming.
struct BadUpdate {
    what: String,
    expected_tags: HashMap<String, String>,
    tags: HashMap<String, String>,
    field: String,
}

/// Updates of an instance tagged `spare` to `adopter` that break the limits of tags.
/// The expectation is checked against the limits too, before it is compared: a tag no
/// instance can have is the caller's mistake, not a lost race.
fn tag_limit_cases(
    spare: &HashMap<String, String>,
    adopter: &HashMap<String, String>,
) -> Vec<BadUpdate> {
    let with = |tags: &HashMap<String, String>, key: &str, value: String| {
        let mut tags = tags.clone();
        tags.insert(key.to_owned(), value);
        tags
    };
    let too_many = |tags: &HashMap<String, String>| {
        let mut tags = tags.clone();
        for n in 0..=MAX_TAGS - tags.len() {
            tags.insert(format!("egressproxy.dev/limit-{n}"), "x".into());
        }
        tags
    };
    let bad = |what: String, expected_tags, tags, field: String| BadUpdate {
        what: format!("UpdateInstanceTags {what}"),
        expected_tags,
        tags,
        field,
    };
    let value_key = "egressproxy.dev/conformance-limit";
    let long_value = || "v".repeat(MAX_TAG_BYTES + 1);
    vec![
        bad(
            "with an empty tag key".into(),
            spare.clone(),
            with(adopter, "", "v".into()),
            map_entry_path("tags", ""),
        ),
        bad(
            "expecting a tag with an empty key".into(),
            with(spare, "", "v".into()),
            adopter.clone(),
            map_entry_path("expected_tags", ""),
        ),
        bad(
            format!("to {} tags", MAX_TAGS + 1),
            spare.clone(),
            too_many(adopter),
            "tags".into(),
        ),
        bad(
            format!("to a tag key of {} bytes", MAX_TAG_BYTES + 1),
            spare.clone(),
            with(adopter, &"k".repeat(MAX_TAG_BYTES + 1), "v".into()),
            // The key is over its limit, so the path may hold it cut (see names_field).
            "tags[\"kk".into(),
        ),
        bad(
            format!("to a tag value of {} bytes", MAX_TAG_BYTES + 1),
            spare.clone(),
            with(adopter, value_key, long_value()),
            map_entry_path("tags", value_key),
        ),
        bad(
            format!("expecting {} tags", MAX_TAGS + 1),
            too_many(spare),
            adopter.clone(),
            "expected_tags".into(),
        ),
        bad(
            format!("expecting a tag value of {} bytes", MAX_TAG_BYTES + 1),
            with(spare, value_key, long_value()),
            adopter.clone(),
            map_entry_path("expected_tags", value_key),
        ),
    ]
}

/// The INVALID_ARGUMENT `status` carries a field violation naming `field`: exactly, or,
/// for the start of a map entry's path (`tags["kk`), a whole entry path that begins so
/// (a key over its limit is named cut, marked with its length).
fn names_field(status: &tonic::Status, field: &str, what: &str) -> Checked {
    let entry_start = field.contains("[\"") && !field.ends_with("\"]");
    let named = status.get_error_details().bad_request().is_some_and(|bad| {
        bad.field_violations.iter().any(|v| {
            v.field == field
                || (entry_start && v.field.starts_with(field) && v.field.ends_with("\"]"))
        })
    });
    if named {
        Ok(())
    } else {
        Err(Outcome::fail(
            format!("{what}: BadRequest with a field violation on {field}"),
            describe::status(status),
        ))
    }
}
