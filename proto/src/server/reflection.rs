//! What gRPC server reflection serves: the contract, health, reflection itself, and
//! the `google.rpc` error detail types, so that tools without the project's protos
//! (`grpcurl`, a Python client) decode an error's ErrorInfo, BadRequest and RetryInfo.

use prost::Message;
use prost_types::FileDescriptorSet;

use crate::pb;

/// `google/rpc/status.proto` and `google/rpc/error_details.proto` (with their
/// `google/protobuf` imports), under the paths every other language's generated code
/// uses. tonic-types ships them compiled from the bare names `status.proto` and
/// `error_details.proto`; a client that asks for the canonical path would miss them.
pub(crate) fn google_rpc_files() -> FileDescriptorSet {
    let mut set = FileDescriptorSet::decode(tonic_types::pb::FILE_DESCRIPTOR_SET)
        .expect("tonic-types ships a valid descriptor set");
    for file in &mut set.file {
        if let Some(name) = file.name.as_mut()
            && !name.contains('/')
        {
            *name = format!("google/rpc/{name}");
        }
    }
    set
}

/// A reflection builder that knows every file the scaffold serves (the google.rpc
/// error types only with `error_types`, which only a misbehaving test server leaves
/// out).
pub(crate) fn builder(error_types: bool) -> tonic_reflection::server::Builder<'static> {
    let builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET);
    if error_types {
        builder.register_file_descriptor_set(google_rpc_files())
    } else {
        builder
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn google_rpc_files_have_their_canonical_paths() {
        let names: Vec<_> = google_rpc_files()
            .file
            .into_iter()
            .filter_map(|file| file.name)
            .collect();
        for expected in ["google/rpc/status.proto", "google/rpc/error_details.proto"] {
            assert!(names.iter().any(|name| name == expected), "{names:?}");
        }
    }
}
