//! Walking a provider's ListInstances pages, bounded, so that a broken provider makes
//! the listing fail instead of making the operator loop with ever more memory.
//!
//! 1. Every page is asked for with the contract's [`FULL_PAGE_SIZE`], which every
//!    provider honours (up to its 4 MiB page limit), so even a listing of instances
//!    with maximal tags fits 115,000 of them within the contract's [`MAX_LIST_PAGES`].
//! 2. A page token handed out a second time (a repeat, or a cycle such as A → B → A)
//!    stops the walk with `PAGE_TOKEN_CYCLE`.
//! 3. A walk still going after [`MAX_LIST_PAGES`] pages, each with a new token, stops
//!    with `PAGE_LIMIT_EXCEEDED`. The tokens remembered for 2 are bounded by it too.
//!
//! Both stops are transient errors (the provider may be fixed and the next attempt
//! succeed) whose message says what the provider did.

use std::collections::HashSet;
use std::future::Future;

use egressproxy_provider::validation::{FULL_PAGE_SIZE, MAX_LIST_PAGES};
use egressproxy_provider::{ProviderError, pb};

/// Walks the pages of a listing by `selector`, asking for each page with `ask`;
/// every instance, or the first error (a failed call, or one of the stops above).
pub(super) async fn walk<Ask, Fut, E>(
    selector: &std::collections::HashMap<String, String>,
    mut ask: Ask,
    stop: impl Fn(ProviderError) -> E,
) -> Result<Vec<pb::Instance>, E>
where
    Ask: FnMut(pb::ListInstancesRequest) -> Fut,
    Fut: Future<Output = Result<pb::ListInstancesResponse, E>>,
{
    let mut instances = Vec::new();
    let mut page_token = String::new();
    let mut seen_tokens = HashSet::new();
    for _ in 0..MAX_LIST_PAGES {
        let page = ask(pb::ListInstancesRequest {
            tag_selector: selector.clone(),
            page_size: Some(FULL_PAGE_SIZE),
            page_token: page_token.clone(),
        })
        .await?;
        instances.extend(page.instances);
        if page.next_page_token.is_empty() {
            return Ok(instances);
        }
        if !seen_tokens.insert(page.next_page_token.clone()) {
            let message = format!(
                "ListInstances handed out page token {:?} a second time, after {} pages: \
                 its pages form a cycle (a provider bug), so the listing stops",
                page.next_page_token,
                seen_tokens.len() + 1
            );
            return Err(stop(
                ProviderError::transient(message).with_reason("PAGE_TOKEN_CYCLE"),
            ));
        }
        page_token = page.next_page_token;
    }
    let message = format!(
        "ListInstances still handed out a next page token after {MAX_LIST_PAGES} pages of \
         {FULL_PAGE_SIZE} (the contract's limit; {} instances so far): the provider's \
         paging never ends (a provider bug), so the listing stops",
        instances.len()
    );
    Err(stop(
        ProviderError::transient(message).with_reason("PAGE_LIMIT_EXCEEDED"),
    ))
}
