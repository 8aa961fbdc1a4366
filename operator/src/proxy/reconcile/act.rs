//! Performing one [`Step`]: the provider calls it needs, the conditions it sets, the
//! Event it publishes, and what happens next (another pass, or a requeue).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use egressproxy_provider::error::reason;
use egressproxy_provider::{ErrorClass, pb};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::runtime::controller::Action;

use super::next::Next;
use super::observe;
use super::plan::{Cause, Step};
use super::tags;
use super::{Reconciliation, adopt, egress_address, egress_observed, no_room};
use crate::crd::{ProxyAddress, ReplacedInstance, condition};
use crate::k8s::events::EventType;
use crate::probe::address::probe_address;
use crate::probe::address_fields;
use crate::providers::placement;
use crate::shared::error::{Error, Result};

/// Performs `step`.
pub(super) async fn act(pass: &mut Reconciliation<'_>, step: Step) -> Result<Next> {
    match step {
        Step::Create => create(pass).await,
        Step::Replace { id, cause } => replace(pass, id, cause).await,
        Step::AwaitInstance { message } => {
            pass.start_provisioning_clock();
            pass.set(condition::PROVISIONED, false, "Provisioning", &message);
            pass.set(condition::READY, false, "Provisioning", &message);
            Ok(Next::Done(Action::requeue(
                pass.ctx.poll_backoff.next(&pass.key.uid),
            )))
        }
        Step::MarkHealthy { addresses } => {
            pass.record_running(&addresses);
            pass.set(condition::HEALTHY, true, "HealthCheckPassed", "");
            pass.set(condition::READY, true, "Ready", "");
            pass.ctx.replace_backoff.reset(&pass.key.uid);
            egress_observed::observe_if_due(pass, &addresses).await;
            Ok(Next::Done(Action::requeue(pass.period())))
        }
        Step::AwaitProxy { addresses, problem } => {
            pass.start_provisioning_clock();
            pass.record_running(&addresses);
            let message = format!("waiting for the proxy to answer: {problem}");
            pass.set(condition::READY, false, "WaitingForProxy", &message);
            Ok(Next::Done(Action::requeue(pass.soon())))
        }
        Step::ToleratePassingFailure { addresses } => {
            pass.record_running(&addresses);
            Ok(Next::Done(Action::requeue(pass.soon())))
        }
        Step::MarkUnhealthy { addresses, message } => {
            pass.record_running(&addresses);
            let already = pass
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == condition::HEALTHY && c.status == "False");
            if !already {
                pass.publish(EventType::Warning, "Unhealthy", &message)
                    .await;
            }
            pass.set(condition::HEALTHY, false, "HealthCheckFailed", &message);
            pass.set(condition::READY, false, "HealthCheckFailed", &message);
            Ok(Next::Done(Action::requeue(pass.period())))
        }
    }
}

