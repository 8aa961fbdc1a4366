//! The real path, end to end, installed as users install it: the commands of
//! `docs/install.md` run as written (the test's names, target URL and shorter timeouts
//! filled in; section 3's namespace is the test's own), into a single-node cluster whose kubelet runs the operator and the agent from the
//! images built from `deploy/docker/`. `helm test` passes once the release is up, and
//! the document's `helm upgrade` restarts only what a changed value needs. The
//! document's Proxy, its user-data in a Secret, becomes a VM booted from the guest image
//! through the in-cluster operator and agent; its squid proxies a request from the
//! hypervisor's network, and the document's pod in another namespace gets an answer
//! through the Proxy's Service name (CoreDNS and kube-proxy). One trace runs from the
//! operator's reconcile into the agent's libvirt calls. The document's uninstall is
//! refused while the Proxy exists, naming it; the deletion it asks for leaves no
//! domain, overlay, seed or NVRAM (the cached base stays), and the uninstall then leaves
//! nothing of the release in the cluster. No secret of the run (the Proxy's user-data
//! and the credentials in the agent's image URL) appears in a log, a span or an Event,
//! and at the end nothing of the run is left on the machine.
//!
//! Needs root (network namespaces, useradd, debootstrap on a cold image cache), the
//! system packages of `integration/tools/install-system-packages.sh`, what `make setup`
//! builds (kube-harness, kube-node, the cluster's images), the workspace's binaries and
//! the images `make images` builds from them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use egressproxy_integration::cluster::TOOLBOX_IMAGE;
use egressproxy_integration::doc_commands::{DocShell, blocks_under, fill_in};
use egressproxy_integration::e2e::http_servers::TARGET_BODY;
use egressproxy_integration::e2e::otlp::ReceivedSpan;
use egressproxy_integration::e2e::stack::{
    HOST, IMAGE, IMAGE_INSTALLING_THE_AGENT, MACHINE_TYPE, PROVIDER, SPANS_FILE, Stack,
    StackOptions,
};
use egressproxy_integration::e2e::wait_for;

const INSTALL_DOC: &str = include_str!("../../docs/install.md");
/// The user-data the document's Proxy takes from its Secret.
const SQUID_CLOUD_CONFIG: &str = include_str!("../../docs/examples/squid-cloud-config.yaml");
/// Apply → Ready: a TCG boot on a loaded 2-core machine, plus a cold image download.
const READY_WITHIN: Duration = Duration::from_secs(600);
/// Several times a loaded TCG boot, and short enough for a replacement to be Ready
/// within [`READY_WITHIN`].
const PROVISIONING_TIMEOUT_SECONDS: u32 = 240;
/// The document's Proxy.
const PROXY: &str = "egress";

/// The document's "3. A Ready Proxy": its user-data file (with a unique marker added, a
/// secret to look for later) into a Secret, its Proxy applied in the stack's namespace
/// with the stack's image and target, and `kubectl wait` until it is Ready. The
/// `visible_hostname` the user-data sets.
fn apply_the_documented_proxy(stack: &Stack, shell: &DocShell, marker: &str) -> String {
    let user_data = shell.dir().join("cloud-config.yaml");
    std::fs::write(&user_data, format!("{SQUID_CLOUD_CONFIG}# {marker}\n")).unwrap();
    let visible_hostname = SQUID_CLOUD_CONFIG
        .lines()
        .find_map(|l| l.trim().strip_prefix("visible_hostname "))
        .expect("the user-data sets visible_hostname")
        .trim()
        .to_owned();
    let block = blocks_under(INSTALL_DOC, "3. A Ready Proxy", "sh")
        .unwrap()
        .into_iter()
        .find(|block| block.contains("kubectl apply"))
        .expect("the document applies a Proxy");
    let block = fill_in(
        &block,
        &[
            ("team-a", stack.kube.namespace.clone()),
            (
                "docs/examples/squid-cloud-config.yaml",
                user_data.display().to_string(),
            ),
            ("image: proxy-image", format!("image: {IMAGE}")),
            // Checked often, and a guest that hangs while booting (seen about once in 50
            // TCG boots) is replaced well before the wait gives up.
            (
                "    url: http://example.com/",
                format!(
                    "    url: {}\n    periodSeconds: 5\n    timeoutSeconds: 3",
                    stack.target.url()
                ),
            ),
            (
                "spec:\n",
                format!("spec:\n  provisioningTimeoutSeconds: {PROVISIONING_TIMEOUT_SECONDS}\n"),
            ),
            (
                "--timeout=10m",
                format!("--timeout={}s", READY_WITHIN.as_secs()),
            ),
        ],
    )
    .unwrap();
    let output = shell
        .run(&block)
        .unwrap_or_else(|err| panic!("{err:#}\n{}", stack.cluster_report()));
    eprintln!("e2e: the document's Proxy:\n{output}");
    visible_hostname
}

