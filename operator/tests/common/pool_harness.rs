//! ProxyPools against the reference provider as a process, with both controllers (Proxy
//! and pool) in-process: the set-up the pool tests share, and what they ask of it.
//!
//! The reference provider gives each of two hosts, `h0` and `h1`, its own address: two
//! of this host's non-loopback addresses (an EndpointSlice accepts no loopback one),
//! where the tests' listeners stand in for the VMs' proxies.

use std::net::IpAddr;

use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Proxy, ProxyPool};
use egressproxy_provider::pb;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use super::{Controller, reference_config, wait_for_all};

/// A test namespace, the reference provider and both controllers.
pub struct PoolHarness {
    pub env: KubeTestEnv,
    pub provider: ReferenceProvider,
    pub controller: Controller,
}

impl PoolHarness {
    /// The reference provider (with `extra` flags) with hosts `h0` at `a` and `h1` at
    /// `b`, and both controllers.
    pub async fn start(test: &str, a: IpAddr, b: IpAddr, extra: &[&str]) -> PoolHarness {
        let env = super::env_with_crd(test).await;
        let host_addresses = format!("h0={a},h1={b}");
        let a = a.to_string();
        let mut args = vec![
            "--provisioning-delay",
            "200ms",
            "--hosts",
            "h0,h1",
            "--instance-address",
            &a,
            "--host-address",
            &host_addresses,
        ];
        args.extend(extra);
        let provider = ReferenceProvider::start(&args).unwrap();
        let cluster = format!("test-{}", env.namespace);
        let controller =
            Controller::start(&env, &reference_config(provider.endpoint(), "5s"), &cluster)
                .with_pools(&env);
        PoolHarness {
            env,
            provider,
            controller,
        }
    }

    pub fn pools(&self) -> Api<ProxyPool> {
        self.env.namespaced()
    }

    pub fn proxies(&self) -> Api<Proxy> {
        self.env.namespaced()
    }

    pub fn slices(&self) -> Api<EndpointSlice> {
        self.env.namespaced()
    }

    /// Creates pool `name` of the `reference` provider, its members checked on `port`
    /// every second and given no Service of their own, with `spec` merged into its spec.
    pub async fn create_pool(&self, name: &str, port: u16, spec: serde_json::Value) {
        let mut full = serde_json::json!({
            "template": {
                "spec": {
                    "provider": "reference",
                    "placement": {"machineType": "small", "image": "debian-12"},
                    "proxyPort": port,
                    "healthCheck": {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 1},
                    "service": {"enabled": false},
                },
            },
        });
        for (key, value) in spec.as_object().cloned().unwrap_or_default() {
            full[key] = value;
        }
        let pool: ProxyPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": name},
            "spec": full,
        }))
        .unwrap();
        self.pools()
            .create(&PostParams::default(), &pool)
            .await
            .unwrap();
    }

    /// Waits until the pool's slices list exactly `addresses` (in any order),
    /// checking at every change seen that `always` holds of the listed addresses.
    pub async fn wait_endpoints(
        &self,
        pool: &str,
        addresses: &[IpAddr],
        always: impl Fn(&[String]) -> Result<(), String>,
    ) {
        let mut wanted: Vec<String> = addresses.iter().map(ToString::to_string).collect();
        wanted.sort();
        let what = format!("the slices of pool {pool} to list {wanted:?}");
        let pool = pool.to_owned();
        wait_for_all(&self.slices(), &what, |slices: &[EndpointSlice]| {
            let mut listed: Vec<String> = slices
                .iter()
                .filter(|s| s.labels().get("kubernetes.io/service-name") == Some(&pool))
                .flat_map(|s| s.endpoints.iter().flatten())
                .flat_map(|e| e.addresses.clone())
                .collect();
            listed.sort();
            if let Err(broken) = always(&listed) {
                panic!("{broken}: the slices listed {listed:?}");
            }
            listed == wanted
        })
        .await;
    }

    /// Every instance at the provider.
    pub async fn instances(&self) -> Vec<pb::Instance> {
        let mut client =
            pb::provider_client::ProviderClient::connect(self.provider.endpoint().to_owned())
                .await
                .unwrap();
        client
            .list_instances(pb::ListInstancesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .instances
    }
}
