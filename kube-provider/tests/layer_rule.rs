//! The import direction of the crate's doc, checked on the source: `service` and
//! `provider` may name anything; the pure modules name only those below them, and
//! `config`, `record` and `kube_errors` name nothing of the crate. A use
//! that points upwards fails with its file and line; a module under `src/` that
//! [`MODULES`] does not list fails too, so no new file escapes the rule.

use egressproxy_layer_rule::{LayerRule, May};

/// Every module under `src/` with the crate modules it may name.
const MODULES: &[(&str, May)] = &[
    ("lib", May::Anything),
    ("main", May::Anything),
    ("service", May::Anything),
    ("provider", May::Anything),
    ("pod_watch", May::Only(&["instance", "record"])),
    ("port_lock", May::Only(&[])),
    ("request", May::Only(&["config"])),
    ("placement", May::Only(&["node_room", "record"])),
    ("node_room", May::Only(&[])),
    ("pod_spec", May::Only(&["config", "record"])),
    ("instance", May::Only(&["record"])),
    ("record", May::Only(&[])),
    ("kube_errors", May::Only(&[])),
    ("config", May::Only(&[])),
];

fn rule() -> LayerRule {
    LayerRule::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src"), MODULES)
}

#[test]
fn imports_point_down_every_module_is_listed_and_nothing_loops() {
    rule().assert_holds();
}
