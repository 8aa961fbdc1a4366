//! A pool pass's work on its spares, around the member steps of
//! [`super::reconcile`]: find them before members are created (so a new member can be
//! told to adopt one), run the spare plan after, and put them into the status.
//!
//! A provider that does not answer costs only the spares: the pass logs it and goes on
//! without them (members are created cold), and the status keeps the last counts.

use std::collections::BTreeSet;

use egressproxy_provider::pb;
use kube::{Resource, ResourceExt};

use super::member::promised_spare;
use super::spare_plan::{self, Spare};
use super::spares;
use super::spread::Spread;
use crate::context::Context;
use crate::crd::{Proxy, ProxyPool, ProxyPoolStatus, pool_condition};
use crate::k8s::events::EventType;
use crate::k8s::status::set_condition;
use crate::providers::Provider;
use crate::shared::error::Error;

/// `pool`'s spares this pass, and whether the provider can hand them over; `None`
/// when the provider does not answer (logged: the pool goes on without spares).
pub(super) async fn find(
    ctx: &Context,
    pool: &ProxyPool,
    provider: &Provider,
    spread: &Spread,
    members: &[Proxy],
) -> Option<SpareState> {
    let promised: BTreeSet<String> = members
        .iter()
        .filter_map(promised_spare)
        .map(str::to_owned)
        .collect();
    let found = async {
        let hand_over = provider.offers(pb::Capability::UpdateTags).await?;
        let found = spares::find(ctx, pool, provider, spread, &promised).await?;
        Ok::<_, Error>(SpareState { hand_over, found })
    };
    match found.await {
        Ok(state) => Some(state),
        Err(error) => {
            tracing::warn!(pool = %pool.name_any(), error = %error.describe(),
                "cannot list the pool's spares; new members are created cold");
            None
        }
    }
}

/// Runs the spare plan; says what the status reports of the spares.
pub(super) async fn act(
    ctx: &Context,
    pool: &ProxyPool,
    provider: &Provider,
    spread: &Spread,
    state: SpareState,
) -> SpareReport {
    let SpareState { hand_over, found } = state;
    let regarding = pool.object_ref(&());
    if !hand_over && pool.spec.spares > 0 {
        let note = format!(
            "provider {} cannot hand an instance over (it does not declare \
             CAPABILITY_UPDATE_TAGS): the pool keeps no spares and creates every member cold",
            provider.name()
        );
        ctx.publish_about(&regarding, EventType::Warning, "SparesUnavailable", &note)
            .await;
    }
    let todo = spare_plan::plan(
        pool.spec.spares,
        hand_over,
        &spares::places(spread),
        &found.spares,
    );
    let (created, failed) = match spares::act(ctx, pool, provider, spread, &found, &todo).await {
        Ok(created) => (created, None),
        Err(error) => {
            // Spares are a convenience: a provider without room for them, or a
            // cloud-init Secret missing, must not stop the pool's own status.
            let message = error.describe();
            tracing::warn!(pool = %pool.name_any(), error = %message, "spares: a step failed");
            let note = format!("cannot keep spec.spares spares: {message}");
            ctx.publish_about(&regarding, EventType::Warning, "SparesFailed", &note)
                .await;
            let last = pool.status.as_ref().map_or(0, |s| s.spares_created);
            (last.saturating_add(todo.create.len() as u32), Some(message))
        }
    };
    let going =
        |id: &str| todo.delete.iter().any(|d| d == id) || todo.retire.iter().any(|(r, _)| r == id);
    let kept: Vec<&Spare> = found
        .spares
        .iter()
        .filter(|s| s.updated && !s.promised && !s.retiring && !going(&s.id))
        .collect();
    SpareReport {
        hand_over,
        spares: kept.len() as u32,
        ready: kept.iter().filter(|s| s.ready).count() as u32,
        created,
        booting: !todo.create.is_empty() || kept.iter().any(|s| !s.ready),
        failed,
    }
}

/// The spares found this pass, and whether they can be handed over.
pub(super) struct SpareState {
    hand_over: bool,
    /// The spares, each with its tags.
    pub found: spares::Found,
}

impl SpareState {
    /// How many spares a new member could adopt at each spread target of `spread` (at
    /// index 0 without targets): none without a hand-over.
    pub(super) fn adoptable(&self, spread: &Spread) -> Vec<u32> {
        let places = spares::places(spread);
        if !self.hand_over {
            return vec![0; places.len()];
        }
        spare_plan::adoptable_at(&self.found.spares, &places)
    }
}

/// What the status says of the spares after this pass.
pub(super) struct SpareReport {
    hand_over: bool,
    spares: u32,
    ready: u32,
    created: u32,
    booting: bool,
    /// Why a step failed this pass.
    failed: Option<String>,
}

/// When a pass looks at the spares again, without a change to start it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SparesNext {
    /// Nothing to wait for.
    Settled,
    /// A spare boots: soon.
    Booting,
    /// A step failed: after a while.
    Failed,
}

/// Puts the spares into `status` (the last known counts when they were not listed);
/// says when to look at them again.
pub(super) fn report(
    pool: &ProxyPool,
    report: Option<&SpareReport>,
    status: &mut ProxyPoolStatus,
) -> SparesNext {
    let last = pool.status.as_ref();
    status.spares_created = last.map_or(0, |s| s.spares_created);
    let Some(report) = report else {
        status.spares = last.map_or(0, |s| s.spares);
        status.spares_ready = last.map_or(0, |s| s.spares_ready);
        return SparesNext::Settled;
    };
    status.spares = report.spares;
    status.spares_ready = report.ready;
    status.spares_created = report.created;
    let wanted = pool.spec.spares;
    let known = status
        .conditions
        .iter()
        .any(|c| c.type_ == pool_condition::SPARES_READY);
    let next = match (&report.failed, report.booting) {
        (Some(_), _) => SparesNext::Failed,
        (None, true) => SparesNext::Booting,
        (None, false) => SparesNext::Settled,
    };
    if wanted == 0 && !known {
        return next;
    }
    let (value, reason, message) = if let Some(failed) = &report.failed {
        (false, "SparesFailed", failed.clone())
    } else if !report.hand_over {
        (
            false,
            "NoHandOver",
            "the provider does not declare CAPABILITY_UPDATE_TAGS: no spares, every member is created cold".to_owned(),
        )
    } else if report.ready >= wanted {
        (
            true,
            "SparesReady",
            format!("{} of {wanted} spares Ready", report.ready),
        )
    } else {
        (
            false,
            "SparesBooting",
            format!("{} of {wanted} spares Ready", report.ready),
        )
    };
    set_condition(
        &mut status.conditions,
        pool_condition::SPARES_READY,
        value,
        reason,
        message,
        pool.metadata.generation,
    );
    next
}
