//! Faults on the real path, with real VMs. Each case converges to exactly one VM and a
//! Ready Proxy (or, for a deleted Proxy, to nothing):
//! 1. the agent SIGKILLed while it uploads the base image, then restarted;
//! 2. the operator SIGKILLed while the VM provisions, then restarted;
//! 3. the VM destroyed behind the operator's back (`virsh destroy`): the Proxy gets a
//!    new instance, and its Events name the old and the new id;
//! 4. the Proxy deleted while its VM provisions: nothing is left.
//!
//! One stack serves all cases, one VM at a time (two cores). The image is served at
//! 40 MiB/s so that the first case can act during the download. Needs what
//! `e2e_proxy.rs` needs.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::{
    HOST, IMAGE, MACHINE_TYPE, PROVIDER, Stack, StackOptions,
};

const READY_WITHIN: Duration = Duration::from_secs(600);

fn manifest(stack: &Stack, name: &str) -> String {
    format!(
        "apiVersion: egressproxy.dev/v1alpha1\n\
         kind: Proxy\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 provider: {PROVIDER}\n\
         \x20 placement: {{host: {HOST}, machineType: {MACHINE_TYPE}, image: {IMAGE}}}\n\
         \x20 healthCheck: {{type: Http, url: \"{url}\", periodSeconds: 5, timeoutSeconds: 3}}\n\
         \x20 provisioningTimeoutSeconds: 240\n",
        url = stack.target.url(),
    )
}

fn jsonpath(stack: &Stack, name: &str, path: &str) -> String {
    stack
        .kubectl(&["get", "proxy", name, "-o", &format!("jsonpath={path}")])
        .unwrap_or_default()
}

async fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_ready(stack: &Stack, name: &str) {
    wait_for(&format!("{name} to be Ready"), READY_WITHIN, || {
        jsonpath(stack, name, "{.status.phase}") == "Ready"
    })
    .await;
}

