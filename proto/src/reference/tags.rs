//! The reference provider's UpdateInstanceTags (since 1.5.0): compare-and-set of an
//! instance's tags, the step by which a caller hands an instance to another owner.
//!
//! How a call goes:
//! 1. The request is validated ([`validation::check_update_tags_request`]): `id`
//!    required, `expected_tags` and `tags` within the limits of tags.
//! 2. Under the one lock Create and Delete take: an id that names no instance is
//!    NOT_FOUND, a DELETING instance FAILED_PRECONDITION (`INSTANCE_DELETING`).
//! 3. [`decide`] compares, still under the lock: tags already `tags` answer OK and
//!    change nothing (a retry whose answer was lost); tags other than `expected_tags`
//!    answer FAILED_PRECONDITION (`TAGS_CHANGED`); otherwise they become `tags`.
//!    Because the compare and the set are one step under the lock, of concurrent
//!    updates from the same tags exactly one finds them as expected.
//! 4. The new instance is told to the [`crate::watch::WatchHub`] (an UPDATED event),
//!    and ListInstances matches its selector against the new tags from then on.

use std::collections::HashMap;
use std::time::Duration;

use super::{MemoryProvider, Misbehaviour, Record, State};
use crate::error::reason;
use crate::{ProviderError, pb, validation};

/// The longest the provider that is not atomic holds a compared update for a second
/// one to arrive. A fixed pause (a second, as for racing Creates) let a loaded machine
/// deliver the concurrent updates further apart than that; waiting for the second
/// update makes the race certain whenever two overlap at all.
const TAG_RACE_WAIT: Duration = Duration::from_secs(5);

/// What an update does to an instance's tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    /// They are already the new tags: answer OK, change nothing.
    Unchanged,
    /// They are the expected tags: they become the new ones.
    Set,
    /// They are neither: answer TAGS_CHANGED.
    Changed,
}

/// The contract's decision for an instance whose tags are `current` (or the one a
/// misbehaviour makes).
pub(super) fn decide(
    current: &HashMap<String, String>,
    request: &pb::UpdateInstanceTagsRequest,
    misbehave: Option<Misbehaviour>,
) -> Decision {
    let unchanged = *current == request.tags;
    let expected = *current == request.expected_tags;
    match misbehave {
        Some(Misbehaviour::TagsUpdateIgnoresExpected) if !unchanged => Decision::Set,
        Some(Misbehaviour::TagsUpdateNotIdempotent) if expected && !unchanged => Decision::Set,
        Some(Misbehaviour::TagsUpdateNotIdempotent) if !expected => Decision::Changed,
        _ if unchanged => Decision::Unchanged,
        _ if expected => Decision::Set,
        _ => Decision::Changed,
    }
}

/// The entries of `tags` with an empty key: all a provider that checks no limit but
/// that one looks at (only to misbehave).
fn empty_keys_only(tags: &HashMap<String, String>) -> HashMap<String, String> {
    tags.iter()
        .filter(|(key, _)| key.is_empty())
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}

impl MemoryProvider {
    /// UpdateInstanceTags' work (see the module docs). The provider that is not atomic
    /// compares, lets go of the lock until a second update has compared too (or
    /// [`TAG_RACE_WAIT`] passed), then sets without comparing again: both win.
    pub(super) async fn update_tags(
        &self,
        request: pb::UpdateInstanceTagsRequest,
    ) -> Result<pb::Instance, ProviderError> {
        let checked = match self.config.misbehave {
            Some(Misbehaviour::ExpectedTagsUnchecked) => pb::UpdateInstanceTagsRequest {
                expected_tags: HashMap::new(),
                ..request.clone()
            },
            Some(Misbehaviour::TagsUpdateUnbounded) => pb::UpdateInstanceTagsRequest {
                expected_tags: empty_keys_only(&request.expected_tags),
                tags: empty_keys_only(&request.tags),
                ..request.clone()
            },
            _ => request.clone(),
        };
        validation::check_update_tags_request(&checked)?;
        if !self.breaks(Misbehaviour::TagsUpdateNotAtomic) {
            return self.compare_and_set_tags(&request, true);
        }
        self.compare_and_set_tags(&request, false)?;
        self.hold_race_window().await;
        self.set_tags_unchecked(&request)
    }

    /// Steps 2 to 4 under one lock; with `set` false, only the compare (to misbehave).
    fn compare_and_set_tags(
        &self,
        request: &pb::UpdateInstanceTagsRequest,
        set: bool,
    ) -> Result<pb::Instance, ProviderError> {
        let mut state = self.lock();
        let record = self.updatable(&mut state, &request.id)?;
        match decide(&record.instance.tags, request, self.config.misbehave) {
            Decision::Unchanged => Ok(self.snapshot(record)),
            Decision::Changed => Err(ProviderError::permanent(format!(
                "instance {}'s tags are no longer the expected ones (another caller changed \
                 them): read the instance again and decide anew",
                request.id
            ))
            .with_reason(reason::TAGS_CHANGED)),
            Decision::Set if !set => Ok(self.snapshot(record)),
            Decision::Set => Ok(self.replace_tags(record, request)),
        }
    }

