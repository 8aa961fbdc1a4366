//! UpdateInstanceTags through the agent's Provider service against a real private
//! libvirtd (local mode): compare-and-set, idempotent, one winner among concurrent
//! callers, ordered against Delete, seen at once by Get, List and WatchInstances, kept by
//! libvirt across a restart of the agent, and traced like every libvirt call.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_provider::pb::provider_server::Provider;
use egressproxy_provider::{ErrorClass, ProviderError, pb};
use futures::StreamExt;
use kvm_agent::config::{Attachment, Config, Firmware};
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::provider::instances::Instances;
use kvm_agent::provider::service::KvmProvider;
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::Pool;
use tonic::Request;
use tracing::Instrument;

const GENEROUS: Duration = Duration::from_secs(180);

fn tags(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The agent's service on `config`'s hosts, as `kvm-agent serve` builds it (a fresh one
/// is what a restarted agent has: new connections, no memory of the old one).
fn agent(config: &Arc<Config>) -> KvmProvider {
    let pool = Arc::new(Pool::new(config).unwrap());
    KvmProvider::new(Instances::new(config.clone(), pool))
}

/// Defines the agent's (shut off) domain of `key` on host `here` with `initial` tags, as
/// Create leaves it before it starts it; returns its id.
async fn define(config: &Arc<Config>, key: &str, initial: &HashMap<String, String>) -> String {
    let names = InstanceNames::for_key(key).unwrap();
    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 128,
        firmware: Firmware::Bios,
        overlay_path: format!("/nonexistent/{}", names.overlay_volume).into(),
        seed_path: format!("/nonexistent/{}", names.seed_volume).into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: None,
            static_address: None,
            key: key.into(),
            name: "ns/proxy".into(),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "cd".repeat(32),
            placement: PlacementRecord {
                zone: None,
                host: "here".into(),
                machine_type: "small".into(),
                image: "debian-12".into(),
                base_volume: format!("egressproxy-base-{}.img", "ab".repeat(32)),
            },
            tags: initial
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        },
    };
    let xml = spec.to_xml().unwrap();
    let pool = Pool::new(config).unwrap();
    pool.host("here")
        .unwrap()
        .call::<_, kvm_agent::TransportError, _>(
            LibvirtOp::new("virDomainDefineXML"),
            deadline_in(GENEROUS),
            move |c| {
                c.define_domain_xml(&xml)?;
                Ok(())
            },
        )
        .await
        .unwrap();
    format!("here/{key}")
}

fn update(
    id: &str,
    expected: &HashMap<String, String>,
    new: &HashMap<String, String>,
) -> Request<pb::UpdateInstanceTagsRequest> {
    Request::new(pb::UpdateInstanceTagsRequest {
        id: id.to_owned(),
        expected_tags: expected.clone(),
        tags: new.clone(),
    })
}

async fn get(agent: &KvmProvider, id: &str) -> Result<pb::Instance, ProviderError> {
    agent
        .get_instance(Request::new(pb::GetInstanceRequest { id: id.to_owned() }))
        .await
        .map(|r| r.into_inner().instance.unwrap())
        .map_err(|status| ProviderError::from_status(&status))
}

