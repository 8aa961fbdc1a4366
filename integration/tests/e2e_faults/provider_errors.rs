//! The provider answering each error class of the contract. kvm-agent cannot produce
//! each on demand, so the reference provider (its `ControlService` injects faults) is
//! registered as a second provider of the stack's operator. Its instances report the
//! gateway address, so the operator's TCP health check reaches the target server's
//! port: they become Ready without a VM.
//!
//! For each class: `CreateInstance` fails with it until the Proxy's `Ready` condition
//! carries the reason `docs/operator.md` gives it (and the phase is `Failed` exactly
//! for the errors a person must fix, with an Event of that reason; `ALREADY_EXISTS`
//! makes the operator replace the attempt under a new key); then the fault is
//! cleared and the Proxy becomes Ready (after the retry annotation where the docs say
//! only a person's action retries soon). `NOT_FOUND` is a `GetInstance` answer: the
//! operator replaces the instance. Each Proxy is deleted, and the provider must then
//! hold no instance.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::{GATEWAY, Stack};
use egressproxy_integration::e2e::wait_for;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, ErrorClass, control_service_client::ControlServiceClient,
    inject_fault_request::Effect,
};

use crate::support::events;

const PROVIDER: &str = "reference";
type Control = ControlServiceClient<tonic::transport::Channel>;

/// One error class: what the operator must make of it.
struct Class {
    class: ErrorClass,
    /// The `Ready` condition's reason.
    reason: &'static str,
    /// A person must act: phase `Failed`, an Event, and the retry annotation.
    needs_a_person: bool,
    /// The condition carries the provider's message (a replacement says why instead).
    shows_message: bool,
    /// The row's case name.
    row: &'static str,
    /// The row's injection.
    injected: &'static str,
}

const CLASSES: &[Class] = &[
    Class {
        class: ErrorClass::Transient,
        reason: "ProviderUnavailable",
        needs_a_person: false,
        shows_message: true,
        row: "provider UNAVAILABLE",
        injected: "CreateInstance fails with UNAVAILABLE until cleared",
    },
    Class {
        class: ErrorClass::DeadlineExceeded,
        reason: "ProviderUnavailable",
        needs_a_person: false,
        shows_message: true,
        row: "provider DEADLINE_EXCEEDED",
        injected: "CreateInstance fails with DEADLINE_EXCEEDED until cleared",
    },
    Class {
        class: ErrorClass::QuotaExhausted,
        reason: "QuotaExhausted",
        needs_a_person: false,
        shows_message: true,
        row: "provider RESOURCE_EXHAUSTED",
        injected: "CreateInstance fails with RESOURCE_EXHAUSTED until cleared",
    },
    Class {
        class: ErrorClass::Permanent,
        reason: "ProviderRejected",
        needs_a_person: true,
        shows_message: true,
        row: "provider FAILED_PRECONDITION",
        injected: "CreateInstance fails with FAILED_PRECONDITION until cleared",
    },
    Class {
        class: ErrorClass::InvalidArgument,
        reason: "InvalidSpec",
        needs_a_person: true,
        shows_message: true,
        row: "provider INVALID_ARGUMENT",
        injected: "CreateInstance fails with INVALID_ARGUMENT until cleared",
    },
    Class {
        class: ErrorClass::AlreadyExists,
        // The key is taken, but no instance tagged as the Proxy's holds it: the
        // operator leaves it alone and creates under the next key, with the replace
        // backoff.
        reason: "InstanceKeyTaken",
        needs_a_person: false,
        shows_message: false,
        row: "provider ALREADY_EXISTS",
        injected: "CreateInstance fails with ALREADY_EXISTS until cleared",
    },
    Class {
        class: ErrorClass::Unimplemented,
        reason: "ProviderRejected",
        needs_a_person: true,
        shows_message: true,
        row: "provider UNIMPLEMENTED",
        injected: "CreateInstance fails with UNIMPLEMENTED until cleared",
    },
];

/// One row per class: its name, what was injected, the time from the injection to Ready.
pub(crate) async fn provider_errors(
    stack: &mut Stack,
) -> Vec<(&'static str, &'static str, Duration)> {
    let provider = ReferenceProvider::start(&[
        "--provisioning-delay",
        "1s",
        "--instance-address",
        &GATEWAY.to_string(),
    ])
    .unwrap();
    let port = provider
        .address()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap();
    stack.add_provider(PROVIDER, port).await.unwrap();
    let mut control = ControlServiceClient::connect(provider.endpoint().to_owned())
        .await
        .unwrap();
    let mut rows = Vec::new();
    for (index, class) in CLASSES.iter().enumerate() {
        let name = format!("class-{index}");
        let converged = create_fails_with(stack, &mut control, &name, class).await;
        delete_and_count(stack, &provider, &name).await;
        rows.push((class.row, class.injected, converged));
    }
    let converged = instance_not_found(stack, &mut control).await;
    delete_and_count(stack, &provider, "vanishes").await;
    rows.push((
        "provider NOT_FOUND",
        "GetInstance of the Ready instance: NOT_FOUND once",
        converged,
    ));
    rows
}

