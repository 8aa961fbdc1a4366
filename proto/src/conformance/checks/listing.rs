//! ListInstances: tag selection (AND across keys), agreement with Get, and paging that
//! honours (and clamps) the page size, walks every instance once and refuses tokens it
//! never issued.

use std::collections::{HashMap, HashSet};

use tonic::Code;
use tonic_types::StatusExt;

use super::{Checked, Suite, expect_code};
use crate::conformance::{Outcome, TAG, describe, walk};
use crate::pb;

/// The lowest cap on `page_size` the contract allows a provider.
const MIN_PAGE_CAP: usize = 1000;

impl walk::PageSource for Suite<'_> {
    async fn page(
        &mut self,
        request: pb::ListInstancesRequest,
    ) -> Result<pb::ListInstancesResponse, tonic::Status> {
        self.list_page(request).await
    }
}

fn walk_failure(error: walk::WalkError) -> Outcome {
    Outcome::fail(error.expected, error.got)
}

impl Suite<'_> {
    /// Every instance matching `selector`, in pages of 2.
    pub(super) async fn list(
        &mut self,
        selector: HashMap<String, String>,
    ) -> Result<Vec<pb::Instance>, Outcome> {
        self.list_in_pages_of(selector, 2).await
    }

    /// Every instance matching `selector`, in pages of `size`.
    pub(super) async fn list_in_pages_of(
        &mut self,
        selector: HashMap<String, String>,
        size: u32,
    ) -> Result<Vec<pb::Instance>, Outcome> {
        walk::list_all(self, selector, Some(size))
            .await
            .map_err(walk_failure)
    }

    pub(super) async fn list_by_tags(&mut self) -> Checked {
        let id = self.create(self.request("listed")).await?.id;
        let mine = self.list(self.ledger.selector()).await?;
        if !mine.iter().any(|i| i.id == id) {
            return Err(Outcome::fail(
                format!("{id} listed by its tag {TAG}={}", self.run_id()),
                format!("{} instances, not that one", mine.len()),
            ));
        }
        let nothing = HashMap::from([(TAG.to_owned(), format!("not-{}", self.run_id()))]);
        let others = self.list(nothing).await?;
        if let Some(other) = others.first() {
            return Err(Outcome::fail(
                "a selector that matches no instance lists nothing",
                describe::instance(other),
            ));
        }
        Ok(())
    }

    pub(super) async fn tag_selector_and(&mut self) -> Checked {
        let mut both = self.request("tags-both");
        both.tags.insert("egressproxy.dev/a".into(), "1".into());
        both.tags.insert("egressproxy.dev/b".into(), "2".into());
        let mut one = self.request("tags-one");
        one.tags.insert("egressproxy.dev/a".into(), "1".into());
        one.tags.insert("egressproxy.dev/b".into(), "other".into());
        let both = self.create(both).await?.id;
        let one = self.create(one).await?.id;
        let mut selector = self.ledger.selector();
        selector.insert("egressproxy.dev/a".into(), "1".into());
        selector.insert("egressproxy.dev/b".into(), "2".into());
        let listed = self.list(selector).await?;
        let ids: Vec<&str> = listed.iter().map(|i| i.id.as_str()).collect();
        if ids != [both.as_str()] {
            return Err(Outcome::fail(
                format!("a selector of three tags lists only {both}, the instance with all three"),
                format!(
                    "[{}]{}",
                    ids.join(", "),
                    if ids.contains(&one.as_str()) {
                        " (an instance matching only some keys: OR, not AND)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(())
    }

    pub(super) async fn list_get_agree(&mut self) -> Checked {
        let running = self.running_instance().await?;
        let listed = self.list(self.ledger.selector()).await?;
        let Some(from_list) = listed.into_iter().find(|i| i.id == running.id) else {
            return Err(Outcome::fail(
                format!("{} listed by the run's tag", running.id),
                "not listed",
            ));
        };
        let from_get = self.get(&running.id).await?;
        let comparable = |i: &pb::Instance| {
            let mut addresses: Vec<(String, i32, i32)> = i
                .addresses
                .iter()
                .map(|a| (a.address.clone(), a.scope, a.family))
                .collect();
            addresses.sort();
            (
                i.state,
                addresses,
                i.tags.clone(),
                i.placement.clone(),
                i.proxy_port,
                i.create_time,
            )
        };
        for (call, instance) in [("ListInstances", &from_list), ("GetInstance", &from_get)] {
            if instance.create_time.is_none() {
                return Err(Outcome::fail(
                    format!("{call} reports the instance's create_time (required)"),
                    describe::instance(instance),
                ));
            }
        }
        if comparable(&from_list) != comparable(&from_get) {
            return Err(Outcome::fail(
                format!("List and Get agree: {}", describe::instance(&from_get)),
                format!("List says {}", describe::instance(&from_list)),
            ));
        }
        Ok(())
    }

    pub(super) async fn paging_walks_once(&mut self) -> Checked {
        for suffix in ["page-1", "page-2", "page-3"] {
            self.create(self.request(suffix)).await?;
        }
        let expected: HashSet<String> = self
            .list(self.ledger.selector())
            .await?
            .into_iter()
            .map(|i| i.id)
            .collect();
        let selector = self.ledger.selector();
        let pages = walk::pages(self, selector, Some(1))
            .await
            .map_err(walk_failure)?;
        let mut seen = HashSet::new();
        for instance in pages.iter().flatten() {
            if !seen.insert(instance.id.clone()) {
                return Err(Outcome::fail(
                    "a walk with page_size 1 lists every instance once",
                    format!("{} listed twice", instance.id),
                ));
            }
        }
        let missing: Vec<&String> = expected.difference(&seen).collect();
        if let Some(missing) = missing.first() {
            return Err(Outcome::fail(
                "a walk with page_size 1 lists every instance a walk with page_size 2 lists",
                format!("{missing} missing after {} pages", pages.len()),
            ));
        }
        Ok(())
    }

    pub(super) async fn foreign_page_token(&mut self) -> Checked {
        for suffix in ["token-1", "token-2"] {
            self.create(self.request(suffix)).await?;
        }
        let first = self
            .list_page(pb::ListInstancesRequest {
                tag_selector: self.ledger.selector(),
                page_size: Some(1),
                page_token: String::new(),
            })
            .await
            .map_err(|status| Outcome::fail("ListInstances answers", describe::status(&status)))?;
        if first.next_page_token.is_empty() {
            return Err(Outcome::fail(
                "a next_page_token after a page of 1 when 2 or more instances match",
                "an empty token",
            ));
        }
        // A made-up token, and an issued one with a character added: a provider whose
        // token is a bare position (the last id) reads the second as a position.
        let tampered = format!("{}0", first.next_page_token);
        for (what, token) in [
            ("a made-up page token", "not-a-page-token".to_owned()),
            ("an issued page token with a character added", tampered),
        ] {
            let result = self
                .list_page(pb::ListInstancesRequest {
                    tag_selector: self.ledger.selector(),
                    page_size: Some(1),
                    page_token: token,
                })
                .await;
            let what = format!("ListInstances with {what}");
            let status = expect_code(result, Code::InvalidArgument, &what)?;
            let named = status
                .get_error_details()
                .bad_request()
                .is_some_and(|bad| bad.field_violations.iter().any(|v| v.field == "page_token"));
            if !named {
                return Err(Outcome::fail(
                    format!("{what}: BadRequest naming page_token"),
                    describe::status(&status),
                ));
            }
        }
        Ok(())
    }

    pub(super) async fn page_size_honoured(&mut self) -> Checked {
        for suffix in ["size-1", "size-2", "size-3"] {
            self.create(self.request(suffix)).await?;
        }
        for size in [1u32, 2] {
            let selector = self.ledger.selector();
            let pages = walk::pages(self, selector, Some(size))
                .await
                .map_err(walk_failure)?;
            if let Some(page) = pages.iter().find(|page| page.len() > size as usize) {
                return Err(Outcome::fail(
                    format!("at most {size} instances per page with page_size {size}"),
                    format!("a page of {}", page.len()),
                ));
            }
        }
        let selector = self.ledger.selector();
        let pages = walk::pages(self, selector, Some(u32::MAX))
            .await
            .map_err(|error| {
                Outcome::fail(
                    format!(
                        "a walk with page_size {} (over any provider's cap) is clamped, not refused: {}",
                        u32::MAX,
                        error.expected
                    ),
                    error.got,
                )
            })?;
        // A cap is at least 1000, and the suite's instances are far from filling the
        // 4 MiB a page may hold: fewer than 1000 of them come in one page.
        let listed: usize = pages.iter().map(Vec::len).sum();
        if pages.len() > 1 && listed < MIN_PAGE_CAP {
            return Err(Outcome::fail(
                format!(
                    "page_size {} clamped to a cap of at least {MIN_PAGE_CAP}: {listed} small instances in one page",
                    u32::MAX
                ),
                format!(
                    "{} pages of {:?} instances",
                    pages.len(),
                    pages.iter().map(Vec::len).collect::<Vec<_>>()
                ),
            ));
        }
        Ok(())
    }
}