async fn list_ids(agent: &KvmProvider, selector: &HashMap<String, String>) -> Vec<String> {
    let listed = agent
        .list_instances(Request::new(pb::ListInstancesRequest {
            tag_selector: selector.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    listed.instances.into_iter().map(|i| i.id).collect()
}

/// The error of a call that must fail, as the contract decodes it from the wire status.
fn refused<T: std::fmt::Debug>(result: Result<T, tonic::Status>) -> ProviderError {
    ProviderError::from_status(&result.expect_err("the call must fail"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_tags_is_compare_and_set_seen_at_once_and_kept_across_a_restart() {
    let libvirtd = Libvirtd::start().unwrap();
    let config = Arc::new(config(vec![local_host("here", &libvirtd.socket())]));
    let spare = tags(&[("pool", "spares"), ("cluster", "it")]);
    let adopted = tags(&[("proxy", "ns/p"), ("uid", "1234")]);
    let id = define(&config, "uid-retag", &spare).await;
    let agent = agent(&config);

    let capabilities = agent
        .get_capabilities(Request::new(pb::GetCapabilitiesRequest {}))
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert!(capabilities.contains(&(pb::Capability::UpdateTags as i32)));

    // A watcher of the instance, synced before the update.
    let mut events = agent
        .watch_instances(Request::new(pb::WatchInstancesRequest {
            id: id.clone(),
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    loop {
        let event = events.next().await.unwrap().unwrap();
        if event.r#type() == pb::WatchEventType::Synced {
            break;
        }
    }

    let before = get(&agent, &id).await.unwrap();
    let trace = caller_trace("UpdateInstanceTags");
    let answer = agent
        .update_instance_tags(update(&id, &spare, &adopted))
        .instrument(trace.request_span.clone())
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    assert_eq!(answer.tags, adopted);
    // Only the tags change.
    assert_eq!(
        pb::Instance {
            tags: spare.clone(),
            ..answer.clone()
        },
        before
    );
    let spans = spans_named(trace.trace_id, "virDomainSetMetadata");
    assert_eq!(spans.len(), 1, "one traced libvirt call");
    assert_eq!(
        attr(&spans[0], "libvirt.domain").as_deref(),
        Some("egressproxy-uid-retag")
    );

    // Get, List by the new tags and the watcher agree at once; the old tags select
    // nothing.
    assert_eq!(get(&agent, &id).await.unwrap(), answer);
    assert_eq!(
        list_ids(&agent, &tags(&[("uid", "1234")])).await,
        [id.as_str()]
    );
    assert!(
        list_ids(&agent, &tags(&[("pool", "spares")]))
            .await
            .is_empty()
    );
    let event = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("the watcher hears of the update without a sweep")
        .unwrap()
        .unwrap();
    assert_eq!(event.r#type(), pb::WatchEventType::Updated);
    assert_eq!(event.instance.unwrap().tags, adopted);

    // A repeat (its first answer lost) is OK and changes nothing.
    let again = agent
        .update_instance_tags(update(&id, &spare, &adopted))
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    assert_eq!(again, answer);

    // A stale expectation: TAGS_CHANGED, nothing changes.
    let stale = refused(
        agent
            .update_instance_tags(update(&id, &spare, &tags(&[("uid", "other")])))
            .await,
    );
    assert_eq!(
        (stale.class, stale.reason.as_str()),
        (ErrorClass::Permanent, "TAGS_CHANGED"),
        "{stale}"
    );
    assert_eq!(get(&agent, &id).await.unwrap().tags, adopted);

    // Unknown ids, an empty id and bad tags.
    for unknown in ["here/never-created", "no-slash"] {
        let error = refused(
            agent
                .update_instance_tags(update(unknown, &spare, &adopted))
                .await,
        );
        assert_eq!(error.class, ErrorClass::NotFound, "{unknown}: {error}");
    }
    let error = refused(
        agent
            .update_instance_tags(update("", &spare, &adopted))
            .await,
    );
    assert_eq!(error.class, ErrorClass::InvalidArgument, "{error}");
    assert_eq!(error.field_violations[0].field, "id");
    let error = refused(
        agent
            .update_instance_tags(update(&id, &adopted, &tags(&[("", "v")])))
            .await,
    );
    assert_eq!(error.class, ErrorClass::InvalidArgument, "{error}");
    assert_eq!(error.field_violations[0].field, r#"tags[""]"#);

    // A restarted agent (new connections, no memory) reads the tags libvirt kept, and
    // `virsh dumpxml` shows them.
    drop(events);
    drop(agent);
    let restarted = self::agent(&config);
    assert_eq!(get(&restarted, &id).await.unwrap().tags, adopted);
    let dumped = std::process::Command::new("virsh")
        .args(["-c", &libvirtd.uri(), "dumpxml", "egressproxy-uid-retag"])
        .output()
        .unwrap();
    let dumped = String::from_utf8_lossy(&dumped.stdout);
    assert!(
        dumped.contains(r#"<egressproxy:tag key="uid" value="1234"/>"#),
        "{dumped}"
    );
    assert!(!dumped.contains("spares"), "{dumped}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_concurrent_updates_one_wins_and_delete_is_ordered_with_them() {
    let libvirtd = Libvirtd::start().unwrap();
    let config = Arc::new(config(vec![local_host("here", &libvirtd.socket())]));
    let spare = tags(&[("pool", "spares")]);
    let id = define(&config, "uid-race", &spare).await;
    let agent = agent(&config);

    // The same expectation, different new tags: exactly one wins.
    let callers = (0..6).map(|n| {
        let agent = agent.clone();
        let (id, spare) = (id.clone(), spare.clone());
        tokio::spawn(async move {
            let mine = tags(&[("owner", &format!("caller-{n}"))]);
            let result = agent.update_instance_tags(update(&id, &spare, &mine)).await;
            (mine, result.map_err(|s| ProviderError::from_status(&s)))
        })
    });
    let results = futures::future::join_all(callers).await;
    let mut winners = Vec::new();
    for result in results {
        match result.unwrap() {
            (mine, Ok(answer)) => {
                assert_eq!(answer.into_inner().instance.unwrap().tags, mine);
                winners.push(mine);
            }
            (_, Err(error)) => assert_eq!(error.reason, "TAGS_CHANGED", "{error}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one caller wins: {winners:?}");
    assert_eq!(get(&agent, &id).await.unwrap().tags, winners[0]);

    // An update beside a Delete: it came first (OK, and the Delete deletes the instance
    // with its new tags) or after (NOT_FOUND); either way the instance is gone.
    let (updated, deleted) = tokio::join!(
        agent.update_instance_tags(update(&id, &winners[0], &tags(&[("owner", "last")]))),
        agent.delete_instance(Request::new(pb::DeleteInstanceRequest { id: id.clone() })),
    );
    deleted.unwrap();
    if let Err(status) = updated {
        let error = ProviderError::from_status(&status);
        assert_eq!(error.class, ErrorClass::NotFound, "{error}");
    }
    assert_eq!(
        get(&agent, &id).await.unwrap_err().class,
        ErrorClass::NotFound
    );
    let error = refused(
        agent
            .update_instance_tags(update(&id, &winners[0], &spare))
            .await,
    );
    assert_eq!(error.class, ErrorClass::NotFound, "{error}");
}
