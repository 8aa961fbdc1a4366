//! The contract's calls as apiserver calls on proxy pods. Nothing is kept in memory:
//! every answer is read from the cluster, so a restarted provider (or a second replica)
//! answers exactly as the first would.
//!
//! - **Create**: check the request; read the key's pod (its name is a digest of the
//!   key): if it exists, answer it (same spec), ALREADY_EXISTS (another spec) or
//!   UNAVAILABLE `KEY_BEING_DELETED` (terminating). That read and all that follows hold
//!   the proxy port's lock (`port_lock`) until the pod exists. Otherwise read the egress
//!   nodes, our pods, and the host ports that every pod on the nodes the placement
//!   allows holds; choose a node where the port is free (`placement`) and create the
//!   pod. A racing Create of the key that won makes the apiserver answer AlreadyExists
//!   (or, where the lock did not order them, holds the port: the key's pod is read
//!   again), and the winner's pod is answered as above, so one key never makes two
//!   pods; a racing Create of another key on the same port waits for the lock and then
//!   reads this one's pod, so two pods never share a port of a node.
//! - **Get**: the pod, read as an instance; no pod (or not ours) is NOT_FOUND.
//! - **Delete**: delete the pod (with its UID as a precondition, so a newer pod of the
//!   same key is never hit); DELETING while it terminates (the kubelet stops the
//!   proxy), NOT_FOUND once the apiserver has removed it. Missing is success.
//! - **UpdateInstanceTags** (compare-and-set): read the pod; DELETING is
//!   FAILED_PRECONDITION `INSTANCE_DELETING`; tags already the new ones: OK, nothing
//!   written; tags not exactly `expected_tags`: FAILED_PRECONDITION `TAGS_CHANGED`.
//!   Otherwise the record annotation with the new tags is patched with the
//!   resourceVersion the tags were compared at, which the apiserver checks: a pod
//!   changed since (another update won, a Delete began) answers 409 Conflict, and the
//!   compare runs again on the pod as it is now. So the compare and the set are one
//!   step, across replicas of the provider too.
//! - **List**: one list of our pods, filtered by tags, sorted by id and paged with the
//!   shared paging: all of them or an error.
//! - **Watch**: the streams of a watch of our pods (`pod_watch`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use egressproxy_provider::error::reason;
use egressproxy_provider::{ProviderError, paging, pb, validation};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};

use crate::config::Config;
use crate::instance::{self, Unreadable};
use crate::kube_errors::{classify, is_already_exists, is_not_found};
use crate::node_room::{NodeRoom, new_pod_requests};
use crate::placement::{self, Candidate};
use crate::pod_spec::proxy_pod;
use crate::pod_watch::PodWatch;
use crate::port_lock::PortLocks;
use crate::record::{
    MANAGED_BY, MANAGED_BY_LABEL, RECORD_ANNOTATION, Recorded, RequestedPlacement, is_instance_id,
    pod_name,
};
use crate::request;

/// Compare-and-sets an UpdateInstanceTags tries when each loses to a concurrent change of
/// the pod (its resourceVersion moved between the read and the patch).
const TAG_UPDATE_ATTEMPTS: usize = 5;
/// How soon a Create of a key whose pod is terminating should be retried.
const KEY_BEING_DELETED_RETRY: Duration = Duration::from_secs(2);

/// The provider: a client and the configuration. Cheap to clone.
#[derive(Clone)]
pub struct KubeProvider {
    client: kube::Client,
    config: Arc<Config>,
    watch: Arc<PodWatch>,
    ports: Arc<PortLocks>,
}

impl std::fmt::Debug for KubeProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeProvider")
            .field("namespace", &self.config.namespace)
            .finish_non_exhaustive()
    }
}

impl KubeProvider {
    /// A provider that keeps its pods in `config.namespace` through `client`, and starts
    /// the watch of them that serves WatchInstances (so it needs a Tokio runtime; the
    /// watch stops when the last clone is dropped).
    pub fn new(client: kube::Client, config: Config) -> Self {
        let pods = Api::namespaced(client.clone(), &config.namespace);
        KubeProvider {
            client,
            config: Arc::new(config),
            watch: Arc::new(PodWatch::start(pods)),
            ports: Arc::default(),
        }
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// WatchInstances' work.
    pub async fn watch(
        &self,
        request: &pb::WatchInstancesRequest,
    ) -> Result<egressproxy_provider::watch::WatchStream, ProviderError> {
        self.watch.stream(request).await
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.config.namespace)
    }

