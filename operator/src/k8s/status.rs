//! Writing a Proxy's status: conditions in `metav1.Condition` form, the phase derived
//! from them in one place ([`phase`]), written whole under one field manager, and only
//! when something changed.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};

use crate::crd::{Phase, Proxy, ProxyStatus, condition};
use crate::shared::error::{PERMANENT_REASONS, Result};

/// The phase a status summarises, from its conditions (first match wins):
///
/// | the Proxy                                           | phase          |
/// |-----------------------------------------------------|----------------|
/// | is being deleted                                    | `Deleting`     |
/// | `Ready=True`                                        | `Ready`        |
/// | `Ready=False` with a reason a person must fix       | `Failed`       |
/// | `Healthy=False`                                     | `Degraded`     |
/// | has an instance, or had one (`Provisioned` is set)  | `Provisioning` |
/// | anything else                                       | `Pending`      |
pub fn phase(status: &ProxyStatus, deleting: bool) -> Phase {
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::READY);
    let has = |type_: &str| status.conditions.iter().any(|c| c.type_ == type_);
    if deleting {
        Phase::Deleting
    } else if ready.is_some_and(|c| c.status == "True") {
        Phase::Ready
    } else if ready.is_some_and(|c| PERMANENT_REASONS.contains(&c.reason.as_str())) {
        Phase::Failed
    } else if status
        .conditions
        .iter()
        .any(|c| c.type_ == condition::HEALTHY && c.status == "False")
    {
        Phase::Degraded
    } else if status.provider_id.is_some() || has(condition::PROVISIONED) {
        Phase::Provisioning
    } else {
        Phase::Pending
    }
}

/// The field manager of everything the operator writes.
pub const FIELD_MANAGER: &str = "egressproxy-operator";

/// Sets condition `type_`, keeping its transition time when its status is unchanged.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) {
    let status = if status { "True" } else { "False" }.to_owned();
    let message = message.into();
    if let Some(existing) = conditions.iter_mut().find(|c| c.type_ == type_) {
        if existing.status != status {
            existing.last_transition_time = Time(jiff::Timestamp::now());
        }
        existing.status = status;
        existing.reason = reason.to_owned();
        existing.message = message;
        existing.observed_generation = generation;
        return;
    }
    conditions.push(Condition {
        type_: type_.to_owned(),
        status,
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: Time(jiff::Timestamp::now()),
    });
}

/// Whether condition `type_` is True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// Writes `status` to `proxy` unless it equals what is already there. Returns the
/// resourceVersion the write gave the Proxy, or `None` when nothing was written.
///
/// The whole status is replaced by one JSON Patch operation rather than applied
/// server-side: the operator is its only writer, so an apply's field ownership buys
/// nothing, and the apiserver spends more CPU on it (merging the applied configuration
/// through the schema), which counts when thousands of Proxies start at once.
///
/// The patch tests the UID first: a reconcile working from the copy of a Proxy that
/// was deleted and created again under its name fails instead of writing the old one's
/// status onto the new one.
pub async fn write_if_changed(
    api: &Api<Proxy>,
    proxy: &Proxy,
    status: &ProxyStatus,
) -> Result<Option<String>> {
    if proxy.status.as_ref() == Some(status) {
        return Ok(None);
    }
    let name = proxy.metadata.name.as_deref().unwrap_or_default();
    let replace = json_patch::Patch(vec![
        json_patch::PatchOperation::Test(json_patch::TestOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["metadata", "uid"]),
            value: serde_json::json!(proxy.metadata.uid),
        }),
        json_patch::PatchOperation::Add(json_patch::AddOperation {
            path: json_patch::jsonptr::PointerBuf::from_tokens(["status"]),
            value: serde_json::to_value(status).map_err(kube::Error::SerdeError)?,
        }),
    ]);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let written = api
        .patch_status(name, &params, &Patch::Json::<()>(replace))
        .await?;
    Ok(Some(written.metadata.resource_version.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(conditions: &[(&str, bool, &str)], provider_id: Option<&str>) -> ProxyStatus {
        let mut status = ProxyStatus {
            provider_id: provider_id.map(str::to_owned),
            ..ProxyStatus::default()
        };
        for (type_, value, reason) in conditions {
            set_condition(&mut status.conditions, type_, *value, reason, "", None);
        }
        status
    }

    #[test]
    fn the_phase_follows_the_conditions() {
        use condition::{HEALTHY, PROVISIONED, READY};
        let cases = [
            (with(&[], None), false, Phase::Pending),
            (
                with(&[(READY, false, "ProviderUnavailable")], None),
                false,
                Phase::Pending,
            ),
            (
                with(&[(READY, false, "CloudInitSecretUnavailable")], None),
                false,
                Phase::Pending,
            ),
            (
                with(&[(READY, false, "Provisioning")], Some("i")),
                false,
                Phase::Provisioning,
            ),
            (
                with(&[(PROVISIONED, false, "InstanceStopped")], None),
                false,
                Phase::Provisioning,
            ),
            (
                with(
                    &[(READY, true, "Ready"), (HEALTHY, true, "HealthCheckPassed")],
                    Some("i"),
                ),
                false,
                Phase::Ready,
            ),
            (
                with(
                    &[
                        (READY, false, "HealthCheckFailed"),
                        (HEALTHY, false, "HealthCheckFailed"),
                    ],
                    Some("i"),
                ),
                false,
                Phase::Degraded,
            ),
            (
                with(&[(READY, false, "InvalidSpec")], None),
                false,
                Phase::Failed,
            ),
            (
                with(
                    &[
                        (READY, false, "ProviderNotConfigured"),
                        (HEALTHY, false, "x"),
                    ],
                    Some("i"),
                ),
                false,
                Phase::Failed,
            ),
            (
                with(&[(READY, true, "Ready")], Some("i")),
                true,
                Phase::Deleting,
            ),
        ];
        for (i, (status, deleting, expected)) in cases.into_iter().enumerate() {
            assert_eq!(phase(&status, deleting), expected, "case {i}: {status:?}");
        }
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            "Ready",
            false,
            "Provisioning",
            "booting",
            Some(1),
        );
        let first = conditions[0].last_transition_time.clone();
        std::thread::sleep(std::time::Duration::from_millis(5));
        set_condition(
            &mut conditions,
            "Ready",
            false,
            "Provisioning",
            "still booting",
            Some(2),
        );
        assert_eq!(conditions[0].last_transition_time, first);
        assert_eq!(
            (
                conditions[0].message.as_str(),
                conditions[0].observed_generation
            ),
            ("still booting", Some(2))
        );
        set_condition(&mut conditions, "Ready", true, "Ready", "", Some(2));
        assert_ne!(conditions[0].last_transition_time, first);
        assert!(is_true(&conditions, "Ready"));
        assert_eq!(conditions.len(), 1);
    }
}
