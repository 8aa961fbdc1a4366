//! The operator binary picks up a changed provider config file without a restart, and
//! keeps its previous config when the new file is invalid (real kube-apiserver,
//! reference provider as a process).

mod common;

use common::{OperatorOptions, OperatorProcess, eventually, wait_until};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Phase, Proxy};
use kube::Api;
use kube::api::PostParams;

fn proxy(name: &str, provider: &str, port: u16) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {
            "provider": provider,
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": port,
            "healthCheck": {"periodSeconds": 2, "timeoutSeconds": 1},
        },
    }))
    .unwrap()
}

fn ready_reason(proxy: Option<&Proxy>) -> Option<String> {
    let status = proxy?.status.as_ref()?;
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready")?;
    Some(ready.reason.clone())
}

fn is_ready(proxy: Option<&Proxy>) -> bool {
    proxy.and_then(|p| p.status.as_ref()).and_then(|s| s.phase) == Some(Phase::Ready)
}

fn reload_count(metrics: &str, result: &str) -> u64 {
    let prefix = format!("egressproxy_provider_config_reloads_total{{result=\"{result}\"}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|count| count.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_provider_added_to_the_config_file_is_used_without_a_restart() {
    let env = common::env_with_crd("reload").await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "0s"]).unwrap();
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "providers: {}\n").unwrap();
    let operator = OperatorProcess::start(
        &env,
        &OperatorOptions {
            identity: "reloading",
            providers: config.path(),
            lease_duration: "15s",
            clock_offset: None,
            extra_args: &["--providers-reload-interval", "200ms"],
        },
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let proxies: Api<Proxy> = env.namespaced();
    proxies
        .create(
            &PostParams::default(),
            &proxy("mistyped", "reference", port),
        )
        .await
        .unwrap();
    wait_until(
        &proxies,
        "mistyped",
        "ProviderNotConfigured",
        |p: Option<&Proxy>| ready_reason(p).as_deref() == Some("ProviderNotConfigured"),
    )
    .await;

    // The user adds the provider to the ConfigMap: no restart.
    std::fs::write(
        config.path(),
        common::reference_config(provider.endpoint(), "5s"),
    )
    .unwrap();
    wait_until(&proxies, "mistyped", "Ready after the config fix", is_ready).await;
    assert_eq!(
        reload_count(&operator.get("/metrics").await.1, "applied"),
        1
    );

    // A broken edit is refused: the previous config stays in use.
    std::fs::write(
        config.path(),
        "providers:\n  reference:\n    endpoint: tcp://nowhere\n",
    )
    .unwrap();
    let rejected = wait_until_rejected(&operator).await;
    assert_eq!(rejected, 1);
    proxies
        .create(
            &PostParams::default(),
            &proxy("after-bad-edit", "reference", port),
        )
        .await
        .unwrap();
    wait_until(
        &proxies,
        "after-bad-edit",
        "Ready on the previous config",
        is_ready,
    )
    .await;
}

/// Waits until the operator counts a rejected reload. The count is only visible on
/// `/metrics`, so this asks again until it shows.
async fn wait_until_rejected(operator: &OperatorProcess) -> u64 {
    eventually(
        "the invalid config to be rejected",
        common::WAIT,
        || async {
            let count = reload_count(&operator.get("/metrics").await.1, "rejected");
            if count > 0 {
                Ok(count)
            } else {
                Err("0 rejected reloads")
            }
        },
    )
    .await
}
