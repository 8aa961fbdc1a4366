//! Every reason of the error table in docs/kvm-agent.md, as a gRPC client sees it:
//! `kvm-agent serve` as a process, a private libvirtd reached over a real sshd, the shared
//! test HTTP server for images, and the ErrorInfo decoded from the wire with
//! `tonic-types`, not with the project's own mapping. Each reason is produced by what a
//! user could do or meet: a wrong known_hosts, a 404 image, a busy key, a hung libvirtd.
//!
//! A few reasons name failures nothing outside the agent can cause on demand (a protocol
//! error inside an SSH session, a thread of the agent dying, libvirt answering XML it
//! cannot have written). They are listed in [`NOT_ON_DEMAND`] with why; the mapping of
//! each is a unit test in `kvm-agent/src/error/tests.rs`. The test fails when the
//! table, the reasons produced here and that list disagree.

mod guest_env;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use egressproxy_integration::http_server::{Delivery, HttpServer, Reply};
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::pb;
use egressproxy_provider::pb::provider_client::ProviderClient;
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};
use tonic::transport::Channel;
use tonic_types::StatusExt;

/// Documented reasons no outside action produces on demand, and why.
const NOT_ON_DEMAND: &[(&str, &str)] = &[
    (
        "SSH_FAILED",
        "an SSH protocol error inside an established session; OpenSSH does not make one",
    ),
    (
        "LIBVIRT_CONNECTION_FAILED",
        "a failure in libvirt's RPC layer on a forward that opened; a refused forward is LIBVIRT_FORWARD_REFUSED",
    ),
    (
        "LIBVIRT_CONNECTION_CUT",
        "needs another call's deadline to cut a shared connection at the same moment",
    ),
    (
        "LIBVIRT_FAILED",
        "a libvirt error of no known class; every error libvirtd gives on demand has one",
    ),
    (
        "LIBVIRT_HOST_ERROR",
        "an OS error on the hypervisor (disk full, EIO); root in the test bypasses permissions",
    ),
    (
        "POOL_FULL",
        "a full pool needs a small filesystem mounted in libvirtd's mount namespace; image_cache_libvirtd.rs and `make faults` (pool-full) mount one",
    ),
    (
        "DOMAIN_XML_INVALID",
        "request validation refuses first every value the XML builder could not take",
    ),
    (
        "LIBVIRT_XML_UNREADABLE",
        "libvirtd would have to answer XML it cannot have written",
    ),
    (
        "LIBVIRT_XML_UNBUILDABLE",
        "built from names the agent made itself; no input reaches it unchecked",
    ),
    (
        "INSTANCE_VANISHED",
        "needs a domain deleted between the agent's define and its read-back",
    ),
    (
        "AGENT_IO_FAILED",
        "the agent's own local I/O (its runtime directory) failing mid-call",
    ),
    ("AGENT_WORKER_FAILED", "a worker thread of the agent dying"),
    (
        "AGENT_CONFIG_INVALID",
        "`serve` refuses to start with an invalid config, so no call can meet one",
    ),
    (
        "NETWORK_WITHOUT_DHCP",
        "needs a libvirt network without a DHCP range; `reservations_test_driver` makes one and meets it",
    ),
    (
        "ADDRESSES_EXHAUSTED",
        "needs every address of the network's DHCP range reserved (253 instances here); the choice is table-tested in `libvirt::reservations`",
    ),
    (
        "ADDRESS_NOT_IN_RANGE",
        "needs a host with a static block (`staticAddresses`), whose bridge this test's host does not have; `static_addresses_test_driver` meets the choice and `error::tests` maps it",
    ),
    (
        "ADDRESS_TAKEN",
        "needs a host with a static block (`staticAddresses`), whose bridge this test's host does not have; `static_addresses_test_driver` meets the choice and `error::tests` maps it",
    ),
    (
        "ALLOCATION_TABLE_UNREADABLE",
        "needs a domain of the agent that vanishes while a Create on a static-address host reads the others",
    ),
    (
        "IDENTITY_MAC_SHARED",
        "needs two identities whose SHA-256 share 32 bits, which no test can find on demand",
    ),
    (
        "KVM_PROBE_RUNNING",
        "needs a host whose libvirt offers KVM, so that `domainType: auto` boots a probe guest; the test's libvirtd offers none and the answer is immediate",
    ),
];

