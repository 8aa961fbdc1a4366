//! Faults on the real path, with real VMs (`make faults`). Each case converges to
//! exactly one VM and a Ready Proxy (or, for a deleted Proxy, to nothing), and leaves
//! nothing behind once its Proxy is deleted:
//! 1. the agent SIGKILLed while it uploads the base image, then restarted;
//! 2. sshd restarted as soon as the operator records the instance key (during Create, or
//!    just after it while the VM boots): every SSH session, and with it the agent's
//!    libvirt connection, drops;
//! 3. the operator SIGKILLed while the VM provisions, then restarted;
//! 4. the VM destroyed behind the operator's back (`virsh destroy`): the Proxy gets a
//!    new instance, and its Events name the old and the new id;
//! 5. the Proxy deleted while its VM provisions: nothing is left.
//!
//! The test prints a table: the case, what was injected, the time from the injection
//! until the Proxy converged, and the leaks found after its deletion (domains, overlays,
//! seeds, NVRAM files; there must be none).
//!
//! One stack serves all cases, one VM at a time (two cores). The image is served at
//! 40 MiB/s so that the first case can act during the download. Needs what
//! `e2e_proxy.rs` needs.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::{
    HOST, IMAGE, MACHINE_TYPE, PROVIDER, Stack, StackOptions,
};
use egressproxy_integration::e2e::wait_for;

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

async fn wait_ready(stack: &Stack, name: &str) {
    wait_for(&format!("{name} to be Ready"), READY_WITHIN, || {
        stack.proxy_field(name, "{.status.phase}") == "Ready"
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
    let instance = stack.proxy_field(name, "{.status.providerId}");
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

async fn agent_killed_during_base_upload(stack: &mut Stack) -> Duration {
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
    let injected = Instant::now();
    stack.kill_agent();
    stack.start_agent().await.unwrap();
    wait_ready(stack, "upload").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "upload");
    let bases = base_files(stack);
    assert_eq!(
        bases.len(),
        2,
        "one complete base and its marker: {bases:?}"
    );
    assert!(bases.iter().any(|f| f.ends_with(".complete")), "{bases:?}");
    delete(stack, "upload").await;
    converged
}

async fn ssh_dropped_during_create(stack: &mut Stack) -> Duration {
    stack.kubectl_apply(&manifest(stack, "ssh")).unwrap();
    // The base is cached: right after the apply the operator is checking the placement
    // or creating the VM, over the agent's SSH connection.
    wait_for("the operator to act", Duration::from_secs(60), || {
        !stack.proxy_field("ssh", "{.status.instanceKey}").is_empty()
    })
    .await;
    let injected = Instant::now();
    stack.restart_sshd().unwrap();
    wait_ready(stack, "ssh").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "ssh");
    delete(stack, "ssh").await;
    converged
}

async fn operator_killed_during_provisioning(stack: &mut Stack) -> (Duration, String) {
    stack.kubectl_apply(&manifest(stack, "crash")).unwrap();
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
    (
        converged,
        stack.proxy_field("crash", "{.status.providerId}"),
    )
}

async fn vm_destroyed_behind_the_operators_back(stack: &Stack, old: &str) -> Duration {
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
        events
            .lines()
            .any(|l| l.starts_with("Replaced: ") && l.contains(old) && l.contains(&new)),
        "a Replaced event names the old instance {old} and the new one {new}:\n{events}"
    );
    delete(stack, "crash").await;
    converged
}

async fn proxy_deleted_while_provisioning(stack: &Stack) -> Duration {
    stack.kubectl_apply(&manifest(stack, "early")).unwrap();
    wait_for("the VM to start", Duration::from_secs(120), || {
        !running_domains(stack).is_empty()
    })
    .await;
    assert_ne!(
        stack.proxy_field("early", "{.status.phase}"),
        "Ready",
        "the VM is still provisioning when its Proxy is deleted"
    );
    let injected = Instant::now();
    delete(stack, "early").await;
    let converged = injected.elapsed();
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
    converged
}

/// What a case left once its Proxy was deleted: domains, files in the pool other than
/// the cached base, NVRAM files.
fn leaks(stack: &Stack) -> Vec<String> {
    let mut leaks = stack.domains().unwrap_or_default();
    leaks.extend(
        Stack::files_in(&stack.pool_dir())
            .into_iter()
            .filter(|f| !f.starts_with("egressproxy-base-")),
    );
    leaks.extend(Stack::files_in(&stack.nvram_dir()));
    leaks
}

/// One row of the printed table.
struct Row {
    case: &'static str,
    injected: &'static str,
    converged: Duration,
    leaks: Vec<String>,
}

fn print_table(rows: &[Row]) {
    eprintln!("\n| # | case | injected | converged after | leaks |\n|---|---|---|---|---|");
    for (index, row) in rows.iter().enumerate() {
        eprintln!(
            "| {} | {} | {} | {:.1} s | {} |",
            index + 1,
            row.case,
            row.injected,
            row.converged.as_secs_f64(),
            row.leaks.len()
        );
    }
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
    let rows = std::sync::Mutex::new(Vec::new());
    let record = |case, injected, converged, stack: &Stack| {
        rows.lock().unwrap().push(Row {
            case,
            injected,
            converged,
            leaks: leaks(stack),
        });
    };
    let outcome = std::panic::AssertUnwindSafe(async {
        let converged = agent_killed_during_base_upload(&mut stack).await;
        record(
            "agent killed mid-Create",
            "SIGKILL during the base upload, restart",
            converged,
            &stack,
        );
        let converged = ssh_dropped_during_create(&mut stack).await;
        record(
            "SSH dropped while provisioning",
            "sshd and its sessions killed once the key is recorded, restart",
            converged,
            &stack,
        );
        let (converged, old) = operator_killed_during_provisioning(&mut stack).await;
        let converged_destroyed = vm_destroyed_behind_the_operators_back(&stack, &old).await;
        record(
            "operator killed mid-reconcile",
            "SIGKILL while the VM provisions, restart",
            converged,
            &stack,
        );
        record(
            "VM destroyed",
            "virsh destroy of the Ready VM",
            converged_destroyed,
            &stack,
        );
        let converged = proxy_deleted_while_provisioning(&stack).await;
        record(
            "Proxy deleted mid-provisioning",
            "kubectl delete while the VM boots",
            converged,
            &stack,
        );
    })
    .catch_unwind()
    .await;
    let rows = rows.into_inner().unwrap();
    print_table(&rows);
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
    for row in &rows {
        assert!(
            row.leaks.is_empty(),
            "{} left {:?} behind",
            row.case,
            row.leaks
        );
    }
}
