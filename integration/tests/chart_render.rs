//! The Helm chart rendered by the real `helm`: it lints, every rendering (default values,
//! every example, the namespaced and multi-replica variants) passes a server-side dry
//! run on the real kube-apiserver, and values the schema or the templates must refuse
//! are refused with a message naming the field.

mod chart_support;

use std::path::Path;

use chart_support::{CERT_MANAGER_CERTIFICATE_CRD, PROMETHEUS_OPERATOR_KINDS};
use egressproxy_integration::helm::{self, Helm, Kubectl};
use egressproxy_integration::kube_apiserver;
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};

fn offline_helm() -> Helm {
    // lint and template never contact the cluster; any kubeconfig path will do.
    Helm::new(Path::new("/nonexistent-kubeconfig")).unwrap()
}

#[test]
fn helm_lint_passes_for_the_defaults_and_every_example() {
    let helm = offline_helm();
    helm.lint(&[]).unwrap();
    let examples = helm::example_values().unwrap();
    assert!(
        examples.len() >= 3,
        "the chart ships its three example set-ups: {examples:?}"
    );
    for values in &examples {
        helm.lint(&[values]).unwrap();
    }
}

#[tokio::test]
async fn every_rendering_passes_a_server_side_dry_run() {
    let env = KubeTestEnv::new("chart-dry-run").await.unwrap();
    for crd in [CERT_MANAGER_CERTIFICATE_CRD, PROMETHEUS_OPERATOR_KINDS] {
        apply_crds_yaml(&env.client, crd).await.unwrap();
    }
    let apiserver = kube_apiserver::shared().unwrap();
    let helm = Helm::new(apiserver.kubeconfig_path()).unwrap();
    let kubectl = Kubectl::new(apiserver.kubeconfig_path());
    let ns = env.namespace.as_str();
    let second_env = KubeTestEnv::new("chart-dry-run-second").await.unwrap();
    let second_ns = second_env.namespace.as_str();

    let watch = format!("operator.watchNamespaces={{{ns},{second_ns}}}");
    let mut renderings = vec![
        (
            "defaults".to_owned(),
            helm.template("rel", ns, &[], &[]).unwrap(),
        ),
        (
            "2 namespaces, 2 replicas, plaintext agent".to_owned(),
            helm.template(
                "rel",
                ns,
                &[],
                &[
                    &watch,
                    // Named: no ClusterRole to read kube-system's UID either.
                    "operator.clusterName=dry-run",
                    "operator.replicas=2",
                    "operator.networkPolicy.enabled=true",
                    "kvmAgent.enabled=true",
                    "kvmAgent.tls.enabled=false",
                    "kvmAgent.tls.mtls.enabled=false",
                    "kvmAgent.ssh.secretName=kvm-agent-ssh",
                    "kvmAgent.config.hosts[0].name=hv1",
                    "kvmAgent.config.hosts[0].ssh.address=hv1.example.org",
                    "kvmAgent.config.hosts[0].ssh.user=egressproxy",
                    "kvmAgent.podDisruptionBudget.enabled=true",
                    "crds.enabled=false",
                ],
            )
            .unwrap(),
        ),
    ];
    for values in helm::example_values().unwrap() {
        let rendered = helm.template("rel", ns, &[&values], &[]).unwrap();
        renderings.push((values.display().to_string(), rendered));
    }

    for (name, rendered) in &renderings {
        let answer = kubectl.dry_run_apply(rendered).unwrap_or_else(|error| {
            panic!("{name}: the apiserver refused the rendering: {error:#}")
        });
        assert!(
            answer.contains("serverside-applied (server dry run)"),
            "{name}: {answer}"
        );
    }
    // What NOTES.txt tells the user to do next, with the in-cluster agent.
    let example = helm::chart_dir().join("examples/in-cluster-agent-ssh.yaml");
    let notes = helm.install_notes("rel", ns, &[&example]).unwrap();
    for expected in [
        "Providers it can use (spec.provider): kvm.",
        "provider: kvm",
        "kubectl get proxies -n default -w",
        &format!("kubectl port-forward -n {ns} svc/rel-egressproxy-kvm-agent 50051:50051"),
        "grpcurl -cacert ca.crt -authority rel-egressproxy-kvm-agent.",
        "/metrics",
        "Traces: set global.otel.endpoint",
    ] {
        assert!(
            notes.contains(expected),
            "NOTES lack {expected:?}:\n{notes}"
        );
    }
    let defaults_notes = helm.install_notes("rel", ns, &[]).unwrap();
    assert!(
        defaults_notes.contains("WARNING: no provider is configured"),
        "{defaults_notes}"
    );

    // The variants really differ where the values say they do.
    let (_, defaults) = &renderings[0];
    let (_, namespaced) = &renderings[1];
    assert!(
        defaults.contains("kind: ClusterRole\n")
            && defaults.contains("kind: CustomResourceDefinition")
    );
    assert!(
        !namespaced.contains("kind: ClusterRole\n")
            && !namespaced.contains("kind: CustomResourceDefinition")
    );
    assert!(namespaced.contains("kind: PodDisruptionBudget"));
    assert_eq!(
        operator_rbac_namespaces(namespaced),
        [
            ("Role", ns.to_owned()),
            ("Role", second_ns.to_owned()),
            ("RoleBinding", ns.to_owned()),
            ("RoleBinding", second_ns.to_owned()),
        ],
        "a Role and its RoleBinding in each watched namespace"
    );
    assert!(
        namespaced.contains(&format!("- --namespace={ns},{second_ns}\n")),
        "the operator watches both"
    );
    assert_eq!(
        operator_rbac_namespaces(defaults),
        [
            ("ClusterRole", String::new()),
            ("ClusterRoleBinding", String::new())
        ]
    );
}

