//! The operator's layers, checked on its source: a folder per resource at the top, what
//! they share below, and imports that point down only. A module under `src/` missing
//! from [`MODULES`] fails, so a new folder cannot escape the rule. Inside each folder
//! the modules name each other without a cycle: what two siblings share lives in a
//! third that both name.

use egressproxy_layer_rule::{LayerRule, May};

/// Every module under `src/`, top first, with the crate modules it may name.
const MODULES: &[(&str, May)] = &[
    ("lib", May::Anything),
    ("main", May::Anything),
    ("bin", May::Anything),
    ("uninstall_check", May::Only(&["k8s", "shared", "crd"])),
    (
        "proxy",
        May::Only(&[
            "endpoints",
            "context",
            "providers",
            "k8s",
            "probe",
            "shared",
            "crd",
        ]),
    ),
    (
        "pool",
        May::Only(&[
            "endpoints",
            "context",
            "providers",
            "k8s",
            "probe",
            "shared",
            "crd",
        ]),
    ),
    ("endpoints", May::Only(&["context", "k8s", "shared", "crd"])),
    ("context", May::Only(&["providers", "k8s", "shared", "crd"])),
    ("providers", May::Only(&["probe", "shared", "crd"])),
    ("k8s", May::Only(&["shared", "crd"])),
    ("probe", May::Only(&["shared", "crd"])),
    ("shared", May::Only(&["crd"])),
    ("crd", May::Only(&[])),
];

fn rule() -> LayerRule {
    LayerRule::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"), MODULES).checking_folders()
}

#[test]
fn imports_point_down_every_module_is_listed_and_nothing_loops_in_the_map_or_a_folder() {
    rule().assert_holds();
}