    /// CreateInstance's work.
    #[tracing::instrument(skip_all, fields(instance.key = %request.key))]
    pub async fn create(
        &self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, ProviderError> {
        request::check_create(&self.config, &request)?;
        let placement = request
            .placement
            .as_ref()
            .expect("checked: placement is set");
        let recorded = Recorded {
            key: request.key.clone(),
            name: request.name.clone(),
            tags: request.tags.clone().into_iter().collect(),
            requested: RequestedPlacement::from_pb(placement),
            proxy_port: request.proxy_port,
        };
        let name = pod_name(&recorded.key);
        // Held from before the key's pod is read until it exists, so the next Create of
        // this port sees it: as its key's pod (a repeat) or holding the port.
        let _port = self.ports.lock(recorded.proxy_port).await;
        if let Some(pod) = self.read_pod(&name).await? {
            return answer_existing(&pod, &recorded);
        }
        let node = match self
            .choose_node(&recorded.requested, recorded.proxy_port)
            .await
        {
            Ok(node) => node,
            // The port may be held by this key's own pod, made since the read above by a
            // Create that this process's lock does not order (another replica's).
            Err(error) if error.reason == placement::PORT_IN_USE => {
                return match self.read_pod(&name).await? {
                    Some(pod) => answer_existing(&pod, &recorded),
                    None => Err(error),
                };
            }
            Err(error) => return Err(error),
        };
        let pod = proxy_pod(
            &self.config,
            &recorded,
            &node,
            &self.config.images[&placement.image],
            &self.config.machine_types[&placement.machine_type],
        );
        match self.pods().create(&PostParams::default(), &pod).await {
            Ok(created) => {
                tracing::info!(instance.id = %name, node = %node, "created proxy pod");
                self.watch.wrote(&created);
                instance::instance(&created).map_err(unreadable)
            }
            Err(error) if is_already_exists(&error) => {
                let pod = self.read_pod(&name).await?.ok_or_else(|| {
                    ProviderError::transient(format!(
                        "pod {name} existed a moment ago and is gone: retry"
                    ))
                })?;
                answer_existing(&pod, &recorded)
            }
            Err(error) => Err(classify(&format!("create pod {name}"), error)),
        }
    }

    /// GetInstance's work.
    #[tracing::instrument(skip(self))]
    pub async fn get(&self, id: &str) -> Result<pb::Instance, ProviderError> {
        validation::check_id(id)?;
        let missing = || ProviderError::not_found(format!("instance {id} does not exist"));
        if !is_instance_id(id) {
            return Err(missing());
        }
        let pod = self
            .read_pod(id)
            .await?
            .filter(is_ours)
            .ok_or_else(missing)?;
        instance::instance(&pod).map_err(unreadable)
    }

    /// DeleteInstance's work.
    #[tracing::instrument(skip(self))]
    pub async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        validation::check_id(id)?;
        if !is_instance_id(id) {
            return Ok(());
        }
        let Some(pod) = self.read_pod(id).await?.filter(is_ours) else {
            return Ok(());
        };
        if pod.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.pods().delete(id, &params).await {
            // The pod as it terminates, or (gone at once) the apiserver's status.
            Ok(outcome) => {
                match outcome.left() {
                    Some(terminating) => {
                        tracing::info!(instance.id = %id, "deleting proxy pod");
                        self.watch.wrote(&terminating);
                    }
                    None => {
                        tracing::info!(instance.id = %id, "deleted proxy pod");
                        self.watch.gone(id);
                    }
                }
                Ok(())
            }
            Err(error) if is_not_found(&error) => Ok(()),
            // The UID precondition failed: the pod was replaced by a newer one of the same
            // key, which this id no longer names as the caller knew it; ours is gone.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(error) => Err(classify(&format!("delete pod {id}"), error)),
        }
    }

