//! The operator SIGKILLed while the VM provisions, then restarted; then that VM
//! destroyed behind the operator's back (`virsh destroy`): the Proxy gets a new
//! instance, and its Events name the old and the new id.
//!
//! The replacement keeps the egress address, as a partner's allow-list needs: the
//! Proxy's address identity reserves the VM's address in the libvirt network's DHCP
//! host list. A destination that admits only that source answers through the Proxy
//! before and after (and refuses the test's own address, so the check can fail); the
//! address the operator observes through the echo URL is the one the destination
//! logged; deleting the Proxy gives the reservation back.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::e2e::wait_for;

use crate::support::{
    READY_WITHIN, assert_one_vm, delete, dhcp_hosts, events, manifest_checking_egress,
    replaced_chain, wait_ready,
};

/// What the destroy case needs from the first: the instance and the network's DHCP
/// host list before the Proxy existed.
pub(crate) struct Crashed {
    pub(crate) instance: String,
    pub(crate) dhcp_hosts_before: Vec<String>,
}

/// Leaves the Proxy `crash` Ready; returns the time to converge and what the destroy case
/// needs.
pub(crate) async fn operator_killed_during_provisioning(stack: &mut Stack) -> (Duration, Crashed) {
    let dhcp_hosts_before = dhcp_hosts(stack);
    stack
        .kubectl_apply(&manifest_checking_egress(stack, "crash"))
        .unwrap();
    wait_for("the VM to be created", Duration::from_secs(120), || {
        !stack
            .proxy_field("crash", "{.status.providerId}")
            .is_empty()
    })
    .await;
    assert_eq!(
        stack.proxy_field("crash", "{.status.phase}"),
        "Provisioning"
    );
    let injected = Instant::now();
    stack.kill_operator();
    stack.start_operator().await.unwrap();
    wait_ready(stack, "crash").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "crash");
    let crashed = Crashed {
        instance: stack.proxy_field("crash", "{.status.providerId}"),
        dhcp_hosts_before,
    };
    (converged, crashed)
}

/// Destroys the VM of the Ready Proxy `crash`, then deletes the Proxy.
pub(crate) async fn vm_destroyed_behind_the_operators_back(
    stack: &Stack,
    crashed: &Crashed,
) -> Duration {
    let old = crashed.instance.as_str();
    let address = stack.proxy_field("crash", "{.status.addresses[0].address}");
    assert!(!address.is_empty(), "the Ready Proxy has an address");
    let reserved = format!("ip='{address}'");
    assert!(
        dhcp_hosts(stack)
            .iter()
            .any(|host| host.contains(&reserved)),
        "the network reserves {address} for the Proxy: {:?}",
        dhcp_hosts(stack)
    );
    egress_observed_as_the_destination_logged(stack, &address).await;
    assert_only_that_source_is_admitted(stack, &address);
    let echoes_before = stack.target.echoed().len();

    let domain = stack.domains().unwrap().remove(0);
    let injected = Instant::now();
    stack.virsh(&["destroy", &domain]).unwrap();
    wait_for("a new instance", READY_WITHIN, || {
        let now = stack.proxy_field("crash", "{.status.providerId}");
        !now.is_empty() && now != old
    })
    .await;
    wait_ready(stack, "crash").await;
    let converged = injected.elapsed();
    let new = stack.proxy_field("crash", "{.status.providerId}");
    assert_one_vm(stack, "crash");
    let events = events(stack, "crash");
    assert!(
        events.contains(old),
        "the Events name the old instance {old}:\n{events}"
    );
    assert!(
        replaced_chain(&events, old, &new),
        "Replaced events lead from the old instance {old} to the new one {new}:\n{events}"
    );
    assert_eq!(
        stack.proxy_field("crash", "{.status.addresses[0].address}"),
        address,
        "the replacement kept the egress address"
    );
    // The condition went with the old VM's state: this is the new VM's observation.
    egress_observed_as_the_destination_logged(stack, &address).await;
    assert!(
        stack.target.echoed().len() > echoes_before,
        "the new VM was asked through the echo"
    );
    assert_only_that_source_is_admitted(stack, &address);
    delete(stack, "crash").await;
    // Create and Delete also sweep reservations no domain holds, so the list may have
    // lost others too; it must not hold this one, nor anything new.
    let after = dhcp_hosts(stack);
    assert!(
        after
            .iter()
            .all(|host| !host.contains(&reserved) && crashed.dhcp_hosts_before.contains(host)),
        "deleting the Proxy gave its reservation back: before {:?}, after {after:?}",
        crashed.dhcp_hosts_before
    );
    converged
}

/// Waits until the operator has observed the Proxy's egress address through the echo
/// URL, and checks that it is `address` and the one the destination logged last.
async fn egress_observed_as_the_destination_logged(stack: &Stack, address: &str) {
    let observed = "{.status.conditions[?(@.type==\"EgressAddressObserved\")].status}";
    wait_for("the egress address to be observed", READY_WITHIN, || {
        stack.proxy_field("crash", observed) == "True"
    })
    .await;
    assert_eq!(
        stack.proxy_field("crash", "{.status.egressAddress}"),
        address
    );
    let logged = stack.target.echoed().last().map(ToString::to_string);
    assert_eq!(
        logged.as_deref(),
        Some(address),
        "the destination logged the observed address"
    );
}

/// A destination that allow-lists `address` answers through the Proxy, and refuses a
/// request from the test's own address.
fn assert_only_that_source_is_admitted(stack: &Stack, address: &str) {
    let url = stack.target.only_from_url(address);
    let status = |via: &[&str]| {
        let mut args = vec![
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "20",
        ];
        args.extend_from_slice(via);
        args.push(&url);
        stack.curl_in_netns(&args).unwrap()
    };
    let proxy = format!("http://{address}:3128");
    assert_eq!(status(&["-x", &proxy]), "200", "admitted through the Proxy");
    assert_eq!(
        status(&["--noproxy", "*"]),
        "403",
        "the test's own address is refused"
    );
}
