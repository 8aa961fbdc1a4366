//! The operator's connections to the apiserver after a burst of work, against a real
//! kube-apiserver and the reference provider: the operator binary reconciles a few
//! hundred Proxies at once and deletes them; afterwards it must not keep a connection
//! per request it once had in flight (seen: 150–230 established connections held with
//! no Proxy left), only its watches and a small pool that idles out.

mod common;

use std::collections::HashSet;
use std::time::Instant;

use common::fixtures::proxy_port;
use common::{OperatorOptions, OperatorProcess};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Phase, Proxy};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const PROXIES: usize = 100;
/// Watches (Proxies, Secrets), the Lease, and the idle pool the operator keeps.
const MOST_CONNECTIONS: usize = 16;

/// The operator's established TCP connections to `port` (its sockets, from its file
/// descriptors, matched with the kernel's connection table).
fn connections_to(pid: u32, port: u16) -> usize {
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| {
            entries
                .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
                .filter_map(|target| {
                    let target = target.to_string_lossy().into_owned();
                    Some(
                        target
                            .strip_prefix("socket:[")?
                            .strip_suffix(']')?
                            .to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).ok())
        .flat_map(|text| text.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote_port = fields
                .get(2)
                .and_then(|remote| remote.rsplit(':').next())
                .and_then(|hex| u16::from_str_radix(hex, 16).ok());
            // State 01 is ESTABLISHED; field 9 is the socket's inode.
            remote_port == Some(port)
                && fields.get(3) == Some(&"01")
                && fields.get(9).is_some_and(|inode| inodes.contains(*inode))
        })
        .count()
}

#[tokio::test]
async fn after_a_burst_the_operator_keeps_few_connections_to_the_apiserver() {
    let env = common::env_with_crd("apiserver-connections").await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "0s"]).unwrap();
    let providers = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        providers.path(),
        common::reference_config(provider.endpoint(), "5s"),
    )
    .unwrap();
    let operator = OperatorProcess::start(
        &env,
        &OperatorOptions {
            identity: "burst",
            providers: providers.path(),
            lease_duration: "15s",
            clock_offset: None,
            extra_args: &[],
        },
    );
    let apiserver_port: u16 = env
        .apiserver()
        .server()
        .rsplit(':')
        .next()
        .and_then(|port| port.trim_end_matches('/').parse().ok())
        .unwrap();

    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    let started = Instant::now();
    futures::stream::iter(0..PROXIES)
        .map(|i| {
            let proxies = proxies.clone();
            let proxy =
                common::fixtures::proxy(&format!("burst-{i:03}"), port, serde_json::json!({}));
            async move { proxies.create(&PostParams::default(), &proxy).await }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    common::wait_for_all(&proxies, "every Proxy Ready", |all: &[Proxy]| {
        all.len() == PROXIES
            && all
                .iter()
                .all(|p| p.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready))
    })
    .await;
    let in_the_burst = connections_to(operator.pid(), apiserver_port);
    println!("{PROXIES} Proxies Ready after {:?}", started.elapsed());
    proxies
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await
        .unwrap();
    common::wait_for_all(&proxies, "every Proxy gone", |all: &[Proxy]| all.is_empty()).await;
    println!("all gone after {:?}", started.elapsed());

    // Idle connections close on the pool's own timer; count (in /proc) until they have.
    let what = format!(
        "the operator to hold at most {MOST_CONNECTIONS} connections to the apiserver with \
         no Proxy left ({in_the_burst} when they were Ready)"
    );
    let held = common::eventually(&what, common::WAIT, || async {
        let held = connections_to(operator.pid(), apiserver_port);
        if held <= MOST_CONNECTIONS {
            Ok(held)
        } else {
            Err(format!("{held} connections"))
        }
    })
    .await;
    println!("connections to the apiserver: {in_the_burst} when Ready, {held} after");
}