/// The reason codes of the error table in docs/kvm-agent.md.
fn documented_reasons() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
        .unwrap();
    let section = doc
        .split("\n## Errors\n")
        .nth(1)
        .expect("docs/kvm-agent.md has an Errors section");
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .flat_map(|line| {
            let first_column = line.split('|').nth(1).unwrap_or_default();
            first_column
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The reason of the ErrorInfo the server sent, with the status for messages.
fn reason_of(status: &tonic::Status) -> String {
    status
        .get_error_details()
        .error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo on the wire: {status:?}"))
        .reason
        .clone()
}

fn placement(host: &str, image: &str) -> pb::Placement {
    pb::Placement {
        location: Some(pb::placement::Location::Host(host.into())),
        machine_type: "tiny".into(),
        image: image.into(),
    }
}

fn create(key: &str, host: &str, image: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("wire/{key}"),
        tags: Default::default(),
        placement: Some(placement(host, image)),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\n{}\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}

/// Calls with a deadline, as the operator does.
fn with_deadline<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    request
}

/// What the reasons were seen for, to compare with the table at the end.
#[derive(Default)]
struct Seen(BTreeSet<String>);

impl Seen {
    /// Asserts `result` failed with `reason`, and records it.
    fn expect<T: std::fmt::Debug>(
        &mut self,
        what: &str,
        result: Result<T, tonic::Status>,
        reason: &str,
    ) {
        let status = match result {
            Ok(answer) => panic!("{what}: expected {reason}, got {answer:?}"),
            Err(status) => status,
        };
        assert_eq!(reason_of(&status), reason, "{what}: {status:?}");
        self.0.insert(reason.to_owned());
    }
}

/// Files the config names: a known_hosts that loses its key after the agent started,
/// and one that vouches for the closed port.
struct KnownHosts {
    forgotten: std::path::PathBuf,
    closed_port: std::path::PathBuf,
}

impl KnownHosts {
    fn write(host: &GuestHost, dir: &Path) -> Self {
        let known = std::fs::read_to_string(host.sshd.known_hosts()).unwrap();
        let forgotten = dir.join("forgotten_known_hosts");
        std::fs::write(&forgotten, &known).unwrap();
        let closed_port = dir.join("closed_port_known_hosts");
        let port = format!("]:{}", host.sshd.port());
        std::fs::write(&closed_port, known.replace(&port, "]:1")).unwrap();
        Self {
            forgotten,
            closed_port,
        }
    }
}

#[allow(clippy::too_many_lines)]
fn config(host: &GuestHost, images: &HttpServer, ipxe: &Path, files: &KnownHosts) -> String {
    let sha = sha256_file(ipxe);
    let address = host.sshd.address();
    let user = host.sshd.user();
    let key = host.sshd.client_key();
    let known = host.sshd.known_hosts();
    let socket = host.libvirtd.socket();
    let ssh_host = |name: &str, key: &Path, known: &Path, extra: &str| {
        format!(
            "- name: {name}\n  ssh: {{address: \"{address}\", user: {user}, privateKey: {key}, knownHosts: {known}}}\n  libvirtSocket: {socket}\n  domainType: qemu\n{extra}",
            key = key.display(),
            known = known.display(),
            socket = socket.display(),
        )
    };
    let file = |path: &str| images.route(path, Reply::File(ipxe.to_owned(), Delivery::Whole));
    let hosts = [
        ssh_host("hv1", &key, &known, ""),
        ssh_host("unknown-key", &key, &files.forgotten, ""),
        ssh_host("changed-key", &key, &host.sshd.other_host_key_known_hosts(), ""),
        ssh_host("wrong-key", &host.sshd.unauthorized_key(), &known, ""),
        ssh_host("no-pool", &key, &known, "  storagePool: no-such-pool\n"),
        ssh_host("no-network", &key, &known, "  network: no-such-network\n"),
        format!(
            "- name: no-libvirtd\n  ssh: {{address: \"{address}\", user: {user}, privateKey: {key}, knownHosts: {known}}}\n  libvirtSocket: /nonexistent/libvirt-sock\n",
            key = key.display(),
            known = known.display(),
        ),
        ssh_host("kvm-only", &key, &known, "").replace("domainType: qemu", "domainType: kvm"),
        ssh_host("full", &key, &known, "  capacity: {maxInstances: 0}\n"),
        format!(
            "- name: closed-port\n  ssh: {{address: \"127.0.0.1:1\", user: {user}, privateKey: {key}, knownHosts: {known}}}\n",
            key = key.display(),
            known = files.closed_port.display(),
        ),
    ]
    .concat();
    // Base images are cached by their SHA-256: every image that must be fetched (and
    // fail) has a digest of its own, so no cached base stands in for it.
    let image = |name: &str, url: String, sha: &str, format: &str| {
        format!("  {name}: {{url: \"{url}\", sha256: {sha}, format: {format}, firmware: bios}}\n")
    };
    let own = |name: &str| hex::encode(<sha2::Sha256 as sha2::Digest>::digest(name.as_bytes()));
    let dir = ipxe.parent().unwrap();
    // A raw disk (zeros) declared qcow2; and the iPXE disk with a tail of zeros, so its
    // digest differs (qcow2 ignores what follows its clusters).
    let raw = dir.join("raw.img");
    std::fs::write(&raw, vec![0_u8; 1 << 20]).unwrap();
    let padded = dir.join("padded.qcow2");
    let mut bytes = std::fs::read(ipxe).unwrap();
    bytes.extend(vec![0_u8; 1 << 20]);
    std::fs::write(&padded, bytes).unwrap();
    let status = |path: &str, code: u16| images.route(path, Reply::Status(code));
    let images_yaml = [
        image("ipxe", file("/ipxe.qcow2"), &sha, "qcow2"),
        image("not-found", status("/404", 404), &own("404"), "qcow2"),
        image("forbidden", status("/403", 403), &own("403"), "qcow2"),
        image("teapot", status("/418", 418), &own("418"), "qcow2"),
        image("server-error", status("/500", 500), &own("500"), "qcow2"),
        image(
            "truncated",
            images.route("/short", Reply::File(ipxe.to_owned(), Delivery::Short)),
            &own("short"),
            "qcow2",
        ),
        image("wrong-sum", file("/sum.qcow2"), &own("sum"), "qcow2"),
        image(
            "wrong-format",
            images.route("/raw.img", Reply::File(raw.clone(), Delivery::Whole)),
            &sha256_file(&raw),
            "qcow2",
        ),
        image(
            "missing-file",
            "file:///nonexistent/image.qcow2".into(),
            &own("file"),
            "qcow2",
        ),
        image(
            "unreachable",
            "http://127.0.0.1:1/image.qcow2".into(),
            &own("closed"),
            "qcow2",
        ),
        image(
            "slow",
            images.route(
                "/slow",
                Reply::File(
                    padded.clone(),
                    Delivery::Slow {
                        chunk: 16 * 1024,
                        pause: Duration::from_millis(100),
                    },
                ),
            ),
            &sha256_file(&padded),
            "qcow2",
        ),
    ]
    .concat();
    format!(
        "hosts:\n{hosts}machineTypes:\n  tiny: {{vcpus: 1, memoryMiB: 128, diskGiB: 1}}\nimages:\n{images_yaml}transport:\n  defaultCallTimeout: 60s\n"
    )
}

async fn client(served: &ServedAgent) -> ProviderClient<Channel> {
    ProviderClient::connect(served.endpoint()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_reason_reaches_the_wire() {
    let host = GuestHost::start();
    let dir = tempfile::tempdir().unwrap();
    let ipxe = ipxe_qcow2(dir.path());
    let images = HttpServer::start();
    let config_path = dir.path().join("agent.yaml");
    let known_hosts = KnownHosts::write(&host, dir.path());
    std::fs::write(&config_path, config(&host, &images, &ipxe, &known_hosts)).unwrap();
    let served = ServedAgent::start_with(&config_path, "127.0.0.1:0", |command| {
        command.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    })
    .unwrap();
    // The agent checked every host's key at start; then the hypervisor's key is removed
    // from one known_hosts, as an operator cleaning up the file might.
    std::fs::write(&known_hosts.forgotten, "").unwrap();
    let mut client = client(&served).await;
    let mut seen = Seen::default();
    let minute = Duration::from_secs(60);

    // The request itself.
    let mut bad = create("", "hv1", "ipxe");
    bad.key.clear();
    seen.expect(
        "an empty key",
        client.create_instance(with_deadline(bad, minute)).await,
        "INVALID_ARGUMENT",
    );
    let mut bad_cloud_config = create("bad-cloud-config", "hv1", "ipxe");
    bad_cloud_config.cloud_init = Some(pb::CloudInit {
        user_data: b"#cloud-config\npackages: [\n".to_vec(),
        vendor_data: None,
    });
    seen.expect(
        "a #cloud-config that does not parse",
        client
            .create_instance(with_deadline(bad_cloud_config, minute))
            .await,
        "INVALID_CLOUD_CONFIG",
    );

    // Reaching the hypervisor.
    for (host_name, reason) in [
        ("unknown-key", "SSH_HOST_KEY_UNKNOWN"),
        ("changed-key", "SSH_HOST_KEY_CHANGED"),
        ("wrong-key", "SSH_AUTH_REJECTED"),
        ("no-libvirtd", "LIBVIRT_FORWARD_REFUSED"),
        ("closed-port", "HOST_UNREACHABLE"),
    ] {
        let request = pb::GetInstanceRequest {
            id: format!("{host_name}/some-key"),
        };
        seen.expect(
            host_name,
            client.get_instance(with_deadline(request, minute)).await,
            reason,
        );
    }
    // Each failed dial doubles the wait before the next one (100 ms first). A call whose
    // deadline ends before the next dial is due is told when to come back.
    let mut backing_off = None;
    for _ in 0..10 {
        let request = pb::GetInstanceRequest {
            id: "closed-port/some-key".into(),
        };
        let status = client
            .get_instance(with_deadline(request, Duration::from_millis(300)))
            .await
            .unwrap_err();
        match reason_of(&status).as_str() {
            "SSH_BACKING_OFF" => {
                backing_off = Some(status);
                break;
            }
            "HOST_UNREACHABLE" => {}
            other => panic!("a call to a host that keeps failing: {other}: {status:?}"),
        }
    }
    seen.expect(
        "a short call to a host whose redial is not due",
        Err::<(), _>(backing_off.expect("ten failed dials in a row back off")),
        "SSH_BACKING_OFF",
    );

    // An id naming a host the agent does not have: not "not found", since the host may
    // have been removed from the config with its VMs still running.
    let request = pb::GetInstanceRequest {
        id: "retired-host/some-key".into(),
    };
    seen.expect(
        "Get of an id on a host the config does not have",
        client.get_instance(with_deadline(request, minute)).await,
        "HOST_NOT_CONFIGURED",
    );

    // Instances.
    let request = pb::GetInstanceRequest {
        id: "hv1/never-created".into(),
    };
    seen.expect(
        "Get of a key never created",
        client.get_instance(with_deadline(request, minute)).await,
        "INSTANCE_NOT_FOUND",
    );
    let made = client
        .create_instance(with_deadline(create("spec", "hv1", "ipxe"), minute))
        .await
        .expect("Create on a working host");
    let mut other_port = create("spec", "hv1", "ipxe");
    other_port.proxy_port = 8080;
    seen.expect(
        "the same key with another proxy port",
        client
            .create_instance(with_deadline(other_port, minute))
            .await,
        "SPEC_MISMATCH",
    );
    let id = made.into_inner().instance.unwrap().id;
    // The instance has no tags; a caller that read some is stale.
    let stale = pb::UpdateInstanceTagsRequest {
        id: id.clone(),
        expected_tags: [("owner".to_owned(), "someone".to_owned())].into(),
        tags: [("owner".to_owned(), "me".to_owned())].into(),
    };
    seen.expect(
        "a tag update whose expected tags are not the instance's",
        client
            .update_instance_tags(with_deadline(stale, minute))
            .await,
        "TAGS_CHANGED",
    );
    client
        .delete_instance(with_deadline(pb::DeleteInstanceRequest { id }, minute))
        .await
        .unwrap();
    let mut holder = create("held-1", "hv1", "ipxe");
    holder.address_identity = Some("wire-identity".into());
    let held = client
        .create_instance(with_deadline(holder, minute))
        .await
        .expect("Create with an address identity");
    let mut second = create("held-2", "hv1", "ipxe");
    second.address_identity = Some("wire-identity".into());
    seen.expect(
        "a second key with an identity whose instance exists",
        client.create_instance(with_deadline(second, minute)).await,
        "ADDRESS_IDENTITY_IN_USE",
    );
    let id = held.into_inner().instance.unwrap().id;
    client
        .delete_instance(with_deadline(pb::DeleteInstanceRequest { id }, minute))
        .await
        .unwrap();
    let foreign = dir.path().join("foreign.xml");
    std::fs::write(
        &foreign,
        "<domain type='qemu'><name>egressproxy-taken</name><memory unit='MiB'>64</memory>\
         <os><type arch='x86_64'>hvm</type></os></domain>",
    )
    .unwrap();
    let defined = Command::new("virsh")
        .args(["-c", &host.libvirtd.uri(), "define"])
        .arg(&foreign)
        .output()
        .unwrap();
    assert!(defined.status.success(), "{defined:?}");
    seen.expect(
        "a key whose domain name a domain not made by the agent has",
        client
            .create_instance(with_deadline(create("taken", "hv1", "ipxe"), minute))
            .await,
        "DOMAIN_NAME_TAKEN",
    );

    // The host's own objects.
    seen.expect(
        "a storage pool that does not exist",
        client
            .create_instance(with_deadline(create("no-pool", "no-pool", "ipxe"), minute))
            .await,
        "LIBVIRT_OBJECT_MISSING",
    );
    let request = pb::ValidatePlacementRequest {
        placement: Some(placement("no-network", "ipxe")),
    };
    seen.expect(
        "ValidatePlacement of a host whose network does not exist",
        client
            .validate_placement(with_deadline(request, minute))
            .await,
        "HOST_NOT_READY",
    );

    seen.expect(
        "a Create on a host set to KVM, which it does not have",
        client
            .create_instance(with_deadline(create("kvm", "kvm-only", "ipxe"), minute))
            .await,
        "LIBVIRT_REJECTED",
    );
    seen.expect(
        "a Create on a host at its instance limit",
        client
            .create_instance(with_deadline(create("no-room", "full", "ipxe"), minute))
            .await,
        "CAPACITY_EXHAUSTED",
    );
    // Images.
    for (image, reason) in [
        ("not-found", "IMAGE_NOT_FOUND"),
        ("forbidden", "IMAGE_FORBIDDEN"),
        ("teapot", "IMAGE_HTTP_ERROR"),
        ("missing-file", "IMAGE_URL_INVALID"),
        ("server-error", "IMAGE_SERVER_ERROR"),
        ("unreachable", "IMAGE_UNREACHABLE"),
        ("truncated", "IMAGE_TRUNCATED"),
        ("wrong-sum", "IMAGE_CHECKSUM_MISMATCH"),
        ("wrong-format", "IMAGE_FORMAT_MISMATCH"),
    ] {
        let request = create(&format!("image-{image}"), "hv1", image);
        seen.expect(
            image,
            client.create_instance(with_deadline(request, minute)).await,
            reason,
        );
    }
    // A download longer than the caller's deadline goes on; the caller hears when to
    // come back, and a second caller of the same key waits for the first.
    let slow = || create("slow", "hv1", "slow");
    seen.expect(
        "a Create whose image downloads longer than its deadline",
        client
            .create_instance(with_deadline(slow(), Duration::from_secs(2)))
            .await,
        "IMAGE_DOWNLOADING",
    );
    // A long Create holds the key while it waits for the download; short Creates of the
    // same key then hear that another one runs. Which call the agent takes first is not
    // up to the client: a short call that got the key first hears IMAGE_DOWNLOADING and
    // the next one finds the long call holding it.
    let mut holder = client.clone();
    let long = tokio::spawn(async move {
        holder
            .create_instance(with_deadline(slow(), Duration::from_secs(20)))
            .await
    });
    let mut racing = Err(tonic::Status::unknown("no short Create was made"));
    for _ in 0..10 {
        racing = client
            .create_instance(with_deadline(slow(), Duration::from_millis(500)))
            .await;
        match &racing {
            Err(status) if reason_of(status) == "IMAGE_DOWNLOADING" => continue,
            _ => break,
        }
    }
    long.abort();
    seen.expect(
        "a Create of a key another Create holds",
        racing,
        "CREATE_IN_PROGRESS",
    );

    // A hung hypervisor: the agent answers by the caller's deadline.
    let mut host = host;
    host.libvirtd.pause().unwrap();
    let request = pb::GetInstanceRequest {
        id: "hv1/frozen".into(),
    };
    let hung = client
        .get_instance(with_deadline(request, Duration::from_secs(2)))
        .await;
    host.libvirtd.resume().unwrap();
    seen.expect("a call to a hung libvirtd", hung, "LIBVIRT_DEADLINE");
    // The agent goes before the hypervisor's sshd and its key files.
    drop(served);

    let documented = documented_reasons();
    let exempt: BTreeSet<String> = NOT_ON_DEMAND.iter().map(|(r, _)| (*r).to_owned()).collect();
    let covered: BTreeSet<String> = seen.0.union(&exempt).cloned().collect();
    assert_eq!(
        documented, covered,
        "the documented reasons and those produced here (or listed as not on demand) differ"
    );
    assert!(
        seen.0.is_disjoint(&exempt),
        "produced on the wire, yet listed as not on demand: {:?}",
        seen.0.intersection(&exempt).collect::<Vec<_>>()
    );
}
