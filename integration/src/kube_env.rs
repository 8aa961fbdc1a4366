//! Per-test Kubernetes environments on the shared kube-apiserver.
//!
//! Each test calls [`KubeTestEnv::new`] and gets an admin [`kube::Client`] plus a fresh
//! namespace of its own, so tests in one process run in parallel on one apiserver
//! without seeing each other's objects. Cluster-scoped things (CRDs) are applied with
//! server-side apply, so tests that apply the same CRD concurrently agree.
//!
//! Caveats: unless a test starts a [`crate::cluster::Cluster`], only the apiserver runs
//! (no controller-manager, scheduler or kubelet), so what controllers would do does not
//! happen by itself: a new namespace gets no
//! `default` ServiceAccount (this module creates it, as the ServiceAccount controller
//! would), a deleted namespace stays `Terminating`, owned objects are not garbage
//! collected, and Pods are never scheduled. Namespaces are left in place: they vanish
//! with the apiserver when the test process exits.

use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use serde::Deserialize;

use crate::kube_apiserver::{self, KubeApiserver};

/// The field manager of objects the test helpers apply.
pub const FIELD_MANAGER: &str = "egressproxy-tests";
/// Label on every namespace made by [`KubeTestEnv::new`].
pub const TEST_NAMESPACE_LABEL: &str = "egressproxy.dev/test";

const CRD_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);
/// Namespace names are DNS labels: at most 63 characters.
const NAMESPACE_PREFIX_MAX: usize = 50;

/// One test's slice of the shared apiserver.
#[derive(Clone)]
pub struct KubeTestEnv {
    /// Admin client, made on the calling test's runtime.
    pub client: kube::Client,
    /// A namespace created for this test only.
    pub namespace: String,
    apiserver: &'static KubeApiserver,
}

impl std::fmt::Debug for KubeTestEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeTestEnv")
            .field("namespace", &self.namespace)
            .field("server", &self.apiserver.server())
            .finish_non_exhaustive()
    }
}

impl KubeTestEnv {
    /// Starts the shared apiserver if needed, then makes a client and a namespace named
    /// after `test_name` plus a random suffix.
    pub async fn new(test_name: &str) -> anyhow::Result<Self> {
        let apiserver = tokio::task::spawn_blocking(kube_apiserver::shared)
            .await
            .context("start the shared kube-apiserver")??;
        let client = apiserver.admin_client().await?;
        let namespace = create_test_namespace(&client, test_name).await?;
        Ok(Self {
            client,
            namespace,
            apiserver,
        })
    }

    /// The apiserver this environment uses.
    pub fn apiserver(&self) -> &'static KubeApiserver {
        self.apiserver
    }

    /// An [`Api`] for namespaced resources of type `K` in this test's namespace.
    pub fn namespaced<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// A client that authenticates as ServiceAccount `name` of this namespace with a
    /// token the apiserver issued (TokenRequest), so RBAC applies to it as to a Pod.
    pub async fn service_account_client(&self, name: &str) -> anyhow::Result<kube::Client> {
        let accounts: Api<ServiceAccount> = self.namespaced();
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let issued = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .with_context(|| {
                format!(
                    "request a token for ServiceAccount {}/{name}",
                    self.namespace
                )
            })?;
        let token = issued
            .status
            .and_then(|status| status.token)
            .unwrap_or_default();
        if token.is_empty() {
            bail!(
                "the apiserver issued an empty token for ServiceAccount {}/{name}",
                self.namespace
            );
        }
        let mut config = self.apiserver.admin_config().await?;
        config.auth_info = serde_json::from_value(serde_json::json!({ "token": token }))
            .context("build token credentials")?;
        config.default_namespace = self.namespace.clone();
        kube::Client::try_from(config).context("build ServiceAccount client")
    }
}

/// Creates a namespace for one test, with the `default` ServiceAccount that the
/// ServiceAccount controller of a full cluster would add.
async fn create_test_namespace(client: &kube::Client, test_name: &str) -> anyhow::Result<String> {
    let name = format!(
        "{}-{}",
        dns_label_prefix(test_name),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some([(TEST_NAMESPACE_LABEL.to_owned(), "true".to_owned())].into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .with_context(|| format!("create test namespace {name}"))?;
    let default_account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("default".to_owned()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    // With a controller manager running (a test cluster), it may have made it first.
    match Api::<ServiceAccount>::namespaced(client.clone(), &name)
        .create(&PostParams::default(), &default_account)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(err) => {
            return Err(err)
                .with_context(|| format!("create the default ServiceAccount in {name}"));
        }
    }
    Ok(name)
}

/// Lowercase alphanumerics and dashes from `test_name`, as a namespace name allows.
fn dns_label_prefix(test_name: &str) -> String {
    let mut label = String::with_capacity(NAMESPACE_PREFIX_MAX);
    for c in test_name.chars().map(|c| c.to_ascii_lowercase()) {
        if label.len() == NAMESPACE_PREFIX_MAX {
            break;
        }
        if c.is_ascii_alphanumeric() {
            label.push(c);
        } else if !label.is_empty() && !label.ends_with('-') {
            label.push('-');
        }
    }
    let trimmed = label.trim_end_matches('-');
    if trimmed.is_empty() {
        "test".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// Applies `crd` (server-side apply, forced) and waits until it is Established, that is
/// until the apiserver serves its resource.
pub async fn apply_crd(
    client: &kube::Client,
    crd: &CustomResourceDefinition,
) -> anyhow::Result<()> {
    let name = crd
        .metadata
        .name
        .clone()
        .context("CustomResourceDefinition without a name")?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut crd = crd.clone();
    crd.metadata.managed_fields = None;
    crd.metadata.resource_version = None;
    crds.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .with_context(|| format!("apply CustomResourceDefinition {name}"))?;
    tokio::time::timeout(
        CRD_ESTABLISHED_TIMEOUT,
        await_condition(crds, &name, conditions::is_crd_established()),
    )
    .await
    .with_context(|| {
        format!("CustomResourceDefinition {name} not Established after {CRD_ESTABLISHED_TIMEOUT:?}")
    })?
    .with_context(|| format!("watch CustomResourceDefinition {name}"))?;
    Ok(())
}

/// Applies every CustomResourceDefinition of a (multi-document) YAML text, for example
/// the output of a `crdgen` binary or a chart's `crds/` file.
pub async fn apply_crds_yaml(client: &kube::Client, yaml: &str) -> anyhow::Result<()> {
    for document in serde_norway::Deserializer::from_str(yaml) {
        let value = serde_norway::Value::deserialize(document).context("parse CRD YAML")?;
        if value.is_null() {
            continue;
        }
        let crd: CustomResourceDefinition = serde_norway::from_value(value)
            .context("YAML document is not a CustomResourceDefinition")?;
        apply_crd(client, &crd).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::dns_label_prefix;

    #[test]
    fn test_names_become_dns_labels() {
        assert_eq!(dns_label_prefix("crd::status_patch"), "crd-status-patch");
        assert_eq!(dns_label_prefix("__Weird__"), "weird");
        assert_eq!(dns_label_prefix("!!!"), "test");
        assert!(dns_label_prefix(&"x".repeat(100)).len() <= 50);
    }
}
