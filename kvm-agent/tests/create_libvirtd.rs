//! Create, Get, List and Delete through the agent over the real SSH transport to a
//! private libvirtd (domain type qemu), the image fetched by the agent's image cache from
//! a loopback HTTP server: the guest is Debian's iPXE image, which gets a
//! DHCP lease from the host's network, so the instance goes PROVISIONING -> RUNNING
//! with an address. Also: Create is idempotent after a failure at every step, the same
//! key with another spec is ALREADY_EXISTS, and concurrent Creates of one key make one
//! domain. A BIOS guest whose DHCP attempt failed boots again. An address identity's DHCP
//! reservation is in the network before the domain starts, survives a Create stopped
//! between the two and an agent restart, and goes with the identity's last instance.

mod common;
mod guest_env;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use common::{caller_trace, deadline_in, spans_of};
use egressproxy_integration::eventually::{eventually, try_eventually};
use egressproxy_integration::http_server::HttpServer;
use egressproxy_provider::{ErrorClass, pb};
use guest_env::{GuestHost, ipxe_qcow2, qemu_img_info, sha256_file};
use kvm_agent::config::Config;
use kvm_agent::error::{Error, TransportError};
use kvm_agent::images::cache::marker_volume;
use kvm_agent::libvirt::naming::{InstanceNames, base_volume};
use kvm_agent::provider::create::{CreateStep, FaultHook};
use kvm_agent::provider::instances::Instances;
use kvm_agent::transport::pool::Pool;
use tracing::Instrument;

const GENEROUS: Duration = Duration::from_secs(120);

struct Agent {
    guest_host: GuestHost,
    instances: Instances,
    /// The image's base volume and its completion marker.
    base: (String, String),
    /// The loopback server of the images.
    server: HttpServer,
    _work: tempfile::TempDir,
}

/// The guest host, and the agent's `Instances` on it with the iPXE image served over
/// HTTP on loopback.
async fn agent(faults: FaultHook) -> Agent {
    agent_with(faults, |yaml| yaml).await
}

/// [`agent`] with the configuration changed by `edit`.
async fn agent_with(faults: FaultHook, edit: impl FnOnce(String) -> String) -> Agent {
    agent_in(faults, |_, _, yaml| edit(yaml)).await
}

/// [`agent`] with the configuration changed by `edit`, which also gets the directory the
/// image server serves and the server's base URL.
async fn agent_in(
    faults: FaultHook,
    edit: impl FnOnce(&std::path::Path, &str, String) -> String,
) -> Agent {
    let guest_host = GuestHost::start();
    let work = tempfile::tempdir().unwrap();
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let yaml = edit(
        work.path(),
        &server.base_url(),
        guest_host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha),
    );
    let config = Config::parse(&yaml).unwrap();
    config.validate().unwrap();
    let config = Arc::new(config);
    let pool = Arc::new(Pool::new(&config).unwrap());
    let base = base_volume(&sha).unwrap();
    Agent {
        instances: Instances::new(config, pool).with_fault_hook(faults),
        guest_host,
        base: (marker_volume(&base), base),
        server,
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
        ..Default::default()
    }
}