/// Kind and namespace of the operator's Proxy permissions in `rendered` (not its
/// leader-election Role), sorted.
fn operator_rbac_namespaces(rendered: &str) -> Vec<(&'static str, String)> {
    use serde::Deserialize;
    let mut found = Vec::new();
    for document in serde_norway::Deserializer::from_str(rendered) {
        let Ok(object) = serde_norway::Value::deserialize(document) else {
            continue;
        };
        let text = |path: &[&str]| {
            let mut value = &object;
            for key in path {
                value = &value[*key];
            }
            value.as_str().unwrap_or_default().to_owned()
        };
        if text(&["metadata", "name"]) != "rel-egressproxy-operator" {
            continue;
        }
        let kind = match text(&["kind"]).as_str() {
            "Role" => "Role",
            "RoleBinding" => "RoleBinding",
            "ClusterRole" => "ClusterRole",
            "ClusterRoleBinding" => "ClusterRoleBinding",
            _ => continue,
        };
        found.push((kind, text(&["metadata", "namespace"])));
    }
    found.sort();
    found
}

/// `helm template` with `values` (YAML) must fail, and its message contain `expected`.
fn assert_rejected(helm: &Helm, values: &str, expected: &str) {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), values).unwrap();
    match helm.template("rel", "egressproxy", &[file.path()], &[]) {
        Ok(_) => panic!("values were accepted, want an error with {expected:?}:\n{values}"),
        Err(error) => {
            let message = format!("{error:#}");
            assert!(
                message.contains(expected),
                "values:\n{values}\nwant {expected:?} in the error, got:\n{message}"
            );
        }
    }
}

