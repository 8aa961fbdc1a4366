//! The configured providers: names mapped to gRPC endpoints, with TLS or mTLS and
//! per-call deadlines, from a YAML file ([`config`]) that is reloaded when it
//! changes ([`reload`]).
//!
//! - [`config`]: the file's format and its checks.
//! - [`provider`]: one provider's client, calls and handshake.
//! - [`instance_tags`]: the tags that say who owns an instance.
//! - [`list_walk`]: walking ListInstances pages, bounded.
//! - `locations`: ListLocations, for a provider that declares it.
//! - [`placement`]: a Proxy's placement as CreateInstance asks for it.
//! - [`reload`]: re-reading the file; an invalid file keeps the previous config.
//!
//! A provider's handle ([`Provider`]) lives as long as the operator, so a reconcile
//! can borrow it while the config is reloaded: a reload changes the handle's
//! settings, adds handles for new names, and marks removed ones, which [`Providers::get`]
//! then reports as not configured.

pub mod config;
pub mod instance_tags;
pub mod list_walk;
mod locations;
pub mod placement;
pub mod provider;
pub mod reload;

use std::sync::Arc;

use tokio::sync::watch;

pub use config::{ProviderConfig, ProvidersConfig, TlsConfig};
pub use provider::{PluginInfo, Provider};

use crate::shared::error::{Error, Result};
use crate::shared::metrics::Metrics;

/// Every configured provider.
#[derive(Debug)]
pub struct Providers {
    handles: elsa::sync::FrozenMap<String, Box<Provider>>,
    metrics: Arc<Metrics>,
    /// Bumped by every reload that changed something.
    changes: watch::Sender<u64>,
}

impl Providers {
    /// Providers from a parsed config, reporting calls to `metrics`.
    pub fn new(config: ProvidersConfig, metrics: Arc<Metrics>) -> Self {
        let providers = Providers {
            handles: elsa::sync::FrozenMap::new(),
            metrics,
            changes: watch::Sender::new(0),
        };
        providers.apply(config);
        providers
    }

    /// The provider called `name`.
    pub fn get(&self, name: &str) -> Result<&Provider> {
        self.handles
            .get(name)
            .filter(|provider| provider.is_configured())
            .ok_or_else(|| Error::ProviderNotConfigured(name.to_owned()))
    }

    /// Every configured provider, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Provider> {
        let mut names = self.handles.keys_cloned();
        names.sort();
        names
            .into_iter()
            .filter_map(|name| self.handles.get(&name))
            .filter(|provider| provider.is_configured())
    }

    /// Makes `config` the current config; returns whether anything changed.
    pub fn apply(&self, mut config: ProvidersConfig) -> bool {
        let mut changed = false;
        for name in self.handles.keys_cloned() {
            let settings = config.providers.remove(&name);
            if let Some(provider) = self.handles.get(&name) {
                changed |= provider.reconfigure(settings);
            }
        }
        for (name, settings) in config.providers {
            let metrics = self.metrics.clone();
            self.handles.insert(
                name.clone(),
                Box::new(Provider::new(name, settings, metrics)),
            );
            changed = true;
        }
        if changed {
            self.changes.send_modify(|n| *n += 1);
        }
        changed
    }

    /// Ticks whenever a reload changes the providers (so that Proxies waiting for a
    /// provider can be retried at once).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> ProvidersConfig {
        ProvidersConfig::parse(text).unwrap()
    }

    #[test]
    fn a_reload_adds_changes_and_removes_providers_behind_stable_handles() {
        let providers = Providers::new(
            config("providers:\n  a:\n    endpoint: http://127.0.0.1:1\n"),
            Arc::new(Metrics::default()),
        );
        let mut changes = providers.changes();
        let a = providers.get("a").unwrap();
        assert!(providers.get("b").is_err());

        assert!(!providers.apply(config(
            "providers:\n  a:\n    endpoint: http://127.0.0.1:1\n"
        )));
        assert!(
            !changes.has_changed().unwrap(),
            "the same config changes nothing"
        );

        assert!(providers.apply(config(
            "providers:\n  b:\n    endpoint: http://127.0.0.1:2\n"
        )));
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        assert!(matches!(
            providers.get("a"),
            Err(Error::ProviderNotConfigured(name)) if name == "a"
        ));
        assert_eq!(
            providers.iter().map(Provider::name).collect::<Vec<_>>(),
            vec!["b"]
        );
        // A handle borrowed before the reload stays valid and says it is gone.
        assert_eq!(a.name(), "a");

        assert!(providers.apply(config(
            "providers:\n  a:\n    endpoint: http://127.0.0.1:3\n  b:\n    endpoint: http://127.0.0.1:2\n"
        )));
        assert!(
            std::ptr::eq(providers.get("a").unwrap(), a),
            "the same handle comes back"
        );
        assert_eq!(providers.iter().count(), 2);
    }
}
