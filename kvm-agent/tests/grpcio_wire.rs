//! `kvm-agent serve` seen by an independent C-core client (Python grpcio, descriptors
//! from reflection only): errors that echo a huge id arrive with their own code and
//! ErrorInfo, never as RESOURCE_EXHAUSTED from an oversized status. No hypervisor is
//! needed: ids that cannot name an instance are answered before libvirt is reached.

use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_integration::tools::run_python_json;

fn serve(config: &std::path::Path) -> ServedAgent {
    ServedAgent::start(config).unwrap()
}

#[test]
fn a_four_thousand_character_id_keeps_its_code_and_error_info() {
    let work = tempfile::tempdir().unwrap();
    let config = work.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "hosts:\n\
             - name: hv1\n\
             \x20 local: true\n\
             \x20 libvirtSocket: {}/no-libvirt-here.sock\n\
             machineTypes:\n\
             \x20 tiny: {{vcpus: 1, memoryMiB: 128, diskGiB: 1}}\n\
             images:\n\
             \x20 ipxe:\n\
             \x20   url: http://127.0.0.1:9/ipxe.qcow2\n\
             \x20   sha256: {}\n\
             \x20   format: qcow2\n",
            work.path().display(),
            "0".repeat(64)
        ),
    )
    .unwrap();
    let served = serve(&config);
    let long = "k".repeat(4000);
    // No host part: cannot be an instance of this provider.
    let unknown =
        run_python_json("wire_client.py", &[served.address(), "GetInstance", &long]).unwrap();
    assert_eq!(unknown["code"], "NOT_FOUND", "{unknown}");
    // A known host with a key no instance can have: not found, or named invalid.
    let bad_key = format!("hv1/{long}");
    let on_host = run_python_json(
        "wire_client.py",
        &[served.address(), "GetInstance", &bad_key],
    )
    .unwrap();
    assert!(
        on_host["code"] == "NOT_FOUND" || on_host["code"] == "INVALID_ARGUMENT",
        "{on_host}"
    );
    for answer in [&unknown, &on_host] {
        assert_eq!(answer["domain"], "egressproxy.dev", "{answer}");
        let length = answer["message_len"].as_u64().unwrap();
        assert!(length <= 1024, "{length}-character message: {answer}");
    }
}
