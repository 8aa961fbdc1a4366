//! The contract on the wire, seen by an independent C-core client (Python grpcio,
//! descriptors from reflection only): an error that echoes a huge input still arrives
//! as its own code with its ErrorInfo, not as RESOURCE_EXHAUSTED because the status
//! outgrew the client's 16 KiB metadata limit (which the contract says to retry).

use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_integration::tools::run_python_json;

#[test]
fn a_four_thousand_character_id_is_not_found_not_resource_exhausted() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let id = "x".repeat(4000);
    for call in ["GetInstance", "DeleteInstance"] {
        let answer = run_python_json("wire_client.py", &[provider.address(), call, &id]).unwrap();
        let expected = if call == "GetInstance" {
            "NOT_FOUND"
        } else {
            "OK"
        };
        assert_eq!(answer["code"], expected, "{call}: {answer}");
        if call == "GetInstance" {
            assert_eq!(answer["domain"], "egressproxy.dev", "{answer}");
            assert_eq!(answer["reason"], "NOT_FOUND", "{answer}");
            let length = answer["message_len"].as_u64().unwrap();
            assert!(length <= 1024, "{length}-character message: {answer}");
        }
    }
}