async fn create_fails_with(
    stack: &Stack,
    control: &mut Control,
    name: &str,
    class: &Class,
) -> Duration {
    let message = format!("injected {:?} for {name}", class.class);
    control
        .inject_fault(control::InjectFaultRequest {
            method: "CreateInstance".into(),
            count: None,
            effect: Some(Effect::Fail(class.class as i32)),
            message: message.clone(),
            retry_after: None,
        })
        .await
        .unwrap();
    let injected = Instant::now();
    stack.kubectl_apply(&manifest(stack, name)).unwrap();
    let ready = "{.status.conditions[?(@.type==\"Ready\")]}";
    wait_for(
        &format!("{name}'s Ready condition to say {}", class.reason),
        Duration::from_secs(60),
        || {
            let condition = stack.proxy_field(name, ready);
            condition.contains(&format!("\"reason\":\"{}\"", class.reason))
                && (!class.shows_message || condition.contains(&message))
        },
    )
    .await;
    let phase = stack.proxy_field(name, "{.status.phase}");
    let events = events(stack, name);
    eprintln!(
        "provider-errors: {:?}: phase {phase}; Events:\n{events}",
        class.class
    );
    if class.needs_a_person {
        assert_eq!(phase, "Failed", "{:?} needs a person", class.class);
        assert!(
            events
                .lines()
                .any(|l| l.starts_with(&format!("{}: ", class.reason)) && l.contains(&message)),
            "an Event {} carries the provider's message:\n{events}",
            class.reason
        );
    } else {
        assert_ne!(phase, "Failed", "{:?} is retried by itself", class.class);
    }
    if class.reason == "InstanceKeyTaken" {
        assert!(
            events
                .lines()
                .any(|l| l.starts_with("InstanceKeyTaken: ") && l.contains("left alone")),
            "an InstanceKeyTaken Event says the key was taken and its instance left alone:\n{events}"
        );
    }
    control
        .clear_faults(control::ClearFaultsRequest {})
        .await
        .unwrap();
    if class.needs_a_person {
        let now = format!("{:?}", std::time::SystemTime::now());
        stack
            .kubectl(&[
                "annotate",
                "proxy",
                name,
                "--overwrite",
                &format!("egressproxy.dev/reconcile-requested-at={now}"),
            ])
            .unwrap();
    }
    wait_ready(stack, name).await;
    injected.elapsed()
}

/// The Ready instance's `GetInstance` answers NOT_FOUND once: the operator replaces it.
async fn instance_not_found(stack: &Stack, control: &mut Control) -> Duration {
    stack.kubectl_apply(&manifest(stack, "vanishes")).unwrap();
    wait_ready(stack, "vanishes").await;
    let old = stack.proxy_field("vanishes", "{.status.providerId}");
    control
        .inject_fault(control::InjectFaultRequest {
            method: "GetInstance".into(),
            count: Some(1),
            effect: Some(Effect::Fail(ErrorClass::NotFound as i32)),
            message: "injected NotFound".into(),
            retry_after: None,
        })
        .await
        .unwrap();
    let injected = Instant::now();
    wait_for("a new instance", Duration::from_secs(60), || {
        let now = stack.proxy_field("vanishes", "{.status.providerId}");
        !now.is_empty() && now != old
    })
    .await;
    wait_ready(stack, "vanishes").await;
    let converged = injected.elapsed();
    let events = events(stack, "vanishes");
    assert!(
        events
            .lines()
            .any(|l| l.starts_with("InstanceVanished: ") && l.contains(&old)),
        "an InstanceVanished Event names {old}:\n{events}"
    );
    converged
}

async fn wait_ready(stack: &Stack, name: &str) {
    wait_for(
        &format!("{name} to be Ready"),
        Duration::from_secs(60),
        || stack.proxy_field(name, "{.status.phase}") == "Ready",
    )
    .await;
}

/// Deletes Proxy `name`; then the provider holds no instance at all.
async fn delete_and_count(stack: &Stack, provider: &ReferenceProvider, name: &str) {
    stack
        .kubectl(&["delete", "proxy", name, "--wait=false"])
        .unwrap();
    wait_for(
        &format!("{name} to be gone"),
        Duration::from_secs(60),
        || {
            stack
                .kubectl(&["get", "proxy", name, "-o", "name"])
                .is_err()
        },
    )
    .await;
    let options = egressproxy_provider::client::ClientOptions::new(provider.endpoint());
    let mut client = egressproxy_provider::client::connect_lazy(&options).unwrap();
    let left = client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .instances;
    let ids: Vec<&str> = left.iter().map(|i| i.id.as_str()).collect();
    assert!(
        ids.is_empty(),
        "{name} left instances at the provider: {ids:?}"
    );
}

/// A Proxy of the reference provider whose TCP health check reaches the target server.
fn manifest(stack: &Stack, name: &str) -> String {
    let url = stack.target.url();
    let port = url
        .trim_end_matches('/')
        .rsplit(':')
        .next()
        .unwrap_or_default();
    format!(
        "apiVersion: egressproxy.dev/v1alpha1\n\
         kind: Proxy\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 provider: {PROVIDER}\n\
         \x20 placement: {{machineType: small, image: debian-12}}\n\
         \x20 proxyPort: {port}\n\
         \x20 healthCheck: {{type: Tcp, periodSeconds: 2, timeoutSeconds: 1}}\n"
    )
}
