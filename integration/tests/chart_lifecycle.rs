//! `helm upgrade` and `helm uninstall` of a release in use:
//!
//! 1. An upgrade restarts what must restart, and only that: the same values change no
//!    pod template; a changed provider leaves the operator running (it re-reads the
//!    ConfigMap, now a directory mount the kubelet updates, where a subPath never was);
//!    a changed agent config restarts the agent (its config checksum) and not the
//!    operator; a changed operator flag restarts the operator.
//! 2. While a Proxy exists, the pre-delete hook (run here as its Job's pod, as the
//!    operator's ServiceAccount) refuses the uninstall, naming the Proxy and the command
//!    that deletes it. That command, run as written, deletes the Proxy through the
//!    operator (its VM too); then the hook lets the uninstall go on, and the uninstall
//!    leaves nothing of the release behind but the kept CRD: no Proxy stuck on its
//!    finalizer, no instance at the provider.

mod chart_support;

use std::time::Duration;

use chart_support::{create_proxy, create_ssh_secret, proxy_api, wait_ready};
use egressproxy_integration::chart_pod::{ChartPod, hook_pod_spec, run_pod_to_completion};
use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ListParams};

const RELEASE: &str = "lc";
const OPERATOR: &str = "lc-egressproxy-operator";
const AGENT: &str = "lc-egressproxy-kvm-agent";

const AGENT_VALUES: &str = "\
kvmAgent:
  enabled: true
  ssh:
    secretName: kvm-agent-ssh
  config:
    hosts:
      - name: hv1
        ssh: { address: \"127.0.0.1:1\", user: egressproxy }
    machineTypes:
      small: { vcpus: 1, memoryMiB: 1024, diskGiB: 10 }
    images:
      debian-12: { url: \"file:///nonexistent/debian-12.qcow2\" }
";

/// Each Deployment's pod template, as the apiserver stores it.
async fn templates(env: &KubeTestEnv) -> (String, String) {
    let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), &env.namespace);
    let template =
        |deployment: Deployment| serde_json::to_string(&deployment.spec.template).unwrap();
    (
        template(deployments.get(OPERATOR).await.unwrap()),
        template(deployments.get(AGENT).await.unwrap()),
    )
}

