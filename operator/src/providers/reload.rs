//! Reloading the provider config file when it changes.
//!
//! The file is re-read every interval and compared with the text last read, rather
//! than watched with inotify: Kubernetes updates a mounted ConfigMap by swapping a
//! symlink to a new directory, which file watches on the old path miss.
//!
//! 1. Unchanged text: nothing happens.
//! 2. Changed text that parses and passes every check: it becomes the config
//!    ([`Providers::apply`]), logged and counted as `applied`.
//! 3. Changed text that is invalid, or a file that cannot be read: the previous
//!    config stays; a warning names the problem and the field, counted as `rejected`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::{Providers, ProvidersConfig};
use crate::shared::metrics::Metrics;

/// Re-reads `path` every `interval` forever, applying valid changes to `providers`.
/// `loaded` is the text the current config was parsed from.
pub async fn watch_file(
    providers: &Providers,
    path: &Path,
    loaded: String,
    interval: Duration,
    metrics: Arc<Metrics>,
) {
    let mut last = Ok(loaded);
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let read = std::fs::read_to_string(path).map_err(|error| error.to_string());
        if read == last {
            continue;
        }
        last = read.clone();
        let outcome = read
            .map_err(|error| format!("cannot read it: {error}"))
            .and_then(|text| ProvidersConfig::parse(&text).map_err(|error| error.to_string()));
        match outcome {
            Ok(config) => {
                let names: Vec<String> = config.providers.keys().cloned().collect();
                providers.apply(config);
                metrics.provider_config_reloaded(true);
                tracing::info!(path = %path.display(), providers = ?names, "provider config reloaded");
            }
            Err(problem) => {
                metrics.provider_config_reloaded(false);
                tracing::warn!(path = %path.display(), %problem,
                    "provider config changed but is invalid: keeping the previous config");
            }
        }
    }
}