#[test]
fn values_the_chart_must_refuse_are_refused_naming_the_field() {
    let helm = offline_helm();
    let cases = [
        (
            "operatr:\n  replicas: 2\n",
            "additional properties 'operatr' not allowed",
        ),
        (
            "operator:\n  replicas: two\n",
            "at '/operator/replicas': got string, want integer",
        ),
        (
            "operator:\n  gc:\n    interval: soon\n",
            "at '/operator/gc/interval': 'soon' does not match pattern",
        ),
        (
            "operator:\n  providers:\n    hv1:\n      endpoint: https://hv1.example.org:50051\n",
            "at '/operator/providers/hv1': missing property 'tls'",
        ),
        (
            "operator:\n  providers:\n    Bad_Name:\n      endpoint: http://x:1\n",
            "invalid propertyName 'Bad_Name'",
        ),
        (
            "operator:\n  watchNamespaces: [team-a, Team_B]\n",
            "at '/operator/watchNamespaces/1': 'Team_B' does not match pattern",
        ),
        (
            "operator:\n  watchNamespaces: [team-a, team-a]\n",
            "at '/operator/watchNamespaces': items at 0 and 1 are equal",
        ),
        (
            "kvmAgent:\n  tls:\n    source: vault\n",
            "at '/kvmAgent/tls/source': value must be one of 'helm', 'secret', 'certManager'",
        ),
        (
            "kvmAgent:\n  config:\n    hosts:\n      - name: hv1\n        ssh: { adress: hv1, user: u }\n",
            "at '/kvmAgent/config/hosts/0/ssh': additional properties 'adress' not allowed",
        ),
        (
            "kvmAgent:\n  config:\n    images:\n      d: { url: \"file:///d\", guestAgent: bundled }\n",
            "at '/kvmAgent/config/images/d/guestAgent': value must be one of 'install', 'preinstalled'",
        ),
        (
            "operator:\n  networkPolicy:\n    egress:\n      rules:\n        - too: []\n",
            "at '/operator/networkPolicy/egress/rules/0': additional properties 'too' not allowed",
        ),
        (
            "crds:\n  keep: yes please\n",
            "at '/crds/keep': got string, want boolean",
        ),
        (
            "providers:\n  - {name: kube, type: vm}\n",
            "at '/providers/0/type': value must be 'kube'",
        ),
        (
            "providers:\n  - {name: kube, type: kube, config: {namespace: other}}\n",
            "at '/providers/0/config': additional properties 'namespace' not allowed",
        ),
        // Checks the schema cannot express, made by the templates.
        (
            "providers:\n  - {name: kube, type: kube}\n  - {name: kube, type: kube}\n",
            "providers[1].name: \"kube\" is already a provider name (in providers[0])",
        ),
        (
            "operator:\n  providers:\n    kube: {endpoint: http://x:1}\nproviders:\n  - {name: kube, type: kube}\n",
            "providers[0].name: \"kube\" is already a provider name (in operator.providers)",
        ),
        (
            "kvmAgent:\n  enabled: true\n  config:\n    hosts:\n      - name: hv1\n        ssh: { address: hv1, user: u }\n",
            "kvmAgent.ssh.secretName: host \"hv1\" connects over SSH",
        ),
        (
            "kvmAgent:\n  enabled: true\n  tls:\n    source: certManager\n  config:\n    hosts: [{name: hv1, ssh: {address: hv1, user: u}}]\n  ssh: {secretName: k}\n",
            "kvmAgent.tls.certManager.issuerRef.name: name the cert-manager Issuer",
        ),
        // Settings that cannot work with the agent in the cluster.
        (
            "kvmAgent:\n  enabled: true\n",
            "kvmAgent.config.hosts: list at least one hypervisor",
        ),
        (
            "kvmAgent:\n  enabled: true\n  config:\n    hosts: []\n",
            "kvmAgent.config.hosts: list at least one hypervisor",
        ),
        (
            "kvmAgent:\n  enabled: true\n  ssh: {secretName: k}\n  config:\n    hosts:\n      - {name: hv1, ssh: {address: hv1, user: u}}\n      - {name: hv2, local: true}\n",
            "kvmAgent.config.hosts[1].local: host \"hv2\" would use the libvirt socket of the pod's own node",
        ),
        (
            "kvmAgent:\n  enabled: true\n  config:\n    hosts:\n      - {name: hv1, libvirtSocket: /run/libvirt/libvirt-sock}\n",
            "kvmAgent.config.hosts[0].ssh: host \"hv1\" needs ssh",
        ),
        (
            "kvmAgent:\n  enabled: true\n  ssh: {secretName: k}\n  tls:\n    enabled: false\n    mtls: {enabled: true}\n  config:\n    hosts: [{name: hv1, ssh: {address: hv1, user: u}}]\n",
            "kvmAgent.tls.mtls.enabled needs kvmAgent.tls.enabled=true",
        ),
    ];
    for (values, expected) in cases {
        assert_rejected(&helm, values, expected);
    }
}

/// A `providers` entry gets mutual TLS and a NetworkPolicy by default, and a `false`
/// written in the entry turns each off (Sprig's `merge` alone would take it for unset).
#[test]
fn a_kube_provider_entry_has_tls_and_a_network_policy_unless_turned_off() {
    let helm = offline_helm();
    let entry = ["providers[0].name=kube", "providers[0].type=kube"];
    let defaults = helm.template("rel", "egress", &[], &entry).unwrap();
    assert!(
        defaults.contains("endpoint: \"https://rel-egressproxy-kube-provider.egress.svc:50051\"")
            && defaults.contains("name: rel-egressproxy-kube-provider-tls\n")
            && defaults.contains("name: rel-egressproxy-kube-provider-client-tls\n")
            && defaults.contains("- --client-ca=/etc/kube-provider/tls/ca.crt")
            && defaults.matches("kind: NetworkPolicy").count() == 1,
        "{defaults}"
    );
    let mut off = entry.to_vec();
    off.extend([
        "providers[0].tls.enabled=false",
        "providers[0].networkPolicy=false",
    ]);
    let plain = helm.template("rel", "egress", &[], &off).unwrap();
    assert!(
        plain.contains("endpoint: \"http://rel-egressproxy-kube-provider.egress.svc:50051\"")
            && !plain.contains("rel-egressproxy-kube-provider-tls")
            && !plain.contains("--tls-cert")
            && !plain.contains("kind: NetworkPolicy"),
        "{plain}"
    );
}

