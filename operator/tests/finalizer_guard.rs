//! The finalizer guards the VM of the Proxy that was read, and only while that Proxy
//! lives: each test calls the reconcile directly (no controller runs) against a real
//! kube-apiserver and the reference provider as a separate process.
//!
//! - A reconcile working from the copy of a Proxy that was deleted and created again
//!   under the same name (a pool reuses its members' names) neither adds the finalizer
//!   to the new Proxy nor creates an instance for the old one.
//! - A Proxy whose status records an instance but that lost its finalizer gets it back,
//!   so that its deletion still deletes the VM.

mod common;

use std::sync::Arc;

use common::fixtures::proxy;
use common::{env_with_crd, reference_config};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::Proxy;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::proxy::reconcile::{FINALIZER, reconcile};
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::pb;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

struct Setup {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    ctx: Arc<Context>,
    cluster: String,
}

async fn start(test: &str) -> Setup {
    let env = env_with_crd(test).await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let config = ProvidersConfig::parse(&reference_config(provider.endpoint(), "5s")).unwrap();
    let metrics = Arc::new(Metrics::default());
    let cluster = format!("test-{}", env.namespace);
    let ctx = Arc::new(Context::new(
        env.client.clone(),
        Providers::new(config, metrics.clone()),
        cluster.clone(),
        metrics,
    ));
    Setup {
        env,
        provider,
        ctx,
        cluster,
    }
}

impl Setup {
    fn proxies(&self) -> Api<Proxy> {
        self.env.namespaced()
    }

    async fn create(&self, name: &str) -> Proxy {
        // The tests look at the finalizer and the instances, never at readiness: the
        // port need not answer.
        self.proxies()
            .create(
                &PostParams::default(),
                &proxy(name, 3128, serde_json::json!({})),
            )
            .await
            .unwrap()
    }

    async fn get(&self, name: &str) -> Proxy {
        self.proxies().get(name).await.unwrap()
    }

    /// The instances of this test's cluster at the provider.
    async fn instances(&self) -> Vec<pb::Instance> {
        let client = egressproxy_provider::client::connect_lazy(
            &egressproxy_provider::client::ClientOptions::new(self.provider.endpoint()),
        )
        .unwrap();
        let request = pb::ListInstancesRequest {
            tag_selector: [("egressproxy.dev/cluster".to_string(), self.cluster.clone())].into(),
            ..Default::default()
        };
        client
            .clone()
            .list_instances(request)
            .await
            .unwrap()
            .into_inner()
            .instances
    }
}

fn holds_finalizer(proxy: &Proxy) -> bool {
    proxy.finalizers().iter().any(|f| f == FINALIZER)
}

#[tokio::test]
async fn a_stale_copy_of_a_proxy_created_again_under_its_name_guards_and_creates_nothing() {
    let s = start("finalizer-stale-copy").await;
    let old = s.create("reused").await;
    // Without a finalizer the Proxy goes at once; a new one takes its name.
    s.proxies()
        .delete("reused", &DeleteParams::default())
        .await
        .unwrap();
    let new = s.create("reused").await;
    assert_ne!(old.uid(), new.uid());

    let result = reconcile(Arc::new(old), s.ctx.clone()).await;

    assert!(
        result.is_err(),
        "the reconcile of the deleted Proxy's copy succeeded"
    );
    let now = s.get("reused").await;
    assert!(
        !holds_finalizer(&now),
        "the new Proxy took the finalizer meant for the deleted one: {:?}",
        now.finalizers()
    );
    assert_eq!(
        s.instances().await,
        Vec::new(),
        "an instance was created for the deleted Proxy"
    );
}

#[tokio::test]
async fn a_proxy_that_lost_its_finalizer_gets_it_back_and_its_deletion_deletes_the_vm() {
    let s = start("finalizer-restored").await;
    s.create("guarded").await;
    reconcile(Arc::new(s.get("guarded").await), s.ctx.clone())
        .await
        .unwrap();
    let created = s.get("guarded").await;
    assert!(holds_finalizer(&created), "no finalizer after the Create");
    let id = created
        .status
        .as_ref()
        .and_then(|status| status.provider_id.clone())
        .expect("the Create's id is recorded");

    // Removed by hand, as a user clearing a stuck Proxy might.
    s.proxies()
        .patch(
            "guarded",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    assert!(!holds_finalizer(&s.get("guarded").await));

    reconcile(Arc::new(s.get("guarded").await), s.ctx.clone())
        .await
        .unwrap();
    assert!(
        holds_finalizer(&s.get("guarded").await),
        "the finalizer of a Proxy that records instance {id} was not added back"
    );

    s.proxies()
        .delete("guarded", &DeleteParams::default())
        .await
        .unwrap();
    reconcile(Arc::new(s.get("guarded").await), s.ctx.clone())
        .await
        .unwrap();
    let left: Vec<String> = s
        .instances()
        .await
        .into_iter()
        .filter(|i| i.state() != pb::InstanceState::Deleting)
        .map(|i| i.id)
        .collect();
    assert_eq!(left, Vec::<String>::new(), "the deleted Proxy's VM is left");
}
