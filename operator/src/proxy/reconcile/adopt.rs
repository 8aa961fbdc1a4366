//! A pool member adopting the spare its pool booted for it, instead of creating an
//! instance (contract "Ownership hand-over").
//!
//! The pool wrote the intent first: the member was created with the annotation
//! [`ADOPT_INSTANCE_ANNOTATION`] naming the spare, before any provider call. The
//! member acts on it only at its first Create step (no instance key recorded, no
//! replacement yet), so it is tried once per member:
//! 1. **Read** the spare (GetInstance) and decide ([`decide`], pure, table-tested).
//! 2. **Take** it: UpdateInstanceTags from the spare's tags, exactly as read, to the
//!    member's. OK: the member records the spare's id and key and goes on as any
//!    Proxy (health check, Ready, the pool's Service). `TAGS_CHANGED`, `NOT_FOUND` or
//!    `INSTANCE_DELETING`: read again and decide anew (a retry of an update whose
//!    answer was lost finds the member's own tags: adopted).
//! 3. **Cold**: anything else (gone, retiring, taken by another member, a provider
//!    without `CAPABILITY_UPDATE_TAGS`) creates an instance as usual, with an Event
//!    saying why.
//!
//! A crash between the steps leaves the spare either a spare (the update did not
//! happen: the member's next pass reads it again) or the member's (it did: the next
//! pass reads the member's tags), never both. A member deleted in between leaves an
//! instance tagged with its UID, which the garbage collection deletes as orphaned.

use std::collections::HashMap;

use egressproxy_provider::pb;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::next::Next;
use super::{Reconciliation, tags};
use crate::crd::{ADOPT_INSTANCE_ANNOTATION, Proxy, condition};
use crate::k8s::events::EventType;
use crate::providers::Provider;
use crate::shared::error::Result;

/// What a member does with the instance its annotation names, as read now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// It carries the member's tags already: an earlier attempt adopted it.
    Ours,
    /// It is a spare of the member's pool: take it (compare-and-set of its tags).
    Take,
    /// Create an instance instead, for this reason.
    Cold(&'static str),
}

/// The decision for `instance` (`None`: gone), given the member's tags, this
/// operator's `cluster` and the UID of the pool that controls the member.
pub fn decide(
    instance: Option<&pb::Instance>,
    member: &HashMap<String, String>,
    cluster: &str,
    pool_uid: Option<&str>,
) -> Adoption {
    let Some(instance) = instance else {
        return Adoption::Cold("it no longer exists");
    };
    if instance.tags == *member {
        return Adoption::Ours;
    }
    let tag = |key: &str| instance.tags.get(key).map(String::as_str);
    if instance.state() == pb::InstanceState::Deleting {
        return Adoption::Cold("it is being deleted");
    }
    if tag(tags::UID).is_some() {
        return Adoption::Cold("another Proxy adopted it");
    }
    if tag(tags::CLUSTER) != Some(cluster) || pool_uid.is_none() || tag(tags::POOL_UID) != pool_uid
    {
        return Adoption::Cold("it is not a spare of this member's pool");
    }
    match tag(tags::ROLE) {
        Some(tags::ROLE_SPARE) => Adoption::Take,
        Some(tags::ROLE_RETIRING) => Adoption::Cold("its pool is deleting it"),
        _ => Adoption::Cold("it is not a spare of this member's pool"),
    }
}

/// Adopts the spare the member's annotation names, when this is its first Create
/// step (module doc); `None`: create as usual.
pub(super) async fn adopt_spare(pass: &mut Reconciliation<'_>) -> Result<Option<Next>> {
    let Some(id) = pass
        .proxy
        .annotations()
        .get(ADOPT_INSTANCE_ANNOTATION)
        .cloned()
    else {
        return Ok(None);
    };
    let status = &pass.status;
    if status.instance_key.is_some() || status.provider_id.is_some() || status.replacements > 0 {
        return Ok(None);
    }
    if !pass.provider.offers(pb::Capability::UpdateTags).await? {
        return cold(pass, &id, "the provider cannot hand instances over").await;
    }
    let member = pass.key.instance_tags(&pass.ctx.cluster_name);
    let pool_uid = controller_uid(pass.proxy);
    let cluster = pass.ctx.cluster_name.clone();
    let mut instance = pass.provider.get(&id).await?;
    // A lost race is read once more: the update may have been this member's own.
    for _ in 0..2 {
        match decide(instance.as_ref(), &member, &cluster, pool_uid.as_deref()) {
            Adoption::Ours => return adopted(pass, instance.unwrap_or_default()).await,
            Adoption::Cold(why) => return cold(pass, &id, why).await,
            Adoption::Take => {
                pass.guard_instance().await?;
                let expected = instance
                    .as_ref()
                    .map(|i| i.tags.clone())
                    .unwrap_or_default();
                match pass
                    .provider
                    .update_tags(&id, expected, member.clone())
                    .await
                {
                    Ok(taken) => return adopted(pass, taken).await,
                    Err(error) if Provider::lost_the_instance(&error) => {
                        instance = pass.provider.get(&id).await?;
                    }
                    Err(error) => return Err(error),
                }
            }
        }
    }
    cold(pass, &id, "its tags kept changing").await
}

