//! The chart's cert-manager Certificates against cert-manager's own Certificate CRD
//! (v1.21.1, in `fixtures/`) in the real kube-apiserver: `helm install` of the mTLS
//! example creates them, the apiserver validates them with cert-manager's schema, and
//! they ask for what the chart's pods use: the Secrets the Deployments mount, and the
//! name the operator dials. No cert-manager controller runs here (it is not among the
//! tools this harness builds), so nothing issues them; `chart_agent.rs` and
//! `chart_tls.rs` run the pods with certificates from Secrets in the same layout.

mod chart_support;

use chart_support::CERT_MANAGER_CERTIFICATE_CRD;
use egressproxy_integration::helm::{self, Helm};
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};

const AGENT: &str = "cm-egressproxy-kvm-agent";
const OPERATOR: &str = "cm-egressproxy-operator";

fn certificates(env: &KubeTestEnv) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("cert-manager.io", "v1", "Certificate");
    Api::namespaced_with(
        env.client.clone(),
        &env.namespace,
        &ApiResource::from_gvk(&gvk),
    )
}

/// The Secret names a Deployment's pods mount, secret volumes and projected ones.
async fn mounted_secrets(env: &KubeTestEnv, deployment: &str) -> Vec<String> {
    let deployments: Api<Deployment> = env.namespaced();
    let spec = deployments.get(deployment).await.unwrap().spec;
    let volumes = spec.template.spec.unwrap().volumes.unwrap_or_default();
    let mut names = Vec::new();
    for volume in volumes {
        names.extend(volume.secret.and_then(|secret| secret.secret_name));
        let sources = volume.projected.and_then(|p| p.sources).unwrap_or_default();
        names.extend(
            sources
                .into_iter()
                .filter_map(|source| source.secret.map(|secret| secret.name)),
        );
    }
    names
}

fn strings(value: &serde_json::Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item.as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn the_mtls_example_makes_certificates_that_cert_manager_s_schema_accepts() {
    let env = KubeTestEnv::new("chart-cert-manager").await.unwrap();
    let ns = env.namespace.as_str();
    apply_crds_yaml(&env.client, CERT_MANAGER_CERTIFICATE_CRD)
        .await
        .unwrap();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    let example = helm::chart_dir().join("examples/mtls-cert-manager.yaml");
    // Namespaced objects only (no CRD, no ClusterRole), so this release stays out of the
    // way of the other chart tests on the same apiserver; the ServiceMonitor kind is
    // not installed here.
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    helm.install(
        "cm",
        ns,
        &[&example],
        &[
            &watch,
            "crds.enabled=false",
            "operator.serviceMonitor.enabled=false",
        ],
    )
    .unwrap();

    let agent = certificates(&env).get(AGENT).await.unwrap().data["spec"].clone();
    let client = certificates(&env)
        .get(&format!("{OPERATOR}-client"))
        .await
        .unwrap()
        .data["spec"]
        .clone();
    for spec in [&agent, &client] {
        assert_eq!(spec["issuerRef"]["name"], "egressproxy-ca");
        assert_eq!(spec["issuerRef"]["kind"], "Issuer");
        assert_eq!(spec["privateKey"]["rotationPolicy"], "Always");
    }
    assert!(strings(&agent["usages"]).contains(&"server auth".to_owned()));
    assert!(strings(&client["usages"]).contains(&"client auth".to_owned()));

    // The agent serves the Secret its Certificate fills; the operator mounts both
    // (the CA from the agent's Secret, its client key pair from its own).
    let agent_secret = agent["secretName"].as_str().unwrap().to_owned();
    let client_secret = client["secretName"].as_str().unwrap().to_owned();
    assert!(mounted_secrets(&env, AGENT).await.contains(&agent_secret));
    let operator_mounts = mounted_secrets(&env, OPERATOR).await;
    assert!(
        operator_mounts.contains(&agent_secret) && operator_mounts.contains(&client_secret),
        "{operator_mounts:?}"
    );

    // The name the operator dials is one the agent's certificate is for.
    let config_maps: Api<ConfigMap> = env.namespaced();
    let providers = config_maps
        .get(&format!("{OPERATOR}-providers"))
        .await
        .unwrap()
        .data
        .unwrap()["providers.yaml"]
        .clone();
    let providers: serde_json::Value = serde_norway::from_str(&providers).unwrap();
    let endpoint = providers["providers"]["kvm"]["endpoint"].as_str().unwrap();
    let host = endpoint
        .trim_start_matches("https://")
        .rsplit_once(':')
        .unwrap()
        .0;
    assert!(
        strings(&agent["dnsNames"]).contains(&host.to_owned()),
        "{host} not in {:?}",
        agent["dnsNames"]
    );

    // The schema is cert-manager's, not a stand-in: a Certificate it would not accept
    // is refused by the apiserver, naming the field.
    let mut wrong = certificates(&env).get(AGENT).await.unwrap();
    wrong.metadata = kube::api::ObjectMeta {
        name: Some("wrong".into()),
        ..Default::default()
    };
    wrong.data["spec"]["privateKey"]["algorithm"] = "DSA".into();
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let error = certificates(&env)
        .create(&dry_run, &wrong)
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("spec.privateKey.algorithm"),
        "{error}"
    );
    helm.uninstall_without_hooks("cm", ns).unwrap();
}
