//! Two kvm-agents on one hypervisor (unsupported; `docs/kvm-agent.md`, "Unsupported:
//! two agents on one hypervisor"): a second `kvm-agent serve` with the same hosts,
//! registered in the operator as a second provider, as a user would. What the docs
//! state is asserted here: the second agent lists, reads and could delete the first
//! one's VM (an agent lists every domain that carries the agent's metadata, whoever
//! created it), and the operator leaves it alone (it judges instances by their Proxy's
//! UID, not by the provider that lists them). Once the Proxy is deleted, neither agent
//! lists an instance.

use std::time::{Duration, Instant};

use egressproxy_integration::e2e::stack::Stack;
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::pb;

use crate::support::{assert_one_vm, delete, manifest, wait_ready};

const SECOND_PROVIDER: &str = "kvm-b";

pub(crate) async fn two_agents_on_one_hypervisor(stack: &mut Stack) -> Duration {
    let runtime_dir = stack.dir().join("b");
    std::fs::create_dir_all(&runtime_dir).unwrap();
    let log = std::fs::File::create(stack.dir().join("kvm-agent-b.log")).unwrap();
    let second = ServedAgent::start_with(&stack.agent_config(), "127.0.0.1:0", |command| {
        command
            .env("KVM_AGENT_RUNTIME_DIR", &runtime_dir)
            .env("RUST_LOG", "info")
            .stderr(log);
    })
    .unwrap();
    let port = second
        .address()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap();
    let injected = Instant::now();
    stack.add_provider(SECOND_PROVIDER, port).await.unwrap();
    stack.kubectl_apply(&manifest(stack, "first")).unwrap();
    wait_ready(stack, "first").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "first");
    let id = stack.proxy_field("first", "{.status.providerId}");
    let uid = stack.proxy_field("first", "{.metadata.uid}");

    let mut client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(second.endpoint()),
    )
    .unwrap();
    let listed = list(&mut client).await;
    let seen: Vec<&pb::Instance> = listed.iter().filter(|i| i.id == id).collect();
    assert_eq!(
        seen.len(),
        1,
        "the second agent lists the first one's VM {id}: {listed:?}"
    );
    assert_eq!(
        seen[0].tags.get("egressproxy.dev/uid"),
        Some(&uid),
        "with the first Proxy's tags"
    );
    let got = client
        .get_instance(pb::GetInstanceRequest { id: id.clone() })
        .await
        .expect("the second agent reads the first one's VM")
        .into_inner();
    assert_eq!(
        got.instance.map(|i| i.state),
        Some(pb::InstanceState::Running as i32),
        "and sees it running"
    );
    // The operator's view is unchanged: one VM, still the Proxy's.
    assert_eq!(stack.proxy_field("first", "{.status.phase}"), "Ready");
    assert_one_vm(stack, "first");

    delete(stack, "first").await;
    assert_eq!(
        list(&mut client).await,
        Vec::<pb::Instance>::new(),
        "the second agent lists nothing once the Proxy is gone"
    );
    drop(second);
    converged
}

async fn list(client: &mut egressproxy_provider::client::Client) -> Vec<pb::Instance> {
    client
        .list_instances(pb::ListInstancesRequest::default())
        .await
        .expect("the second agent lists the hypervisor's instances")
        .into_inner()
        .instances
}