    /// UpdateInstanceTags' work; see the module docs.
    #[tracing::instrument(skip_all, fields(instance.id = %request.id))]
    pub async fn update_tags(
        &self,
        request: &pb::UpdateInstanceTagsRequest,
    ) -> Result<pb::Instance, ProviderError> {
        validation::check_update_tags_request(request)?;
        let id = &request.id;
        let missing = || ProviderError::not_found(format!("instance {id} does not exist"));
        if !is_instance_id(id) {
            return Err(missing());
        }
        let expected: BTreeMap<String, String> =
            request.expected_tags.clone().into_iter().collect();
        let new: BTreeMap<String, String> = request.tags.clone().into_iter().collect();
        for _ in 0..TAG_UPDATE_ATTEMPTS {
            let pod = self
                .read_pod(id)
                .await?
                .filter(is_ours)
                .ok_or_else(missing)?;
            let mut recorded = instance::recorded(&pod).map_err(unreadable)?;
            if pod.metadata.deletion_timestamp.is_some() {
                return Err(ProviderError::permanent(format!(
                    "instance {id} is being deleted: its tags no longer change"
                ))
                .with_reason(reason::INSTANCE_DELETING));
            }
            if recorded.tags == new {
                return instance::instance(&pod).map_err(unreadable);
            }
            if recorded.tags != expected {
                return Err(ProviderError::permanent(format!(
                    "instance {id}: its tags are no longer the expected_tags (another caller \
                     changed them); nothing was changed: read the instance again and decide anew"
                ))
                .with_reason(reason::TAGS_CHANGED));
            }
            recorded.tags = new.clone();
            let record = serde_json::to_string(&recorded).map_err(|error| {
                ProviderError::permanent(format!("cannot write the record of pod {id}: {error}"))
            })?;
            let patch = serde_json::json!({"metadata": {
                "resourceVersion": pod.metadata.resource_version,
                "annotations": {RECORD_ANNOTATION: record},
            }});
            match self
                .pods()
                .patch(id, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(patched) => {
                    tracing::info!(instance.id = %id, "updated instance tags");
                    self.watch.wrote(&patched);
                    return instance::instance(&patched).map_err(unreadable);
                }
                // Changed since it was read: compare again with what it is now.
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(error) if is_not_found(&error) => return Err(missing()),
                Err(error) => return Err(classify(&format!("patch pod {id}"), error)),
            }
        }
        Err(ProviderError::transient(format!(
            "instance {id} changed under each of {TAG_UPDATE_ATTEMPTS} tag updates: retry"
        ))
        .with_reason("KUBE_CONFLICT"))
    }

    /// ListInstances' work.
    #[tracing::instrument(skip_all)]
    pub async fn list(
        &self,
        request: &pb::ListInstancesRequest,
    ) -> Result<pb::ListInstancesResponse, ProviderError> {
        validation::check_list_request(request)?;
        paging::decode_token(&request.page_token)?;
        let size = paging::page_size(request.page_size, paging::DEFAULT_PAGE_SIZE);
        let mut instances: Vec<pb::Instance> = self
            .our_pods()
            .await?
            .iter()
            .filter_map(|pod| match instance::instance(pod) {
                Ok(instance) => Some(instance),
                Err(error) => {
                    // Never list (and so never let a collector delete) what cannot be read.
                    tracing::warn!(%error, "skipping a pod that is not a readable instance");
                    None
                }
            })
            .filter(|instance| {
                request
                    .tag_selector
                    .iter()
                    .all(|(key, value)| instance.tags.get(key) == Some(value))
            })
            .collect();
        instances.sort_by(|a, b| a.id.cmp(&b.id));
        paging::page(instances, &request.page_token, size)
    }

    async fn read_pod(&self, name: &str) -> Result<Option<Pod>, ProviderError> {
        self.pods()
            .get_opt(name)
            .await
            .map_err(|error| classify(&format!("read pod {name}"), error))
    }

    async fn our_pods(&self) -> Result<Vec<Pod>, ProviderError> {
        let params = ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"));
        let list = self
            .pods()
            .list(&params)
            .await
            .map_err(|error| classify("list proxy pods", error))?;
        Ok(list.items)
    }

