//! Reading a `#cloud-config` without changing it: is it something cloud-init will use,
//! what does it do with the lists the bootstrap adds to, and does it let cloud-init read
//! vendor-data?
//!
//! The document is parsed into the small tree of `yaml_tree`, which keeps no more than
//! these questions need, reads duplicate keys and merge keys (`<<`) as cloud-init's
//! loader does, and is never written back. Scalars that YAML 1.1 and 1.2 type
//! differently never matter here: only the top-level keys `packages`, `runcmd` and
//! `vendor_data`, the words of the lists' items and `vendor_data.enabled` are looked at.

use super::bootstrap::{GUEST_AGENT_PACKAGE, Item};
use super::document_facts::{DocumentFacts, ListSeen};
use super::invalid;
use super::yaml_tree::{BadMergeKey, Entry, Node};
use crate::guest::GuestError;

/// Checks the `#cloud-config` `text` and tells what it does (see the module docs): it
/// must parse, be a mapping (or empty), have only merge keys that name mappings, and
/// have lists for `packages` and `runcmd` when it has them, merged in or its own.
/// Errors name `field` and at most a line and column, never the content.
pub(super) fn check(text: &str, field: &str) -> Result<DocumentFacts, GuestError> {
    let root: Node = serde_norway::from_str(text).map_err(|e| {
        let at = e
            .location()
            .map(|l| format!(" at line {} column {}", l.line(), l.column()))
            .unwrap_or_default();
        invalid(field, format!("the #cloud-config is not valid YAML{at}"))
    })?;
    let bad_merge_key = |BadMergeKey| {
        invalid(
            field,
            "a YAML merge key (`<<`) must name a mapping or a list of mappings",
        )
    };
    root.check_merge_keys().map_err(bad_merge_key)?;
    let entries = match root.entries() {
        Some(entries) => entries.map_err(bad_merge_key)?,
        None if matches!(root, Node::Null) => return Ok(DocumentFacts::NO_CONFIG),
        None => {
            return Err(invalid(
                field,
                "a #cloud-config must be a YAML mapping (key: value pairs)",
            ));
        }
    };
    let list = |item: Item| -> Result<ListSeen, GuestError> {
        let key = item.key();
        let Some(Entry { value, merged, .. }) = Node::last(&entries, key) else {
            return Ok(ListSeen::Absent);
        };
        let named = if merged {
            format!("`{key}` (merged in by `<<`)")
        } else {
            format!("`{key}`")
        };
        match value {
            Node::List(items) => Ok(ListSeen::Present {
                has_agent: items.iter().any(|i| match item {
                    Item::Package => installs_guest_agent(i),
                    Item::Runcmd => starts_guest_agent(i),
                }),
            }),
            Node::Null => Err(invalid(
                field,
                format!(
                    "{named} is empty: cloud-init wants a list; write `{key}: []` or remove the key"
                ),
            )),
            _ => Err(invalid(field, format!("{named} must be a list"))),
        }
    };
    Ok(DocumentFacts {
        packages: list(Item::Package)?,
        runcmd: list(Item::Runcmd)?,
        vendor_data_enabled: Some(vendor_data_enabled(&entries).map_err(bad_merge_key)?),
    })
}

