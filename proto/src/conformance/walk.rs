//! Walking ListInstances page by page, bounded: a provider whose page token never
//! ends (or repeats) fails the walk instead of looping for ever.

use std::collections::{HashMap, HashSet};

use super::{MAX_PAGES, describe};
use crate::client::Client;
use crate::pb;

/// Why a walk stopped short.
#[derive(Debug, Clone)]
pub(crate) struct WalkError {
    pub(crate) expected: String,
    pub(crate) got: String,
}

/// Where a walk gets its pages: a bare client, or the suite (which retries what callers
/// retry and records the errors it meets).
pub(crate) trait PageSource {
    /// One ListInstances call.
    async fn page(
        &mut self,
        request: pb::ListInstancesRequest,
    ) -> Result<pb::ListInstancesResponse, tonic::Status>;
}

impl PageSource for Client {
    async fn page(
        &mut self,
        request: pb::ListInstancesRequest,
    ) -> Result<pb::ListInstancesResponse, tonic::Status> {
        Ok(self.list_instances(request).await?.into_inner())
    }
}

/// One page's instances, per page, in order.
pub(crate) async fn pages(
    client: &mut impl PageSource,
    tag_selector: HashMap<String, String>,
    page_size: Option<u32>,
) -> Result<Vec<Vec<pb::Instance>>, WalkError> {
    let mut pages = Vec::new();
    let mut seen_tokens = HashSet::new();
    let mut page_token = String::new();
    loop {
        if pages.len() >= MAX_PAGES {
            return Err(WalkError {
                expected: format!("the page walk ends within {MAX_PAGES} pages"),
                got: format!("a next_page_token on page {MAX_PAGES}"),
            });
        }
        let request = pb::ListInstancesRequest {
            tag_selector: tag_selector.clone(),
            page_size,
            page_token: page_token.clone(),
        };
        let page = client.page(request).await.map_err(|status| WalkError {
            expected: "ListInstances answers".into(),
            got: describe::status(&status),
        })?;
        pages.push(page.instances);
        if page.next_page_token.is_empty() {
            return Ok(pages);
        }
        if !seen_tokens.insert(page.next_page_token.clone()) {
            return Err(WalkError {
                expected: "every next_page_token leads forward".into(),
                got: format!(
                    "page token {:?} came back a second time (page {}): the walk would never end",
                    page.next_page_token,
                    pages.len()
                ),
            });
        }
        page_token = page.next_page_token;
    }
}

/// Every instance matching the selector.
pub(crate) async fn list_all(
    client: &mut impl PageSource,
    tag_selector: HashMap<String, String>,
    page_size: Option<u32>,
) -> Result<Vec<pb::Instance>, WalkError> {
    Ok(pages(client, tag_selector, page_size)
        .await?
        .into_iter()
        .flatten()
        .collect())
}