/// The document's "4. A request through the Proxy": a pod of another namespace fetches
/// the target with `http_proxy` set to the Proxy's Service name.
fn a_pod_of_another_namespace_is_proxied_by_the_service_name(
    stack: &Stack,
    shell: &DocShell,
    visible_hostname: &str,
) {
    let client_namespace = format!(
        "e2e-client-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let toolbox = egressproxy_integration::tools::image_archive(TOOLBOX_IMAGE)
        .unwrap()
        .name;
    let block = blocks_under(INSTALL_DOC, "4. A request through the Proxy", "sh")
        .unwrap()
        .remove(0);
    let block = fill_in(
        &block,
        &[
            ("team-a", stack.kube.namespace.clone()),
            ("team-b", client_namespace),
            ("--image=busybox", format!("--image={toolbox}")),
            ("http://example.com/", stack.target.url()),
        ],
    )
    .unwrap();
    let output = shell
        .run(&block)
        .unwrap_or_else(|err| panic!("{err:#}\n{}", stack.cluster_report()));
    assert!(
        output.contains(TARGET_BODY.trim()),
        "the target's body came through to the pod:\n{output}"
    );
    assert!(
        output
            .lines()
            .any(|l| l.contains("Via:") && l.contains(visible_hostname)),
        "the answer came through the Proxy's squid ({visible_hostname} in Via):\n{output}"
    );
}

/// The spans of the trace that holds `name`, and the names from it up to the root.
fn trace_with(spans: &[ReceivedSpan], name: &str) -> Option<(Vec<ReceivedSpan>, Vec<String>)> {
    let leaf = spans.iter().find(|s| s.name == name)?;
    let trace: Vec<ReceivedSpan> = spans
        .iter()
        .filter(|s| s.trace_id == leaf.trace_id)
        .cloned()
        .collect();
    let by_id: HashMap<&str, &ReceivedSpan> =
        trace.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let mut chain = vec![format!("{}:{}", leaf.service, leaf.name)];
    let mut current = leaf;
    while let Some(parent) = by_id.get(current.parent_span_id.as_str()) {
        chain.push(format!("{}:{}", parent.service, parent.name));
        current = parent;
    }
    Some((trace, chain))
}

/// Where each of `secrets` appears in `places` (name, text): `secret in name` lines.
fn secrets_shown(secrets: &[&str], places: &[(String, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (name, text) in places {
        for secret in secrets {
            if text.contains(secret) {
                found.push(format!("{secret} in {name}"));
            }
        }
    }
    found
}

/// Every log the stack keeps, every span the receiver got (attributes and events), the
/// namespace's Events, and (while it exists) the Proxy as `kubectl get -o yaml` shows it.
fn observable_output(stack: &Stack, proxy_yaml: &str) -> Vec<(String, String)> {
    stack.collect_pod_logs();
    let mut places = Vec::new();
    for entry in std::fs::read_dir(stack.dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".log") || name == SPANS_FILE {
            places.push((name, std::fs::read_to_string(&path).unwrap_or_default()));
        }
    }
    for span in stack.spans.spans() {
        places.push((
            format!("span {}:{}", span.service, span.name),
            format!("{:?} {:?}", span.attributes, span.events),
        ));
    }
    places.push((
        "Events".into(),
        stack.kubectl(&["get", "events", "-o", "yaml"]).unwrap(),
    ));
    places.push(("the Proxy".into(), proxy_yaml.to_owned()));
    places
}

async fn scenario(stack: &mut Stack) {
    let marker = format!("user-data-secret-{}", uuid::Uuid::new_v4().simple());
    let shell = DocShell::new(&stack.dir().join("install"), stack.kubeconfig()).unwrap();

    // 0. A jinja template that pins a package version: cloud-init merges it with the
    // guest-agent bootstrap. First, while it is the only Proxy, so that its VM is the
    // only one and its deletion leaves none.
    jinja_user_data_gets_the_bootstrap(stack).await;

    // 1. Ready: the document's Proxy.
    let started = Instant::now();
    let visible_hostname = apply_the_documented_proxy(stack, &shell, &marker);
    let replacements = stack.proxy_field(PROXY, "{.status.replacements}");
    eprintln!(
        "e2e: apply -> Ready in {:.1} s (replacements: {replacements})",
        started.elapsed().as_secs_f64()
    );

    // 2. A request through the proxy at the status's address, from inside the namespace.
    let address = stack.proxy_field(PROXY, "{.status.addresses[0].address}");
    assert!(!address.is_empty(), "the Ready Proxy has an address");
    let proxy_url = format!("http://{address}:3128");
    let answer = stack
        .curl_in_netns(&[
            "-sS",
            "-i",
            "--max-time",
            "20",
            "-x",
            &proxy_url,
            &stack.target.url(),
        ])
        .unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "proxied answer: {answer}"
    );
    assert!(
        answer.ends_with(TARGET_BODY),
        "the target's body came through: {answer}"
    );
    let via = answer
        .lines()
        .find_map(|l| l.strip_prefix("Via: "))
        .unwrap_or_else(|| panic!("squid adds a Via header: {answer}"));
    assert!(
        via.contains(&visible_hostname),
        "the user-data's visible_hostname {visible_hostname} is in Via: {via}"
    );
    assert!(
        stack
            .target
            .vias()
            .iter()
            .any(|v| v.contains(&visible_hostname)),
        "the target saw the proxy's Via: {:?}",
        stack.target.vias()
    );

    // 2b. The document's pod in another namespace, through the Proxy's Service name.
    a_pod_of_another_namespace_is_proxied_by_the_service_name(stack, &shell, &visible_hostname);

    // 3. What the user sees.
    let table = stack.kubectl(&["get", "proxies"]).unwrap();
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME", "PHASE", "PROVIDER", "ADDRESS", "EGRESS", "SERVICE", "READY", "AGE"
        ],
        "{table}"
    );
    // EGRESS is empty: the stack configures no check URL, so no address is observed.
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..6],
        [PROXY, "Ready", PROVIDER, &address, PROXY, "True"],
        "{table}"
    );
    let proxy_yaml = stack
        .kubectl(&["get", "proxy", PROXY, "-o", "yaml"])
        .unwrap();
    let instance = stack.proxy_field(PROXY, "{.status.providerId}");
    assert!(!instance.is_empty(), "the status names the instance");
    let events = stack
        .kubectl(&[
            "get",
            "events",
            "--field-selector",
            &format!("involvedObject.name={PROXY}"),
            "-o",
            "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
        ])
        .unwrap();
    // The instance was created, or replaced one that never became Ready.
    assert!(
        events.lines().any(
            |l| (l.starts_with("Created: ") || l.starts_with("Replaced: "))
                && l.contains(&instance)
        ),
        "a Created or Replaced event names instance {instance}:\n{events}"
    );

    // 4. One trace from the reconcile into libvirt.
    wait_for("the spans of the Create", Duration::from_secs(30), || {
        trace_with(&stack.spans.spans(), "virDomainCreate").is_some()
    })
    .await;
    let (trace, chain) = trace_with(&stack.spans.spans(), "virDomainCreate").unwrap();
    let names: Vec<&str> = trace.iter().map(|s| s.name.as_str()).collect();
    for libvirt_call in [
        "virStorageVolCreateXML",
        "virDomainDefineXML",
        "virDomainCreate",
    ] {
        assert!(
            names.contains(&libvirt_call),
            "{libvirt_call} in the trace: {names:?}"
        );
    }
    let expected_chain_tail = [
        "kvm-agent:grpc.request",
        "egressproxy-operator:egressproxy.provider.v1.Provider/CreateInstance",
    ];
    assert!(
        chain.windows(2).any(|w| w == expected_chain_tail),
        "virDomainCreate → … → grpc.request → the operator's client span: {chain:?}"
    );
    assert_eq!(
        chain.last().map(String::as_str),
        Some("egressproxy-operator:reconcile"),
        "the trace starts at the operator's reconcile: {chain:?}"
    );

    // 5. The document's uninstall: refused while the Proxy exists; the deletion it asks
    // for leaves nothing of the instance (the cached base stays); then the release goes
    // and leaves nothing in the cluster.
    let before_delete = Stack::files_in(&stack.pool_dir());
    let uninstall = stack.uninstall_as_documented().await.unwrap();
    assert!(
        !uninstall.refused.succeeded
            && uninstall.refused.output.contains(
                "* job egressproxy-operator-uninstall-check failed: BackoffLimitExceeded"
            ),
        "helm uninstall is refused by the pre-delete hook while the Proxy exists: {:?}",
        uninstall.refused
    );
    let named = format!("{}/{PROXY}", stack.kube.namespace);
    assert!(
        uninstall.hook_log.output.contains("refusing to uninstall")
            && uninstall.hook_log.output.contains(&named),
        "the hook's log names {named}: {:?}",
        uninstall.hook_log
    );
    assert!(uninstall.deleted.succeeded, "{:?}", uninstall.deleted);
    assert!(
        uninstall.uninstalled.succeeded,
        "{:?}",
        uninstall.uninstalled
    );
    assert!(
        uninstall.left.is_empty(),
        "helm uninstall left objects of the release: {:?}",
        uninstall.left
    );
    let bases: Vec<String> = before_delete
        .iter()
        .filter(|f| f.starts_with("egressproxy-base-"))
        .cloned()
        .collect();
    assert!(
        !bases.is_empty(),
        "the pool held a base image: {before_delete:?}"
    );
    assert!(
        before_delete.len() > bases.len(),
        "the pool held the instance's overlay and seed: {before_delete:?}"
    );
    assert_eq!(
        Stack::files_in(&stack.pool_dir()),
        bases,
        "the overlay and seed are gone and the cached base (and its marker) stays"
    );
    assert_eq!(
        Stack::files_in(&stack.nvram_dir()),
        Vec::<String>::new(),
        "no NVRAM is left"
    );
    eprintln!("e2e: image downloads: {}", stack.images.downloads());

    // 6. No secret of the run was shown anywhere. The markers are checked against what
    // holds them, so a search that finds nothing proves something.
    let password = stack.images.password();
    let agent_config = std::fs::read_to_string(stack.agent_config()).unwrap();
    assert!(
        agent_config.contains(password),
        "the agent's image URL has the password"
    );
    assert!(
        stack.images.downloads() >= 1,
        "the image was fetched with its credentials"
    );
    let places = observable_output(stack, &proxy_yaml);
    assert!(
        places
            .iter()
            .any(|(name, text)| name == "kvm-agent.log" && text.contains("listening on")),
        "the agent's log was read: {:?}",
        places.iter().map(|(name, _)| name).collect::<Vec<_>>()
    );
    let shown = secrets_shown(&[&marker, password], &places);
    assert!(shown.is_empty(), "secrets shown: {shown:?}");
}