impl Agent {
    async fn create(
        &self,
        request: &pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, egressproxy_provider::ProviderError> {
        // As the gRPC edge answers it: through the one mapping.
        self.instances
            .create(request, deadline_in(GENEROUS))
            .await
            .map_err(Into::into)
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
    let running = eventually(
        "RUNNING with an address",
        Duration::from_secs(90),
        || async {
            let instance = agent
                .instances
                .get(&created.id, deadline_in(GENEROUS))
                .await
                .unwrap();
            match instance.state() {
                pb::InstanceState::Running => Ok(instance),
                pb::InstanceState::Provisioning => Err("PROVISIONING"),
                other => panic!("{other:?} while waiting for an address: {instance:?}"),
            }
        },
    )
    .await;
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
        .unwrap_err()
        .to_provider_error();
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
                return Err(Error::Transport(TransportError::Worker {
                    host: "hv1".into(),
                    op: "injected fault",
                    reason: format!("after {step:?}"),
                }));
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

/// A BIOS guest whose boot fails boots again: with the network's dnsmasq frozen, iPXE's
/// one DHCP attempt times out and it hands back to SeaBIOS, which (told to by the domain's
/// `<bios rebootTimeout>`) resets the guest instead of halting at "No bootable device";
/// once dnsmasq answers again, the instance reaches RUNNING with an address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bios_guest_whose_dhcp_attempt_failed_boots_again_and_gets_its_address() {
    let agent = agent(FaultHook::default()).await;
    let dnsmasq_pid_file = agent
        .guest_host
        .libvirtd
        .dir()
        .join("run/network/default.pid");
    let dnsmasq = std::fs::read_to_string(&dnsmasq_pid_file)
        .unwrap_or_else(|e| panic!("{}: {e}", dnsmasq_pid_file.display()))
        .trim()
        .to_owned();
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([name, &dnsmasq])
            .status()
            .unwrap();
        assert!(status.success(), "kill {name} {dnsmasq}");
    };
    signal("-STOP");
    // Listening before the guest exists: its first reset cannot come before iPXE's
    // DHCP attempt has timed out, seconds after the guest starts.
    let reboot = tokio::process::Command::new("virsh")
        .args(["-c", &agent.guest_host.libvirtd.uri()])
        .args(["event", "--event", "reboot", "--timeout", "180"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let key = "uid-boot-again";
    let domain = InstanceNames::for_key(key).unwrap().domain;
    let created = agent.create(&request(key)).await.unwrap();
    let reboot = reboot.wait_with_output().await.unwrap();
    signal("-CONT");
    let said = String::from_utf8_lossy(&reboot.stdout);
    assert!(
        said.contains(&format!("event 'reboot' for domain '{domain}'")),
        "the guest did not boot again after its failed boot: {said}\n{}",
        agent.guest_host.diagnostics()
    );
    let what = "RUNNING with an address after dnsmasq answered again";
    let running = try_eventually(what, GENEROUS, || async {
        let instance = agent
            .instances
            .get(&created.id, deadline_in(GENEROUS))
            .await
            .unwrap();
        match instance.state() {
            pb::InstanceState::Running => Ok(instance),
            _ => Err(format!("{instance:?}")),
        }
    })
    .await
    .unwrap_or_else(|timed_out| panic!("{timed_out}\n{}", agent.guest_host.diagnostics()));
    assert!(
        running.addresses[0].address.starts_with("192.168.200."),
        "{:?}",
        running.addresses
    );
    agent
        .instances
        .delete(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_during_a_create_of_the_key_waits_for_it_and_leaves_nothing() {
    let reached = Arc::new(tokio::sync::Notify::new());
    let (release, released) = std::sync::mpsc::channel::<()>();
    let hook = {
        let reached = reached.clone();
        let released = std::sync::Mutex::new(released);
        FaultHook::new(move |step| {
            if step == CreateStep::Overlay {
                reached.notify_one();
                // Hold Create half-way (a slow host) until the Delete waits for it.
                released.lock().unwrap().recv().unwrap();
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
    let id = format!("hv1/{key}");
    let mut delete = std::pin::pin!(agent.instances.delete(&id, deadline_in(GENEROUS)));
    // Delete's first await is the key's lock: pending here means it queued behind the
    // Create, which holds the lock until its steps end.
    let first = std::future::poll_fn(|cx| Poll::Ready(delete.as_mut().poll(cx))).await;
    assert!(
        first.is_pending(),
        "Delete did not wait for the Create: {first:?}"
    );
    release.send(()).unwrap();
    delete.await.unwrap();
    // The Create finished its steps, then the Delete removed what it made.
    let created = create.await.unwrap().unwrap();
    assert_eq!(created.id, id);
    assert!(agent.guest_host.domains().is_empty());
    agent.assert_pool_holds(&[]);
}

/// A hook that fails Create once after `step` each time `armed` is set.
fn fail_after(step: CreateStep) -> (FaultHook, Arc<AtomicBool>) {
    let armed = Arc::new(AtomicBool::new(false));
    let hook = {
        let armed = armed.clone();
        FaultHook::new(move |reached| {
            if reached == step && armed.swap(false, Ordering::SeqCst) {
                return Err(Error::Transport(TransportError::Worker {
                    host: "hv1".into(),
                    op: "injected fault",
                    reason: format!("after {reached:?}"),
                }));
            }
            Ok(())
        })
    };
    (hook, armed)
}

/// Every domain's disk files exist (no domain outlived its volumes).
fn assert_no_domain_misses_its_disks(guest_host: &GuestHost) {
    for domain in guest_host.domains() {
        let out = std::process::Command::new("virsh")
            .args([
                "-c",
                &guest_host.libvirtd.uri(),
                "domblklist",
                "--details",
                &domain,
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().filter(|l| l.trim_start().starts_with("file")) {
            let source = line.split_whitespace().last().unwrap();
            assert!(
                std::path::Path::new(source).exists(),
                "domain {domain} lost its disk {source}"
            );
        }
    }
}

/// A change to a request's placement.
type PlacementChange = fn(&mut pb::Placement);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlay_left_for_another_image_or_machine_type_is_made_again() {
    let (hook, armed) = fail_after(CreateStep::Overlay);
    // A second machine type with a larger disk, and a second image (the same iPXE with
    // other qcow2 clusters: other bytes, so another digest and another base).
    let mut second_sha = String::new();
    let agent = agent_in(hook, |dir, base_url, yaml| {
        let second = dir.join("ipxe-b.qcow2");
        let out = std::process::Command::new("qemu-img")
            .args([
                "convert",
                "-f",
                "qcow2",
                "-O",
                "qcow2",
                "-o",
                "cluster_size=32768",
            ])
            .arg(dir.join("ipxe.qcow2"))
            .arg(&second)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        second_sha = sha256_file(&second);
        yaml.replace(
            "  tiny: {vcpus: 1, memoryMiB: 128, diskGiB: 1}\n",
            "  tiny: {vcpus: 1, memoryMiB: 128, diskGiB: 1}\n  \
             roomy: {vcpus: 1, memoryMiB: 128, diskGiB: 2}\n",
        )
        .replace(
            "transport:\n",
            &format!(
                "  ipxe-b:\n    url: {base_url}/ipxe-b.qcow2\n    sha256: {second_sha}\n    \
                 format: qcow2\n    firmware: bios\ntransport:\n"
            ),
        )
    })
    .await;
    let second_base = agent
        .guest_host
        .images
        .join(base_volume(&second_sha).unwrap())
        .display()
        .to_string();

    // (placement change, what the remade overlay must show)
    let cases: [(&str, PlacementChange, String, &str); 2] = [
        (
            "uid-respec-machine",
            |p| p.machine_type = "roomy".into(),
            agent.base_path(),
            "virtual size: 2 GiB",
        ),
        (
            "uid-respec-image",
            |p| p.image = "ipxe-b".into(),
            second_base.clone(),
            "virtual size: 1 GiB",
        ),
    ];
    for (key, change, wanted_base, wanted_size) in cases {
        let names = InstanceNames::for_key(key).unwrap();
        let overlay = agent.guest_host.images.join(&names.overlay_volume);
        // A Create that stops after its overlay, before any domain exists.
        armed.store(true, Ordering::SeqCst);
        let err = agent.create(&request(key)).await.unwrap_err();
        assert!(err.message.contains("injected fault"), "{key}: {err}");
        assert!(agent.guest_host.domains().is_empty(), "{key}");
        let first = qemu_img_info(&overlay);
        assert!(first.contains(&agent.base_path()), "{key}: {first}");
        assert!(first.contains("virtual size: 1 GiB"), "{key}: {first}");

        // The spec changes before the retry: the retry's overlay follows the new spec.
        let mut changed = request(key);
        change(changed.placement.as_mut().unwrap());
        let instance = agent.create(&changed).await.unwrap();
        let info = qemu_img_info(&overlay);
        assert!(
            info.contains(&format!("backing file: {wanted_base}")),
            "{key}: {info}"
        );
        assert!(info.contains(wanted_size), "{key}: {info}");
        assert_eq!(agent.guest_host.domstate(&names.domain), "running", "{key}");
        assert_eq!(
            instance.placement.unwrap().image,
            changed.placement.unwrap().image
        );
        agent
            .instances
            .delete(&instance.id, deadline_in(GENEROUS))
            .await
            .unwrap();
    }
    assert!(agent.guest_host.domains().is_empty());
    let mut bases = vec![
        agent.base.0.clone(),
        agent.base.1.clone(),
        marker_volume(&base_volume(&second_sha).unwrap()),
        base_volume(&second_sha).unwrap(),
    ];
    bases.sort();
    assert_eq!(agent.guest_host.pool_files(), bases);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_create_finishes_under_its_lock_before_a_delete_of_the_key() {
    let steps: Arc<std::sync::Mutex<Vec<CreateStep>>> = Arc::default();
    let hook = {
        let steps = steps.clone();
        FaultHook::new(move |step| {
            steps.lock().unwrap().push(step);
            Ok(())
        })
    };
    let agent = agent(hook).await;
    let key = "uid-cancelled";
    // The caller goes away a few milliseconds in (tonic drops the handler's future when
    // the client cancels): the first connection to the host is not even up yet.
    let cancelled =
        tokio::time::timeout(Duration::from_millis(5), agent.create(&request(key))).await;
    assert!(cancelled.is_err(), "Create finished within 5 ms?");
    assert!(steps.lock().unwrap().is_empty(), "{steps:?}");

    agent
        .instances
        .delete(&format!("hv1/{key}"), deadline_in(GENEROUS))
        .await
        .unwrap();
    // The Create went on to its end, holding the key's lock, and only then did the
    // Delete run: it removed a complete instance, and nothing runs on afterwards.
    assert_eq!(*steps.lock().unwrap(), CreateStep::ALL);
    assert!(agent.guest_host.domains().is_empty());
    agent.assert_pool_holds(&[]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(agent.guest_host.domains().is_empty());
    assert_no_domain_misses_its_disks(&agent.guest_host);
    agent.assert_pool_holds(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_of_different_keys_share_one_download() {
    let agent = Arc::new(agent(FaultHook::default()).await);
    let keys = ["uid-share-1", "uid-share-2", "uid-share-3"];
    let creates: Vec<_> = keys
        .iter()
        .map(|&key| {
            let agent = agent.clone();
            tokio::spawn(async move { agent.create(&request(key)).await })
        })
        .collect();
    let mut ids = Vec::new();
    for create in creates {
        ids.push(create.await.unwrap().unwrap().id);
    }
    assert_eq!(ids, keys.map(|k| format!("hv1/{k}")));
    assert_eq!(agent.server.requests("/ipxe.qcow2"), 1, "one download");
    agent.assert_pool_holds(&keys);
    for id in &ids {
        agent
            .instances
            .delete(id, deadline_in(GENEROUS))
            .await
            .unwrap();
    }
    assert!(agent.guest_host.domains().is_empty());
    agent.assert_pool_holds(&[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_fails_when_one_configured_host_is_unreachable() {
    // A second hypervisor whose sshd has stopped (its address refuses connections).
    // Its host key stays known (the configuration is valid), its server is gone.
    let stopped = egressproxy_integration::sshd::Sshd::start().unwrap();
    let stopped_address = stopped.address();
    let hv2_files = tempfile::tempdir().unwrap();
    let hv2_known_hosts = hv2_files.path().join("known_hosts");
    std::fs::copy(stopped.known_hosts(), &hv2_known_hosts).unwrap();
    drop(stopped);
    let agent = agent_with(FaultHook::default(), |yaml| {
        let hv1 = yaml
            .split("machineTypes:\n")
            .next()
            .unwrap()
            .strip_prefix("hosts:\n")
            .unwrap()
            .to_owned();
        let address = hv1
            .lines()
            .find(|l| l.trim_start().starts_with("address:"))
            .unwrap()
            .to_owned();
        let known_hosts = hv1
            .lines()
            .find(|l| l.trim_start().starts_with("knownHosts:"))
            .unwrap()
            .to_owned();
        let hv2 = hv1
            .replace("- name: hv1", "- name: hv2")
            .replace(&address, &format!("    address: \"{stopped_address}\""))
            .replace(
                &known_hosts,
                &format!("    knownHosts: {}", hv2_known_hosts.display()),
            );
        yaml.replace("machineTypes:\n", &format!("{hv2}machineTypes:\n"))
    })
    .await;
    assert_eq!(agent.instances.config().hosts.len(), 2);
    let key = "uid-list-partial";
    // Create also asks hv2 whether the key is there; hv2 cannot answer and is skipped,
    // so a host that is down does not stop Creates on the others.
    let created = agent.create(&request(key)).await.unwrap();
    assert_eq!(created.id, format!("hv1/{key}"));

    // hv1's instance exists, but a list without hv2's would be short: the call fails.
    let err = agent
        .instances
        .list(&selector(&[("cluster", "it")]), deadline_in(GENEROUS))
        .await
        .unwrap_err()
        .to_provider_error();
    assert_eq!(err.class, ErrorClass::Transient, "{err}");
    assert!(err.message.contains("hv2"), "{err}");
    // hv1 itself answers.
    agent
        .instances
        .get(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    agent
        .instances
        .delete(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(agent.guest_host.domains().is_empty());
}

/// A key names one instance whatever host a request names: the key created on hv1 is
/// found from a Create naming hv2 (ALREADY_EXISTS: the placement differs) and from one
/// naming no host once hv2 is the first host. Before, each host was asked alone and
/// the second Create made a second instance of the key on hv2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_one_instance_across_hosts() {
    let second = GuestHost::start();
    let agent = agent_with(FaultHook::default(), |yaml| {
        let hv2 = second
            .config_yaml("unused", "unused")
            .split("machineTypes:\n")
            .next()
            .unwrap()
            .strip_prefix("hosts:\n")
            .unwrap()
            .replace("- name: hv1", "- name: hv2");
        yaml.replace("machineTypes:\n", &format!("{hv2}machineTypes:\n"))
    })
    .await;
    let key = "uid-two-hosts";
    let on = |host: Option<&str>| {
        let mut request = request(key);
        request.placement.as_mut().unwrap().location =
            host.map(|h| pb::placement::Location::Host(h.into()));
        request
    };
    let created = agent.create(&on(Some("hv1"))).await.unwrap();
    assert_eq!(created.id, format!("hv1/{key}"));

    let err = agent.create(&on(Some("hv2"))).await.unwrap_err();
    assert_eq!(err.class, ErrorClass::AlreadyExists, "{err}");
    assert!(err.message.contains("hv1"), "{err}");
    assert!(second.domains().is_empty(), "{:?}", second.domains());

    // The same request again: the same instance.
    let again = agent.create(&on(Some("hv1"))).await.unwrap();
    assert_eq!(again.id, created.id);
    agent
        .instances
        .delete(&created.id, deadline_in(GENEROUS))
        .await
        .unwrap();

    // Made with no location on hv1, then asked for with no location by an agent whose
    // first host is hv2: the same instance, not a second one on hv2.
    let anywhere = agent.create(&on(None)).await.unwrap();
    assert_eq!(anywhere.id, format!("hv1/{key}"));
    let mut reordered = (**agent.instances.config()).clone();
    reordered.hosts.reverse();
    let reordered = Arc::new(reordered);
    let pool = Arc::new(Pool::new(&reordered).unwrap());
    // hv1 answers this agent before the Create asks it: the Create gives a host that
    // does not answer within a few seconds up (a host that is down must not stop
    // Creates), and a first SSH dial on a loaded machine can take that long. What is
    // tested here is a host that answers.
    pool.host("hv1")
        .unwrap()
        .lib_version(deadline_in(GENEROUS))
        .await
        .unwrap();
    let found = Instances::new(reordered.clone(), pool)
        .create(&on(None), deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(found.id, anywhere.id);
    assert!(second.domains().is_empty(), "{:?}", second.domains());
    agent
        .instances
        .delete(&anywhere.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(agent.guest_host.domains().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_data_never_reaches_logs_or_spans() {
    let agent = agent(FaultHook::default()).await;
    let key = "uid-secret";
    let marker = format!("ep-secret-{}-c4a9d1e0", std::process::id());
    let mut request = request(key);
    request.cloud_init = Some(pb::CloudInit {
        user_data: format!(
            "#cloud-config\npackages: [squid]\nwrite_files:\n- path: /etc/squid/secret\n  \
             content: {marker}\n"
        )
        .into_bytes(),
        vendor_data: None,
    });

    let trace = caller_trace("CreateInstance");
    let created = agent
        .create(&request)
        .instrument(trace.request_span.clone())
        .await
        .unwrap();
    // The seed carries it to the guest (so it did go through the agent).
    let names = InstanceNames::for_key(key).unwrap();
    let seed = std::fs::read(agent.guest_host.images.join(&names.seed_volume)).unwrap();
    assert!(
        seed.windows(marker.len()).any(|w| w == marker.as_bytes()),
        "the seed holds the user-data"
    );
    // A repeated Create, a Get, a List and a Delete, under the same trace.
    async {
        agent.create(&request).await.unwrap();
        agent
            .instances
            .get(&created.id, deadline_in(GENEROUS))
            .await
            .unwrap();
        agent
            .instances
            .list(&[], deadline_in(GENEROUS))
            .await
            .unwrap();
        agent
            .instances
            .delete(&created.id, deadline_in(GENEROUS))
            .await
            .unwrap();
    }
    .instrument(trace.request_span.clone())
    .await;
    drop(trace.request_span);

    assert!(agent.guest_host.domains().is_empty());

    let spans = common::all_spans();
    assert!(
        !spans_of(trace.trace_id).is_empty(),
        "the Create's spans were captured"
    );
    for span in &spans {
        let text = format!("{span:?}");
        assert!(
            !text.contains(&marker),
            "span {} holds user-data",
            span.name
        );
    }
    let log = common::captured_log();
    assert!(
        log.contains("created instance") && log.contains(key),
        "the agent's log was captured"
    );
    assert!(!log.contains(&marker), "the log holds user-data");
}

/// The DHCP host entries of the host's `default` network, live or as defined.
fn dhcp_hosts(agent: &Agent, inactive: bool) -> Vec<(Option<String>, Option<std::net::Ipv4Addr>)> {
    let mut args = vec!["net-dumpxml", "default"];
    if inactive {
        args.push("--inactive");
    }
    let xml = agent.guest_host.virsh(&args);
    let mut hosts: Vec<_> = kvm_agent::libvirt::xml::network::DhcpFacts::parse(&xml)
        .unwrap()
        .hosts
        .into_iter()
        .map(|h| (h.mac, h.ip))
        .collect();
    hosts.sort();
    hosts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_identity_is_reserved_before_start_and_released_with_its_last_instance() {
    use kvm_agent::libvirt::identity_mac::mac_for_identity;
    // The agent is "killed" once, between the reservation and the domain's start.
    let armed = Arc::new(AtomicBool::new(true));
    let hook = {
        let armed = armed.clone();
        FaultHook::new(move |step| {
            if step == CreateStep::Reservation && armed.swap(false, Ordering::SeqCst) {
                return Err(Error::Transport(TransportError::Worker {
                    host: "hv1".into(),
                    op: "injected fault",
                    reason: "killed after the reservation".into(),
                }));
            }
            Ok(())
        })
    };
    let agent = agent(hook).await;
    let before = dhcp_hosts(&agent, false);
    let identity = "proxy-uid-7f3a";
    let mac = mac_for_identity(identity);
    let mut first = request("uid-identity-1");
    first.address_identity = Some(identity.into());

    let err = agent.create(&first).await.unwrap_err();
    assert!(err.message.contains("injected fault"), "{err}");
    let names = InstanceNames::for_key(&first.key).unwrap();
    // Stopped at the seam: the reservation is in the network (live and as defined) while
    // the domain has not started, and ListInstances shows the instance that holds it.
    assert_eq!(agent.guest_host.domstate(&names.domain), "shut off");
    let reserved: Vec<_> = dhcp_hosts(&agent, false)
        .into_iter()
        .filter(|(m, _)| m.as_deref() == Some(mac.as_str()))
        .collect();
    assert_eq!(reserved.len(), 1, "{reserved:?}");
    let address = reserved[0].1.expect("the reservation has an address");
    assert_eq!(dhcp_hosts(&agent, true), dhcp_hosts(&agent, false));
    let listed = agent
        .instances
        .list(&[], deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].address_identity.as_deref(), Some(identity));

    // A restarted agent (nothing shared with the first but libvirt) finishes the Create
    // with the same reservation.
    let config = agent.instances.config().clone();
    let restarted = Instances::new(config.clone(), Arc::new(Pool::new(&config).unwrap()));
    let instance = restarted
        .create(&first, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(instance.address_identity.as_deref(), Some(identity));
    assert_eq!(agent.guest_host.domstate(&names.domain), "running");
    let dumpxml = std::process::Command::new("virsh")
        .args([
            "-c",
            &agent.guest_host.libvirtd.uri(),
            "dumpxml",
            &names.domain,
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&dumpxml.stdout).contains(&mac));
    let after_restart = dhcp_hosts(&agent, false);
    assert!(after_restart.contains(&(Some(mac.clone()), Some(address))));
    assert_eq!(after_restart.len(), before.len() + 1, "{after_restart:?}");

    // One instance of an identity at a time.
    let mut second = request("uid-identity-2");
    second.address_identity = Some(identity.into());
    let err = egressproxy_provider::ProviderError::from(
        restarted
            .create(&second, deadline_in(GENEROUS))
            .await
            .unwrap_err(),
    );
    assert_eq!(err.reason, "ADDRESS_IDENTITY_IN_USE", "{err}");
    assert_eq!(err.class, ErrorClass::Transient, "{err}");
    assert!(err.message.contains("hv1/uid-identity-1"), "{err}");

    // The last instance goes, and its reservation with it.
    restarted
        .delete(&instance.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(dhcp_hosts(&agent, false), before);
    assert_eq!(dhcp_hosts(&agent, true), before);

    // The replacement gets the same address, reserved before it starts.
    let replacement = restarted
        .create(&second, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(dhcp_hosts(&agent, false).contains(&(Some(mac.clone()), Some(address))));
    restarted
        .delete(&replacement.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(dhcp_hosts(&agent, false), before);
    assert!(agent.guest_host.domains().is_empty());
}

/// A host whose VMs attach to a bridge with a static block: two concurrent Creates of two
/// identities get two addresses of the block, each in its own seed's `network-config`
/// and reported first by Create; a requested address held by another is ADDRESS_TAKEN,
/// one outside the block ADDRESS_NOT_IN_RANGE; the full block is ADDRESSES_EXHAUSTED; a
/// Delete frees an address for the next identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_block_on_a_bridge_gives_concurrent_creates_distinct_addresses() {
    // The libvirt network's bridge serves as the host bridge; the block lies outside
    // its DHCP range.
    let agent = agent_with(FaultHook::default(), |yaml| {
        yaml.replace(
            "  domainType: qemu\n",
            "  domainType: qemu\n  bridge: virbr-ep0\n  staticAddresses: {first: \
             192.168.200.251, last: 192.168.200.253, prefixLength: 24, gateway: \
             192.168.200.1, dns: [192.168.200.1]}\n",
        )
    })
    .await;
    let with_identity = |key: &str, identity: &str, requested: Option<&str>| {
        let mut request = request(key);
        request.address_identity = Some(identity.into());
        request.requested_address = requested.map(str::to_owned);
        request
    };
    // Both identities' searches start at the same address of the block (the first 8
    // bytes of their SHA-256, modulo 3, are 0 for both), so without the host's
    // allocation lock both Creates would choose it.
    let (a, b) = (
        with_identity("uid-static-a", "static-a", None),
        with_identity("uid-static-b", "static-b2", None),
    );
    let (made_a, made_b) = tokio::join!(agent.create(&a), agent.create(&b));
    let (made_a, made_b) = (made_a.unwrap(), made_b.unwrap());
    let address_of = |instance: &pb::Instance| instance.addresses[0].address.clone();
    let (address_a, address_b) = (address_of(&made_a), address_of(&made_b));
    assert_ne!(address_a, address_b);
    for (key, address) in [(&a.key, &address_a), (&b.key, &address_b)] {
        assert!(address.starts_with("192.168.200.25"), "{address}");
        let seed = std::fs::read(
            agent
                .guest_host
                .images
                .join(InstanceNames::for_key(key).unwrap().seed_volume),
        )
        .unwrap();
        let wanted = format!("{address}/24");
        assert!(
            seed.windows(wanted.len()).any(|w| w == wanted.as_bytes()),
            "the seed of {key} configures {wanted}"
        );
    }

    let taken = agent
        .create(&with_identity("uid-static-c", "static-c", Some(&address_a)))
        .await
        .unwrap_err();
    assert_eq!(taken.reason, "ADDRESS_TAKEN", "{taken}");
    assert!(taken.message.contains("hv1/uid-static-a"), "{taken}");
    let outside = agent
        .create(&with_identity(
            "uid-static-c",
            "static-c",
            Some("192.168.200.100"),
        ))
        .await
        .unwrap_err();
    assert_eq!(outside.reason, "ADDRESS_NOT_IN_RANGE", "{outside}");
    assert_eq!(outside.field_violations[0].field, "requested_address");

    let made_c = agent
        .create(&with_identity("uid-static-c2", "static-c", None))
        .await
        .unwrap();
    let full = agent
        .create(&with_identity("uid-static-d", "static-d", None))
        .await
        .unwrap_err();
    assert_eq!(full.reason, "ADDRESSES_EXHAUSTED", "{full}");

    // Deleting A frees its address: D, asking for it, gets it.
    agent
        .instances
        .delete(&made_a.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    let made_d = agent
        .create(&with_identity("uid-static-d", "static-d", Some(&address_a)))
        .await
        .unwrap();
    assert_eq!(address_of(&made_d), address_a);
    for instance in [made_b, made_c, made_d] {
        agent
            .instances
            .delete(&instance.id, deadline_in(GENEROUS))
            .await
            .unwrap();
    }
    assert!(agent.guest_host.domains().is_empty());
}

/// What docs/kvm-agent.md says of a Create refused for want of an address on a libvirt
/// network: the domain it defined stays, shut off and listed STOPPED without an address;
/// a retry of the key once an address is free reserves it and starts the domain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_refused_for_want_of_an_address_keeps_its_domain_shut_off_until_one_is_free() {
    let agent = agent(FaultHook::default()).await;
    // Every address of the network's DHCP range reserved for MACs no instance has (not
    // the agent's prefix, so its sweep leaves them).
    let hosts: String = (10..=250)
        .map(|n| format!("<host mac='52:54:00:ee:00:{n:02x}' ip='192.168.200.{n}'/>"))
        .collect();
    let network = agent.guest_host.libvirtd.dir().join("full-network.xml");
    std::fs::write(&network, guest_env::network_xml(&hosts)).unwrap();
    let virsh = |args: &[&str]| agent.guest_host.virsh(args);
    virsh(&["net-destroy", "default"]);
    virsh(&["net-undefine", "default"]);
    virsh(&["net-define", &network.display().to_string()]);
    virsh(&["net-start", "default"]);
    assert_eq!(dhcp_hosts(&agent, false).len(), 241);

    let mut request = request("uid-exhausted");
    request.address_identity = Some("proxy-uid-exhausted".into());
    let err = agent.create(&request).await.unwrap_err();
    assert_eq!(err.reason, "ADDRESSES_EXHAUSTED", "{err}");
    assert_eq!(err.class, ErrorClass::QuotaExhausted, "{err}");
    let names = InstanceNames::for_key(&request.key).unwrap();
    assert_eq!(agent.guest_host.domstate(&names.domain), "shut off");
    let listed = agent
        .instances
        .list(&[], deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].state(), pb::InstanceState::Stopped, "{listed:?}");
    assert!(listed[0].addresses.is_empty(), "{listed:?}");

    // One address freed: the retried Create reserves it and starts the same domain.
    virsh(&[
        "net-update",
        "default",
        "delete",
        "ip-dhcp-host",
        "<host mac='52:54:00:ee:00:7b' ip='192.168.200.123'/>",
        "--live",
        "--config",
    ]);
    let instance = agent.create(&request).await.unwrap();
    assert_eq!(instance.id, listed[0].id);
    assert_eq!(agent.guest_host.domstate(&names.domain), "running");
    let mac = kvm_agent::libvirt::identity_mac::mac_for_identity("proxy-uid-exhausted");
    assert!(
        dhcp_hosts(&agent, false).contains(&(Some(mac), Some("192.168.200.123".parse().unwrap()))),
        "{:?}",
        dhcp_hosts(&agent, false)
    );
    agent
        .instances
        .delete(&instance.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert!(agent.guest_host.domains().is_empty());
}
