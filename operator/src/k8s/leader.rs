//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several replicas
//! exactly one reconciles and collects garbage.
//!
//! 1. A replica becomes leader when the Lease is missing, released (no holder), already
//!    its own, or expired. Expiry is timed on this replica's own monotonic clock, from
//!    when it last *observed the lease record change*, never by comparing the holder's
//!    `renewTime` with the local wall clock: that comparison lets a replica whose clock
//!    runs ahead (or a holder whose clock runs behind) take a lease that is still
//!    renewed. This is how client-go's leader election times it.
//! 2. Every write carries the Lease's `resourceVersion`, so of two replicas racing for
//!    it one gets a conflict and loses.
//! 3. A candidate retries every `retry_period`, and also as soon as it sees the Lease
//!    change, so a released Lease is taken at once.
//! 4. The leader renews every `retry_period`. A renewal that fails or hangs (each
//!    attempt is bounded by half the renew deadline) is retried every `retry_period`
//!    until `renew_deadline` has passed since the last renewal began; only then, or
//!    when another replica holds the Lease, is leadership lost: [`Leadership::lost`]
//!    completes and the process must stop acting (the binary exits, as
//!    controller-runtime's managers do). The deadline is shorter than the lease, so
//!    the leader stops before anyone may take over. These are client-go's rules and,
//!    by default, its proportions (15 s lease, 10 s renew deadline, 2 s retry period).
//! 5. On a graceful shutdown, once the replica has stopped acting,
//!    [`Leadership::release`] clears the holder, as client-go's `ReleaseOnCancel`
//!    does, so a successor does not wait for the lease to expire. A replica stopped
//!    while it is still a candidate ([`acquire_unless_stopped`]) hands the Lease back
//!    too: its winning write may have landed just before the stop.
//!
//! Caveat: a replica that starts while another holds the Lease waits one full lease
//! duration from its first look before it may take an abandoned (not released) lease,
//! even if that lease was last renewed long ago. Only a crashed leader costs that wait.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::time::Instant;

/// Lease settings.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This replica's identity (pod name).
    pub identity: String,
    /// How long a lease is valid without renewal.
    pub duration: Duration,
    /// How long the leader keeps retrying a renewal before it gives up: less than
    /// `duration`, so it stops acting before another replica may take over.
    pub renew_deadline: Duration,
    /// How often the leader renews and retries a failed renewal, and candidates retry.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// Settings for a lease of `duration`, timed in client-go's proportions: a renew
    /// deadline of two thirds of it and a retry period of two fifteenths (15 s, 10 s,
    /// 2 s).
    pub fn new(name: String, namespace: String, identity: String, duration: Duration) -> Self {
        LeaseConfig {
            name,
            namespace,
            identity,
            duration,
            renew_deadline: duration * 2 / 3,
            retry_period: duration * 2 / 15,
        }
    }

    /// The longest one attempt may take: half the renew deadline, so that a hung
    /// attempt leaves time for another within the deadline.
    fn attempt_timeout(&self) -> Duration {
        self.renew_deadline / 2
    }
}

/// What one attempt at the Lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    /// This replica holds it (took or renewed it).
    Held,
    /// Another replica holds it and its lease has not expired.
    HeldByOther,
    /// Someone wrote it between our read and our write: read again.
    Conflict,
}

/// The lease record as this replica last saw it, and when (on its monotonic clock) it
/// last saw it change.
#[derive(Debug, Default)]
struct Observation {
    record: Option<LeaseSpec>,
    changed_at: Option<Instant>,
}

impl Observation {
    fn see(&mut self, record: &LeaseSpec, now: Instant) {
        if self.record.as_ref() != Some(record) {
            self.record = Some(record.clone());
            self.changed_at = Some(now);
        }
    }

    /// Whether the record has stayed unchanged for its whole lease duration.
    fn expired(&self, now: Instant) -> bool {
        let (Some(record), Some(changed_at)) = (&self.record, self.changed_at) else {
            return false;
        };
        let seconds = record.lease_duration_seconds.unwrap_or(0).max(0);
        // An absurd duration in a foreign record must not overflow the clock: such a
        // lease is simply never taken over by expiry.
        changed_at
            .checked_add(Duration::from_secs(u64::from(seconds.unsigned_abs())))
            .is_some_and(|expiry| now >= expiry)
    }
}