    /// The node for a new pod: the egress nodes, each with our pods on it counted and,
    /// for those the placement allows, the host ports and resources in use on it.
    async fn choose_node(
        &self,
        requested: &RequestedPlacement,
        proxy_port: u32,
    ) -> Result<String, ProviderError> {
        let wanted = &self
            .config
            .machine_types
            .get(&requested.machine_type)
            .map(|machine_type| new_pod_requests(&machine_type.resources()))
            .unwrap_or_default();
        let selector: Vec<String> = self
            .config
            .node_selector
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        let nodes = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default().labels(&selector.join(",")))
            .await
            .map_err(|error| classify("list egress nodes", error))?;
        let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
        for pod in self.our_pods().await? {
            if pod.metadata.deletion_timestamp.is_none()
                && let Some(node) = pod.spec.and_then(|spec| spec.node_name)
            {
                *per_node.entry(node).or_default() += 1;
            }
        }
        let mut candidates: Vec<Candidate> = nodes
            .items
            .iter()
            .map(|node| {
                let name = node.metadata.name.as_deref().unwrap_or_default();
                let count = per_node.get(name).copied().unwrap_or_default();
                Candidate::from_node(node, &self.config.zone_label, count)
            })
            .collect();
        let inspected: Vec<&Node> = placement::in_scope(requested, &candidates)?
            .into_iter()
            .filter(|candidate| candidate.schedulable)
            .filter_map(|candidate| {
                nodes
                    .items
                    .iter()
                    .find(|node| node.metadata.name.as_ref() == Some(&candidate.name))
            })
            .collect();
        let live_pods =
            futures::future::try_join_all(inspected.iter().map(|node| self.live_pods_on(node)))
                .await?;
        for (node, pods) in inspected.iter().zip(live_pods) {
            if let Some(candidate) = candidates
                .iter_mut()
                .find(|c| node.metadata.name.as_ref() == Some(&c.name))
            {
                candidate.ports_in_use = pods.iter().flat_map(placement::host_ports).collect();
                candidate.room = Some(NodeRoom::of(node, &pods));
            }
        }
        placement::choose(requested, proxy_port, wanted, &candidates)
    }

    /// The pods bound to `node`, in any namespace, that have not terminated: they hold
    /// its ports and its resources.
    async fn live_pods_on(&self, node: &Node) -> Result<Vec<Pod>, ProviderError> {
        let name = node.metadata.name.as_deref().unwrap_or_default();
        // Terminated pods hold neither; the field selector leaves them out at the source.
        let params = ListParams::default().fields(&format!(
            "spec.nodeName={name},status.phase!=Succeeded,status.phase!=Failed"
        ));
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&params)
            .await
            .map_err(|error| classify(&format!("list the pods on node {name}"), error))?;
        Ok(pods.items)
    }
}

/// The key's pod exists: answer it, or say why not.
fn answer_existing(pod: &Pod, wanted: &Recorded) -> Result<pb::Instance, ProviderError> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    if !is_ours(pod) {
        return Err(ProviderError::permanent(format!(
            "pod {name} in the provider's namespace was not made by this provider: \
             remove it, or give the provider a namespace of its own"
        ))
        .with_reason("POD_NAME_TAKEN"));
    }
    let existing = instance::recorded(pod).map_err(unreadable)?;
    if existing.key != wanted.key {
        return Err(ProviderError::permanent(format!(
            "pod {name} belongs to another key: two keys share a digest"
        ))
        .with_reason("POD_NAME_TAKEN"));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(ProviderError::transient(format!(
            "key {} belongs to instance {name}, which is being deleted: retry once it is gone",
            wanted.key
        ))
        .with_reason("KEY_BEING_DELETED")
        .with_retry_after(Some(KEY_BEING_DELETED_RETRY)));
    }
    if existing.requested != wanted.requested || existing.proxy_port != wanted.proxy_port {
        return Err(ProviderError::already_exists(format!(
            "key {} belongs to instance {name}, created with a different placement or proxy \
             port: delete it first or use another key",
            wanted.key
        )));
    }
    instance::instance(pod).map_err(unreadable)
}

fn is_ours(pod: &Pod) -> bool {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(MANAGED_BY_LABEL))
        .is_some_and(|value| value == MANAGED_BY)
}

/// A pod of ours whose record was changed by hand: retrying will not fix it.
fn unreadable(error: Unreadable) -> ProviderError {
    ProviderError::permanent(error.to_string()).with_reason("POD_RECORD_UNREADABLE")
}