/// Whether cloud-init reads vendor-data after this configuration: unless `vendor_data`
/// is set and is not a mapping, or its `enabled` is set and not true (cloud-init's
/// built-in setting is `enabled: true`).
fn vendor_data_enabled(entries: &[Entry<'_>]) -> Result<bool, BadMergeKey> {
    let Some(vendor_data) = Node::last(entries, "vendor_data") else {
        return Ok(true);
    };
    let Some(settings) = vendor_data.value.entries() else {
        return Ok(false);
    };
    Ok(Node::last(&settings?, "enabled").is_none_or(|enabled| enabled.value.is_true()))
}

/// `qemu-guest-agent`, `qemu-guest-agent=VERSION` or `[qemu-guest-agent, VERSION]`.
fn installs_guest_agent(item: &Node) -> bool {
    let name = match item {
        Node::List(pair) => pair.first().and_then(Node::text),
        other => other.text(),
    };
    name.is_some_and(|name| {
        name == GUEST_AGENT_PACKAGE
            || name
                .strip_prefix(GUEST_AGENT_PACKAGE)
                .is_some_and(|rest| rest.starts_with('='))
    })
}

/// A command (a string or a list of words) that names the agent's service and starts it:
/// `start`, `restart`, or `enable --now`.
fn starts_guest_agent(item: &Node) -> bool {
    let words: Vec<&str> = match item {
        Node::List(words) => words
            .iter()
            .filter_map(Node::text)
            .flat_map(str::split_whitespace)
            .collect(),
        other => other
            .text()
            .map_or(Vec::new(), |s| s.split_whitespace().collect()),
    };
    let has = |word: &str| words.contains(&word);
    let names_agent = words
        .iter()
        .any(|w| w.trim_end_matches(".service") == GUEST_AGENT_PACKAGE);
    names_agent && (has("start") || has("restart") || (has("enable") && has("--now")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const WITH: ListSeen = ListSeen::Present { has_agent: true };
    const WITHOUT: ListSeen = ListSeen::Present { has_agent: false };

    fn facts(text: &str) -> DocumentFacts {
        check(text, "f").unwrap()
    }

    #[test]
    fn the_agent_counts_as_installed_as_a_name_a_pinned_name_or_a_pair() {
        for packages in [
            "[qemu-guest-agent]",
            "['qemu-guest-agent=1:7.2+dfsg-7']",
            "[[qemu-guest-agent, '1:7.2']]",
            "\n  - curl\n  - - qemu-guest-agent\n    - 1:7.2\n",
        ] {
            let found = facts(&format!("#cloud-config\npackages: {packages}\n"));
            assert_eq!(
                (found.packages, found.runcmd),
                (WITH, ListSeen::Absent),
                "{packages}"
            );
        }
        for packages in [
            "[qemu-guest-agent-extra]",
            "[[curl, qemu-guest-agent]]",
            "[]",
        ] {
            let found = facts(&format!("#cloud-config\npackages: {packages}\n"));
            assert_eq!(found.packages, WITHOUT, "{packages}");
        }
    }

    #[test]
    fn a_runcmd_that_starts_the_agent_counts_and_one_that_stops_it_does_not() {
        for runcmd in [
            "[systemctl enable --now qemu-guest-agent]",
            "[[systemctl, start, qemu-guest-agent.service]]",
            "[[sh, -c, 'systemctl restart qemu-guest-agent']]",
            "[service qemu-guest-agent start]",
        ] {
            let found = facts(&format!("#cloud-config\nruncmd: {runcmd}\n"));
            assert_eq!(found.runcmd, WITH, "{runcmd}");
        }
        for runcmd in [
            "[systemctl stop qemu-guest-agent]",
            "[systemctl enable qemu-guest-agent]",
            "[[systemctl, start, squid]]",
        ] {
            let found = facts(&format!("#cloud-config\nruncmd: {runcmd}\n"));
            assert_eq!(found.runcmd, WITHOUT, "{runcmd}");
        }
    }

    #[test]
    fn duplicate_keys_are_accepted_and_the_last_one_counts() {
        let found = facts(
            "#cloud-config\npackages: [qemu-guest-agent]\nhostname: a\nhostname: b\n\
             packages: [squid]\nwrite_files: [{path: /a, path: /b}]\n",
        );
        assert_eq!(found.packages, WITHOUT);
        let err = check("#cloud-config\nruncmd: [a]\nruncmd: a\n", "f").unwrap_err();
        assert!(err.to_string().contains("`runcmd` must be a list"), "{err}");
    }

    #[test]
    fn anchors_tags_and_empty_documents_are_read() {
        let found = facts(
            "#cloud-config\nbase: &agent [qemu-guest-agent]\npackages: *agent\n\
             runcmd: !!seq [!custom systemctl enable --now qemu-guest-agent]\n",
        );
        assert_eq!((found.packages, found.runcmd), (WITH, WITH));
        assert_eq!(facts("#cloud-config\n"), DocumentFacts::NO_CONFIG);
        assert_eq!(
            facts("#cloud-config\n# only a comment\n"),
            DocumentFacts::NO_CONFIG
        );
    }

    #[test]
    fn lists_merged_in_by_a_merge_key_count_and_are_checked() {
        let found = facts(
            "#cloud-config\ncommon: &c\n  packages: [squid]\n  runcmd:\n    \
             - [systemctl, enable, --now, qemu-guest-agent]\n<<: *c\n",
        );
        assert_eq!((found.packages, found.runcmd), (WITHOUT, WITH));
        // The mapping's own key wins over the merged one; of a list, the first mapping.
        let found = facts(
            "#cloud-config\na: &a {packages: [qemu-guest-agent]}\nb: &b {packages: x}\n\
             <<: [*a, *b]\nruncmd: &r [echo]\n",
        );
        assert_eq!(found.packages, WITH);
        for (text, message) in [
            (
                "#cloud-config\nd: &d {packages: curl}\n<<: *d\n",
                "`packages` (merged in by `<<`) must be a list",
            ),
            (
                "#cloud-config\nd: &d {runcmd: }\n<<: *d\n",
                "`runcmd` (merged in by `<<`) is empty",
            ),
            (
                "#cloud-config\n<<: [a]\n",
                "a YAML merge key (`<<`) must name a mapping or a list of mappings",
            ),
            (
                "#cloud-config\nwrite_files:\n  - {<<: x, path: /a}\n",
                "a YAML merge key (`<<`) must name a mapping or a list of mappings",
            ),
        ] {
            let err = check(text, "f").unwrap_err().to_string();
            assert!(err.contains(message), "{text}: {err}");
        }
    }

    #[test]
    fn vendor_data_is_read_unless_user_data_turns_it_off() {
        for (text, want) in [
            ("hostname: h", true),
            ("vendor_data: {}", true),
            ("vendor_data: {prefix: [sh]}", true),
            ("vendor_data: {enabled: true}", true),
            ("vendor_data: {enabled: 'yes'}", true),
            ("vendor_data: {enabled: 1}", true),
            ("vendor_data: {enabled: false}", false),
            ("vendor_data: {enabled: 'no'}", false),
            ("vendor_data: {enabled: }", false),
            ("vendor_data: off", false),
            ("vendor_data:", false),
            ("v: &v {enabled: false}\nvendor_data: {<<: *v}", false),
            ("v: &v {vendor_data: {enabled: false}}\n<<: *v", false),
        ] {
            let found = facts(&format!("#cloud-config\n{text}\n"));
            assert_eq!(found.vendor_data_enabled, Some(want), "{text}");
        }
    }
}
