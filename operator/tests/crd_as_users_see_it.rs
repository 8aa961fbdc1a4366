//! The CRDs as a `kubectl` user meets them, against a real kube-apiserver: applying
//! it draws no warnings, `kubectl explain` has a real description to show, and the
//! cloud-init size is checked in bytes at admission, as providers count it.

mod common;

use common::{CRD, eventually};
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_operator::crd::{Proxy, ProxyPool};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams, PostParams};

/// Every CRD of the chart's file (Proxy, ProxyPool).
fn crds() -> Vec<CustomResourceDefinition> {
    use serde::Deserialize;
    serde_norway::Deserializer::from_str(CRD)
        .map(|document| CustomResourceDefinition::deserialize(document).unwrap())
        .collect()
}

#[tokio::test]
async fn applying_the_crds_draws_no_warnings() {
    let env = KubeTestEnv::new("crd-warnings").await.unwrap();
    let crds = crds();
    assert_eq!(crds.len(), 2, "the Proxy and ProxyPool CRDs");
    for crd in crds {
        let name = crd.metadata.name.clone().unwrap();
        // A dry-run apply validates the schema as a real apply does, and the apiserver
        // reports what it dislikes in Warning headers (what kubectl prints).
        let request =
            kube::core::Request::new("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
                .patch(
                    &name,
                    &PatchParams::apply("crd-warnings-test").force().dry_run(),
                    &Patch::Apply(&crd),
                )
                .unwrap();
        let response = env
            .client
            .send(request.map(kube::client::Body::from))
            .await
            .unwrap();
        assert!(
            response.status().is_success(),
            "{name}: {:?}",
            response.status()
        );
        let warnings: Vec<String> = response
            .headers()
            .get_all("warning")
            .iter()
            .map(|value| value.to_str().unwrap_or_default().to_owned())
            .collect();
        assert!(
            warnings.is_empty(),
            "the apiserver warned about {name}: {warnings:#?}"
        );
    }
}

/// A pool's template may change where a Proxy's spec may not (that is how members are
/// replaced), and a pool that could never roll, or a spread entry naming both a host and
/// a zone, is refused at admission with a message that says what to set.
#[tokio::test]
async fn a_pool_s_template_may_change_and_its_mistakes_are_refused_at_admission() {
    let env = KubeTestEnv::new("crd-pool").await.unwrap();
    apply_crds_yaml(&env.client, CRD).await.unwrap();
    let pools: kube::Api<ProxyPool> = env.namespaced();
    let pool = |name: &str, extra: serde_json::Value| -> ProxyPool {
        let mut spec = serde_json::json!({
            "replicas": 2,
            "template": {"spec": {
                "provider": "reference",
                "placement": {"machineType": "small", "image": "debian-12"},
            }},
        });
        for (key, value) in extra.as_object().cloned().unwrap_or_default() {
            spec[key] = value;
        }
        serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .unwrap()
    };
    pools
        .create(&PostParams::default(), &pool("ok", serde_json::json!({})))
        .await
        .unwrap();
    let placement = serde_json::json!({"spec": {"template": {"spec": {
        "provider": "other",
        "placement": {"machineType": "medium", "image": "debian-12"},
    }}}});
    pools
        .patch("ok", &PatchParams::default(), &Patch::Merge(&placement))
        .await
        .expect("a template's provider and placement may change");

    for (name, extra, message) in [
        (
            "no-room",
            serde_json::json!({"maxSurge": 0, "maxUnavailable": 0}),
            "set spec.maxSurge or spec.maxUnavailable above 0",
        ),
        (
            "both",
            serde_json::json!({"spread": [{"host": "a", "zone": "b"}]}),
            "exactly one of host and zone",
        ),
        (
            "list-and-across",
            serde_json::json!({"spread": [{"host": "a"}], "spreadAcross": "hosts"}),
            "set spec.spread (a fixed list) or spec.spreadAcross",
        ),
        (
            "one-address",
            serde_json::json!({"template": {"spec": {
                "provider": "reference",
                "placement": {"machineType": "small", "image": "debian-12"},
                "egress": {"address": "192.0.2.50"},
            }}}),
            "remove spec.template.spec.egress.address",
        ),
        (
            "too-many",
            serde_json::json!({"replicas": 101}),
            "spec.replicas",
        ),
    ] {
        let refused = pools
            .create(&PostParams::default(), &pool(name, extra))
            .await
            .expect_err(name);
        let text = refused.to_string();
        assert!(text.contains(message), "{name}: {text}");
    }
}

#[tokio::test]
async fn kubectl_explain_has_a_real_description() {
    let env = KubeTestEnv::new("crd-explain").await.unwrap();
    apply_crds_yaml(&env.client, CRD).await.unwrap();
    // `kubectl explain` reads the served OpenAPI v3 document of the group version. The
    // apiserver publishes a CRD's document a moment after the CRD is established, and
    // offers nothing to watch for it: ask until it is there.
    let what = "the OpenAPI document to be served";
    let within = std::time::Duration::from_secs(60);
    let document: serde_json::Value = eventually(what, within, || async {
        let request = http::Request::get("/openapi/v3/apis/egressproxy.dev/v1alpha1")
            .body(Vec::new())
            .unwrap();
        env.client.request(request).await
    })
    .await;
    let schemas = &document["components"]["schemas"];
    let proxy = schemas
        .as_object()
        .unwrap()
        .iter()
        .find(|(name, _)| name.ends_with(".Proxy"))
        .map(|(_, schema)| schema)
        .expect("the Proxy schema is served");
    let description = proxy["description"].as_str().unwrap_or_default();
    assert!(
        description.contains("egress proxy") && !description.contains("Auto-generated"),
        "{description:?}"
    );
    let user_data = proxy["properties"]["spec"]["properties"]["cloudInit"]["properties"]
        ["userData"]["description"]
        .as_str()
        .unwrap_or_default();
    let user_data = user_data.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(user_data.contains("65536 bytes"), "{user_data}");
}

fn proxy_with_user_data(name: &str, user_data: String) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "cloudInit": {"userData": user_data},
        },
    }))
    .unwrap()
}

#[tokio::test]
async fn user_data_is_limited_in_bytes_at_admission() {
    let env = KubeTestEnv::new("crd-bytes").await.unwrap();
    apply_crds_yaml(&env.client, CRD).await.unwrap();
    let proxies: kube::Api<Proxy> = env.namespaced();
    // 65,536 characters of two bytes each: within a character limit, twice the bytes.
    let wide = "é".repeat(65_536);
    let outcome = proxies
        .create(&PostParams::default(), &proxy_with_user_data("wide", wide))
        .await;
    let Err(error) = outcome else {
        panic!("131072 bytes of user-data must be refused at admission");
    };
    assert!(error.to_string().contains("over 65536 bytes"), "{error}");
    // Exactly the limit in bytes is accepted.
    let full = format!("#cloud-config\n#{}", "a".repeat(65_536 - 15));
    assert_eq!(full.len(), 65_536);
    proxies
        .create(&PostParams::default(), &proxy_with_user_data("full", full))
        .await
        .unwrap();
}
