//! kube-provider against a real kube-apiserver (no kubelet): a Create becomes a pod on
//! the chosen egress node with the machine type's resources; Create is idempotent on
//! the key; List filters by tags and pages; Delete is DELETING until the pod is gone
//! (the test finishes the termination, as a kubelet would), then NOT_FOUND; user-data
//! is refused naming the field; a restarted provider finds its instances; a pod its
//! kubelet reports Ready is RUNNING at the node's address.
//!
//! Needs the kube-harness of `make setup` (`integration/tools/install-go-tools.sh`).

mod common;

use std::collections::BTreeSet;

use common::{Harness, create, create_request, get};
use egressproxy_provider::{ErrorClass, ProviderError, pb};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ObjectMeta, PostParams};
use kube_provider::record::{MANAGED_BY, MANAGED_BY_LABEL};
use pb::InstanceState;
use pb::placement::Location;

fn zone(name: &str) -> Option<Location> {
    Some(Location::Zone(name.into()))
}

#[tokio::test]
async fn a_create_becomes_a_pod_on_a_node_of_the_zone() {
    let harness = Harness::new("kube-provider-create", &[("a", "z1"), ("b", "z2")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();

    let instance = create(
        &mut client,
        create_request("key-1", zone("z2"), &[("c", "1")]),
    )
    .await;
    assert_eq!(instance.state(), InstanceState::Provisioning);
    assert_eq!(instance.placement.as_ref().unwrap().location, zone("z2"));
    assert_eq!(instance.tags["c"], "1");
    assert!(instance.create_time.is_some());

    let pod = harness.pods().get(&instance.id).await.unwrap();
    let spec = pod.spec.unwrap();
    assert_eq!(spec.node_name.as_deref(), Some(harness.nodes["b"].as_str()));
    assert_eq!(spec.host_network, Some(true));
    let resources = spec.containers[0].resources.clone().unwrap();
    assert_eq!(resources.requests.unwrap()["memory"].0, "64Mi");
    assert_eq!(resources.limits.unwrap()["memory"].0, "128Mi");
    assert_eq!(pod.metadata.labels.unwrap()[MANAGED_BY_LABEL], MANAGED_BY);

    // A host is a node by name; no location echoes the node chosen. (Port 3128 is now
    // in use on both nodes: the last one asks for another.)
    let on_a = Some(Location::Host(harness.nodes["a"].clone()));
    let pinned = create(&mut client, create_request("key-2", on_a.clone(), &[])).await;
    assert_eq!(pinned.placement.unwrap().location, on_a);
    let mut anywhere = create_request("key-3", None, &[]);
    anywhere.proxy_port = 3129;
    let chosen = create(&mut client, anywhere).await;
    let Some(Location::Host(node)) = chosen.placement.unwrap().location else {
        panic!("no chosen node echoed");
    };
    assert!(harness.nodes.values().any(|n| *n == node), "{node}");
}

#[tokio::test]
async fn unknown_locations_and_names_are_invalid_arguments() {
    let harness = Harness::new("kube-provider-invalid", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let cases = [
        (create_request("k", zone("nowhere"), &[]), "placement.zone"),
        (
            create_request("k", Some(Location::Host("no-such-node".into())), &[]),
            "placement.host",
        ),
        (
            pb::CreateInstanceRequest {
                placement: Some(pb::Placement {
                    location: None,
                    machine_type: "huge".into(),
                    image: "squid".into(),
                }),
                ..create_request("k", None, &[])
            },
            "placement.machine_type",
        ),
    ];
    for (request, field) in cases {
        let status = client.create_instance(request).await.unwrap_err();
        let error = ProviderError::from_status(&status);
        assert_eq!(error.class, ErrorClass::InvalidArgument, "{error}");
        assert_eq!(error.field_violations[0].field, field);
    }
    assert!(
        harness
            .pods()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

#[tokio::test]
async fn a_retried_create_returns_the_same_instance() {
    let harness = Harness::new("kube-provider-idempotent", &[("a", "z1"), ("b", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let first = create(
        &mut client,
        create_request("uid-0", zone("z1"), &[("t", "1")]),
    )
    .await;

    let mut retry = create_request("uid-0", zone("z1"), &[("t", "other")]);
    retry.name = "renamed".into();
    retry.cloud_init = Some(pb::CloudInit::default());
    let again = create(&mut client, retry).await;
    assert_eq!(again.id, first.id);
    assert_eq!(again.name, first.name);
    assert_eq!(again.tags, first.tags);
    assert_eq!(again.create_time, first.create_time);

    let mut other_port = create_request("uid-0", zone("z1"), &[]);
    other_port.proxy_port = 8080;
    let asked_for_a_host = create_request(
        "uid-0",
        Some(Location::Host(harness.nodes["a"].clone())),
        &[],
    );
    for conflicting in [other_port, asked_for_a_host] {
        let status = client.create_instance(conflicting).await.unwrap_err();
        assert_eq!(
            ProviderError::from_status(&status).class,
            ErrorClass::AlreadyExists
        );
    }
    assert_eq!(
        harness
            .pods()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

#[tokio::test]
async fn concurrent_creates_of_one_key_make_one_pod() {
    let harness = Harness::new("kube-provider-race", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let client = provider.client.clone();
    let creates = (0..8).map(|_| {
        let mut client = client.clone();
        async move {
            create(&mut client, create_request("raced", None, &[]))
                .await
                .id
        }
    });
    let ids: BTreeSet<String> = futures_join_all(creates).await.into_iter().collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(
        harness
            .pods()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

async fn futures_join_all<F: Future<Output = String> + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<String> {
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.unwrap());
    }
    out
}

#[tokio::test]
async fn list_selects_by_every_tag_and_pages() {
    let harness = Harness::new("kube-provider-list", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let mut ours = BTreeSet::new();
    // One node: each instance on a port of its own.
    for n in 0..3 {
        let tags = [("cluster", "a"), ("n", if n == 0 { "0" } else { "x" })];
        let mut request = create_request(&format!("a-{n}"), None, &tags);
        request.proxy_port = 3128 + n;
        ours.insert(create(&mut client, request).await.id);
    }
    let mut other_cluster = create_request("b-0", None, &[("cluster", "b")]);
    other_cluster.proxy_port = 3131;
    create(&mut client, other_cluster).await;
    // A pod the provider did not make is never listed.
    let foreign = Pod {
        metadata: ObjectMeta {
            name: Some("not-a-proxy".into()),
            ..ObjectMeta::default()
        },
        spec: Some(
            serde_json::from_value(serde_json::json!({
                "containers": [{"name": "c", "image": "x"}]
            }))
            .unwrap(),
        ),
        status: None,
    };
    harness
        .pods()
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();

    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = client
            .list_instances(pb::ListInstancesRequest {
                tag_selector: [("cluster".to_owned(), "a".to_owned())].into(),
                page_size: Some(1),
                page_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.instances.len() <= 1);
        seen.extend(page.instances.into_iter().map(|i| i.id));
        pages += 1;
        assert!(pages <= 4, "the walk does not end");
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), ours);
    assert_eq!(seen.len(), ours.len(), "an instance listed twice: {seen:?}");

    let both = client
        .list_instances(pb::ListInstancesRequest {
            tag_selector: [("cluster", "a"), ("n", "0")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(both.instances.len(), 1);

    let status = client
        .list_instances(pb::ListInstancesRequest {
            page_token: "made-up".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        ProviderError::from_status(&status).reason,
        "INVALID_PAGE_TOKEN"
    );
}

#[tokio::test]
async fn a_deleted_instance_is_deleting_until_its_pod_is_gone() {
    let harness = Harness::new("kube-provider-delete", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let instance = create(&mut client, create_request("doomed", None, &[])).await;

    for _ in 0..2 {
        client
            .delete_instance(pb::DeleteInstanceRequest {
                id: instance.id.clone(),
            })
            .await
            .unwrap();
    }
    assert_eq!(
        get(&mut client, &instance.id).await.unwrap().state(),
        InstanceState::Deleting
    );
    let listed = client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.instances[0].state(), InstanceState::Deleting);
    let status = client
        .create_instance(create_request("doomed", None, &[]))
        .await
        .unwrap_err();
    let error = ProviderError::from_status(&status);
    assert_eq!(
        (error.class, error.reason.as_str()),
        (ErrorClass::Transient, "KEY_BEING_DELETED")
    );

    harness.finish_termination(&instance.id).await;
    let gone = get(&mut client, &instance.id).await.unwrap_err();
    assert_eq!(gone.class, ErrorClass::NotFound);
    client
        .delete_instance(pb::DeleteInstanceRequest {
            id: instance.id.clone(),
        })
        .await
        .unwrap();
    // Once gone, the key may be used again, for a new instance.
    let reborn = create(&mut client, create_request("doomed", None, &[])).await;
    assert_eq!(reborn.state(), InstanceState::Provisioning);
}

#[tokio::test]
async fn user_data_is_refused_naming_the_field() {
    let harness = Harness::new("kube-provider-cloud-init", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let mut request = create_request("with-user-data", None, &[]);
    request.cloud_init = Some(pb::CloudInit {
        user_data: b"#cloud-config\npackages: [squid]\n".to_vec(),
        vendor_data: None,
    });
    let status = client.create_instance(request).await.unwrap_err();
    let error = ProviderError::from_status(&status);
    assert_eq!(error.class, ErrorClass::InvalidArgument);
    assert_eq!(error.reason, kube_provider::request::CLOUD_INIT_UNSUPPORTED);
    assert_eq!(error.field_violations[0].field, "cloud_init.user_data");
    assert!(
        harness
            .pods()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    let capabilities = client
        .get_capabilities(pb::GetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        !capabilities
            .capabilities
            .contains(&(pb::Capability::VendorData as i32))
    );
}

#[tokio::test]
async fn a_restarted_provider_finds_its_instances() {
    let harness = Harness::new("kube-provider-restart", &[("a", "z1")]).await;
    let first = harness.serve().await;
    let mut client = first.client.clone();
    let instance = create(&mut client, create_request("survivor", None, &[("k", "v")])).await;
    drop(client);
    drop(first);

    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let found = get(&mut client, &instance.id).await.unwrap();
    assert_eq!(found, instance);
    let again = create(&mut client, create_request("survivor", None, &[])).await;
    assert_eq!(again.id, instance.id);
    let listed = client
        .list_instances(pb::ListInstancesRequest {
            tag_selector: [("k".to_owned(), "v".to_owned())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.instances, vec![instance]);
}

#[tokio::test]
async fn a_ready_pod_is_running_at_its_node_address() {
    let harness = Harness::new("kube-provider-running", &[("a", "z1")]).await;
    let provider = harness.serve().await;
    let mut client = provider.client.clone();
    let instance = create(&mut client, create_request("ready", None, &[])).await;
    harness.report_running(&instance.id, "192.0.2.10").await;

    let running = get(&mut client, &instance.id).await.unwrap();
    assert_eq!(running.state(), InstanceState::Running);
    assert_eq!(running.addresses[0].address, "192.0.2.10");
    assert_eq!(running.addresses[0].scope(), pb::AddressScope::Internal);
}

#[tokio::test]
async fn a_watch_resumed_after_a_restart_starts_from_a_new_snapshot() {
    use pb::WatchEventType::{Restarted, Synced, Updated};
    let harness = Harness::new("kube-provider-watch", &[("a", "z1")]).await;
    let first = harness.serve().await;
    let mut client = first.client.clone();
    let instance = create(&mut client, create_request("watched", None, &[])).await;
    let mut stream = client
        .watch_instances(pb::WatchInstancesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let updated = stream.message().await.unwrap().unwrap();
    assert_eq!(updated.r#type(), Updated);
    assert_eq!(updated.instance.unwrap().id, instance.id);
    let synced = stream.message().await.unwrap().unwrap();
    assert_eq!(synced.r#type(), Synced);
    drop((stream, client, first));

    let second = harness.serve().await;
    let mut client = second.client.clone();
    let mut stream = client
        .watch_instances(pb::WatchInstancesRequest {
            resume_token: synced.resume_token,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut types = Vec::new();
    for _ in 0..3 {
        types.push(stream.message().await.unwrap().unwrap().r#type());
    }
    assert_eq!(types, [Restarted, Updated, Synced]);
}
