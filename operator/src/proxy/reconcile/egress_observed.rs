//! Observing the address destinations see (`status.egressAddress`), not assuming it:
//! the VM's own address is often not it (NAT between the VM's network and the
//! destination).
//!
//! 1. **When** ([`due`]): once the Proxy is Ready, if a check URL is configured
//!    (`spec.egress.checkUrl`, else the provider's `egressCheckUrl`) and the
//!    `EgressAddressObserved` condition is not True at the Proxy's generation. A
//!    replacement removes that condition with the rest of the old VM's state, so every
//!    new VM is checked once it is Ready; so is every spec change. A failed check is
//!    tried again at the next health check.
//! 2. **How**: [`egress_echo::egress_address`] through the proxy, within the health
//!    check's timeout.
//! 3. **What it records**: the address, the condition (True, or False with what
//!    failed), a Normal `EgressAddressChanged` Event naming the old and new address
//!    when an earlier one differed, and a Warning `EgressCheckFailed` Event when the
//!    check fails. A failed check keeps the last address observed. Without a check URL
//!    both the address and the condition are removed: nothing is shown that was not
//!    observed.

use std::net::SocketAddr;
use std::time::Duration;

use egressproxy_provider::pb;

use super::Reconciliation;
use crate::crd::{ProxyStatus, condition};
use crate::k8s::events::EventType;
use crate::probe::address::probe_address;
use crate::probe::egress_echo::{self, redact_url};

/// What to do about the egress address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Due {
    /// Nothing: observed through this VM at this generation, or nothing to remove.
    Nothing,
    /// No check URL any more: remove what an earlier one observed.
    Forget,
    /// Ask the echo service at this URL.
    Check(String),
}

/// The decision, from the configured check URL, the status and the Proxy's
/// generation.
pub(super) fn due(check_url: Option<String>, status: &ProxyStatus, generation: Option<i64>) -> Due {
    let observed = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::EGRESS_ADDRESS_OBSERVED);
    match check_url {
        None if observed.is_some() || status.egress_address.is_some() => Due::Forget,
        None => Due::Nothing,
        Some(_)
            if observed
                .is_some_and(|c| c.status == "True" && c.observed_generation == generation) =>
        {
            Due::Nothing
        }
        Some(url) => Due::Check(url),
    }
}

/// Observes the egress address of the Ready proxy at `addresses` if it is due.
pub(super) async fn observe_if_due(pass: &mut Reconciliation<'_>, addresses: &[pb::Address]) {
    let spec_url = pass
        .proxy
        .spec
        .egress
        .as_ref()
        .and_then(|egress| egress.check_url.clone());
    let check_url = spec_url.or_else(|| pass.provider.egress_check_url());
    let url = match due(check_url, &pass.status, pass.proxy.metadata.generation) {
        Due::Nothing => return,
        Due::Forget => {
            pass.status.egress_address = None;
            pass.status
                .conditions
                .retain(|c| c.type_ != condition::EGRESS_ADDRESS_OBSERVED);
            return;
        }
        Due::Check(url) => url,
    };
    let Some(ip) = probe_address(addresses) else {
        return;
    };
    let proxy = SocketAddr::new(ip, pass.proxy.spec.proxy_port);
    let check = pass.proxy.spec.health_check.clone().unwrap_or_default();
    let timeout = Duration::from_secs(u64::from(check.timeout_seconds));
    let instance = pass.status.provider_id.clone().unwrap_or_default();
    match egress_echo::egress_address(proxy, &url, timeout).await {
        Ok(seen) => {
            let seen = seen.to_string();
            let shown = redact_url(&url);
            if let Some(old) = pass.status.egress_address.as_deref()
                && old != seen
            {
                let note = format!(
                    "egress address changed from {old} to {seen} (seen by {shown} through instance {instance}): update allow-lists that name {old}"
                );
                pass.publish(EventType::Normal, "EgressAddressChanged", &note)
                    .await;
            }
            let message = format!("{seen} seen by {shown} through instance {instance}");
            pass.status.egress_address = Some(seen);
            pass.set(
                condition::EGRESS_ADDRESS_OBSERVED,
                true,
                "Observed",
                &message,
            );
        }
        Err(problem) => {
            let message = format!("the egress address was not observed: {problem}");
            pass.publish(EventType::Warning, "EgressCheckFailed", &message)
                .await;
            pass.set(
                condition::EGRESS_ADDRESS_OBSERVED,
                false,
                "EgressCheckFailed",
                &message,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::k8s::status::set_condition;

    fn status(observed: Option<(bool, i64)>, address: Option<&str>) -> ProxyStatus {
        let mut status = ProxyStatus {
            egress_address: address.map(str::to_owned),
            ..ProxyStatus::default()
        };
        if let Some((value, generation)) = observed {
            set_condition(
                &mut status.conditions,
                condition::EGRESS_ADDRESS_OBSERVED,
                value,
                "r",
                "",
                Some(generation),
            );
        }
        status
    }

    /// The same table as "When the check runs" in `docs/operator.md`.
    #[test]
    fn the_egress_check_runs_once_per_vm_and_generation_until_it_succeeds() {
        let url = || Some("http://echo.test/".to_owned());
        let check = Due::Check("http://echo.test/".into());
        let cases = [
            // check URL, observed (value, generation), address, generation 2 → due
            (url(), None, None, check.clone()),
            (url(), Some((true, 2)), Some("203.0.113.7"), Due::Nothing),
            (url(), Some((true, 1)), Some("203.0.113.7"), check.clone()),
            (url(), Some((false, 2)), Some("203.0.113.7"), check.clone()),
            (url(), None, Some("203.0.113.7"), check.clone()),
            (None, None, None, Due::Nothing),
            (None, Some((true, 2)), Some("203.0.113.7"), Due::Forget),
            (None, None, Some("203.0.113.7"), Due::Forget),
        ];
        for (check_url, observed, address, expected) in cases {
            let case = format!("{check_url:?} {observed:?} {address:?}");
            assert_eq!(
                due(check_url, &status(observed, address), Some(2)),
                expected,
                "{case}"
            );
        }
    }
}