#[test]
fn the_values_table_in_the_chart_readme_is_up_to_date() {
    // The same generator `make generate` runs, on a copy: the committed README must
    // not change.
    let chart = helm::chart_dir();
    let copy = tempfile::tempdir().unwrap();
    for file in ["README.md", "values.yaml"] {
        std::fs::copy(chart.join(file), copy.path().join(file)).unwrap();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/chart-values-table.py");
    let status = std::process::Command::new("python3")
        .arg(&script)
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    let committed = std::fs::read_to_string(chart.join("README.md")).unwrap();
    let regenerated = std::fs::read_to_string(copy.path().join("README.md")).unwrap();
    assert!(
        committed == regenerated,
        "charts/egressproxy/README.md is stale: run `make generate`"
    );
}

#[test]
fn the_values_table_generator_refuses_an_undocumented_key() {
    let copy = tempfile::tempdir().unwrap();
    std::fs::write(
        copy.path().join("README.md"),
        "<!-- values:start -->\n<!-- values:end -->\n",
    )
    .unwrap();
    std::fs::write(
        copy.path().join("values.yaml"),
        "# -- documented\noperator:\n  # -- documented\n  replicas: 1\n  silent: true\n",
    )
    .unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/chart-values-table.py");
    let output = std::process::Command::new("python3")
        .arg(&script)
        .arg(copy.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("values.yaml:5: operator.silent has no '# --' comment"),
        "{stderr}"
    );
}

/// The agent config the chart renders from the in-cluster example parses with the
/// agent's own `check-config`, once the mounted paths (SSH key, known_hosts, spool) are
/// moved to files that exist here.
#[test]
fn the_rendered_agent_config_passes_kvm_agent_check_config() {
    use serde::Deserialize as _;

    let example = helm::chart_dir().join("examples/in-cluster-agent-ssh.yaml");
    let rendered = offline_helm()
        .template("rel", "egressproxy", &[&example], &[])
        .unwrap();
    let config = serde_norway::Deserializer::from_str(&rendered)
        .filter_map(|document| serde_norway::Value::deserialize(document).ok())
        // A Secret: image URLs may carry credentials.
        .find(|doc| {
            doc["kind"] == "Secret" && doc["metadata"]["name"] == "rel-egressproxy-kvm-agent"
        })
        .expect("the kvm-agent config in a Secret")["stringData"]["config.yaml"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        config.contains("privateKey: /etc/kvm-agent/ssh/id_ed25519"),
        "{config}"
    );
    assert!(
        config.contains("knownHosts: /etc/kvm-agent/ssh/known_hosts"),
        "{config}"
    );
    assert!(
        config.contains("imageSpoolDir: /var/spool/kvm-agent"),
        "{config}"
    );
    assert!(config.contains("guestAgent: preinstalled"), "{config}");

    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("id_ed25519");
    let status = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(status.success());
    let public = std::fs::read_to_string(dir.path().join("id_ed25519.pub")).unwrap();
    let host_key = public
        .split_whitespace()
        .take(2)
        .collect::<Vec<_>>()
        .join(" ");
    std::fs::write(
        dir.path().join("known_hosts"),
        format!("hv1.example.org {host_key}\nhv2.example.org {host_key}\n"),
    )
    .unwrap();
    let spool = dir.path().join("spool");
    std::fs::create_dir(&spool).unwrap();
    let local = config
        .replace("/etc/kvm-agent/ssh", &dir.path().display().to_string())
        .replace("/var/spool/kvm-agent", &spool.display().to_string());
    let config_file = dir.path().join("config.yaml");
    std::fs::write(&config_file, local).unwrap();

    let binary =
        egressproxy_integration::reference_provider::workspace_binary("kvm-agent").unwrap();
    let output = std::process::Command::new(binary)
        .arg("check-config")
        .arg("--config")
        .arg(&config_file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("ok (2 hosts, 2 machine types, 2 images)"),
        "{stdout}"
    );
}
