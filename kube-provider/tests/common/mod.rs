//! One test's kube-provider on the shared real kube-apiserver: its own namespace for
//! the pods, its own egress Nodes (objects only: no kubelet runs them), and the
//! provider served over gRPC with the shared scaffold, as the binary serves it.
//!
//! Nodes are cluster-scoped, so each test's nodes carry a label whose value is the
//! test's namespace, and its provider selects only those: tests run in parallel
//! without seeing each other's nodes.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;

use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_provider::client::{Client, ClientOptions, connect_lazy};
use egressproxy_provider::server::ProviderServer;
use egressproxy_provider::{ProviderError, pb};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube_provider::{Config, KubeProvider};
use tokio::sync::oneshot;

/// The node label a test's provider selects its egress nodes by.
pub const EGRESS_LABEL: &str = "egressproxy.dev/test-egress";
/// The zone label of the tests' nodes (the configuration's default).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// A test's environment: the apiserver slice, its nodes, and how to serve a provider.
pub struct Harness {
    pub env: KubeTestEnv,
    /// Node names by the short name the test gave them.
    pub nodes: BTreeMap<String, String>,
}

/// A provider being served; dropping it stops the server (a provider restart), so a
/// test keeps it in a variable for as long as it calls the provider.
pub struct Served {
    pub client: Client,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    _stop: oneshot::Sender<()>,
}

impl Harness {
    /// A namespace and egress nodes `(short name, zone)`.
    pub async fn new(test: &str, nodes: &[(&str, &str)]) -> Harness {
        let env = KubeTestEnv::new(test).await.unwrap();
        let api: Api<Node> = Api::all(env.client.clone());
        let mut names = BTreeMap::new();
        for (short, zone) in nodes {
            let name = format!("{}-{short}", env.namespace);
            let node = Node {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(BTreeMap::from([
                        (EGRESS_LABEL.to_owned(), env.namespace.clone()),
                        (ZONE_LABEL.to_owned(), (*zone).to_owned()),
                    ])),
                    ..ObjectMeta::default()
                },
                ..Node::default()
            };
            api.create(&PostParams::default(), &node).await.unwrap();
            // Ready and with room, as its kubelet would report it: only Ready nodes get
            // proxies, and only where their requests fit.
            let ready = serde_json::json!({"status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "capacity": node_allocatable(),
                "allocatable": node_allocatable(),
            }});
            api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&ready))
                .await
                .unwrap();
            names.insert((*short).to_owned(), name);
        }
        Harness { env, nodes: names }
    }

    /// The configuration: this test's namespace and nodes, machine type `small`, image
    /// `squid`.
    pub fn config(&self) -> Config {
        Config::parse(&format!(
            "namespace: {ns}\n\
             node_selector: {{{EGRESS_LABEL}: {ns}}}\n\
             machine_types:\n  small: {{requests: {{cpu: 100m, memory: 64Mi}}, limits: {{memory: 128Mi}}}}\n\
             images:\n  squid: {{image: 'localhost/squid:6', pull_policy: Never}}\n",
            ns = self.env.namespace
        ))
        .unwrap()
    }

    /// Makes an existing node (a kubelet's) one of this test's egress nodes, in `zone`,
    /// as a user labels the nodes partners allow-list.
    pub async fn label_egress_node(&self, node: &str, zone: &str) {
        let labels = serde_json::json!({"metadata": {"labels": {
            EGRESS_LABEL: self.env.namespace,
            ZONE_LABEL: zone,
        }}});
        Api::<Node>::all(self.env.client.clone())
            .patch(node, &PatchParams::default(), &Patch::Merge(&labels))
            .await
            .unwrap();
    }

    /// A namespace of someone else's beside the test's (`<test namespace>-<suffix>`),
    /// ready for pods: its name and its pods.
    pub async fn other_namespace(&self, suffix: &str) -> (String, Api<Pod>) {
        let namespace = format!("{}-{suffix}", self.env.namespace);
        let object: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": namespace}})).unwrap();
        Api::<Namespace>::all(self.env.client.clone())
            .create(&PostParams::default(), &object)
            .await
            .unwrap();
        // No controller makes the namespace's default ServiceAccount here; admission
        // needs it.
        let account: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}})).unwrap();
        Api::<ServiceAccount>::namespaced(self.env.client.clone(), &namespace)
            .create(&PostParams::default(), &account)
            .await
            .unwrap();
        let pods = Api::namespaced(self.env.client.clone(), &namespace);
        (namespace, pods)
    }

    /// Deletes a namespace [`Harness::other_namespace`] made.
    pub async fn delete_namespace(&self, namespace: &str) {
        Api::<Namespace>::all(self.env.client.clone())
            .delete(namespace, &DeleteParams::default())
            .await
            .unwrap();
    }

    /// Sets what node `short` reports allocatable (its capacity too).
    pub async fn set_allocatable(&self, short: &str, allocatable: serde_json::Value) {
        let status = serde_json::json!({"status": {
            "capacity": allocatable,
            "allocatable": allocatable,
        }});
        Api::<Node>::all(self.env.client.clone())
            .patch_status(
                &self.nodes[short],
                &PatchParams::default(),
                &Patch::Merge(&status),
            )
            .await
            .unwrap();
    }

    /// Serves a new provider (no state but the cluster's) and connects a client to it.
    pub async fn serve(&self) -> Served {
        self.serve_with(self.config()).await
    }

    /// As [`Harness::serve`], with `config`.
    pub async fn serve_with(&self, config: Config) -> Served {
        self.serve_as(self.env.client.clone(), config).await
    }

    /// As [`Harness::serve`], reaching the apiserver through `client` (for example as
    /// a ServiceAccount, so that RBAC applies).
    pub async fn serve_as(&self, client: kube::Client, config: Config) -> Served {
        let provider = KubeProvider::new(client, config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            ProviderServer::new(provider)
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        let endpoint = format!("http://{address}");
        let client = connect_lazy(&ClientOptions::new(endpoint.clone())).unwrap();
        Served {
            client,
            endpoint,
            _stop: stop,
        }
    }

    pub fn pods(&self) -> Api<Pod> {
        self.env.namespaced()
    }

    /// Removes a terminating pod as the kubelet would once its containers stopped.
    pub async fn finish_termination(&self, name: &str) {
        self.pods()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    /// Reports the pod Running and Ready on a node at `ip`, as its kubelet would.
    pub async fn report_running(&self, name: &str, ip: &str) {
        self.pods()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&running_status(ip)),
            )
            .await
            .unwrap();
    }
}

