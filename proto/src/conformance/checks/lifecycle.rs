//! An instance's life: idempotent and conflicting Creates, RUNNING with addresses,
//! echoed fields, ValidatePlacement, and Deletes.

use std::net::IpAddr;

use tonic::Code;

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe};
use crate::pb::{self, InstanceState};

impl Suite<'_> {
    pub(super) async fn create_idempotent(&mut self) -> Checked {
        let first = self.create(self.request("idempotent")).await?;
        let second = self.create(self.request("idempotent")).await?;
        if first.id.is_empty() || first.id != second.id {
            return Err(Outcome::fail(
                "a repeated Create with the same key and spec returns the same instance id",
                format!("ids {:?} then {:?}", first.id, second.id),
            ));
        }
        if first.create_time.is_none() {
            return Err(Outcome::fail("create_time set", describe::instance(&first)));
        }
        Ok(())
    }

    pub(super) async fn create_conflict(&mut self) -> Checked {
        self.create(self.request("conflict")).await?;
        let mut conflicting = self.request("conflict");
        conflicting.proxy_port = 3129;
        let result = self.create_raw(conflicting).await;
        expect_code(
            result,
            Code::AlreadyExists,
            "Create of a taken key with another proxy_port",
        )
        .map(|_| ())
    }

    pub(super) async fn becomes_running(&mut self) -> Checked {
        self.running_instance().await.map(|_| ())
    }

    pub(super) async fn addresses_parse(&mut self) -> Checked {
        let instance = self.running_instance().await?;
        let capabilities = self.capabilities().await?;
        let mut seen_external = false;
        for address in &instance.addresses {
            let scope = address.scope();
            let undeclared = match (address.family(), scope) {
                (pb::IpFamily::V6, _) if !capabilities.contains(&pb::Capability::Ipv6) => {
                    Some("CAPABILITY_IPV6")
                }
                (_, pb::AddressScope::External)
                    if !capabilities.contains(&pb::Capability::ExternalAddresses) =>
                {
                    Some("CAPABILITY_EXTERNAL_ADDRESSES")
                }
                _ => None,
            };
            if let Some(capability) = undeclared {
                return Err(Outcome::fail(
                    format!("no such address without {capability}"),
                    format!("address {:?} ({})", address.address, scope.as_str_name()),
                ));
            }
            if scope == pb::AddressScope::Internal && seen_external {
                return Err(Outcome::fail(
                    "INTERNAL addresses before EXTERNAL ones (callers use the first INTERNAL)",
                    format!(
                        "INTERNAL address {:?} after an EXTERNAL one",
                        address.address
                    ),
                ));
            }
            seen_external |= scope == pb::AddressScope::External;
            let family = address.family();
            let parsed: Option<IpAddr> = address.address.parse().ok();
            let fits = match (parsed, family) {
                (Some(ip), pb::IpFamily::V4) => ip.is_ipv4(),
                (Some(ip), pb::IpFamily::V6) => ip.is_ipv6(),
                _ => false,
            };
            if !fits || parsed.is_some_and(|ip| ip.is_unspecified()) {
                return Err(Outcome::fail(
                    "every address is an IP address of its stated family (V4 or V6), not unspecified",
                    format!(
                        "address {:?} with family {}",
                        address.address,
                        family.as_str_name()
                    ),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn echo(&mut self) -> Checked {
        let mut request = self.request("echo");
        request.proxy_port = 3130;
        request
            .tags
            .insert("egressproxy.dev/echo".into(), "yes".into());
        let created = self.create(request.clone()).await?;
        let got = self.get(&created.id).await?;
        for (call, instance) in [("CreateInstance", &created), ("GetInstance", &got)] {
            let expected = |what: &str| format!("{call} echoes the requested {what}");
            if instance.key != request.key || instance.name != request.name {
                return Err(Outcome::fail(
                    expected("key and name"),
                    format!("key {:?}, name {:?}", instance.key, instance.name),
                ));
            }
            if instance.proxy_port != request.proxy_port {
                return Err(Outcome::fail(
                    expected("proxy_port 3130"),
                    describe::instance(instance),
                ));
            }
            if instance.tags != request.tags {
                return Err(Outcome::fail(
                    expected("tags, exactly"),
                    describe::instance(instance),
                ));
            }
            let requested = request.placement.as_ref();
            let placed = instance.placement.as_ref();
            let same = placed.is_some_and(|placed| {
                let requested = requested.expect("the suite sets a placement");
                placed.machine_type == requested.machine_type
                    && placed.image == requested.image
                    && (requested.location.is_none() || placed.location == requested.location)
            });
            if !same {
                return Err(Outcome::fail(
                    format!(
                        "{call} echoes the placement ({})",
                        describe::placement(requested)
                    ),
                    describe::placement(placed),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn validate_placement(&mut self) -> Checked {
        let capabilities = self.capabilities().await?;
        if !capabilities.contains(&pb::Capability::ValidatePlacement) {
            return Err(Outcome::Skip(
                "the provider does not declare CAPABILITY_VALIDATE_PLACEMENT".into(),
            ));
        }
        let valid = pb::ValidatePlacementRequest {
            placement: Some(self.target.placement.clone()),
        };
        self.client
            .validate_placement(valid)
            .await
            .map_err(|status| {
                Outcome::fail(
                    "ValidatePlacement accepts the placement Create accepts",
                    describe::status(&status),
                )
            })?;
        let mut bad = self.target.placement.clone();
        bad.image = "no-such-image-0".into();
        let result = self
            .client
            .validate_placement(pb::ValidatePlacementRequest {
                placement: Some(bad),
            })
            .await;
        expect_code(
            result,
            Code::InvalidArgument,
            "ValidatePlacement of an unknown image",
        )
        .map(|_| ())
    }

    pub(super) async fn delete_twice_then_gone(&mut self) -> Checked {
        let id = self.create(self.request("deleted")).await?.id;
        self.delete(&id).await?;
        self.delete(&id).await?;
        self.wait_gone(&id).await
    }

    pub(super) async fn delete_missing(&mut self) -> Checked {
        let missing = format!("missing-{}", self.run_id());
        self.delete(&missing).await
    }

    pub(super) async fn delete_while_provisioning(&mut self) -> Checked {
        let instance = self.create(self.request("early-delete")).await?;
        self.delete(&instance.id).await?;
        self.wait_gone(&instance.id).await
    }

    pub(super) async fn foreign_instance_survives(&mut self) -> Checked {
        let Some(id) = self.bystander.clone() else {
            return Err(Outcome::fail(
                "the bystander instance planted at the start of the run exists",
                "its Create failed",
            ));
        };
        let result = self.get_raw(&id).await;
        match result {
            Ok(instance) if instance.state() != InstanceState::Deleting => {}
            Ok(instance) => {
                return Err(Outcome::fail(
                    "an instance nobody deleted is still there after the other checks' Deletes",
                    describe::instance(&instance),
                ));
            }
            Err(status) => {
                return Err(Outcome::fail(
                    "an instance nobody deleted is still there after the other checks' Deletes",
                    describe::status(&status),
                ));
            }
        }
        let listed = self.list(self.ledger.selector()).await?;
        if !listed
            .iter()
            .any(|i| i.id == id && i.tags.contains_key(TAG))
        {
            return Err(Outcome::fail(
                "ListInstances by the run's tag still lists the untouched instance",
                format!("{} instances without {id}", listed.len()),
            ));
        }
        Ok(())
    }
}
