//! A Proxy spec's cloud-init input, read when an instance is about to be created (a
//! Proxy's, or a pool's spare made from its template).

use egressproxy_provider::pb;
use egressproxy_provider::validation::MAX_USER_DATA_BYTES;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use crate::crd::ProxySpec;
use crate::shared::error::{Error, Result};

/// The cloud-init input for a new instance of `spec` in `namespace`: inline, or read
/// from its Secret.
pub async fn read(
    client: &kube::Client,
    namespace: &str,
    spec: &ProxySpec,
) -> Result<pb::CloudInit> {
    let Some(spec) = &spec.cloud_init else {
        return Ok(pb::CloudInit::default());
    };
    let user_data = match (&spec.user_data, &spec.user_data_secret_ref) {
        (Some(inline), _) => inline.clone().into_bytes(),
        (None, Some(reference)) => {
            let secret_name = format!("{namespace}/{}", reference.name);
            let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
            let secret =
                secrets
                    .get_opt(&reference.name)
                    .await?
                    .ok_or_else(|| Error::CloudInitSecret {
                        secret: secret_name.clone(),
                        problem:
                            "not found: create it, or fix spec.cloudInit.userDataSecretRef.name"
                                .into(),
                    })?;
            let value = secret
                .data
                .as_ref()
                .and_then(|data| data.get(&reference.key));
            let user_data =
                value
                    .map(|bytes| bytes.0.clone())
                    .ok_or_else(|| Error::CloudInitSecret {
                        secret: secret_name.clone(),
                        problem: format!(
                            "has no key {:?}: fix spec.cloudInit.userDataSecretRef.key",
                            reference.key
                        ),
                    })?;
            // Inline user-data is checked at admission; a Secret's only here, and
            // the error names the Secret, which a person fixes without touching
            // the Proxy.
            if user_data.len() > MAX_USER_DATA_BYTES {
                return Err(Error::CloudInitSecret {
                    secret: secret_name,
                    problem: format!(
                        "key {:?} holds {} bytes of user-data, over the {MAX_USER_DATA_BYTES}-byte limit: \
                             move large files into the image or fetch them at boot",
                        reference.key,
                        user_data.len()
                    ),
                });
            }
            user_data
        }
        (None, None) => Vec::new(),
    };
    Ok(pb::CloudInit {
        user_data,
        vendor_data: spec.vendor_data.clone().map(String::into_bytes),
    })
}
