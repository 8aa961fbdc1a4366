//! Compiles the contract with protox (a pure-Rust protobuf compiler, so no `protoc` is
//! needed) and generates the tonic/prost code plus the encoded file descriptor set that
//! gRPC server reflection serves.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "egressproxy/provider/v1/provider.proto",
    "egressproxy/reference/v1/control.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        .skip_protoc_run()
        // Every server method has a default that answers UNIMPLEMENTED, so a call added
        // in a minor version does not break the build of existing providers: they answer
        // it as the contract requires of a provider without its capability. ADR 0018.
        .generate_default_stubs(true)
        // cloud-init input may hold secrets: its Debug is written by hand and redacts.
        .skip_debug(["egressproxy.provider.v1.CloudInit"])
        .compile_fds(descriptors)?;
    Ok(())
}