fn events(stack: &Stack, name: &str) -> String {
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

fn running_domains(stack: &Stack) -> Vec<String> {
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
fn assert_one_vm(stack: &Stack, name: &str) {
    let domains = stack.domains().unwrap();
    assert_eq!(domains.len(), 1, "exactly one VM for {name}: {domains:?}");
    assert_eq!(running_domains(stack), domains, "the one VM runs");
    let instance = jsonpath(stack, name, "{.status.providerId}");
    let key = instance.rsplit('/').next().unwrap_or_default();
    assert!(
        !key.is_empty() && domains[0].contains(key),
        "the VM {} is the Proxy's instance {instance}",
        domains[0]
    );
}

async fn delete(stack: &Stack, name: &str) {
    stack
        .kubectl(&["delete", "proxy", name, "--wait=false"])
        .unwrap();
    wait_for(
        &format!("{name} to be gone"),
        Duration::from_secs(180),
        || {
            stack
                .kubectl(&["get", "proxies", "-o", "name"])
                .unwrap_or_default()
                .trim()
                .is_empty()
        },
    )
    .await;
    assert_eq!(
        stack.domains().unwrap(),
        Vec::<String>::new(),
        "no VM after deleting {name}"
    );
}

fn base_files(stack: &Stack) -> Vec<String> {
    Stack::files_in(&stack.pool_dir())
        .into_iter()
        .filter(|f| f.starts_with("egressproxy-base-"))
        .collect()
}

async fn agent_killed_during_base_upload(stack: &mut Stack) {
    assert!(
        base_files(stack).is_empty(),
        "the pool starts without a base"
    );
    stack.kubectl_apply(&manifest(stack, "upload")).unwrap();
    wait_for("the base upload to start", Duration::from_secs(120), || {
        !base_files(stack).is_empty()
    })
    .await;
    assert!(
        !base_files(stack).iter().any(|f| f.ends_with(".complete")),
        "the upload is still under way when the agent is killed: {:?}",
        base_files(stack)
    );
    stack.kill_agent();
    stack.start_agent().await.unwrap();
    wait_ready(stack, "upload").await;
    assert_one_vm(stack, "upload");
    let bases = base_files(stack);
    assert_eq!(
        bases.len(),
        2,
        "one complete base and its marker: {bases:?}"
    );
    assert!(bases.iter().any(|f| f.ends_with(".complete")), "{bases:?}");
    delete(stack, "upload").await;
}

async fn operator_killed_during_provisioning(stack: &mut Stack) -> String {
    stack.kubectl_apply(&manifest(stack, "crash")).unwrap();
    wait_for("the VM to be created", Duration::from_secs(120), || {
        !jsonpath(stack, "crash", "{.status.providerId}").is_empty()
    })
    .await;
    assert_eq!(jsonpath(stack, "crash", "{.status.phase}"), "Provisioning");
    stack.kill_operator();
    stack.start_operator().await.unwrap();
    wait_ready(stack, "crash").await;
    assert_one_vm(stack, "crash");
    jsonpath(stack, "crash", "{.status.providerId}")
}

async fn vm_destroyed_behind_the_operators_back(stack: &Stack, old: &str) {
    let domain = stack.domains().unwrap().remove(0);
    stack.virsh(&["destroy", &domain]).unwrap();
    wait_for("a new instance", READY_WITHIN, || {
        let now = jsonpath(stack, "crash", "{.status.providerId}");
        !now.is_empty() && now != old
    })
    .await;
    wait_ready(stack, "crash").await;
    let new = jsonpath(stack, "crash", "{.status.providerId}");
    assert_one_vm(stack, "crash");
    let events = events(stack, "crash");
    assert!(
        events.contains(old),
        "the Events name the old instance {old}:\n{events}"
    );
    assert!(
        events
            .lines()
            .any(|l| l.starts_with("Replaced: ") && l.contains(old) && l.contains(&new)),
        "a Replaced event names the old instance {old} and the new one {new}:\n{events}"
    );
    delete(stack, "crash").await;
}

async fn proxy_deleted_while_provisioning(stack: &Stack) {
    stack.kubectl_apply(&manifest(stack, "early")).unwrap();
    wait_for("the VM to start", Duration::from_secs(120), || {
        !running_domains(stack).is_empty()
    })
    .await;
    assert_ne!(
        jsonpath(stack, "early", "{.status.phase}"),
        "Ready",
        "the VM is still provisioning when its Proxy is deleted"
    );
    delete(stack, "early").await;
    let left: Vec<String> = Stack::files_in(&stack.pool_dir())
        .into_iter()
        .filter(|f| !f.starts_with("egressproxy-base-"))
        .collect();
    assert_eq!(left, Vec::<String>::new(), "no overlay or seed is left");
    assert_eq!(
        Stack::files_in(&stack.nvram_dir()),
        Vec::<String>::new(),
        "no NVRAM is left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_converge_to_one_ready_vm() {
    use futures::FutureExt;
    let options = StackOptions {
        image_bytes_per_second: Some(40 << 20),
        ..StackOptions::default()
    };
    let mut stack = Stack::start_with("e2e-faults", &options)
        .await
        .expect("start the stack");
    let footprint = stack.footprint();
    let outcome = std::panic::AssertUnwindSafe(async {
        agent_killed_during_base_upload(&mut stack).await;
        let old = operator_killed_during_provisioning(&mut stack).await;
        vm_destroyed_behind_the_operators_back(&stack, &old).await;
        proxy_deleted_while_provisioning(&stack).await;
    })
    .catch_unwind()
    .await;
    if outcome.is_err() {
        for name in ["operator.log", "kvm-agent.log"] {
            let text = std::fs::read_to_string(stack.dir().join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "--- {name}\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
    tokio::task::spawn_blocking(move || drop(stack))
        .await
        .unwrap();
    let left = footprint.leftovers();
    if let Err(panic) = outcome {
        eprintln!("left behind after the failure: {left:?}");
        std::panic::resume_unwind(panic);
    }
    assert!(left.is_empty(), "the run left behind: {left:?}");
}
