//! An instance's life: idempotent and conflicting Creates, RUNNING with addresses,
//! echoed fields, ValidatePlacement, Deletes, and a key used again after its instance
//! is gone.

use std::net::IpAddr;
use std::time::Instant;

use tonic::Code;

use super::errors::bad_request_fields;
use super::{Checked, POLL_INTERVAL, Suite, expect_code};
use crate::ProviderError;
use crate::conformance::{Outcome, TAG, describe};
use crate::pb::{self, InstanceState};
use crate::validation::MAX_ID_BYTES;

/// Most addresses an instance reports.
const MAX_ADDRESSES: usize = 16;
/// Longest address text (an IPv6 address with a zone fits).
const MAX_ADDRESS_BYTES: usize = 64;
/// Longest state message and ValidatePlacement warning.
const MAX_MESSAGE_BYTES: usize = 1024;
/// Most ValidatePlacement warnings.
const MAX_WARNINGS: usize = 16;

/// What in `instance` is over the contract's response limits, if anything.
fn over_limits(instance: &pb::Instance) -> Option<String> {
    if instance.id.is_empty() || instance.id.len() > MAX_ID_BYTES {
        return Some(format!(
            "an id of {} bytes (1 to {MAX_ID_BYTES})",
            instance.id.len()
        ));
    }
    if instance.state_message.len() > MAX_MESSAGE_BYTES {
        return Some(format!(
            "a {}-byte state_message",
            instance.state_message.len()
        ));
    }
    if instance.addresses.len() > MAX_ADDRESSES
        || instance
            .addresses
            .iter()
            .any(|a| a.address.len() > MAX_ADDRESS_BYTES)
    {
        return Some(format!(
            "{} addresses (at most {MAX_ADDRESSES}, each at most {MAX_ADDRESS_BYTES} bytes)",
            instance.addresses.len()
        ));
    }
    None
}

