//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several replicas
//! exactly one reconciles and collects garbage.
//!
//! 1. A replica becomes leader when the Lease is missing, expired (`renewTime` older
//!    than `leaseDurationSeconds`) or already its own; every write carries the Lease's
//!    `resourceVersion`, so of two replicas racing for it one gets a conflict and loses.
//! 2. The leader renews every `renew_every`. When a renewal fails for longer than the
//!    lease lasts, leadership is lost: [`Leadership::lost`] completes and the process
//!    must stop acting (the binary exits, as controller-runtime's managers do).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;

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
    /// How often the leader renews, and candidates retry.
    pub renew_every: Duration,
}

/// Held leadership; [`Leadership::lost`] completes when it ends.
#[derive(Debug)]
pub struct Leadership {
    lost: watch::Receiver<bool>,
    renewer: tokio::task::JoinHandle<()>,
}

impl Leadership {
    /// Completes when this replica stops being the leader.
    pub async fn lost(&mut self) {
        let _ = self.lost.wait_for(|lost| *lost).await;
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

/// Waits until this replica holds the lease, then keeps renewing it in the background.
pub async fn acquire(client: kube::Client, config: LeaseConfig) -> Leadership {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    loop {
        match try_acquire(&api, &config).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(%error, lease = %config.name, "cannot read or write the leader lease")
            }
        }
        tokio::time::sleep(config.renew_every).await;
    }
    tracing::info!(identity = %config.identity, lease = %config.name, "became leader");
    let (tell, lost) = watch::channel(false);
    let renewer = tokio::spawn(async move {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(config.renew_every).await;
            // A renewal that hangs must not outlive the lease: another replica may
            // take it meanwhile, and two leaders would act.
            match tokio::time::timeout(config.renew_every, try_acquire(&api, &config)).await {
                Ok(Ok(true)) => last_renewal = tokio::time::Instant::now(),
                Ok(Ok(false)) => {
                    tracing::error!(identity = %config.identity, "another replica took the leader lease");
                    break;
                }
                Ok(Err(error)) => tracing::warn!(%error, "renewing the leader lease failed"),
                Err(_) => tracing::warn!("renewing the leader lease timed out"),
            }
            if last_renewal.elapsed() + config.renew_every >= config.duration {
                tracing::error!("leader lease about to expire without renewal");
                break;
            }
        }
        let _ = tell.send(true);
    });
    Leadership { lost, renewer }
}

/// One attempt to take or renew the lease; `Ok(false)` when another replica holds it.
async fn try_acquire(api: &Api<Lease>, config: &LeaseConfig) -> Result<bool, kube::Error> {
    let now = jiff::Timestamp::now();
    let duration_seconds = i32::try_from(config.duration.as_secs()).unwrap_or(i32::MAX);
    let Some(mut lease) = api.get_opt(&config.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(config.name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(config.identity.clone()),
                lease_duration_seconds: Some(duration_seconds),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(error) => Err(error),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let mine = spec.holder_identity.as_deref() == Some(config.identity.as_str());
    let held_for = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
    let expired = spec.renew_time.as_ref().is_none_or(|renewed| {
        let age = now.duration_since(renewed.0);
        age.as_secs_f64() >= held_for.as_secs_f64()
    });
    if !mine && !expired {
        return Ok(false);
    }
    if !mine {
        spec.holder_identity = Some(config.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(duration_seconds);
    match api
        .replace(&config.name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(error) => Err(error),
    }
}
