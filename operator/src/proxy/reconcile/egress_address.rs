//! The address fields of a Create: which identity holds the VM's address, and which
//! address the user asked for.
//!
//! The identity is the Proxy's UID, so every VM of one Proxy (each replacement too)
//! gets the same address from a provider that keeps addresses for an identity, and a
//! partner's allow-list keeps matching. It is sent only to providers that declare
//! `CAPABILITY_ADDRESS_IDENTITY`: older ones ignore it and newer ones refuse it.
//! `spec.egress.address` asks for one specific address and needs
//! `CAPABILITY_REQUESTED_ADDRESS`; without it the Proxy fails on its spec instead of
//! silently getting some other address.

use std::net::IpAddr;

use egressproxy_provider::pb;

use crate::crd::Egress;
use crate::shared::error::{Error, Result};

const FIELD: &str = "spec.egress.address";

/// `address_identity` and `requested_address` for a Create of the Proxy with `uid`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct AddressFields {
    pub identity: Option<String>,
    pub requested: Option<String>,
}

/// What a Create carries, given the provider's `capabilities`.
pub(super) fn address_fields(
    capabilities: &[pb::Capability],
    provider: &str,
    uid: &str,
    egress: Option<&Egress>,
) -> Result<AddressFields> {
    let keeps_addresses = capabilities.contains(&pb::Capability::AddressIdentity);
    let requested = match egress.and_then(|egress| egress.address.as_deref()) {
        None => None,
        Some(text) => {
            let address: IpAddr = text.parse().map_err(|_| Error::UnsupportedSpec {
                field: FIELD,
                problem: format!(
                    "{text:?} is not an IP address: write one such as 192.168.200.50, or remove the field"
                ),
            })?;
            if !(keeps_addresses && capabilities.contains(&pb::Capability::RequestedAddress)) {
                return Err(Error::UnsupportedSpec {
                    field: FIELD,
                    problem: format!(
                        "provider {provider} cannot give a VM a chosen address (it does not declare CAPABILITY_REQUESTED_ADDRESS): remove the field, or use a provider that can"
                    ),
                });
            }
            Some(address.to_string())
        }
    };
    Ok(AddressFields {
        identity: keeps_addresses.then(|| uid.to_owned()),
        requested,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use pb::Capability::{AddressIdentity, RequestedAddress};

    fn asking(address: &str) -> Option<Egress> {
        Some(Egress {
            address: Some(address.to_owned()),
            ..Egress::default()
        })
    }

    fn fields(capabilities: &[pb::Capability], egress: Option<Egress>) -> Result<AddressFields> {
        address_fields(capabilities, "kvm", "uid-1", egress.as_ref())
    }

    #[test]
    fn the_identity_is_the_uid_only_for_providers_that_keep_addresses() {
        let cases: [(&[pb::Capability], Option<&str>); 3] = [
            (&[], None),
            (&[AddressIdentity], Some("uid-1")),
            (&[AddressIdentity, RequestedAddress], Some("uid-1")),
        ];
        for (capabilities, identity) in cases {
            assert_eq!(
                fields(capabilities, None).unwrap(),
                AddressFields {
                    identity: identity.map(str::to_owned),
                    requested: None
                },
                "{capabilities:?}"
            );
            let empty = Some(Egress::default());
            assert_eq!(fields(capabilities, empty).unwrap().requested, None);
        }
    }

    #[test]
    fn a_requested_address_is_sent_normalised_with_the_identity() {
        let sent = fields(
            &[AddressIdentity, RequestedAddress],
            asking("2001:DB8::0:1"),
        )
        .unwrap();
        assert_eq!(
            sent,
            AddressFields {
                identity: Some("uid-1".into()),
                requested: Some("2001:db8::1".into()),
            }
        );
    }

    #[test]
    fn a_requested_address_the_provider_cannot_honour_fails_on_the_field() {
        for capabilities in [&[][..], &[AddressIdentity], &[RequestedAddress]] {
            let error = fields(capabilities, asking("192.168.200.50")).unwrap_err();
            let message = error.to_string();
            assert!(
                message.starts_with("spec.egress.address: provider kvm cannot")
                    && message.contains("CAPABILITY_REQUESTED_ADDRESS"),
                "{message}"
            );
            assert!(error.is_permanent());
        }
    }

    #[test]
    fn a_requested_address_that_is_no_address_fails_on_the_field() {
        let error = fields(&[AddressIdentity, RequestedAddress], asking("10.0.0.300")).unwrap_err();
        assert_eq!(
            error.to_string(),
            "spec.egress.address: \"10.0.0.300\" is not an IP address: write one such as 192.168.200.50, or remove the field"
        );
        assert_eq!(error.reason(), "InvalidSpec");
    }
}