impl Suite<'_> {
    pub(super) async fn create_idempotent(&mut self) -> Checked {
        // Unset cloud_init first, then an empty one: the same input. Another name and
        // one more tag are not compared, and do not change the instance.
        let mut request = self.request("idempotent");
        request.cloud_init = None;
        let first = self.create(request.clone()).await?;
        request.cloud_init = Some(pb::CloudInit::default());
        request.name = "conformance/renamed".into();
        request
            .tags
            .insert("egressproxy.dev/added".into(), "later".into());
        let second = self.create_raw(request).await.map_err(|status| {
            Outcome::fail(
                "a repeated Create with an empty cloud_init (the first had none), another name and another tag returns the instance",
                describe::status(&status),
            )
        })?;
        if first.id.is_empty() || first.id != second.id {
            return Err(Outcome::fail(
                "a repeated Create with the same key and spec returns the same instance id",
                format!("ids {:?} then {:?}", first.id, second.id),
            ));
        }
        if second.name != first.name || second.tags != first.tags {
            return Err(Outcome::fail(
                "the repeated Create returns the instance unchanged (name and tags as first created)",
                format!(
                    "name {:?} then {:?}; {}",
                    first.name,
                    second.name,
                    describe::instance(&second)
                ),
            ));
        }
        if first.create_time.is_none() {
            return Err(Outcome::fail("create_time set", describe::instance(&first)));
        }
        Ok(())
    }

    pub(super) async fn create_conflict(&mut self) -> Checked {
        let first = self.create(self.request("conflict")).await?;
        let mut cases = Vec::new();
        let mut request = self.request("conflict");
        request.proxy_port = 3129;
        cases.push(("another proxy_port", request));
        // Without cloud-init, other user-data is refused as such (limits-at-boundary
        // checks that), never compared.
        if self.target.cloud_init {
            let mut request = self.request("conflict");
            if let Some(cloud_init) = request.cloud_init.as_mut() {
                cloud_init.user_data.extend_from_slice(b"\n# changed\n");
            }
            cases.push(("another cloud_init.user_data", request));
            // An unset vendor_data is no vendor-data at all; an empty one is a document
            // that says nothing. Only a provider that takes vendor-data compares them.
            if self
                .capabilities()
                .await?
                .contains(&pb::Capability::VendorData)
            {
                let mut request = self.request("conflict");
                if let Some(cloud_init) = request.cloud_init.as_mut() {
                    cloud_init.vendor_data = Some(Vec::new());
                }
                cases.push((
                    "an empty cloud_init.vendor_data where the first left it unset",
                    request,
                ));
            }
        }
        // The placement is compared as requested: asking for the location the provider
        // chose is another request than leaving the choice to it (and the reverse).
        let mut request = self.request("conflict");
        let placement = request
            .placement
            .as_mut()
            .expect("the suite sets a placement");
        let as_requested = placement.location.take();
        if as_requested.is_none() {
            placement.location = first.placement.as_ref().and_then(|p| p.location.clone());
        }
        if placement.location != as_requested {
            cases.push((
                "the location named instead of left to the provider (or the reverse)",
                request,
            ));
        }
        // Another machine type or image the provider offers there: a valid request, so
        // the only answer is the taken key's.
        let (other_machine_type, other_image) = self.other_offers().await?;
        if let Some(machine_type) = other_machine_type {
            let mut request = self.request("conflict");
            if let Some(placement) = request.placement.as_mut() {
                placement.machine_type = machine_type;
            }
            cases.push(("another placement.machine_type", request));
        }
        if let Some(image) = other_image {
            let mut request = self.request("conflict");
            if let Some(placement) = request.placement.as_mut() {
                placement.image = image;
            }
            cases.push(("another placement.image", request));
        }
        for (what, request) in cases {
            let result = self.create_raw(request).await;
            expect_code(
                result,
                Code::AlreadyExists,
                &format!("Create of a taken key with {what}"),
            )?;
        }
        Ok(())
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
            if let Some(problem) = over_limits(instance) {
                return Err(Outcome::fail(
                    format!("{call} answers within the response limits"),
                    problem,
                ));
            }
            if instance.create_time.is_none() || instance.create_time != created.create_time {
                return Err(Outcome::fail(
                    format!("{call} reports the create_time Create reported"),
                    format!("{:?} then {:?}", created.create_time, instance.create_time),
                ));
            }
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
                    && match &requested.location {
                        Some(_) => placed.location == requested.location,
                        None => placed.location.is_some(),
                    }
            });
            if !same {
                return Err(Outcome::fail(
                    format!(
                        "{call} echoes the placement ({}), with the location it chose when none was requested",
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
        let requested = self.target.placement.clone();
        let valid = pb::ValidatePlacementRequest {
            placement: Some(requested.clone()),
        };
        let answer = self
            .retrying("ValidatePlacement", |mut client| {
                let valid = valid.clone();
                async move { client.validate_placement(valid).await }
            })
            .await
            .map_err(|status| {
                Outcome::fail(
                    "ValidatePlacement accepts the placement Create accepts",
                    describe::status(&status),
                )
            })?
            .into_inner();
        let resolved_ok = answer.resolved.as_ref().is_some_and(|resolved| {
            resolved.machine_type == requested.machine_type
                && resolved.image == requested.image
                && match &requested.location {
                    Some(_) => resolved.location == requested.location,
                    None => resolved.location.is_some(),
                }
        });
        if !resolved_ok {
            return Err(Outcome::fail(
                format!(
                    "ValidatePlacement's resolved placement: {}, with the location it would choose",
                    describe::placement(Some(&requested))
                ),
                describe::placement(answer.resolved.as_ref()),
            ));
        }
        if answer.warnings.len() > MAX_WARNINGS
            || answer.warnings.iter().any(|w| w.len() > MAX_MESSAGE_BYTES)
        {
            return Err(Outcome::fail(
                format!("at most {MAX_WARNINGS} warnings of at most {MAX_MESSAGE_BYTES} bytes"),
                format!("{} warnings", answer.warnings.len()),
            ));
        }
        let mut bad = self.target.placement.clone();
        bad.image = "no-such-image-0".into();
        let bad = pb::ValidatePlacementRequest {
            placement: Some(bad),
        };
        let result = self
            .retrying("ValidatePlacement", |mut client| {
                let bad = bad.clone();
                async move { client.validate_placement(bad).await }
            })
            .await;
        expect_code(
            result,
            Code::InvalidArgument,
            "ValidatePlacement of an unknown image",
        )?;
        let what = "ValidatePlacement without a placement";
        let result = self
            .retrying("ValidatePlacement", |mut client| async move {
                client
                    .validate_placement(pb::ValidatePlacementRequest { placement: None })
                    .await
            })
            .await;
        let status = expect_code(result, Code::InvalidArgument, what)?;
        if !bad_request_fields(&status).iter().any(|f| f == "placement") {
            return Err(Outcome::fail(
                format!("{what}: BadRequest with a field violation on placement"),
                describe::status(&status),
            ));
        }
        Ok(())
    }

    pub(super) async fn delete_twice_then_gone(&mut self) -> Checked {
        let mut request = self.request("deleted");
        let marker = (
            "egressproxy.dev/deleted".to_owned(),
            self.run_id().to_owned(),
        );
        request.tags.insert(marker.0.clone(), marker.1.clone());
        let id = self.create(request).await?.id;
        self.delete(&id).await?;
        self.delete(&id).await?;
        // While Get says DELETING, List shows the instance too, as DELETING.
        // (The check is over when the instance is gone before the list or after it.)
        if let Ok(instance) = self.get_raw(&id).await
            && instance.state() == InstanceState::Deleting
        {
            let mut selector = self.ledger.selector();
            selector.insert(marker.0, marker.1);
            let listed = self.list_in_pages_of(selector, 100).await?;
            let state = listed.iter().find(|i| i.id == id).map(|i| i.state());
            let still_deleting = self
                .get_raw(&id)
                .await
                .is_ok_and(|i| i.state() == InstanceState::Deleting);
            if state != Some(InstanceState::Deleting) && still_deleting {
                return Err(Outcome::fail(
                    format!("{id}, DELETING by GetInstance, listed as DELETING until it is gone"),
                    match state {
                        Some(state) => format!("listed as {}", describe::state(state as i32)),
                        None => "not listed".into(),
                    },
                ));
            }
        }
        self.wait_gone(&id).await
    }

    pub(super) async fn key_reuse_after_delete(&mut self) -> Checked {
        let request = self.request("reused");
        let first = self.create(request.clone()).await?;
        self.delete(&first.id).await?;
        let expected = "Create of a key whose instance was just deleted: UNAVAILABLE with reason KEY_BEING_DELETED while it is DELETING, then a new instance";
        let deadline = Instant::now() + self.target.running_timeout;
        let second = loop {
            let status = match self.create_once(request.clone()).await {
                Ok(instance) => break instance,
                Err(status) => status,
            };
            let error = ProviderError::from_status(&status);
            let deleting = self
                .get_raw(&first.id)
                .await
                .is_ok_and(|i| i.state() == InstanceState::Deleting);
            let fine = match status.code() {
                Code::Unavailable if deleting => error.reason == "KEY_BEING_DELETED",
                _ => error.class.is_retryable(),
            };
            if !fine || Instant::now() > deadline {
                return Err(Outcome::fail(
                    expected,
                    format!(
                        "{} (the old instance {})",
                        describe::status(&status),
                        if deleting { "DELETING" } else { "not DELETING" }
                    ),
                ));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        };
        let newer = match (&first.create_time, &second.create_time) {
            (Some(old), Some(new)) => (new.seconds, new.nanos) >= (old.seconds, old.nanos),
            _ => false,
        };
        if second.state() == InstanceState::Deleting || !newer {
            return Err(Outcome::fail(
                format!("{expected} (not DELETING, created no earlier than the old one)"),
                describe::instance(&second),
            ));
        }
        Ok(())
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
