//! The chart's optional egress NetworkPolicies, installed by the real `helm` into the
//! real kube-apiserver and read back as the apiserver stored them: DNS, the operator's
//! way to the in-cluster agent, and the user's rules; refused without the policy they
//! belong to. (No CNI runs here, so what a network plugin enforces is not tested.)

use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::KubeTestEnv;
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyEgressRule};
use kube::Api;

const VALUES: &str = "\
crds:
  enabled: false
operator:
  networkPolicy:
    enabled: true
    egress:
      enabled: true
      rules:
        - to: [{ ipBlock: { cidr: 10.0.0.1/32 } }]
          ports: [{ port: 6443, protocol: TCP }]
kvmAgent:
  enabled: true
  port: 50052
  tls:
    enabled: false
    mtls:
      enabled: false
  ssh:
    secretName: kvm-agent-ssh
  config:
    hosts:
      - name: hv1
        ssh: { address: 192.0.2.10, user: egressproxy }
  networkPolicy:
    enabled: true
    egress:
      enabled: true
      dns: false
      rules:
        - to: [{ ipBlock: { cidr: 192.0.2.0/24 } }]
          ports: [{ port: 22, protocol: TCP }]
";

/// Each egress rule as `peers -> ports`, to compare whole policies at a glance.
fn describe(rules: &[NetworkPolicyEgressRule]) -> Vec<String> {
    rules
        .iter()
        .map(|rule| {
            let peers: Vec<String> = rule
                .to
                .iter()
                .flatten()
                .map(|peer| match (&peer.ip_block, &peer.pod_selector) {
                    (Some(block), _) => block.cidr.clone(),
                    (None, Some(selector)) => {
                        let labels = selector.match_labels.clone().unwrap_or_default();
                        format!("pods {}", labels["app.kubernetes.io/component"])
                    }
                    (None, None) => "?".to_owned(),
                })
                .collect();
            let ports: Vec<String> = rule
                .ports
                .iter()
                .flatten()
                .map(|port| {
                    let number = match &port.port {
                        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n)) => {
                            n.to_string()
                        }
                        other => format!("{other:?}"),
                    };
                    format!("{number}/{}", port.protocol.as_deref().unwrap_or("TCP"))
                })
                .collect();
            let to = if peers.is_empty() {
                "anywhere".to_owned()
            } else {
                peers.join(",")
            };
            format!("{to} -> {}", ports.join(","))
        })
        .collect()
}

#[tokio::test]
async fn egress_policies_allow_dns_the_agent_and_the_users_rules_only() {
    let env = KubeTestEnv::new("chart-netpol").await.unwrap();
    let ns = env.namespace.as_str();
    let values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(values.path(), VALUES).unwrap();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    // Watching its own namespace keeps the release's objects namespaced, so this test
    // shares the apiserver with the other chart tests without touching theirs.
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    helm.install("np", ns, &[values.path()], &[&watch]).unwrap();

    let policies: Api<NetworkPolicy> = Api::namespaced(env.client.clone(), ns);
    let operator = policies.get("np-egressproxy-operator").await.unwrap();
    let spec = operator.spec.unwrap();
    assert_eq!(spec.policy_types.unwrap_or_default(), ["Ingress", "Egress"]);
    assert_eq!(
        describe(&spec.egress.unwrap_or_default()),
        [
            "anywhere -> 53/UDP,53/TCP",
            "pods kvm-agent -> 50052/TCP",
            "10.0.0.1/32 -> 6443/TCP",
        ]
    );
    let agent = policies.get("np-egressproxy-kvm-agent").await.unwrap();
    let spec = agent.spec.unwrap();
    assert_eq!(spec.policy_types.unwrap_or_default(), ["Ingress", "Egress"]);
    assert_eq!(
        describe(&spec.egress.unwrap_or_default()),
        ["192.0.2.0/24 -> 22/TCP"],
        "dns: false leaves DNS out"
    );

    // Off by default: only incoming traffic is restricted.
    helm.upgrade(
        "np",
        ns,
        &[],
        &[
            &watch,
            "crds.enabled=false",
            "operator.networkPolicy.enabled=true",
        ],
    )
    .unwrap();
    let spec = policies
        .get("np-egressproxy-operator")
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(spec.policy_types.unwrap_or_default(), ["Ingress"]);
    assert!(spec.egress.is_none());

    // Egress rules without their policy would restrict nothing: refused, naming both.
    let error = helm
        .upgrade(
            "np",
            ns,
            &[],
            &[
                &watch,
                "crds.enabled=false",
                "operator.networkPolicy.egress.enabled=true",
            ],
        )
        .unwrap_err();
    assert!(
        format!("{error:#}").contains(
            "operator.networkPolicy.egress.enabled needs operator.networkPolicy.enabled=true"
        ),
        "{error:#}"
    );
    helm.uninstall_without_hooks("np", ns).unwrap();
}
