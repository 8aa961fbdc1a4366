//! The kube-apiserver harness against the real thing: CRDs, custom objects, the status
//! subresource, watches, RBAC, admission, and the harness's own start and stop.
//!
//! Needs `kube-harness` built by `integration/tools/install-go-tools.sh`.

use std::net::TcpListener;
use std::time::Duration;

use anyhow::Context;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::kube_apiserver::{KubeApiserver, StartOptions};
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, Patch, PatchParams, PostParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

const WIDGET_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.harness.egressproxy.dev
spec:
  group: harness.egressproxy.dev
  scope: Namespaced
  names: { plural: widgets, singular: widget, kind: Widget }
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources: { status: {} }
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [size]
              properties:
                size: { type: integer, minimum: 1 }
            status:
              type: object
              properties:
                phase: { type: string }
"#;

fn widget_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("harness.egressproxy.dev", "v1alpha1", "Widget"),
        "widgets",
    )
}

fn widget(name: &str, size: i64) -> DynamicObject {
    DynamicObject::new(name, &widget_resource()).data(json!({ "spec": { "size": size } }))
}

async fn widgets(env: &KubeTestEnv) -> anyhow::Result<Api<DynamicObject>> {
    apply_crds_yaml(&env.client, WIDGET_CRD).await?;
    Ok(Api::namespaced_with(
        env.client.clone(),
        &env.namespace,
        &widget_resource(),
    ))
}

fn status_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[tokio::test]
async fn serves_the_pinned_kubernetes_release() -> anyhow::Result<()> {
    let env = KubeTestEnv::new("version").await?;
    let version = env.client.apiserver_version().await?;
    assert_eq!(version.git_version, "v1.37.2");
    assert_eq!(
        (version.major.as_str(), version.minor.as_str()),
        ("1", "37")
    );
    Ok(())
}

#[tokio::test]
async fn custom_object_status_patch_is_seen_by_a_watch() -> anyhow::Result<()> {
    let env = KubeTestEnv::new("status-watch").await?;
    let widgets = widgets(&env).await?;

    let created = widgets
        .create(&PostParams::default(), &widget("w1", 2))
        .await?;
    assert!(
        created.data.get("status").is_none(),
        "a new object has no status"
    );

    // The schema is enforced: this is a real apiserver, not a mock.
    let invalid = widgets
        .create(&PostParams::default(), &widget("w0", 0))
        .await;
    assert_eq!(
        invalid.as_ref().err().and_then(status_code),
        Some(422),
        "{invalid:?}"
    );

    let mut events = watcher(
        widgets.clone(),
        watcher::Config::default().fields("metadata.name=w1"),
    )
    .applied_objects()
    .boxed();
    let first = tokio::time::timeout(Duration::from_secs(30), events.try_next())
        .await
        .context("no initial watch event")??
        .context("watch ended")?;
    assert!(first.data.get("status").is_none());

    // With the status subresource, status written through the main resource is dropped...
    widgets
        .patch(
            "w1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Ignored" } })),
        )
        .await?;
    assert!(widgets.get("w1").await?.data.get("status").is_none());

    // ...and status written through /status is kept, while spec written there is not.
    let patched = widgets
        .patch_status(
            "w1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "size": 9 }, "status": { "phase": "Ready" } })),
        )
        .await?;
    assert_eq!(patched.data["status"]["phase"], "Ready");
    assert_eq!(patched.data["spec"]["size"], 2);

    let seen = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(object) = events.try_next().await? {
            if object.data["status"]["phase"] == "Ready" {
                return anyhow::Ok(object);
            }
        }
        anyhow::bail!("watch ended before the status change")
    })
    .await
    .context("watch did not see the status change within 30 s")??;
    assert_eq!(
        seen.metadata.resource_version,
        patched.metadata.resource_version
    );
    Ok(())
}

