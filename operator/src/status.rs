//! Writing a Proxy's status: conditions in `metav1.Condition` form, applied with
//! server-side apply under one field manager, and only when something changed.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};

use crate::crd::{Proxy, ProxyStatus};
use crate::error::Result;

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

/// Applies `status` to `proxy` unless it equals what is already there. Returns
/// whether a write happened.
pub async fn apply_if_changed(
    api: &Api<Proxy>,
    proxy: &Proxy,
    status: &ProxyStatus,
) -> Result<bool> {
    if proxy.status.as_ref() == Some(status) {
        return Ok(false);
    }
    let name = proxy.metadata.name.as_deref().unwrap_or_default();
    let patch = serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

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