/// The document's `helm upgrade`: the same values restart nothing; a changed agent
/// configuration restarts the agent (its config checksum) and not the operator.
async fn upgrades_restart_only_what_they_must(stack: &Stack) {
    let before = stack.release_pods().await.unwrap();
    for component in ["operator", "kvm-agent"] {
        assert_eq!(
            before[component].len(),
            1,
            "one {component} pod runs: {before:?}"
        );
    }
    let same = stack.upgrade_as_documented(|_| {}).await.unwrap();
    assert_eq!(
        same, before,
        "an upgrade with the same values restarts nothing"
    );
    let changed = stack
        .upgrade_as_documented(|values| {
            values["kvmAgent"]["config"]["transport"]["defaultCallTimeout"] = "61s".into();
        })
        .await
        .unwrap();
    assert_eq!(
        changed["operator"], before["operator"],
        "a changed agent config leaves the operator running"
    );
    assert!(
        !changed["kvm-agent"].is_subset(&before["kvm-agent"]),
        "a changed agent config restarts the agent: before {before:?}, after {changed:?}"
    );
}

/// A jinja template whose `packages:` pins a version as a quoted string (bare, YAML 1.1
/// would read `1:5.7` as the number 65.7), on the image declared `guestAgent: install`.
/// The kvm-agent sends it unchanged beside its bootstrap part (package and runcmd); in the guest, cloud-init itself renders the template and merges the
/// two. What cloud-init assembled is read back from the guest through qemu-guest-agent.
/// The guest is offline, so apt cannot install the pinned version (the image ships
/// squid and the agent); the merged lists and the agent's address are what is checked.
async fn jinja_user_data_gets_the_bootstrap(stack: &Stack) {
    const NAME: &str = "jinja";
    let manifest = format!(
        "apiVersion: egressproxy.dev/v1alpha1\n\
         kind: Proxy\n\
         metadata: {{name: {NAME}}}\n\
         spec:\n\
         \x20 provider: {PROVIDER}\n\
         \x20 placement: {{host: {HOST}, machineType: {MACHINE_TYPE}, image: {IMAGE_INSTALLING_THE_AGENT}}}\n\
         \x20 provisioningTimeoutSeconds: {PROVISIONING_TIMEOUT_SECONDS}\n\
         \x20 cloudInit:\n\
         \x20   userData: |\n\
         \x20     ## template: jinja\n\
         \x20     #cloud-config\n\
         \x20     packages:\n\
         \x20       - [squid, \"1:5.7\"]  # quoted: a version, not a number\n\
         \x20     write_files:\n\
         \x20       - path: /etc/egressproxy-jinja\n\
         \x20         content: \"rendered for {{{{ v1.instance_id }}}}\"\n"
    );
    stack.kubectl_apply(&manifest).unwrap();
    let phase = || stack.proxy_field(NAME, "{.status.phase}");
    wait_for("the jinja Proxy to be Ready", READY_WITHIN, || {
        phase() == "Ready"
    })
    .await;
    let domain = stack.domains().unwrap().remove(0);
    let mut merged = String::new();
    wait_for(
        "cloud-init's merged cloud-config in the guest",
        Duration::from_secs(120),
        || match stack.read_guest_file(&domain, "/var/lib/cloud/instance/cloud-config.txt") {
            Ok(text) => {
                merged = text;
                true
            }
            Err(_) => false,
        },
    )
    .await;
    let config: serde_norway::Value = serde_norway::from_str(&merged)
        .unwrap_or_else(|e| panic!("cloud-config.txt is YAML ({e}):\n{merged}"));
    let packages: Vec<serde_norway::Value> = config["packages"]
        .as_sequence()
        .unwrap_or_else(|| panic!("merged packages:\n{merged}"))
        .clone();
    let pinned: serde_norway::Value = serde_norway::from_str("[squid, '1:5.7']").unwrap();
    assert!(
        packages.contains(&pinned),
        "the user's pinned package, its version still a string:\n{merged}"
    );
    assert!(
        packages.contains(&"qemu-guest-agent".into()),
        "the bootstrap's package is merged in, after the user's:\n{merged}"
    );
    let runcmd = format!("{:?}", config["runcmd"]);
    assert!(
        runcmd.contains("qemu-guest-agent"),
        "the bootstrap's runcmd is merged in:\n{merged}"
    );
    let rendered = stack
        .read_guest_file(&domain, "/etc/egressproxy-jinja")
        .unwrap();
    assert!(
        rendered.starts_with("rendered for ") && !rendered.contains("{{"),
        "cloud-init rendered the template: {rendered:?}"
    );
    stack.delete_proxy(NAME, Duration::from_secs(120)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_becomes_a_vm_that_proxies_and_leaves_nothing_behind() {
    use futures::FutureExt;
    let started = Instant::now();
    // Installed as users install it: through the Helm chart, into a cluster.
    let options = StackOptions {
        through_chart: true,
        ..StackOptions::default()
    };
    let mut stack = Stack::start_with("e2e-proxy", &options)
        .await
        .expect("start the stack");
    eprintln!("e2e: stack up in {:.1} s", started.elapsed().as_secs_f64());
    let footprint = stack.footprint();
    let outcome = std::panic::AssertUnwindSafe(async {
        // `helm test`, as a user checks an install: the chart's test pod reaches the
        // agent through its Service with the operator's client certificate.
        let tested = stack.test_release().unwrap();
        assert!(
            tested.contains("Phase:") && tested.contains("Succeeded"),
            "helm test:\n{tested}"
        );
        upgrades_restart_only_what_they_must(&stack).await;
        scenario(&mut stack).await;
    })
    .catch_unwind()
    .await;
    if outcome.is_err() {
        eprintln!("{}", stack.log_tails());
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
    eprintln!("e2e: whole test {:.1} s", started.elapsed().as_secs_f64());
}
