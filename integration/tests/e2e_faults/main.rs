//! Faults on the real path, with real VMs (`make faults`). Each case converges to
//! exactly one VM and a Ready Proxy (or, for a deleted Proxy, to nothing), and leaves
//! nothing behind once its Proxy is deleted:
//! 1. the agent SIGKILLed while it uploads the base image, then restarted;
//! 2. sshd restarted as soon as the operator records the instance key (during Create, or
//!    just after it while the VM boots): every SSH session, and with it the agent's
//!    libvirt connection, drops;
//! 3. the operator SIGKILLed while the VM provisions, then restarted;
//! 4. the VM destroyed behind the operator's back (`virsh destroy`): the Proxy gets a
//!    new instance with the same egress address (a destination that allow-lists it
//!    answers before and after; the address observed is the one it logged), and its
//!    Events name the old and the new id;
//! 5. the Proxy deleted while its VM provisions: nothing is left;
//! 6. libvirtd restarted alone while the VM starts: the guest keeps running, the new
//!    daemon reconnects to it;
//! 7. libvirtd hung (SIGSTOP) for longer than the call deadline while the VM provisions,
//!    then continued: the calls end with a deadline error, nothing hangs;
//! 8. the kube-apiserver crashed and restarted on the same data while the VM provisions:
//!    the operator's watches recover;
//! 9. the hypervisor presenting another SSH host key: the agent refuses it and the Proxy
//!    says which host and what to do; with the known key back it becomes Ready;
//! 10. the image download cut mid-stream (a base no pool has yet), until the Proxy's
//!     status names the cause: the retry downloads it again, nothing half-written stays;
//! 11. the storage pool's disk full (a second host whose pool is a 64 MiB tmpfs): the
//!     status names the pool, the host and the fix, nothing half-written stays, and once
//!     the tmpfs is grown the Proxy becomes Ready;
//! 12. the provider answering each error class of the contract (the reference provider,
//!     registered as a second provider, injects them): the condition's reason and the
//!     Events say what the operator does, and clearing the fault converges;
//! 13. two kvm-agents on one hypervisor (unsupported): what `docs/kvm-agent.md` says
//!     happens, happens.
//!
//! `FAULTS=agent-killed,operator-killed` runs only those cases (see [`LANES`]); by
//! default every case runs.
//!
//! The test prints a table: the case, what was injected, the time from the injection
//! until the Proxy converged, and the leaks found after its deletion (domains, overlays,
//! seeds, NVRAM files; there must be none).
//!
//! Two stacks run side by side, each with its own libvirtd, sshd, agent, operator and
//! namespace, and each runs one lane of cases, one VM at a time: a guest boots on about
//! one core under TCG, and a case spends much of its time waiting (deadlines, backoffs,
//! a throttled download), so two lanes on two cores take about half the time of one.
//! The kube-apiserver is the one thing they share, so the case that restarts it runs
//! alone, after both lanes. The image is served at 40 MiB/s so that the first case can
//! act during the download, and every call has a deadline of [`CALL_TIMEOUT`], so that a
//! hang outlasts it soon. Needs what `e2e_proxy.rs` needs. This binary has a single
//! test: the apiserver case restarts the apiserver every test of the process shares.

mod agent_killed;
mod apiserver_restarted;
mod deleted_while_provisioning;
mod download_cut;
mod host_key_changed;
mod libvirtd_hung;
mod libvirtd_restarted;
mod operator_killed;
mod pool_full;
mod provider_errors;
mod ssh_dropped;
mod support;
mod two_agents;

use std::time::Duration;

use egressproxy_integration::e2e::stack::{Stack, StackOptions};

/// Every case by the name `FAULTS` selects it with: two lanes that run side by side,
/// each on its own stack, their cases one after another. A lane's first case finds its
/// pool empty, which the base upload case needs. No case of one lane touches the other
/// lane's stack.
const LANES: [&[&str]; 2] = [
    &[
        "agent-killed",
        "operator-killed",
        "libvirtd-restarted",
        "libvirtd-hung",
        "pool-full",
    ],
    &[
        "ssh-dropped",
        "deleted-while-provisioning",
        "host-key-changed",
        "download-cut",
        "provider-errors",
        "two-agents",
    ],
];