#[tokio::test]
async fn rbac_denies_a_service_account_until_a_role_allows_it() -> anyhow::Result<()> {
    let env = KubeTestEnv::new("rbac").await?;
    let accounts: Api<ServiceAccount> = env.namespaced();
    let reader = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("reader".into()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    accounts.create(&PostParams::default(), &reader).await?;
    let admin_maps: Api<ConfigMap> = env.namespaced();
    let map = ConfigMap {
        metadata: ObjectMeta {
            name: Some("settings".into()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    };
    admin_maps.create(&PostParams::default(), &map).await?;

    let as_reader = env.service_account_client("reader").await?;
    let reader_maps: Api<ConfigMap> = Api::namespaced(as_reader, &env.namespace);
    let denied = reader_maps.get("settings").await;
    assert_eq!(
        denied.as_ref().err().and_then(status_code),
        Some(403),
        "{denied:?}"
    );

    grant_configmap_read(&env, "reader").await?;
    // The RBAC authorizer reads roles from an informer cache: allow it to catch up.
    eventually(
        "get allowed after the RoleBinding",
        Duration::from_secs(20),
        || async {
            reader_maps
                .get("settings")
                .await
                .map_err(|e| format!("{e}"))
        },
    )
    .await;

    let delete = reader_maps.delete("settings", &Default::default()).await;
    assert_eq!(
        delete.as_ref().err().and_then(status_code),
        Some(403),
        "{delete:?}"
    );
    Ok(())
}

async fn grant_configmap_read(env: &KubeTestEnv, account: &str) -> anyhow::Result<()> {
    let role = Role {
        metadata: ObjectMeta {
            name: Some("configmap-reader".into()),
            ..ObjectMeta::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: vec!["get".into(), "list".into()],
            ..PolicyRule::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some("configmap-reader".into()),
            ..ObjectMeta::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "configmap-reader".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some(env.namespace.clone()),
            ..Subject::default()
        }]),
    };
    env.namespaced::<Role>()
        .create(&PostParams::default(), &role)
        .await?;
    env.namespaced::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await?;
    Ok(())
}

#[tokio::test]
async fn admission_rejects_objects_in_a_missing_namespace() -> anyhow::Result<()> {
    let env = KubeTestEnv::new("admission").await?;
    let nowhere: Api<ConfigMap> = Api::namespaced(env.client.clone(), "no-such-namespace");
    let map = ConfigMap {
        metadata: ObjectMeta {
            name: Some("orphan".into()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    };
    let rejected = nowhere.create(&PostParams::default(), &map).await;
    assert_eq!(
        rejected.as_ref().err().and_then(status_code),
        Some(404),
        "{rejected:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_port_in_use_stops_the_harness_with_advice() -> anyhow::Result<()> {
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port();
    let started = tokio::task::spawn_blocking(move || {
        KubeApiserver::start(&StartOptions {
            port: Some(port),
            ..StartOptions::default()
        })
    })
    .await?;
    let message = format!(
        "{:#}",
        started.expect_err("started on a port that is in use")
    );
    assert!(
        message.contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "{message}"
    );
    assert!(message.contains("--port 0"), "{message}");
    drop(taken);
    Ok(())
}

#[tokio::test]
async fn a_stopped_harness_leaves_nothing_behind() -> anyhow::Result<()> {
    let apiserver =
        tokio::task::spawn_blocking(|| KubeApiserver::start(&StartOptions::default())).await??;
    let dir = apiserver
        .kubeconfig_path()
        .parent()
        .context("kubeconfig dir")?
        .to_owned();
    let pid = apiserver.harness_pid().context("harness pid")?;
    let port = apiserver
        .server()
        .rsplit(':')
        .next()
        .context("port")?
        .parse::<u16>()?;
    assert!(
        dir.join("etcd").is_dir(),
        "etcd data under {}",
        dir.display()
    );

    tokio::task::spawn_blocking(move || drop(apiserver)).await?;

    assert!(!dir.exists(), "{} was not removed", dir.display());
    assert!(!process_alive(&pid.to_string()), "harness {pid} still runs");
    TcpListener::bind(("127.0.0.1", port)).context("the apiserver port is free again")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_harness_keeps_its_address_certificates_and_data() -> anyhow::Result<()> {
    let apiserver =
        tokio::task::spawn_blocking(|| KubeApiserver::start(&StartOptions::default())).await??;
    let first_pid = apiserver.harness_pid().context("harness pid")?;
    let client = apiserver.admin_client().await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(client, "default");
    let kept = ConfigMap {
        metadata: ObjectMeta {
            name: Some("kept".into()),
            ..ObjectMeta::default()
        },
        data: Some([("written".to_owned(), "before".to_owned())].into()),
        ..ConfigMap::default()
    };
    configmaps.create(&PostParams::default(), &kept).await?;

    tokio::task::block_in_place(|| apiserver.restart())?;

    assert_ne!(
        apiserver.harness_pid(),
        Some(first_pid),
        "a new harness runs"
    );
    assert!(
        !process_alive(&first_pid.to_string()),
        "the old one is gone"
    );
    // The client made before the restart: same address, same CA, same admin certificate.
    let read = configmaps.get("kept").await?;
    assert_eq!(
        read.data
            .unwrap_or_default()
            .get("written")
            .map(String::as_str),
        Some("before"),
        "etcd kept the object"
    );
    let dir = apiserver
        .kubeconfig_path()
        .parent()
        .context("kubeconfig dir")?
        .to_owned();
    tokio::task::spawn_blocking(move || drop(apiserver)).await?;
    assert!(!dir.exists(), "{} was not removed", dir.display());
    Ok(())
}

/// Set for the child process of [`the_shared_harness_dies_with_a_panicking_test_process`]:
/// the file to write the harness's directory and pid to.
const PANIC_PROBE_ENV: &str = "EGRESSPROXY_TEST_PANIC_PROBE";

/// Runs only as that child: starts the shared apiserver, reports it, and panics.
#[tokio::test]
#[ignore = "run by the_shared_harness_dies_with_a_panicking_test_process"]
async fn panicking_test_process() {
    let Some(probe) = std::env::var_os(PANIC_PROBE_ENV) else {
        return;
    };
    let env = KubeTestEnv::new("panics").await.expect("apiserver starts");
    let apiserver = env.apiserver();
    let dir = apiserver
        .kubeconfig_path()
        .parent()
        .expect("kubeconfig dir");
    let pid = apiserver.harness_pid().expect("harness pid");
    std::fs::write(probe, format!("{}\n{pid}\n", dir.display())).expect("write probe");
    panic!("this test panics on purpose, with the shared apiserver running");
}

#[tokio::test]
async fn the_shared_harness_dies_with_a_panicking_test_process() -> anyhow::Result<()> {
    let probe = tempfile::NamedTempFile::new()?;
    let output = tokio::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "panicking_test_process",
            "--ignored",
            "--test-threads=1",
        ])
        .env(PANIC_PROBE_ENV, probe.path())
        .env_remove(egressproxy_integration::kube_apiserver::KUBECONFIG_ENV)
        .output()
        .await?;
    assert!(
        !output.status.success(),
        "the child test was meant to panic"
    );
    let report = std::fs::read_to_string(probe.path())?;
    let (dir, pid) = report
        .trim()
        .split_once('\n')
        .context("probe has dir and pid")?;
    let what =
        format!("harness {pid} and its directory {dir} to go with the panicking test process");
    eventually(&what, Duration::from_secs(30), || async {
        match (std::path::Path::new(dir).exists(), process_alive(pid)) {
            (false, false) => Ok(()),
            (dir_left, process_left) => Err(format!(
                "directory left: {dir_left}, process alive: {process_left}"
            )),
        }
    })
    .await;
    Ok(())
}

/// Whether `pid` runs; a zombie does not (PID 1 here may never reap an orphan).
fn process_alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, Some("Z" | "X"))
    })
}
