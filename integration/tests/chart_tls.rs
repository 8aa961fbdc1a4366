//! Mutual TLS to a provider, wired only through the chart's values: a Secret with the CA
//! and the operator's client certificate, `operator.providers.<name>.tls` naming it. The
//! reference provider requires client certificates from that CA; the operator, run as the
//! installed Deployment would run it (its projected TLS volume and the rendered provider
//! config), brings a Proxy to Ready through it.

mod chart_support;

use chart_support::{create_proxy, make_certificates, wait_ready};
use egressproxy_integration::chart_pod::ChartPod;
use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

const OPERATOR: &str = "tls-egressproxy-operator";

#[tokio::test]
async fn mutual_tls_to_a_provider_from_a_secret_named_in_values() {
    let env = KubeTestEnv::new("chart-tls").await.unwrap();
    let ns = env.namespace.as_str();
    let certs = tempfile::tempdir().unwrap();
    make_certificates(certs.path(), "localhost");
    let path = |name: &str| certs.path().join(name).display().to_string();
    let provider = ReferenceProvider::start(&[
        "--provisioning-delay",
        "200ms",
        "--tls-cert",
        &path("server.crt"),
        "--tls-key",
        &path("server.key"),
        "--client-ca",
        &path("ca.crt"),
    ])
    .unwrap();
    let port = provider.address().rsplit_once(':').unwrap().1.to_owned();

    let read = |name: &str| std::fs::read_to_string(certs.path().join(name)).unwrap();
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "reference-tls"},
        "stringData": {
            "ca.crt": read("ca.crt"),
            "tls.crt": read("client.crt"),
            "tls.key": read("client.key"),
        },
    }))
    .unwrap();
    Api::<Secret>::namespaced(env.client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();

    let values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        values.path(),
        format!(
            "operator:\n  clusterName: chart-tls\n  providers:\n    reference:\n      \
             endpoint: https://localhost:{port}\n      tls:\n        secretName: reference-tls\n        \
             clientCertificate: true\n"
        ),
    )
    .unwrap();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    helm.install("tls", ns, &[values.path()], &[]).unwrap();

    let operator = ChartPod::start(&env, ns, OPERATOR, "egressproxy-operator", Some(OPERATOR))
        .await
        .unwrap();
    // The chart mounted the Secret's three keys where its provider config says.
    let tls_dir = operator
        .root()
        .join("etc/egressproxy/provider-tls/reference");
    for file in ["ca.crt", "tls.crt", "tls.key"] {
        assert!(tls_dir.join(file).is_file(), "{file} not mounted");
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = listener.local_addr().unwrap().port();
    create_proxy(&env, ns, "secure", proxy_port).await;
    wait_ready(&env, ns, "secure").await;
}
