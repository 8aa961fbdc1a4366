//! Create, Get, List and Delete through the agent over the real SSH transport to a
//! private libvirtd (domain type qemu), the image fetched by the agent's image cache from
//! a loopback HTTP server: the guest is Debian's iPXE image, which gets a
//! DHCP lease from the host's network, so the instance goes PROVISIONING -> RUNNING
//! with an address. Also: Create is idempotent after a failure at every step, the same
//! key with another spec is ALREADY_EXISTS, and concurrent Creates of one key make one
//! domain.

mod common;
mod guest_env;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{caller_trace, deadline_in, spans_of};
use egressproxy_provider::{ErrorClass, pb};
use guest_env::{FileServer, GuestHost, ipxe_qcow2, qemu_img_info, sha256_file};
use kvm_agent::config::Config;
use kvm_agent::error::Error;
use kvm_agent::image_cache::marker_volume;
use kvm_agent::instance_create::{CreateStep, FaultHook};
use kvm_agent::instances::Instances;
use kvm_agent::naming::{InstanceNames, base_volume};
use kvm_agent::pool::Pool;
use tracing::Instrument;

const GENEROUS: Duration = Duration::from_secs(120);

struct Agent {
    guest_host: GuestHost,
    instances: Instances,
    /// The image's base volume and its completion marker.
    base: (String, String),
    _work: tempfile::TempDir,
}

/// The guest host, and the agent's `Instances` on it with the iPXE image served over
/// HTTP on loopback.
async fn agent(faults: FaultHook) -> Agent {
    agent_with(faults, |yaml| yaml).await
}

/// [`agent`] with the configuration changed by `edit`.
async fn agent_with(faults: FaultHook, edit: impl FnOnce(String) -> String) -> Agent {
    let guest_host = GuestHost::start();
    let work = tempfile::tempdir().unwrap();
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = FileServer::start(work.path());
    let yaml = edit(guest_host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url), &sha));
    let config = Config::parse(&yaml).unwrap();
    config.validate().unwrap();
    let config = Arc::new(config);
    let pool = Arc::new(Pool::new(&config).unwrap());
    let base = base_volume(&sha).unwrap();
    Agent {
        instances: Instances::new(config, pool).with_fault_hook(faults),
        guest_host,
        base: (marker_volume(&base), base),
        _work: work,
    }
}