/// Whether `proxy` was created to adopt a spare (it carries the annotation).
pub(super) fn told_to_adopt(proxy: &Proxy) -> bool {
    proxy.annotations().contains_key(ADOPT_INSTANCE_ANNOTATION)
}

/// The UID of the object that controls `proxy` (its pool).
fn controller_uid(proxy: &Proxy) -> Option<String> {
    proxy
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.clone())
}

/// Records the adopted `instance` as the member's and runs the next pass at once.
async fn adopted(pass: &mut Reconciliation<'_>, instance: pb::Instance) -> Result<Option<Next>> {
    let note = format!(
        "adopted spare instance {} (booted in advance by its pool)",
        instance.id
    );
    pass.publish(EventType::Normal, "AdoptedSpare", &note).await;
    pass.status.provider_id = Some(instance.id.clone());
    pass.status.instance_key = Some(instance.key.clone());
    pass.status.placement = Some(pass.proxy.spec.placement.clone());
    pass.record_location(&instance);
    pass.status.instance_create_time = Some(Time(jiff::Timestamp::now()));
    let message = format!("adopted instance {}, checking its proxy", instance.id);
    pass.set(condition::READY, false, "Provisioning", &message);
    pass.save().await?;
    Ok(Some(Next::Again))
}

/// Says why spare `id` is not adopted; the member creates an instance.
async fn cold(pass: &mut Reconciliation<'_>, id: &str, why: &str) -> Result<Option<Next>> {
    let note = format!("spare {id} not adopted ({why}): creating an instance");
    pass.publish(EventType::Normal, "SpareNotAdopted", &note)
        .await;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(tags: &[(&str, &str)], state: pb::InstanceState) -> pb::Instance {
        let mut instance = pb::Instance {
            id: "i-1".into(),
            tags: tags
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..pb::Instance::default()
        };
        instance.set_state(state);
        instance
    }

    /// The table in `docs/operator.md` ("Spares", the member's side), row for row.
    #[test]
    fn the_adoption_table() {
        use pb::InstanceState::{Deleting, Running};
        let member: HashMap<String, String> = [
            (tags::CLUSTER, "c"),
            (tags::NAMESPACE, "ns"),
            (tags::NAME, "egress-0"),
            (tags::UID, "m-uid"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        let ours: Vec<(&str, &str)> = member
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let spare = |cluster: &'static str, pool: &'static str, role: &'static str| {
            vec![
                (tags::CLUSTER, cluster),
                (tags::POOL_UID, pool),
                (tags::ROLE, role),
            ]
        };
        let rows: Vec<(&str, Option<pb::Instance>, Adoption)> = vec![
            ("gone", None, Adoption::Cold("it no longer exists")),
            (
                "already the member's (a retry)",
                Some(instance(&ours, Running)),
                Adoption::Ours,
            ),
            (
                "a spare of its pool",
                Some(instance(&spare("c", "p-uid", "spare"), Running)),
                Adoption::Take,
            ),
            (
                "being deleted",
                Some(instance(&spare("c", "p-uid", "spare"), Deleting)),
                Adoption::Cold("it is being deleted"),
            ),
            (
                "retiring",
                Some(instance(&spare("c", "p-uid", "retiring"), Running)),
                Adoption::Cold("its pool is deleting it"),
            ),
            (
                "another pool's spare",
                Some(instance(&spare("c", "other", "spare"), Running)),
                Adoption::Cold("it is not a spare of this member's pool"),
            ),
            (
                "another cluster's spare",
                Some(instance(&spare("d", "p-uid", "spare"), Running)),
                Adoption::Cold("it is not a spare of this member's pool"),
            ),
            (
                "adopted by another member",
                Some(instance(
                    &[
                        (tags::CLUSTER, "c"),
                        (tags::NAMESPACE, "ns"),
                        (tags::NAME, "egress-1"),
                        (tags::UID, "x"),
                    ],
                    Running,
                )),
                Adoption::Cold("another Proxy adopted it"),
            ),
        ];
        for (row, found, expected) in rows {
            assert_eq!(
                decide(found.as_ref(), &member, "c", Some("p-uid")),
                expected,
                "{row}"
            );
        }
        assert_eq!(
            decide(
                Some(&instance(&spare("c", "p-uid", "spare"), Running)),
                &member,
                "c",
                None
            ),
            Adoption::Cold("it is not a spare of this member's pool"),
            "a Proxy no pool controls adopts nothing"
        );
    }
}
