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

/// Like [`manifest`], with the target's echo as the Proxy's egress check URL.
pub(crate) fn manifest_checking_egress(stack: &Stack, name: &str) -> String {
    format!(
        "{}\x20 egress: {{checkUrl: \"{}\"}}\n",
        manifest(stack, name),
        stack.target.echo_url()
    )
}

/// The `<host>` elements of the guests' libvirt network: its DHCP host reservations.
pub(crate) fn dhcp_hosts(stack: &Stack) -> Vec<String> {
    let xml = stack.virsh(&["net-dumpxml", "default"]).unwrap();
    xml.lines()
        .map(str::trim)
        .filter(|line| line.starts_with("<host "))
        .map(str::to_owned)
        .collect()
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

/// Whether the `Replaced` Events (`instance A → B (...)`) lead from instance `old` to
/// `new`: in one step, or in several when a replacement was itself replaced (a guest
/// that did not boot within the provisioning timeout).
pub(crate) fn replaced_chain(events: &str, old: &str, new: &str) -> bool {
    let steps: std::collections::HashMap<&str, &str> = events
        .lines()
        .filter_map(|l| l.strip_prefix("Replaced: instance "))
        .filter_map(|l| l.split_once(" → "))
        .filter_map(|(from, rest)| Some((from, rest.split_whitespace().next()?)))
        .collect();
    let mut at = old;
    for _ in 0..=steps.len() {
        match steps.get(at) {
            Some(&next) if next == new => return true,
            Some(&next) => at = next,
            None => return false,
        }
    }
    false
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

#[cfg(test)]
mod tests {
    use super::replaced_chain;

    /// Events of a VM destroyed whose first replacement did not boot in time.
    const TWICE_REPLACED: &str = "\
Created: created instance hv1/k-0 with provider kvm
InstanceStopped: instance hv1/k-0 stopped (shut off): replacing it
Replaced: instance hv1/k-0 → hv1/k-1 (stopped (shut off)); replacement 1
ProvisioningTimedOut: instance hv1/k-1 was not ready within spec.provisioningTimeoutSeconds (240s): replacing it
Replaced: instance hv1/k-1 → hv1/k-2 (not ready within 240s); replacement 2
";

    #[test]
    fn replaced_chain_follows_one_or_several_replacements() {
        assert!(replaced_chain(TWICE_REPLACED, "hv1/k-0", "hv1/k-1"));
        assert!(replaced_chain(TWICE_REPLACED, "hv1/k-0", "hv1/k-2"));
        assert!(replaced_chain(TWICE_REPLACED, "hv1/k-1", "hv1/k-2"));
    }

    #[test]
    fn replaced_chain_needs_every_step() {
        assert!(!replaced_chain(TWICE_REPLACED, "hv1/k-2", "hv1/k-0"));
        assert!(!replaced_chain(TWICE_REPLACED, "hv1/k-0", "hv1/k-3"));
        let gap = TWICE_REPLACED.replace("Replaced: instance hv1/k-0", "Other: instance hv1/k-0");
        assert!(!replaced_chain(&gap, "hv1/k-0", "hv1/k-2"));
        let cycle = "Replaced: instance a → b (x)\nReplaced: instance b → a (x)\n";
        assert!(!replaced_chain(cycle, "a", "c"));
    }
}
