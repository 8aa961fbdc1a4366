//! Address identities and requested addresses (since 1.4.0, behind
//! CAPABILITY_ADDRESS_IDENTITY and CAPABILITY_REQUESTED_ADDRESS): instances of one
//! identity get one primary address, one at a time, and it is released when the last
//! of them is gone; a requested address is granted exactly, or refused as taken or out
//! of range. A provider that does not declare a capability must refuse its field as
//! INVALID_ARGUMENT naming it, never ignore it.
//!
//! The checks need no configuration of the provider's ranges: an address inside one is
//! the address an identity was granted, requested again once it is released, and one
//! outside is taken from a documentation range no provider offers. Each check deletes
//! what it made and waits until it is gone, also when it fails, so no identity of the
//! run stays held.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Instant;

use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, POLL_INTERVAL, Suite, expect_code};
use crate::conformance::{Outcome, describe};
use crate::pb::{self, AddressScope};

impl Suite<'_> {
    pub(super) async fn address_identity(&mut self) -> Checked {
        if let Some(skip) = self.before_address_identities().await? {
            return Err(skip);
        }
        if !self
            .capabilities()
            .await?
            .contains(&pb::Capability::AddressIdentity)
        {
            let mut request = self.request("identity-undeclared");
            request.address_identity = Some(self.identity("undeclared"));
            let before = self.ledger.recorded();
            let result = self.refused_undeclared(request, "address_identity").await;
            return self.clean_up_since(before, result).await;
        }
        let before = self.ledger.recorded();
        let result = self.identity_holds_one_address().await;
        self.clean_up_since(before, result).await
    }

    pub(super) async fn requested_address(&mut self) -> Checked {
        if let Some(skip) = self.before_address_identities().await? {
            return Err(skip);
        }
        let capabilities = self.capabilities().await?;
        let identity = capabilities.contains(&pb::Capability::AddressIdentity);
        if !capabilities.contains(&pb::Capability::RequestedAddress) {
            let mut request = self.request("requested-undeclared");
            request.address_identity = Some(self.identity("requested-undeclared"));
            request.requested_address = Some(OUTSIDE_V4[0].into());
            let before = self.ledger.recorded();
            let result = self.refused_undeclared(request, "requested_address").await;
            return self.clean_up_since(before, result).await;
        }
        if !identity {
            return Err(Outcome::fail(
                "CAPABILITY_REQUESTED_ADDRESS declared with CAPABILITY_ADDRESS_IDENTITY (a requested address is held by an identity)",
                "CAPABILITY_REQUESTED_ADDRESS without CAPABILITY_ADDRESS_IDENTITY",
            ));
        }
        let before = self.ledger.recorded();
        let result = self.requested_address_granted_exactly().await;
        self.clean_up_since(before, result).await
    }

    /// A skip when the provider implements a contract from before address identities:
    /// such a provider does not know the fields, and ignores them as the contract
    /// allows.
    async fn before_address_identities(&mut self) -> Result<Option<Outcome>, Outcome> {
        let info = self
            .client
            .get_plugin_info(pb::GetPluginInfoRequest {})
            .await
            .map_err(|status| Outcome::fail("GetPluginInfo answers", describe::status(&status)))?
            .into_inner();
        let mut parts = info
            .contract_version
            .split(['.', '-', '+'])
            .map(|part| part.parse::<u64>().unwrap_or(0));
        let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        Ok((version < (1, 4)).then(|| {
            Outcome::Skip(format!(
                "the provider implements contract {}, from before address identities (1.4.0)",
                info.contract_version
            ))
        }))
    }

    /// An address identity of this run.
    pub(super) fn identity(&self, suffix: &str) -> String {
        format!("cf-{}-{suffix}", self.run_id())
    }

    /// Deletes every instance made since the ledger held `before` that is still
    /// recorded, and waits until each is gone, so that their identities are released.
    /// The check's own failure comes first; a failed cleanup fails a check that passed.
    async fn clean_up_since(&mut self, before: BTreeSet<String>, result: Checked) -> Checked {
        let made: BTreeSet<String> = self
            .ledger
            .recorded()
            .difference(&before)
            .cloned()
            .collect();
        let mut cleaned = Ok(());
        for id in made {
            let gone = match self.delete(&id).await {
                Ok(()) => self.wait_gone(&id).await,
                Err(failure) => Err(failure),
            };
            cleaned = cleaned.and(gone);
        }
        result.and(cleaned)
    }

    /// Without the field's capability, a Create with it is INVALID_ARGUMENT naming it.
    async fn refused_undeclared(
        &mut self,
        request: pb::CreateInstanceRequest,
        field: &str,
    ) -> Checked {
        let capability = match field {
            "address_identity" => "CAPABILITY_ADDRESS_IDENTITY",
            _ => "CAPABILITY_REQUESTED_ADDRESS",
        };
        let expected = format!(
            "Create with {field}, without {capability}: INVALID_ARGUMENT naming {field} (never ignored)"
        );
        let status = match self.create_once(request).await {
            Ok(instance) => {
                return Err(Outcome::fail(
                    expected,
                    format!(
                        "success ({}): the field is honoured without the capability, or ignored",
                        describe::instance(&instance)
                    ),
                ));
            }
            Err(status) => status,
        };
        // A reason of the field's own rules means the provider honours it.
        let honoured = matches!(
            reason(&status).as_deref(),
            Some("ADDRESS_NOT_IN_RANGE" | "ADDRESS_TAKEN" | "ADDRESS_IDENTITY_IN_USE")
        );
        if status.code() != Code::InvalidArgument || !names_field(&status, field) || honoured {
            return Err(Outcome::fail(expected, describe::status(&status)));
        }
        Ok(())
    }

    /// See [`Suite::address_identity`]: two identities get two addresses; a repeated
    /// Create compares the identity; a second instance of a held identity is refused
    /// while the first exists; once it is gone, the identity's next instance gets the
    /// address back.
    async fn identity_holds_one_address(&mut self) -> Checked {
        let (a, b) = (self.identity("addr-a"), self.identity("addr-b"));
        let mut first = self.request("addr-a1");
        first.address_identity = Some(a.clone());
        let first_instance = self.running_with_identity(first.clone()).await?;
        let held = primary_address(&first_instance)?;
        let mut other = self.request("addr-b1");
        other.address_identity = Some(b.clone());
        let other_held = primary_address(&self.running_with_identity(other).await?)?;
        if other_held == held {
            return Err(Outcome::fail(
                format!("identities {a} and {b}, both with a running instance, hold two addresses"),
                format!("both have {held}"),
            ));
        }

        let again = self.create_raw(first.clone()).await.map_err(|status| {
            Outcome::fail(
                "a repeated Create of a key with the same address_identity returns its instance",
                describe::status(&status),
            )
        })?;
        if again.id != first_instance.id {
            return Err(Outcome::fail(
                "a repeated Create of a key with the same address_identity returns the same instance",
                format!("ids {:?} then {:?}", first_instance.id, again.id),
            ));
        }
        let mut changed = first.clone();
        changed.address_identity = Some(b.clone());
        let mut unset = first.clone();
        unset.address_identity = None;
        for (what, request) in [("another address_identity", changed), ("none", unset)] {
            let result = self.create_raw(request).await;
            expect_code(
                result,
                Code::AlreadyExists,
                &format!(
                    "Create of key {} (made with address_identity {a}) with {what}",
                    first.key
                ),
            )?;
        }

        let mut second = self.request("addr-a2");
        second.address_identity = Some(a.clone());
        let expected = format!(
            "Create of a new key with address_identity {a}, while its instance {} runs: \
             UNAVAILABLE with reason ADDRESS_IDENTITY_IN_USE (two instances with one address \
             would take each other's traffic)",
            first_instance.id
        );
        match self.create_once(second.clone()).await {
            Ok(instance) => {
                return Err(Outcome::fail(
                    expected,
                    format!("success: {}", describe::instance(&instance)),
                ));
            }
            Err(status)
                if status.code() != Code::Unavailable
                    || reason(&status).as_deref() != Some("ADDRESS_IDENTITY_IN_USE") =>
            {
                return Err(Outcome::fail(expected, describe::status(&status)));
            }
            Err(_) => {}
        }

        self.delete(&first_instance.id).await?;
        self.wait_gone(&first_instance.id).await?;
        let replacement = self
            .create_after_release(
                second,
                &format!(
                    "Create of a new key with address_identity {a}, once its last instance is gone (NOT_FOUND), succeeds"
                ),
            )
            .await?;
        let replacement = self.wait_running(&replacement.id).await?;
        let got = primary_address(&replacement)?;
        if got != held {
            return Err(Outcome::fail(
                format!(
                    "the next instance of address_identity {a} gets its address {held} again (no other instance holds it)"
                ),
                format!("{got}: {}", describe::instance(&replacement)),
            ));
        }
        Ok(())
    }

    /// See [`Suite::requested_address`]: an address held by another identity is refused
    /// as taken, one outside every range as not in range, and the same address, once
    /// released, is granted exactly.
    async fn requested_address_granted_exactly(&mut self) -> Checked {
        let (c, d) = (self.identity("addr-c"), self.identity("addr-d"));
        let mut holder = self.request("addr-c1");
        holder.address_identity = Some(c.clone());
        let holder = self.running_with_identity(holder).await?;
        let held = primary_address(&holder)?;

        let mut request = self.request("addr-d1");
        request.address_identity = Some(d.clone());
        request.requested_address = Some(held.to_string());
        let expected = format!(
            "Create with requested_address {held}, which instance {} of identity {c} holds: \
             ALREADY_EXISTS with reason ADDRESS_TAKEN",
            holder.id
        );
        let status = expect_code(
            self.create_once(request.clone()).await,
            Code::AlreadyExists,
            &expected,
        )?;
        if reason(&status).as_deref() != Some("ADDRESS_TAKEN") {
            return Err(Outcome::fail(expected, describe::status(&status)));
        }

        let outside = outside_of(held);
        self.requested_address_refused(
            &request,
            outside,
            "a documentation address no provider offers",
            "ADDRESS_NOT_IN_RANGE",
        )
        .await?;
        for &unusable in unusable_like(held) {
            self.requested_address_refused(
                &request,
                unusable,
                "an address no instance can hold",
                "INVALID_ARGUMENT",
            )
            .await?;
        }

        self.delete(&holder.id).await?;
        self.wait_gone(&holder.id).await?;
        let granted = self
            .create_after_release(
                request.clone(),
                &format!(
                    "Create with address_identity {d} and requested_address {held}, released when \
                     its holder was gone (NOT_FOUND), succeeds"
                ),
            )
            .await?;
        let granted = self.wait_running(&granted.id).await?;
        let got = primary_address(&granted)?;
        if got != held {
            return Err(Outcome::fail(
                format!("the instance's primary address is the requested {held}"),
                format!("{got}: {}", describe::instance(&granted)),
            ));
        }
        // The requested address is part of the spec: the same key without it is
        // another request (an unset field is always valid, so no other rule answers).
        let mut unset = request;
        unset.requested_address = None;
        expect_code(
            self.create_once(unset).await,
            Code::AlreadyExists,
            &format!(
                "Create of the key of {} (requested_address {held}) without requested_address: \
                 ALREADY_EXISTS",
                granted.id
            ),
        )?;
        Ok(())
    }

    /// A Create of `request` asking for `address` (which is `what`) is INVALID_ARGUMENT
    /// naming `requested_address`, with `expected_reason`.
    async fn requested_address_refused(
        &mut self,
        request: &pb::CreateInstanceRequest,
        address: &str,
        what: &str,
        expected_reason: &str,
    ) -> Checked {
        let mut asking = request.clone();
        asking.requested_address = Some(address.into());
        let expected = format!(
            "Create with requested_address {address} ({what}): INVALID_ARGUMENT naming \
             requested_address, reason {expected_reason}"
        );
        let status = expect_code(
            self.create_once(asking).await,
            Code::InvalidArgument,
            &expected,
        )?;
        if reason(&status).as_deref() != Some(expected_reason)
            || !names_field(&status, "requested_address")
        {
            return Err(Outcome::fail(expected, describe::status(&status)));
        }
        Ok(())
    }

    /// Creates `request` (which has an address identity) and waits until it runs; its
    /// `address_identity` must be echoed.
    async fn running_with_identity(
        &mut self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, Outcome> {
        let identity = request.address_identity.clone();
        let created = self.create(request).await?;
        let instance = self.wait_running(&created.id).await?;
        if instance.address_identity != identity || created.address_identity != identity {
            return Err(Outcome::fail(
                format!(
                    "Create and Get return address_identity {} as created",
                    identity.unwrap_or_default()
                ),
                format!(
                    "{:?} then {:?}",
                    created.address_identity, instance.address_identity
                ),
            ));
        }
        Ok(instance)
    }

    /// Create of `request` right after the instance holding its identity or address
    /// went: retried like any Create, except that ADDRESS_IDENTITY_IN_USE and
    /// ADDRESS_TAKEN now break the rule that a gone instance holds nothing.
    async fn create_after_release(
        &mut self,
        request: pb::CreateInstanceRequest,
        expected: &str,
    ) -> Result<pb::Instance, Outcome> {
        let deadline = Instant::now() + self.target.running_timeout;
        loop {
            let status = match self.create_once(request.clone()).await {
                Ok(instance) => return Ok(instance),
                Err(status) => status,
            };
            let still_held = matches!(
                reason(&status).as_deref(),
                Some("ADDRESS_IDENTITY_IN_USE" | "ADDRESS_TAKEN")
            );
            let retryable = crate::ErrorClass::from_code(status.code()).is_retryable();
            if still_held || !retryable || Instant::now() > deadline {
                return Err(Outcome::fail(expected, describe::status(&status)));
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

/// Addresses from the documentation ranges (TEST-NET-3, TEST-NET-2, and 3fff::/20 for
/// IPv6), which no provider offers; two of each, so one differs from any granted one.
pub(super) const OUTSIDE_V4: [&str; 2] = ["203.0.113.254", "198.51.100.254"];
const OUTSIDE_V6: [&str; 2] = ["3fff:ffff::fe", "3fff:fffe::fe"];

/// Addresses of `granted`'s family that no instance can hold: loopback, link-local,
/// multicast, unspecified (and for IPv4, broadcast).
fn unusable_like(granted: IpAddr) -> &'static [&'static str] {
    if granted.is_ipv4() {
        &[
            "127.0.0.1",
            "169.254.1.1",
            "224.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
        ]
    } else {
        &["::1", "fe80::1", "ff02::1", "::"]
    }
}

/// An address of `granted`'s family that is surely outside the provider's ranges.
fn outside_of(granted: IpAddr) -> &'static str {
    let candidates = if granted.is_ipv4() {
        OUTSIDE_V4
    } else {
        OUTSIDE_V6
    };
    let same_block = |text: &str| {
        let other: IpAddr = text.parse().expect("a valid address");
        match (granted, other) {
            (IpAddr::V4(g), IpAddr::V4(o)) => g.octets()[..3] == o.octets()[..3],
            (IpAddr::V6(g), IpAddr::V6(o)) => g.segments()[..2] == o.segments()[..2],
            _ => false,
        }
    };
    if same_block(candidates[0]) {
        candidates[1]
    } else {
        candidates[0]
    }
}

/// The instance's primary address: its first INTERNAL one (else its first).
fn primary_address(instance: &pb::Instance) -> Result<IpAddr, Outcome> {
    let address = instance
        .addresses
        .iter()
        .find(|a| a.scope() == AddressScope::Internal)
        .or(instance.addresses.first());
    address.and_then(|a| a.address.parse().ok()).ok_or_else(|| {
        Outcome::fail(
            "a RUNNING instance with a primary address that parses as an IP address",
            describe::instance(instance),
        )
    })
}

/// The ErrorInfo reason, exactly as sent (none without an ErrorInfo).
fn reason(status: &tonic::Status) -> Option<String> {
    status
        .get_error_details()
        .error_info()
        .map(|info| info.reason.clone())
}

fn names_field(status: &tonic::Status, field: &str) -> bool {
    status
        .get_error_details()
        .bad_request()
        .is_some_and(|bad| bad.field_violations.iter().any(|v| v.field == field))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outside_address_is_never_in_the_granted_ones_block() {
        let granted: IpAddr = "203.0.113.7".parse().unwrap();
        assert_eq!(outside_of(granted), "198.51.100.254");
        let granted: IpAddr = "192.0.2.10".parse().unwrap();
        assert_eq!(outside_of(granted), "203.0.113.254");
        let granted: IpAddr = "3fff:ffff::1".parse().unwrap();
        assert_eq!(outside_of(granted), "3fff:fffe::fe");
        let granted: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(outside_of(granted), "3fff:ffff::fe");
    }
}