/// The cases that touch what both lanes share (the kube-apiserver): they run on the
/// first lane's stack once both lanes are done.
const ALONE: &[&str] = &["apiserver-restarted"];

/// The operator's and the agent's deadline of each call in this stack (the default is
/// 60 s): short enough that the hung-libvirtd case outlasts it soon, long enough for a
/// Create on two loaded cores.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// One row of the printed table.
struct Row {
    case: &'static str,
    injected: &'static str,
    converged: Duration,
    leaks: Vec<String>,
}

impl Row {
    fn new(case: &'static str, injected: &'static str, converged: Duration) -> Self {
        Row {
            case,
            injected,
            converged,
            leaks: Vec::new(),
        }
    }
}

/// Runs the case `name`; its rows, without leaks yet.
async fn run_case(name: &str, stack: &mut Stack) -> Vec<Row> {
    match name {
        "agent-killed" => vec![Row::new(
            "agent killed mid-Create",
            "SIGKILL during the base upload, restart",
            agent_killed::agent_killed_during_base_upload(stack).await,
        )],
        "ssh-dropped" => vec![Row::new(
            "SSH dropped while provisioning",
            "sshd and its sessions killed once the key is recorded, restart",
            ssh_dropped::ssh_dropped_during_create(stack).await,
        )],
        "operator-killed" => {
            let (killed, crashed) =
                operator_killed::operator_killed_during_provisioning(stack).await;
            let destroyed =
                operator_killed::vm_destroyed_behind_the_operators_back(stack, &crashed).await;
            vec![
                Row::new(
                    "operator killed mid-reconcile",
                    "SIGKILL while the VM provisions, restart",
                    killed,
                ),
                Row::new("VM destroyed", "virsh destroy of the Ready VM", destroyed),
            ]
        }
        "deleted-while-provisioning" => vec![Row::new(
            "Proxy deleted mid-provisioning",
            "kubectl delete while the VM boots",
            deleted_while_provisioning::proxy_deleted_while_provisioning(stack).await,
        )],
        "libvirtd-restarted" => vec![Row::new(
            "libvirtd restarted while the VM starts",
            "libvirtd alone SIGTERMed and started again; its booting guest keeps running",
            libvirtd_restarted::libvirtd_restarted_while_the_vm_starts(stack).await,
        )],
        "libvirtd-hung" => {
            let (converged, _hung_for) =
                libvirtd_hung::libvirtd_hung_while_provisioning(stack).await;
            vec![Row::new(
                "libvirtd hung while provisioning",
                "SIGSTOP of libvirtd and its guests past the call deadline, then SIGCONT",
                converged,
            )]
        }
        "apiserver-restarted" => {
            let (converged, _down_for, kept_running) =
                apiserver_restarted::apiserver_restarted_while_provisioning(stack).await;
            vec![Row::new(
                "kube-apiserver restarted mid-provisioning",
                if kept_running {
                    "SIGKILL, start on the same port and data (the operator kept running)"
                } else {
                    "SIGKILL, start on the same port and data (the operator lost its Lease and was restarted)"
                },
                converged,
            )]
        }
        "host-key-changed" => {
            let (refused, converged) = host_key_changed::host_key_changed(stack).await;
            vec![
                Row::new(
                    "SSH host key changed",
                    "sshd restarted with another host key, Proxy applied (time until refused)",
                    refused,
                ),
                Row::new(
                    "SSH host key restored",
                    "sshd restarted with its own key, retry annotation set",
                    converged,
                ),
            ]
        }
        "download-cut" => vec![Row::new(
            "image download cut",
            "connection reset halfway through a new base, until reported",
            download_cut::download_cut_mid_stream(stack).await,
        )],
        "pool-full" => vec![Row::new(
            "storage pool full",
            "64 MiB tmpfs pool; time from growing it to 1 GiB",
            pool_full::pool_full(stack).await,
        )],
        "provider-errors" => provider_errors::provider_errors(stack)
            .await
            .into_iter()
            .map(|(case, injected, converged)| Row::new(case, injected, converged))
            .collect(),
        "two-agents" => vec![Row::new(
            "two agents, one hypervisor",
            "a second kvm-agent serve as provider kvm-b; time to Ready",
            two_agents::two_agents_on_one_hypervisor(stack).await,
        )],
        other => unreachable!("no case {other}"),
    }
}

