//! What every case needs: the Proxy manifest, waits on its phase, the VM and leak checks.

use std::time::Duration;

use egressproxy_integration::e2e::stack::{HOST, IMAGE, MACHINE_TYPE, PROVIDER, Stack};
use egressproxy_integration::e2e::wait_for;

/// How long a Proxy may take to become Ready after a fault (TCG boots, under load).
pub(crate) const READY_WITHIN: Duration = Duration::from_secs(600);

/// A Proxy of the stack's provider, host, image and machine type, health-checked
/// against the stack's target server.
pub(crate) fn manifest(stack: &Stack, name: &str) -> String {
    manifest_placed(stack, name, PROVIDER, HOST, IMAGE)
}

/// Like [`manifest`], with another provider, host or image.
pub(crate) fn manifest_placed(
    stack: &Stack,
    name: &str,
    provider: &str,
    host: &str,
    image: &str,
) -> String {
    format!(
        "apiVersion: egressproxy.dev/v1alpha1\n\
         kind: Proxy\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 provider: {provider}\n\
         \x20 placement: {{host: {host}, machineType: {MACHINE_TYPE}, image: {image}}}\n\
         \x20 healthCheck: {{type: Http, url: \"{url}\", periodSeconds: 5, timeoutSeconds: 3}}\n\
         \x20 provisioningTimeoutSeconds: 240\n",
        url = stack.target.url(),
    )
}

pub(crate) async fn wait_ready(stack: &Stack, name: &str) {
    wait_for(&format!("{name} to be Ready"), READY_WITHIN, || {
        stack.proxy_field(name, "{.status.phase}") == "Ready"
    })
    .await;
}

/// The Events of the object `name`, one `reason: message` a line.
pub(crate) fn events(stack: &Stack, name: &str) -> String {
    stack
        .kubectl(&[
            "get",
            "events",
            "--field-selector",
            &format!("involvedObject.name={name}"),
            "-o",
            "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
        ])
        .unwrap_or_default()
}

pub(crate) fn running_domains(stack: &Stack) -> Vec<String> {
    stack
        .virsh(&["list", "--name"])
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Exactly one domain exists, it runs, and it is the Proxy's instance.
pub(crate) fn assert_one_vm(stack: &Stack, name: &str) {
    let domains = stack.domains().unwrap();
    assert_eq!(domains.len(), 1, "exactly one VM for {name}: {domains:?}");
    assert_eq!(running_domains(stack), domains, "the one VM runs");
    let instance = stack.proxy_field(name, "{.status.providerId}");
    let key = instance.rsplit('/').next().unwrap_or_default();
    assert!(
        !key.is_empty() && domains[0].contains(key),
        "the VM {} is the Proxy's instance {instance}",
        domains[0]
    );
}

/// Deletes the Proxy `name`, waits until no Proxy is left, and checks that no VM is.
pub(crate) async fn delete(stack: &Stack, name: &str) {
    stack.delete_proxy(name, Duration::from_secs(180)).await;
}

/// The cached base images in the pool (and their completion markers).
pub(crate) fn base_files(stack: &Stack) -> Vec<String> {
    Stack::files_in(&stack.pool_dir())
        .into_iter()
        .filter(|f| f.starts_with("egressproxy-base-"))
        .collect()
}

/// What a case left once its Proxy was deleted: domains, files in the pool other than
/// the cached base, NVRAM files.
pub(crate) fn leaks(stack: &Stack) -> Vec<String> {
    let mut leaks = stack.domains().unwrap_or_default();
    leaks.extend(
        Stack::files_in(&stack.pool_dir())
            .into_iter()
            .filter(|f| !f.starts_with("egressproxy-base-")),
    );
    leaks.extend(Stack::files_in(&stack.nvram_dir()));
    leaks
}