fn request(key: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("test/{key}"),
        tags: [
            ("cluster".to_string(), "it".to_string()),
            ("uid".to_string(), key.to_string()),
        ]
        .into(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "tiny".into(),
            image: "ipxe".into(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\npackages: [squid]\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
    }
}

impl Agent {
    async fn create(
        &self,
        request: &pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, egressproxy_provider::ProviderError> {
        self.instances.create(request, deadline_in(GENEROUS)).await
    }

    fn base_path(&self) -> String {
        self.guest_host
            .images
            .join(&self.base.1)
            .display()
            .to_string()
    }

    /// Exactly the base (with its marker) and the overlay and seed of each of `keys` are in the pool.
    fn assert_pool_holds(&self, keys: &[&str]) {
        let mut expected = vec![self.base.0.clone(), self.base.1.clone()];
        for key in keys {
            let names = InstanceNames::for_key(key).unwrap();
            expected.push(names.overlay_volume);
            expected.push(names.seed_volume);
        }
        expected.sort();
        assert_eq!(self.guest_host.pool_files(), expected);
    }
}

/// The `virsh` commands of the console section of docs/kvm-agent.md, without comments.
fn documented_console_commands() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n### ")
        .find(|s| s.starts_with("A VM's console"))
        .expect("docs/kvm-agent.md has an \"A VM's console\" section");
    let block = section.split("```").nth(1).expect("a code block");
    let commands: Vec<String> = block
        .lines()
        .filter(|l| l.starts_with("virsh "))
        .map(|l| l.split(" #").next().unwrap().trim().to_owned())
        .collect();
    assert_eq!(commands.len(), 2, "{block}");
    commands
}

fn selector(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_get_list_delete_over_ssh() {
    let agent = agent(FaultHook::default()).await;
    let key = "uid-create-1";
    let names = InstanceNames::for_key(key).unwrap();

    // Under a caller's trace, as a gRPC request would be.
    let trace = caller_trace("CreateInstance");
    let created = agent
        .create(&request(key))
        .instrument(trace.request_span.clone())
        .await
        .unwrap();
    drop(trace.request_span);
    // Every libvirt call is a span named after its API, in the caller's trace.
    let spans: Vec<String> = spans_of(trace.trace_id)
        .into_iter()
        .map(|s| s.name.into_owned())
        .collect();
    for api in [
        "virDomainLookupByName",
        "virStorageVolCreateXML",
        "virStorageVolUpload",
        "virDomainDefineXML",
        "virDomainCreate",
    ] {
        assert!(spans.iter().any(|s| s == api), "no {api} span in {spans:?}");
    }
    assert_eq!(created.id, format!("hv1/{key}"));
    assert_eq!(created.key, key);
    assert_eq!(created.name, format!("test/{key}"));
    assert_eq!(created.state(), pb::InstanceState::Provisioning);
    assert!(created.create_time.is_some());
    assert_eq!(created.tags["cluster"], "it");
    assert_eq!(created.proxy_port, 3128);
    let placement = created.placement.clone().unwrap();
    assert_eq!(
        placement.location,
        Some(pb::placement::Location::Host("hv1".into()))
    );
    assert_eq!(agent.guest_host.domstate(&names.domain), "running");
    agent.assert_pool_holds(&[key]);

    // The overlay is qcow2 on the base's file, sized by the machine type (1 GiB).
    let info = qemu_img_info(&agent.guest_host.images.join(&names.overlay_volume));
    assert!(info.contains("file format: qcow2"), "{info}");
    assert!(info.contains(&agent.base_path()), "{info}");
    assert!(info.contains("virtual size: 1 GiB"), "{info}");
    // The seed is a complete ISO 9660 image (the `CD001` descriptor at 32 KiB + 1).
    let seed = std::fs::read(agent.guest_host.images.join(&names.seed_volume)).unwrap();
    assert_eq!(&seed[32769..32774], b"CD001");

    // A repeated Create returns the same instance and makes nothing new.
    let again = agent.create(&request(key)).await.unwrap();
    assert_eq!(again.id, created.id);
    assert_eq!(again.create_time, created.create_time);
    agent.assert_pool_holds(&[key]);

    // The same key with another spec is ALREADY_EXISTS naming the key.
    let mut other = request(key);
    other.proxy_port = 8080;
    let err = agent.create(&other).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::AlreadyExists, "{err}");
    assert!(err.message.contains(key), "{err}");

    // iPXE asks for a lease: RUNNING with the lease's address.
    let started = std::time::Instant::now();
    let running = loop {
        let instance = agent
            .instances
            .get(&created.id, deadline_in(GENEROUS))
            .await
            .unwrap();
        if instance.state() == pb::InstanceState::Running {
            break instance;
        }
        assert_eq!(instance.state(), pb::InstanceState::Provisioning);
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "no address after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        running.addresses[0].address.starts_with("192.168.200."),
        "{:?}",
        running.addresses
    );

    // The console commands of docs/kvm-agent.md work as written on this domain.
    for command in documented_console_commands() {
        let command = command
            .replace("qemu:///system", &agent.guest_host.libvirtd.uri())
            .replace("egressproxy-<key>", &names.domain);
        // `virsh console` needs a terminal: `script` gives it one; it runs until killed.
        let out = std::process::Command::new("timeout")
            .args(["5", "script", "-qec", &command, "/dev/null"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if command.contains(" console ") {
            assert!(text.contains("Connected to domain"), "{command}: {text}");
        } else {
            assert!(out.status.success(), "{command}: {text}");
            assert!(text.contains(&names.domain), "{command}: {text}");
        }
    }

    let listed = agent
        .instances
        .list(&selector(&[("cluster", "it")]), deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
        [created.id.as_str()]
    );
    assert!(
        agent
            .instances
            .list(&selector(&[("cluster", "other")]), deadline_in(GENEROUS))
            .await
            .unwrap()
            .is_empty()
    );

    agent
        .instances
        .delete(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    let err = agent
        .instances
        .get(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap_err();
    assert_eq!(err.class, ErrorClass::NotFound, "{err}");
    assert!(agent.guest_host.domains().is_empty());
    agent.assert_pool_holds(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_is_idempotent_after_a_failure_at_every_step() {
    let failing: Arc<std::sync::Mutex<Option<CreateStep>>> = Arc::default();
    let armed = Arc::new(AtomicBool::new(false));
    let hook = {
        let (failing, armed) = (failing.clone(), armed.clone());
        FaultHook::new(move |step| {
            if armed.load(Ordering::SeqCst) && *failing.lock().unwrap() == Some(step) {
                armed.store(false, Ordering::SeqCst);
                return Err(Error::Worker {
                    host: "hv1".into(),
                    op: "injected fault",
                    reason: format!("after {step:?}"),
                });
            }
            Ok(())
        })
    };
    let agent = agent(hook).await;
    for (i, step) in CreateStep::ALL.into_iter().enumerate() {
        let key = format!("uid-fault-{i}");
        let names = InstanceNames::for_key(&key).unwrap();
        *failing.lock().unwrap() = Some(step);
        armed.store(true, Ordering::SeqCst);
        let err = agent.create(&request(&key)).await.unwrap_err();
        assert!(err.message.contains("injected fault"), "{step:?}: {err}");
        assert!(!armed.load(Ordering::SeqCst), "{step:?} was reached");

        let instance = agent.create(&request(&key)).await.unwrap();
        assert_eq!(instance.id, format!("hv1/{key}"), "{step:?}");
        assert_eq!(
            agent.guest_host.domains(),
            std::slice::from_ref(&names.domain),
            "{step:?}"
        );
        assert_eq!(
            agent.guest_host.domstate(&names.domain),
            "running",
            "{step:?}"
        );
        agent.assert_pool_holds(&[&key]);
        let seed = std::fs::read(agent.guest_host.images.join(&names.seed_volume)).unwrap();
        assert_eq!(&seed[32769..32774], b"CD001", "{step:?}: seed complete");

        agent
            .instances
            .delete(&instance.id, deadline_in(GENEROUS))
            .await
            .unwrap();
        assert!(agent.guest_host.domains().is_empty(), "{step:?}");
        agent.assert_pool_holds(&[]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_of_one_key_make_one_domain() {
    let agent = Arc::new(agent(FaultHook::default()).await);
    let key = "uid-concurrent";
    let creates: Vec<_> = (0..4)
        .map(|_| {
            let agent = agent.clone();
            tokio::spawn(async move { agent.create(&request(key)).await })
        })
        .collect();
    let mut ids = Vec::new();
    for create in creates {
        ids.push(create.await.unwrap().unwrap().id);
    }
    ids.dedup();
    assert_eq!(ids, [format!("hv1/{key}")]);
    assert_eq!(
        agent.guest_host.domains(),
        [InstanceNames::for_key(key).unwrap().domain]
    );
    agent.assert_pool_holds(&[key]);
    agent
        .instances
        .delete(&ids[0], deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(agent.guest_host.domains().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn domain_type_auto_falls_back_to_qemu_where_libvirt_offers_no_kvm() {
    let agent = agent_with(FaultHook::default(), |yaml| {
        yaml.replace("domainType: qemu", "domainType: auto")
    })
    .await;
    let key = "uid-auto";
    let created = agent.create(&request(key)).await.unwrap();
    let domain = InstanceNames::for_key(key).unwrap().domain;
    let out = std::process::Command::new("virsh")
        .args(["-c", &agent.guest_host.libvirtd.uri(), "dumpxml", &domain])
        .output()
        .unwrap();
    let xml = String::from_utf8_lossy(&out.stdout);
    assert!(xml.starts_with("<domain type='qemu'"), "{xml}");
    assert_eq!(agent.guest_host.domstate(&domain), "running");
    agent
        .instances
        .delete(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(agent.guest_host.domains().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_during_a_create_of_the_key_waits_for_it_and_leaves_nothing() {
    let reached = Arc::new(tokio::sync::Notify::new());
    let hook = {
        let reached = reached.clone();
        FaultHook::new(move |step| {
            if step == CreateStep::Overlay {
                reached.notify_one();
                // Hold Create half-way (a slow host) while the Delete arrives.
                std::thread::sleep(Duration::from_secs(1));
            }
            Ok(())
        })
    };
    let agent = Arc::new(agent(hook).await);
    let key = "uid-create-then-delete";
    let create = {
        let agent = agent.clone();
        tokio::spawn(async move { agent.create(&request(key)).await })
    };
    reached.notified().await;
    agent
        .instances
        .delete(&format!("hv1/{key}"), deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(create.is_finished(), "Delete returned before the Create");
    create.await.unwrap().unwrap();
    assert!(agent.guest_host.domains().is_empty());
    agent.assert_pool_holds(&[]);
}