/// Held leadership; [`Leadership::lost`] completes when it ends.
#[derive(Debug)]
pub struct Leadership {
    lost: watch::Receiver<bool>,
    renewer: tokio::task::JoinHandle<()>,
    api: Api<Lease>,
    config: LeaseConfig,
}

impl Leadership {
    /// Completes when this replica stops being the leader.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }

    /// Stops renewing and hands the Lease back (clears its holder) if this replica
    /// still holds it, so another replica can take it at once. Call it only after
    /// this replica has stopped acting. Failures are logged: the lease then simply
    /// expires.
    pub async fn release(self) {
        self.renewer.abort();
        hand_back(&self.api, &self.config).await;
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

/// Like [`acquire`], but gives up when `stop` completes first, and then hands the Lease
/// back if this replica holds it: the write that won the Lease may have landed just
/// before the stop, and a replica that exits without releasing it makes its
/// successor wait out the whole lease. A stop that is ready wins over a Lease won in
/// the same instant, for the same reason.
pub async fn acquire_unless_stopped(
    client: kube::Client,
    config: LeaseConfig,
    stop: impl Future<Output = ()>,
) -> Option<Leadership> {
    let api: Api<Lease> = Api::namespaced(client.clone(), &config.namespace);
    tokio::select! {
        biased;
        () = stop => {
            hand_back(&api, &config).await;
            None
        }
        leadership = acquire(client, config.clone()) => Some(leadership),
    }
}

/// Clears the holder if it is this replica, within one attempt's time. Failures are
/// logged: the lease then simply expires.
async fn hand_back(api: &Api<Lease>, config: &LeaseConfig) {
    let attempt = tokio::time::timeout(config.attempt_timeout(), release(api, config));
    match attempt.await {
        Ok(Ok(true)) => {
            tracing::info!(identity = %config.identity, lease = %config.name, "released the leader lease")
        }
        Ok(Ok(false)) => {}
        Ok(Err(error)) => {
            tracing::warn!(%error, "cannot release the leader lease: it will expire")
        }
        Err(_) => tracing::warn!("releasing the leader lease timed out: it will expire"),
    }
}

/// Waits until this replica holds the lease, then keeps renewing it in the background.
pub async fn acquire(client: kube::Client, config: LeaseConfig) -> Leadership {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let mut observation = Observation::default();
    let mut changes = watcher::watch_object(api.clone(), &config.name)
        .default_backoff()
        .boxed();
    loop {
        match try_acquire(&api, &config, &mut observation).await {
            Ok(Attempt::Held) => break,
            Ok(Attempt::HeldByOther | Attempt::Conflict) => {}
            Err(error) => {
                tracing::warn!(%error, lease = %config.name, "cannot read or write the leader lease")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(config.retry_period) => {}
            _ = changes.next() => {}
        }
    }
    drop(changes);
    tracing::info!(identity = %config.identity, lease = %config.name, "became leader");
    let (tell, lost) = watch::channel(false);
    let renewer = tokio::spawn(renew(api.clone(), config.clone(), observation, tell));
    Leadership {
        lost,
        renewer,
        api,
        config,
    }
}

/// Renews the held lease every `retry_period` until it is lost, then says so on `tell`.
async fn renew(
    api: Api<Lease>,
    config: LeaseConfig,
    mut observation: Observation,
    tell: watch::Sender<bool>,
) {
    // When the last successful renewal was sent: others time the lease from when they
    // saw its write, which came after this.
    let mut renewed_at = Instant::now();
    loop {
        tokio::time::sleep(config.retry_period).await;
        let deadline = renewed_at + config.renew_deadline;
        match renew_within(&api, &config, &mut observation, deadline).await {
            Some(sent_at) => renewed_at = sent_at,
            None => break,
        }
    }
    let _ = tell.send(true);
}

/// Renews the lease, retrying every `retry_period` until `deadline`: when the successful
/// attempt was sent, or `None` when leadership is lost.
async fn renew_within(
    api: &Api<Lease>,
    config: &LeaseConfig,
    observation: &mut Observation,
    deadline: Instant,
) -> Option<Instant> {
    loop {
        let sent_at = Instant::now();
        let Some(left) = deadline
            .checked_duration_since(sent_at)
            .filter(|left| !left.is_zero())
        else {
            tracing::error!(deadline = ?config.renew_deadline,
                "could not renew the leader lease within the renew deadline");
            return None;
        };
        // A renewal that hangs must not outlive the deadline: another replica may take
        // the lease after it, and two leaders would act.
        let attempt = tokio::time::timeout(
            config.attempt_timeout().min(left),
            try_acquire(api, config, observation),
        );
        match attempt.await {
            Ok(Ok(Attempt::Held)) => return Some(sent_at),
            Ok(Ok(Attempt::HeldByOther)) => {
                tracing::error!(identity = %config.identity, "another replica took the leader lease");
                return None;
            }
            Ok(Ok(Attempt::Conflict)) => {
                tracing::warn!("the leader lease changed while renewing it: retrying")
            }
            Ok(Err(error)) => tracing::warn!(%error, "renewing the leader lease failed: retrying"),
            Err(_) => tracing::warn!("renewing the leader lease timed out: retrying"),
        }
        let pause = config
            .retry_period
            .min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(pause).await;
    }
}

fn lease_seconds(duration: Duration) -> i32 {
    i32::try_from(duration.as_secs().max(1)).unwrap_or(i32::MAX)
}

/// One attempt to take or renew the lease.
async fn try_acquire(
    api: &Api<Lease>,
    config: &LeaseConfig,
    observation: &mut Observation,
) -> Result<Attempt, kube::Error> {
    let now = jiff::Timestamp::now();
    let Some(mut lease) = api.get_opt(&config.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(config.name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(config.identity.clone()),
                lease_duration_seconds: Some(lease_seconds(config.duration)),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(created) => {
                observation.see(&created.spec.unwrap_or_default(), Instant::now());
                Ok(Attempt::Held)
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(Attempt::Conflict),
            Err(error) => Err(error),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    observation.see(spec, Instant::now());
    let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty());
    let mine = holder == Some(config.identity.as_str());
    if holder.is_some() && !mine && !observation.expired(Instant::now()) {
        return Ok(Attempt::HeldByOther);
    }
    if !mine {
        spec.holder_identity = Some(config.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
    }
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(lease_seconds(config.duration));
    match api
        .replace(&config.name, &PostParams::default(), &lease)
        .await
    {
        Ok(written) => {
            observation.see(&written.spec.unwrap_or_default(), Instant::now());
            Ok(Attempt::Held)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(Attempt::Conflict),
        Err(error) => Err(error),
    }
}

/// Clears the holder if it is this replica; `Ok(false)` when another replica holds it.
/// The duration drops to one second so that replicas which still time expiry by
/// `renewTime` (older clients) take it soon too.
async fn release(api: &Api<Lease>, config: &LeaseConfig) -> Result<bool, kube::Error> {
    for _ in 0..3 {
        let Some(mut lease) = api.get_opt(&config.name).await? else {
            return Ok(false);
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
            return Ok(false);
        }
        let now = jiff::Timestamp::now();
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(now));
        spec.acquire_time = Some(MicroTime(now));
        match api
            .replace(&config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => return Ok(true),
            // A renewal that was in flight when renewing stopped landed first: read the
            // lease again and retry.
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(holder: &str, renewed_minutes_ago: i64) -> LeaseSpec {
        let renewed = jiff::Timestamp::now() - jiff::SignedDuration::from_mins(renewed_minutes_ago);
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(renewed)),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn expiry_is_timed_from_the_observed_change_not_from_renew_time() {
        let start = Instant::now();
        let mut seen = Observation::default();
        // A holder whose clock runs ten minutes behind: its renewTime looks ancient.
        seen.see(&record("skewed", 10), start);
        assert!(!seen.expired(start + Duration::from_secs(14)));
        assert!(seen.expired(start + Duration::from_secs(15)));
        // The holder renews (the record changes): the clock starts over.
        let renewed = record("skewed", 9);
        seen.see(&renewed, start + Duration::from_secs(14));
        assert!(!seen.expired(start + Duration::from_secs(20)));
        // The same record seen again does not restart the clock.
        seen.see(&renewed, start + Duration::from_secs(20));
        assert!(seen.expired(start + Duration::from_secs(29)));
    }

    #[test]
    fn an_absurd_foreign_duration_never_expires_and_never_panics() {
        let start = Instant::now();
        let mut seen = Observation::default();
        let mut absurd = record("other", 0);
        absurd.lease_duration_seconds = Some(i32::MAX);
        seen.see(&absurd, start);
        assert!(!seen.expired(start + Duration::from_secs(3600)));
        absurd.lease_duration_seconds = Some(-5);
        seen.see(&absurd, start);
        assert!(seen.expired(start));
    }
}