/// The cases `FAULTS` names (all by default): of each lane, and of [`ALONE`], in their
/// order.
fn selected_cases() -> ([Vec<&'static str>; 2], Vec<&'static str>) {
    let wanted: Option<Vec<String>> = std::env::var("FAULTS")
        .ok()
        .map(|list| list.split(',').map(|name| name.trim().to_owned()).collect());
    let every: Vec<&str> = LANES
        .iter()
        .flat_map(|lane| lane.iter())
        .chain(ALONE)
        .copied()
        .collect();
    if let Some(wanted) = &wanted {
        for name in wanted {
            assert!(
                every.contains(&name.as_str()),
                "FAULTS names {name:?}, which is not a case; the cases are {every:?}"
            );
        }
    }
    let pick = |cases: &[&'static str]| -> Vec<&'static str> {
        cases
            .iter()
            .copied()
            .filter(|case| wanted.as_ref().is_none_or(|w| w.iter().any(|n| n == case)))
            .collect()
    };
    ([pick(LANES[0]), pick(LANES[1])], pick(ALONE))
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

/// Runs `cases` on `stack` one after another; the rows so far, and the panic of the case
/// that failed, if one did.
async fn run_lane(
    cases: &[&'static str],
    stack: &mut Stack,
) -> (Vec<Row>, Option<Box<dyn std::any::Any + Send>>) {
    use futures::FutureExt;
    let mut rows = Vec::new();
    for case in cases {
        let outcome = std::panic::AssertUnwindSafe(run_case(case, stack))
            .catch_unwind()
            .await;
        match outcome {
            Ok(mut case_rows) => {
                let left = support::leaks(stack);
                for row in &mut case_rows {
                    row.leaks.clone_from(&left);
                }
                rows.extend(case_rows);
            }
            Err(panic) => return (rows, Some(panic)),
        }
    }
    (rows, None)
}

async fn start_stack(name: &str) -> Stack {
    let options = StackOptions {
        image_bytes_per_second: Some(40 << 20),
        call_timeout: Some(CALL_TIMEOUT),
        ..StackOptions::default()
    };
    Stack::start_with(name, &options)
        .await
        .unwrap_or_else(|e| panic!("start the stack {name}: {e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_converge_to_one_ready_vm() {
    let ([first, second], alone) = selected_cases();
    let (mut first_stack, mut second_stack) = tokio::join!(start_stack("e2e-faults-a"), async {
        if second.is_empty() {
            None
        } else {
            Some(start_stack("e2e-faults-b").await)
        }
    });
    let footprints: Vec<_> = std::iter::once(&first_stack)
        .chain(second_stack.as_ref())
        .map(Stack::footprint)
        .collect();

    let second_lane = async {
        match second_stack.as_mut() {
            Some(stack) => run_lane(&second, stack).await,
            None => (Vec::new(), None),
        }
    };
    let ((mut rows, mut failed), (second_rows, second_failed)) =
        tokio::join!(run_lane(&first, &mut first_stack), second_lane);
    rows.extend(second_rows);
    if failed.is_none() && second_failed.is_none() {
        let (alone_rows, alone_failed) = run_lane(&alone, &mut first_stack).await;
        rows.extend(alone_rows);
        failed = alone_failed;
    }
    let failed = failed.or(second_failed);

    print_table(&rows);
    if failed.is_some() {
        eprintln!("{}", first_stack.log_tails());
        if let Some(stack) = &second_stack {
            eprintln!("{}", stack.log_tails());
        }
    }
    tokio::task::spawn_blocking(move || drop((first_stack, second_stack)))
        .await
        .unwrap();
    let left: Vec<String> = footprints.iter().flat_map(|f| f.leftovers()).collect();
    if let Some(panic) = failed {
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
