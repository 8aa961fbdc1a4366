//! The guest layer's error: cloud-init documents the agent cannot pass to the guest.

use crate::classification::{Classification, ErrorClass};

/// A request's cloud-init documents cannot be used. Messages name a line and column at
/// most, never the content: user-data may hold secrets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuestError {
    /// The user's cloud-config is malformed or conflicts with what the agent adds.
    #[error("{field}: {description}")]
    InvalidCloudConfig {
        /// The request field, e.g. `cloud_init.user_data`.
        field: String,
        /// What is wrong, where, and what to do.
        description: String,
    },
    /// A document is over the contract's size limit.
    #[error("{field}: {description}")]
    TooLarge {
        /// The request field.
        field: String,
        /// The size and the limit.
        description: String,
    },
}

impl GuestError {
    /// The layer's verdict: the request is wrong and names its field.
    pub fn classify(&self) -> Classification {
        match self {
            GuestError::InvalidCloudConfig { .. } => {
                Classification::new(ErrorClass::InvalidArgument, "INVALID_CLOUD_CONFIG")
            }
            GuestError::TooLarge { .. } => {
                Classification::new(ErrorClass::InvalidArgument, "INVALID_ARGUMENT")
            }
        }
    }

    /// The request field at fault, with what is wrong with it.
    pub fn field_violations(&self) -> Vec<(String, String)> {
        match self {
            GuestError::InvalidCloudConfig { field, description }
            | GuestError::TooLarge { field, description } => {
                vec![(field.clone(), description.clone())]
            }
        }
    }
}