/// A Create request for `key` with placement `location`, machine type `small`, image
/// `squid`, port 3128, and `tags`.
pub fn create_request(
    key: &str,
    location: Option<pb::placement::Location>,
    tags: &[(&str, &str)],
) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("ns/{key}"),
        placement: Some(pb::Placement {
            location,
            machine_type: "small".into(),
            image: "squid".into(),
        }),
        proxy_port: 3128,
        tags: tags
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..pb::CreateInstanceRequest::default()
    }
}

/// Creates and returns the instance, failing the test on an error.
pub async fn create(client: &mut Client, request: pb::CreateInstanceRequest) -> pb::Instance {
    client
        .create_instance(request)
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap()
}

/// Gets the instance, or the error as the contract's.
pub async fn get(client: &mut Client, id: &str) -> Result<pb::Instance, ProviderError> {
    client
        .get_instance(pb::GetInstanceRequest { id: id.into() })
        .await
        .map(|r| r.into_inner().instance.unwrap())
        .map_err(|status| ProviderError::from_status(&status))
}

/// Stands in for the kubelet of the test's egress nodes, driven by a watch of the
/// namespace's pods: it reports every new pod Running and Ready on a node at
/// 127.0.0.1, and removes every terminating pod at once. The apiserver-only harness has
/// no kubelet; this lets the contract's checks that need RUNNING (and a deleted
/// instance that goes) run, while proving nothing about pods really running.
pub struct StandInKubelet {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StandInKubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Harness {
    /// Starts the stand-in kubelet for this test's namespace.
    pub fn stand_in_kubelet(&self) -> StandInKubelet {
        use futures::StreamExt;
        use kube::runtime::{WatchStreamExt, watcher};

        let pods = self.pods();
        let task = tokio::spawn(async move {
            let events = watcher(pods.clone(), watcher::Config::default())
                .default_backoff()
                .applied_objects();
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                let Ok(pod) = event else { continue };
                let Some(name) = pod.metadata.name.clone() else {
                    continue;
                };
                if pod.metadata.deletion_timestamp.is_some() {
                    let gone = pods
                        .delete(&name, &DeleteParams::default().grace_period(0))
                        .await;
                    if let Err(kube::Error::Api(status)) = &gone
                        && status.code != 404
                    {
                        panic!("stand-in kubelet: remove {name}: {status}");
                    }
                    continue;
                }
                let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
                if phase != Some("Running") {
                    let status = running_status("127.0.0.1");
                    // The pod may be deleted meanwhile: its next event handles that.
                    let _ = pods
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                        .await;
                }
            }
        });
        StandInKubelet { task }
    }
}

/// A pod status Running and Ready on a host-network node at `ip`.
fn running_status(ip: &str) -> serde_json::Value {
    serde_json::json!({"status": {
        "phase": "Running",
        "hostIP": ip,
        "hostIPs": [{"ip": ip}],
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }})
}

/// What each test node reports allocatable (and its capacity), as a status's JSON: room
/// for dozens of pods of machine type `small`.
pub fn node_allocatable() -> serde_json::Value {
    serde_json::json!({"cpu": "4", "memory": "8Gi", "pods": "110"})
}