#[tokio::test]
async fn upgrades_restart_what_they_must_and_uninstall_refuses_while_proxies_exist() {
    let env = KubeTestEnv::new("chart-lifecycle").await.unwrap();
    let ns = env.namespace.clone();
    let kubeconfig = env.apiserver().kubeconfig_path();
    let dir = tempfile::tempdir().unwrap();
    create_ssh_secret(&env, dir.path(), "kvm-agent-ssh").await;
    let values = dir.path().join("values.yaml");
    std::fs::write(&values, AGENT_VALUES).unwrap();
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let endpoint = format!(
        "operator.providers.reference.endpoint={}",
        provider.endpoint()
    );
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    let cluster = format!("operator.clusterName=lc-{ns}");
    let base = [endpoint.as_str(), watch.as_str(), cluster.as_str()];
    let helm = Helm::new(kubeconfig).unwrap();
    helm.install(RELEASE, &ns, &[&values], &base).unwrap();
    let (operator_before, agent_before) = templates(&env).await;

    // 1. Upgrades.
    helm.upgrade(RELEASE, &ns, &[&values], &base).unwrap();
    assert_eq!(
        templates(&env).await,
        (operator_before.clone(), agent_before.clone()),
        "the same values restart nothing"
    );

    let mut with_provider = base.to_vec();
    with_provider.push("operator.providers.extra.endpoint=http://127.0.0.1:1");
    helm.upgrade(RELEASE, &ns, &[&values], &with_provider)
        .unwrap();
    let config_maps: Api<ConfigMap> = Api::namespaced(env.client.clone(), &ns);
    let providers = config_maps
        .get(&format!("{OPERATOR}-providers"))
        .await
        .unwrap()
        .data
        .unwrap()["providers.yaml"]
        .clone();
    assert!(providers.contains("extra:"), "{providers}");
    let (operator_now, agent_now) = templates(&env).await;
    assert_eq!(
        operator_now, operator_before,
        "a changed provider is re-read by the operator, not a restart"
    );
    assert!(
        !operator_now.contains("subPath"),
        "the provider config is a directory mount the kubelet updates: {operator_now}"
    );
    assert_eq!(agent_now, agent_before);

    let mut with_machine = with_provider.clone();
    with_machine.push("kvmAgent.config.machineTypes.large.vcpus=4");
    with_machine.push("kvmAgent.config.machineTypes.large.memoryMiB=4096");
    with_machine.push("kvmAgent.config.machineTypes.large.diskGiB=20");
    helm.upgrade(RELEASE, &ns, &[&values], &with_machine)
        .unwrap();
    let (operator_now, agent_now) = templates(&env).await;
    assert_ne!(
        agent_now, agent_before,
        "a changed agent config restarts the agent"
    );
    assert_eq!(operator_now, operator_before, "and not the operator");

    let mut with_gc = with_machine.clone();
    with_gc.push("operator.gc.interval=10m");
    helm.upgrade(RELEASE, &ns, &[&values], &with_gc).unwrap();
    let (operator_now, _) = templates(&env).await;
    assert_ne!(
        operator_now, operator_before,
        "a changed operator flag restarts it"
    );

    // 2. Uninstall while a Proxy exists.
    let operator = ChartPod::start(&env, &ns, OPERATOR, "egressproxy-operator", Some(OPERATOR))
        .await
        .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    create_proxy(&env, &ns, "in-use", listener.local_addr().unwrap().port()).await;
    wait_ready(&env, &ns, "in-use").await;

    let kubectl = Kubectl::new(kubeconfig);
    let hooks = helm.get_hooks(RELEASE, &ns).unwrap();
    let check = hook_pod_spec(
        &kubectl,
        &hooks,
        "Job",
        &format!("{OPERATOR}-uninstall-check"),
    )
    .unwrap();
    let run_check = || {
        run_pod_to_completion(
            &env,
            &ns,
            &check,
            Some(OPERATOR),
            &[],
            Duration::from_secs(60),
        )
    };
    let refused = run_check().await.unwrap();
    let said = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(
        !refused.status.success(),
        "the hook let the uninstall go on: {said}"
    );
    let delete = format!("kubectl delete proxypools,proxies --all -n {ns} --wait");
    for expected in [
        &format!("{ns}/in-use"),
        delete.as_str(),
        "helm uninstall --no-hooks",
    ] {
        assert!(
            said.contains(expected),
            "the refusal lacks {expected:?}: {said}"
        );
    }

    // The command it gives, as written: the operator deletes the VM, then the Proxy goes.
    let deleted = std::process::Command::new("bash")
        .args(["-c", &format!("timeout 120 {delete}")])
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    assert!(deleted.status.success(), "{deleted:?}");
    let allowed = run_check().await.unwrap();
    assert!(
        allowed.status.success(),
        "{}",
        String::from_utf8_lossy(&allowed.stderr)
    );
    drop(operator);

    helm.uninstall_without_hooks(RELEASE, &ns).unwrap();
    let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), &ns);
    assert!(
        deployments
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &ns);
    let left: Vec<String> = secrets
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|secret| secret.metadata.name)
        .filter(|name| name.starts_with("lc-"))
        .collect();
    assert!(left.is_empty(), "the release's Secrets stay: {left:?}");
    assert!(
        proxy_api(&env.client, &ns)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "no Proxy is left on its finalizer"
    );
    let instances = connect_lazy(&ClientOptions::new(provider.endpoint()))
        .unwrap()
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .instances;
    assert!(
        instances.is_empty(),
        "the VM went with its Proxy: {instances:?}"
    );
}
