//! kvm-agent's layers (ADR 0008), checked on its source: each layer names only the
//! crate modules it may use, so an import that points upwards fails with its file and
//! line. A lower layer may use the layers below it and the shared leaves
//! (`classification`, `config`, `single_flight`, `metrics`), which name no layer; the
//! top (`error`, `startup`, `provider`) may name anything.
//!
//! Beyond the imports, the rule reads:
//! - a lower layer's comments too: a doc link to a layer above points upwards as an
//!   import does;
//! - every folder: its modules name each other without a cycle, so each folder reads
//!   top to bottom like the layers do (what two siblings share lives in a third below
//!   both);
//! - the contract's error: no layer below the provider names `crate::error` (or its
//!   re-export `crate::Error`) or writes `ProviderError`, and inside the provider only
//!   the gRPC edge (`provider/service.rs`) does: each layer returns its own error type,
//!   and the one mapping in `error.rs` turns it into the contract's.
//!
//! A module under `src/` missing from [`MODULES`] fails, so a new folder cannot escape
//! the rule.

use egressproxy_layer_rule::{LayerRule, May};

/// Every module under `src/`, top first, with the crate modules it may name.
const MODULES: &[(&str, May)] = &[
    ("lib", May::Anything),
    ("main", May::Anything),
    ("error", May::Anything),
    ("startup", May::Anything),
    ("provider", May::Anything),
    (
        "images",
        May::Only(&[
            "libvirt",
            "transport",
            "config",
            "classification",
            "single_flight",
            "metrics",
        ]),
    ),
    ("guest", May::Only(&["config", "classification"])),
    (
        "libvirt",
        May::Only(&[
            "transport",
            "config",
            "classification",
            "single_flight",
            "metrics",
        ]),
    ),
    (
        "transport",
        May::Only(&["config", "classification", "metrics"]),
    ),
    ("config", May::Only(&["classification"])),
    ("single_flight", May::Only(&[])),
    ("classification", May::Only(&[])),
    ("metrics", May::Only(&[])),
];

/// The contract's error, built only by the one mapping (`Error::to_provider_error`).
const CONTRACT_ERROR: &str = "ProviderError";

fn rule() -> LayerRule {
    LayerRule::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"), MODULES)
        .reading_comments()
        .checking_folders()
        .top_only_words(&[CONTRACT_ERROR])
        .confining(CONTRACT_ERROR, "provider", &["provider/service.rs"])
}

#[test]
fn imports_point_down_folders_have_no_cycle_and_the_contract_error_stays_at_the_edge() {
    rule().assert_holds();
}