/// Checks the placement, reads the cloud-init input, adds the finalizer (so a crash
/// during the call leaves a trace that an instance may exist), then creates.
async fn create(pass: &mut Reconciliation<'_>) -> Result<Next> {
    if let Some(next) = adopt::adopt_spare(pass).await? {
        return Ok(next);
    }
    let provider = pass.provider;
    provider
        .validate_placement(placement::to_pb(&pass.proxy.spec.placement))
        .await?;
    let capabilities = provider.handshake().await?.capabilities;
    let address = egress_address::address_fields(
        &capabilities,
        provider.name(),
        &pass.key.uid,
        pass.proxy.spec.egress.as_ref(),
    )?;
    let cloud_init = observe::cloud_init(pass.ctx, pass.key, pass.proxy).await?;
    let key = pass.key.instance_key(pass.status.replacements);
    pass.status.instance_key = Some(key.clone());
    pass.guard_instance().await?;
    // A member told to adopt a spare reads the recorded key to know that its first
    // Create may have happened, and must not adopt after it: record it first.
    if adopt::told_to_adopt(pass.proxy) {
        pass.save().await?;
    }
    let request = pb::CreateInstanceRequest {
        key,
        name: pass.key.to_string(),
        tags: pass.key.instance_tags(&pass.ctx.cluster_name),
        placement: Some(placement::to_pb(&pass.proxy.spec.placement)),
        cloud_init: Some(cloud_init),
        proxy_port: u32::from(pass.proxy.spec.proxy_port),
        address_identity: address.identity,
        requested_address: address.requested,
    };
    let instance = match provider.create(request).await {
        Ok(instance) => instance,
        // ALREADY_EXISTS names either the key (an earlier attempt's instance) or, with
        // ADDRESS_TAKEN, the requested address: only the first is this Proxy's to fix.
        Err(Error::Provider { source, .. })
            if source.class == ErrorClass::AlreadyExists
                && source.reason != reason::ADDRESS_TAKEN =>
        {
            return replace_stale_attempt(pass).await;
        }
        Err(error) => {
            let asked = placement::to_pb(&pass.proxy.spec.placement);
            return Err(no_room::explained(provider, &asked, error).await);
        }
    };
    let replaced = pass.status.replacing.take();
    let (reason, note) = match replaced {
        Some(old) => (
            "Replaced",
            format!(
                "instance {} \u{2192} {} ({}); replacement {}",
                old.provider_id, instance.id, old.cause, pass.status.replacements
            ),
        ),
        None if pass.status.replacements > 0 => (
            "Replaced",
            format!(
                "created instance {} as replacement {}",
                instance.id, pass.status.replacements
            ),
        ),
        None => (
            "Created",
            format!(
                "created instance {} with provider {}",
                instance.id,
                provider.name()
            ),
        ),
    };
    pass.publish(EventType::Normal, reason, &note).await;
    pass.status.provider_id = Some(instance.id.clone());
    pass.status.placement = Some(pass.proxy.spec.placement.clone());
    pass.record_location(&instance);
    pass.status.instance_create_time = Some(Time(jiff::Timestamp::now()));
    let message = format!("instance {} created, waiting for it to run", instance.id);
    pass.set(condition::READY, false, "Provisioning", &message);
    // Not saved here: the next pass looks at the instance at once, and the reconcile
    // saves the status once at its end (after a failure too). A crash before that
    // loses nothing: the key comes from the saved replacement count, so the next
    // Create returns this instance, and the finalizer makes a deletion look for it.
    Ok(Next::Again)
}

/// Deletes the instance (unless it vanished), marks it for replacement, and says why.
async fn replace(pass: &mut Reconciliation<'_>, id: String, cause: Cause) -> Result<Next> {
    if cause.deletes_old() {
        pass.provider.delete(&id).await?;
    }
    let provider = pass.provider.name().to_owned();
    let (type_, note) = match &cause {
        Cause::PlacementChanged => (
            EventType::Normal,
            format!("placement changed: deleting instance {id} and creating a new one"),
        ),
        Cause::Stopped(message) => (
            EventType::Warning,
            format!("instance {id} stopped ({message}): replacing it"),
        ),
        Cause::Vanished => (
            EventType::Warning,
            format!("instance {id} no longer exists at provider {provider}: creating a new one"),
        ),
        Cause::ProvisioningTimedOut {
            timeout_seconds,
            waiting_for,
        } => (
            EventType::Warning,
            format!(
                "instance {id} was not ready within spec.provisioningTimeoutSeconds ({timeout_seconds}s), still waiting for {waiting_for}: replacing it; raise the timeout if the image or cloud-init needs longer"
            ),
        ),
    };
    pass.publish(type_, cause.reason(), &note).await;
    mark_for_replacement(pass, &id, cause.describe());
    if cause == Cause::PlacementChanged {
        pass.save().await?;
        return Ok(Next::Again);
    }
    pass.set(condition::PROVISIONED, false, cause.reason(), &note);
    pass.set(condition::READY, false, cause.reason(), &note);
    Ok(Next::Done(Action::requeue(
        pass.ctx.replace_backoff.next(&pass.key.uid),
    )))
}

