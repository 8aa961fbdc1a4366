//! Creates at the same time: distinct keys give distinct instances, one key gives one
//! instance, and a Create cut off mid-way and repeated converges to one instance.
//! Answers a caller would retry (the contract's transient classes; a provider may say a
//! key is busy) are retried, as the operator does.

use std::collections::HashSet;
use std::time::Duration;

use futures::future::join_all;

use super::{Checked, Suite};
use crate::ErrorClass;
use crate::conformance::{Outcome, describe, raw_call};
use crate::pb;

fn retryable(status: &tonic::Status) -> bool {
    ErrorClass::from_code(status.code()).is_retryable()
}

impl Suite<'_> {
    /// Creates `request`, retrying answers callers retry, until the running timeout.
    async fn create_until_answered(
        &mut self,
        request: pb::CreateInstanceRequest,
    ) -> Result<pb::Instance, Outcome> {
        let key = request.key.clone();
        self.create_raw(request).await.map_err(|status| {
            Outcome::fail(
                format!("a repeated Create of key {key} succeeds"),
                describe::status(&status),
            )
        })
    }

    /// How many instances of this run carry `key`.
    async fn instances_with_key(&mut self, key: &str) -> Result<Vec<pb::Instance>, Outcome> {
        Ok(self
            .list(self.ledger.selector())
            .await?
            .into_iter()
            .filter(|i| i.key == key)
            .collect())
    }

    async fn concurrent_creates(
        &mut self,
        requests: Vec<pb::CreateInstanceRequest>,
    ) -> Vec<Result<pb::Instance, tonic::Status>> {
        let calls = requests.into_iter().map(|request| {
            let mut client = self.client.clone();
            async move {
                client.create_instance(request).await.and_then(|answer| {
                    answer
                        .into_inner()
                        .instance
                        .ok_or_else(|| tonic::Status::internal("no instance in the answer"))
                })
            }
        });
        let results = join_all(calls).await;
        for result in &results {
            match result {
                Ok(instance) => self.ledger.record(&instance.id),
                Err(status) => self.observe("CreateInstance", status),
            }
        }
        results
    }

    pub(super) async fn concurrent_distinct_keys(&mut self) -> Checked {
        let count = self.target.concurrent_creates;
        let requests: Vec<_> = (0..count)
            .map(|n| self.request(&format!("many-{n}")))
            .collect();
        let mut ids = HashSet::new();
        for (request, result) in requests
            .clone()
            .into_iter()
            .zip(self.concurrent_creates(requests).await)
        {
            let instance = match result {
                Ok(instance) => instance,
                Err(status) if retryable(&status) => self.create_until_answered(request).await?,
                Err(status) => {
                    return Err(Outcome::fail(
                        format!("{count} concurrent Creates of distinct keys all succeed"),
                        describe::status(&status),
                    ));
                }
            };
            ids.insert(instance.id.clone());
        }
        if ids.len() != count {
            return Err(Outcome::fail(
                format!("{count} concurrent Creates of distinct keys give {count} instances"),
                format!("{} distinct ids", ids.len()),
            ));
        }
        for id in ids {
            self.delete(&id).await?;
        }
        Ok(())
    }

    pub(super) async fn concurrent_one_key(&mut self) -> Checked {
        let request = self.request("one-key");
        let results = self.concurrent_creates(vec![request.clone(); 5]).await;
        let mut ids = HashSet::new();
        for result in results {
            match result {
                Ok(instance) => {
                    ids.insert(instance.id);
                }
                Err(status) if retryable(&status) => {}
                Err(status) => {
                    return Err(Outcome::fail(
                        "5 concurrent Creates of one key succeed (or answer a retryable code)",
                        describe::status(&status),
                    ));
                }
            }
        }
        let settled = self.create_until_answered(request.clone()).await?;
        ids.insert(settled.id.clone());
        let listed = self.instances_with_key(&request.key).await?;
        if ids.len() != 1 || listed.len() != 1 {
            return Err(Outcome::fail(
                "5 concurrent Creates of one key give one instance",
                format!(
                    "ids [{}] answered, {} instances listed with the key",
                    ids.into_iter().collect::<Vec<_>>().join(", "),
                    listed.len()
                ),
            ));
        }
        Ok(())
    }

    pub(super) async fn cancelled_create_converges(&mut self) -> Checked {
        let request = self.request("cancelled");
        match self.plaintext_authority.clone() {
            // Over a bare HTTP/2 connection the request surely arrives, and only the
            // provider's own deadline (100 ms: longer than reading the request, shorter
            // than creating a VM) ends it.
            Some(authority) => {
                let encoded = prost::Message::encode_to_vec(&request);
                let status = raw_call::unary(
                    &authority,
                    "/egressproxy.provider.v1.Provider/CreateInstance",
                    &encoded,
                    "100m",
                    Duration::from_secs(10),
                )
                .await
                .map_err(|got| {
                    Outcome::fail("an answer by the Create's 100 ms grpc-timeout", got)
                })?;
                if status.code() != tonic::Code::Ok {
                    self.observe("CreateInstance", &status);
                }
            }
            None => {
                let mut cut_short = tonic::Request::new(request.clone());
                cut_short.set_timeout(Duration::from_millis(1));
                if let Ok(answer) = self.client.create_instance(cut_short).await
                    && let Some(instance) = answer.into_inner().instance
                {
                    self.ledger.record(&instance.id);
                }
            }
        }
        let settled = self.create_until_answered(request.clone()).await?;
        let again = self.create_until_answered(request.clone()).await?;
        let listed = self.instances_with_key(&request.key).await?;
        if settled.id != again.id || listed.len() != 1 {
            return Err(Outcome::fail(
                "a Create cut off by its deadline, then repeated, leaves one instance",
                format!(
                    "ids {} and {}, {} instances listed with the key",
                    settled.id,
                    again.id,
                    listed.len()
                ),
            ));
        }
        Ok(())
    }
}
