//! ListLocations (contract 1.2.0, `CAPABILITY_LIST_LOCATIONS`) as the operator asks it:
//! the locations that accept one machine type and image, every page, or `None` from a
//! provider without the capability.

use egressproxy_provider::pb;

use super::Provider;
use crate::shared::error::Result;

/// The most pages one listing reads (a provider whose tokens never end is cut off).
const MAX_PAGES: usize = 20;

impl Provider {
    /// The locations that accept `machine_type` and `image`, with their room; `None`
    /// when the provider does not declare `CAPABILITY_LIST_LOCATIONS`.
    pub async fn locations(
        &self,
        machine_type: &str,
        image: &str,
    ) -> Result<Option<Vec<pb::Location>>> {
        let info = self.handshake().await?;
        if !info.capabilities.contains(&pb::Capability::ListLocations) {
            return Ok(None);
        }
        let mut locations = Vec::new();
        let mut page_token = String::new();
        for _ in 0..MAX_PAGES {
            let request = pb::ListLocationsRequest {
                machine_type: machine_type.to_owned(),
                image: image.to_owned(),
                page_size: None,
                page_token: page_token.clone(),
            };
            let page = self
                .call("ListLocations", |mut c| async move {
                    c.list_locations(request).await
                })
                .await?;
            locations.extend(page.locations);
            if page.next_page_token.is_empty() || page.next_page_token == page_token {
                break;
            }
            page_token = page.next_page_token;
        }
        Ok(Some(locations))
    }
}