/// Our own key is taken by an instance made from an older spec: an earlier Create
/// whose answer never arrived (timeout, crash) before the spec or its Secret changed.
/// That instance is ours (tagged with our UID and key): delete it and create anew
/// under the next key.
async fn replace_stale_attempt(pass: &mut Reconciliation<'_>) -> Result<Next> {
    let key = pass.status.instance_key.clone().unwrap_or_default();
    let selector = HashMap::from([
        (tags::CLUSTER.to_owned(), pass.ctx.cluster_name.clone()),
        (tags::UID.to_owned(), pass.key.uid.clone()),
    ]);
    let stale: Vec<String> = pass
        .provider
        .list(&selector)
        .await?
        .into_iter()
        .filter(|i| i.key == key)
        .map(|i| i.id)
        .collect();
    if stale.is_empty() {
        return skip_taken_key(pass, &key).await;
    }
    for id in &stale {
        pass.provider.delete(id).await?;
    }
    let stale = stale.join(", ");
    let reason = "StaleAttemptReplaced";
    let note = format!(
        "key {key} belongs to instance {stale} made from an older spec by an unfinished attempt: deleted it, creating a new one"
    );
    pass.publish(EventType::Warning, reason, &note).await;
    mark_for_replacement(pass, &stale, "made from an older spec".into());
    pass.set(condition::PROVISIONED, false, reason, &note);
    pass.set(condition::READY, false, reason, &note);
    Ok(Next::Done(Action::requeue(
        pass.ctx.replace_backoff.next(&pass.key.uid),
    )))
}

/// Our key is taken by an instance not tagged as this Proxy's (made by hand, or by an
/// operator with another cluster name). It may be someone's: leave it, say so, and
/// create under the next key.
async fn skip_taken_key(pass: &mut Reconciliation<'_>, key: &str) -> Result<Next> {
    let reason = "InstanceKeyTaken";
    let note = format!(
        "key {key} is taken at provider {} by an instance not tagged {}={} and {}={}, so not this Proxy's: \
         left alone, creating under the next key; delete that instance at the provider if nothing uses it",
        pass.provider.name(),
        tags::CLUSTER,
        pass.ctx.cluster_name,
        tags::UID,
        pass.key.uid,
    );
    pass.publish(EventType::Warning, reason, &note).await;
    pass.status.instance_key = None;
    pass.status.replacements = pass.status.replacements.saturating_add(1);
    pass.set(condition::PROVISIONED, false, reason, &note);
    pass.set(condition::READY, false, reason, &note);
    Ok(Next::Done(Action::requeue(
        pass.ctx.replace_backoff.next(&pass.key.uid),
    )))
}

/// Marks the current instance for replacement: clears it (and its health) from the
/// status and counts the replacement, so the next pass creates one under the next key;
/// remembers why for the `Replaced` Event.
fn mark_for_replacement(pass: &mut Reconciliation<'_>, old_id: &str, cause: String) {
    let status = &mut pass.status;
    status.provider_id = None;
    status.instance_key = None;
    status.placement = None;
    status.location = None;
    status.instance_create_time = None;
    status.addresses.clear();
    status.replacements = status.replacements.saturating_add(1);
    // What was observed of the old VM's proxy is not known of the new one's: its egress
    // address is observed again once it is Ready.
    status
        .conditions
        .retain(|c| c.type_ != condition::HEALTHY && c.type_ != condition::EGRESS_ADDRESS_OBSERVED);
    let uid = &pass.key.uid;
    pass.ctx.clear_health_failures(uid);
    pass.status.replacing = Some(ReplacedInstance {
        provider_id: old_id.to_owned(),
        cause,
    });
}

/// The addresses as the status lists them: the one the operator uses (and health-checks)
/// first, so the `Address` column shows it, then the rest in the provider's order (which
/// lists `INTERNAL` ones first).
fn status_addresses(addresses: &[pb::Address], chosen: Option<IpAddr>) -> Vec<ProxyAddress> {
    let is_chosen = |a: &&pb::Address| a.address.parse::<IpAddr>().ok() == chosen;
    let first = addresses.iter().find(is_chosen);
    first
        .into_iter()
        .chain(
            addresses
                .iter()
                .filter(|a| first.is_none_or(|f| !std::ptr::eq(*a, f))),
        )
        .map(proxy_address)
        .collect()
}