    /// Holds a compared update (only to misbehave): the first waits for a second to
    /// compare too, and the second wakes it.
    async fn hold_race_window(&self) {
        let alone = {
            let mut state = self.lock();
            state.tag_updates_racing += 1;
            state.tag_updates_racing == 1
        };
        if alone {
            let _ = tokio::time::timeout(TAG_RACE_WAIT, self.tag_race.notified()).await;
        } else {
            self.tag_race.notify_one();
        }
        self.lock().tag_updates_racing -= 1;
    }

    /// The set without a compare (only to misbehave): the last writer wins.
    fn set_tags_unchecked(
        &self,
        request: &pb::UpdateInstanceTagsRequest,
    ) -> Result<pb::Instance, ProviderError> {
        let mut state = self.lock();
        let record = self.updatable(&mut state, &request.id)?;
        Ok(self.replace_tags(record, request))
    }

    /// The instance `id`, if it exists and is not DELETING (step 2).
    fn updatable<'s>(
        &self,
        state: &'s mut State,
        id: &str,
    ) -> Result<&'s mut Record, ProviderError> {
        self.purge(state);
        let record = state
            .instances
            .get_mut(id)
            .ok_or_else(|| ProviderError::not_found(format!("instance {id} does not exist")))?;
        if record.deleted.is_some() && !self.breaks(Misbehaviour::TagsUpdateWhileDeleting) {
            return Err(ProviderError::permanent(format!(
                "instance {id} is being deleted: its tags can no longer change"
            ))
            .with_reason(reason::INSTANCE_DELETING));
        }
        Ok(record)
    }

    /// Step 4: the record takes the new tags, and the hub is told.
    fn replace_tags(
        &self,
        record: &mut Record,
        request: &pb::UpdateInstanceTagsRequest,
    ) -> pb::Instance {
        let old = std::mem::replace(&mut record.instance.tags, request.tags.clone());
        if self.breaks(Misbehaviour::TagsUpdateListStale) && record.listed_tags.is_none() {
            record.listed_tags = Some(old);
        }
        tracing::info!(instance.id = %request.id, "replaced instance tags");
        let now = self.snapshot(record);
        self.hub.updated(now.clone());
        now
    }

    /// The tags ListInstances matches and shows: the instance's, or (to misbehave) the
    /// ones it had before its first update.
    pub(super) fn listed_tags<'r>(&self, record: &'r Record) -> &'r HashMap<String, String> {
        match &record.listed_tags {
            Some(old) if self.breaks(Misbehaviour::TagsUpdateListStale) => old,
            _ => &record.instance.tags,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(entries: &[(&str, &str)]) -> HashMap<String, String> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The contract's table: current tags against expected and new ones.
    #[test]
    fn decisions_follow_the_contract() {
        let spare = tags(&[("pool", "spares")]);
        let adopted = tags(&[("proxy", "a")]);
        let other = tags(&[("proxy", "b")]);
        let request = pb::UpdateInstanceTagsRequest {
            id: "ref-1".into(),
            expected_tags: spare.clone(),
            tags: adopted.clone(),
        };
        let table = [
            (&spare, Decision::Set),
            (&adopted, Decision::Unchanged),
            (&other, Decision::Changed),
        ];
        for (current, decision) in table {
            assert_eq!(decide(current, &request, None), decision, "{current:?}");
        }
        let no_op = pb::UpdateInstanceTagsRequest {
            tags: spare.clone(),
            ..request.clone()
        };
        assert_eq!(decide(&spare, &no_op, None), Decision::Unchanged);
    }

    #[test]
    fn misbehaviours_break_the_table_as_named() {
        let spare = tags(&[("pool", "spares")]);
        let adopted = tags(&[("proxy", "a")]);
        let other = tags(&[("proxy", "b")]);
        let request = pb::UpdateInstanceTagsRequest {
            id: "ref-1".into(),
            expected_tags: spare,
            tags: adopted.clone(),
        };
        let ignores = Some(Misbehaviour::TagsUpdateIgnoresExpected);
        assert_eq!(decide(&other, &request, ignores), Decision::Set);
        let not_idempotent = Some(Misbehaviour::TagsUpdateNotIdempotent);
        assert_eq!(
            decide(&adopted, &request, not_idempotent),
            Decision::Changed
        );
    }
}