/// An address as the status shows it, its scope and family read as the contract says
/// (a newer provider's scope as `External`, its family from the address text).
fn proxy_address(address: &pb::Address) -> ProxyAddress {
    ProxyAddress {
        address: address.address.clone(),
        scope: if address_fields::is_internal(address) {
            "Internal"
        } else {
            "External"
        }
        .into(),
        family: match address_fields::family(address) {
            Some(pb::IpFamily::V4) => "IPv4",
            Some(pb::IpFamily::V6) => "IPv6",
            Some(pb::IpFamily::Unspecified) | None => "Unknown",
        }
        .into(),
    }
}

impl Reconciliation<'_> {
    /// Records a running instance's addresses; it is provisioned.
    fn record_running(&mut self, addresses: &[pb::Address]) {
        self.ctx.poll_backoff.reset(&self.key.uid);
        self.status.addresses = status_addresses(addresses, probe_address(addresses));
        self.set(condition::PROVISIONED, true, "Running", "");
    }

    /// An instance recorded before the operator kept its creation time gets its
    /// provisioning clock started now, so the timeout still applies to it.
    fn start_provisioning_clock(&mut self) {
        if self.status.instance_create_time.is_none() {
            self.status.instance_create_time = Some(Time(jiff::Timestamp::now()));
        }
    }

    fn period(&self) -> Duration {
        let check = self.proxy.spec.health_check.clone().unwrap_or_default();
        Duration::from_secs(u64::from(check.period_seconds))
    }

    /// The next check while the proxy is coming up or failing below the threshold.
    fn soon(&self) -> Duration {
        self.period().min(Duration::from_secs(5))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(ip: &str, scope: pb::AddressScope, family: pb::IpFamily) -> pb::Address {
        let mut address = pb::Address {
            address: ip.to_owned(),
            ..pb::Address::default()
        };
        address.set_scope(scope);
        address.set_family(family);
        address
    }

    /// Before, the status re-sorted the addresses by scope, family and text, so the
    /// `Address` column could show another address than the one checked ("10.0.0.10"
    /// sorts before "10.0.0.9").
    #[test]
    fn the_status_lists_the_address_in_use_first_then_the_providers_order() {
        use pb::{AddressScope::*, IpFamily::*};
        let addresses = [
            address("2001:db8::9", Internal, V6),
            address("10.0.0.9", Internal, V4),
            address("10.0.0.10", Internal, V4),
            address("203.0.113.9", External, V4),
        ];
        let listed = |chosen: &str| -> Vec<String> {
            status_addresses(&addresses, chosen.parse().ok())
                .into_iter()
                .map(|a| a.address)
                .collect()
        };
        assert_eq!(
            listed("10.0.0.9"),
            ["10.0.0.9", "2001:db8::9", "10.0.0.10", "203.0.113.9"]
        );
        assert_eq!(
            listed("2001:db8::9"),
            ["2001:db8::9", "10.0.0.9", "10.0.0.10", "203.0.113.9"]
        );
        assert_eq!(
            listed("none"),
            ["2001:db8::9", "10.0.0.9", "10.0.0.10", "203.0.113.9"]
        );
        let first = &status_addresses(&addresses, Some("10.0.0.9".parse().unwrap()))[0];
        assert_eq!(
            (first.scope.as_str(), first.family.as_str()),
            ("Internal", "IPv4")
        );
    }

    /// Before, a scope this operator does not know showed as `Internal`, and a family
    /// it does not know as `IPv4` whatever the address.
    #[test]
    fn values_of_a_newer_provider_show_as_the_contract_reads_them() {
        let newer = pb::Address {
            address: "2001:db8::9".to_owned(),
            scope: 7,
            family: 9,
        };
        let listed = status_addresses(&[newer], None);
        assert_eq!(
            (listed[0].scope.as_str(), listed[0].family.as_str()),
            ("External", "IPv6")
        );
        let unreadable = pb::Address {
            address: "not-an-ip".to_owned(),
            scope: pb::AddressScope::Internal as i32,
            family: 9,
        };
        let listed = status_addresses(&[unreadable], None);
        assert_eq!(
            (listed[0].scope.as_str(), listed[0].family.as_str()),
            ("Internal", "Unknown")
        );
    }
}
