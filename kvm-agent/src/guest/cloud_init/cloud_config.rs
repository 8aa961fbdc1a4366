//! Reading a `#cloud-config` without changing it: is it something cloud-init will use,
//! and does it already install and start the guest agent?
//!
//! The document is parsed into a small tree that keeps no more than these questions
//! need. It accepts duplicate keys, the last one winning, as cloud-init's YAML loader
//! does (a `Value` DOM would refuse them). Scalars that YAML 1.1 and 1.2 type
//! differently never matter here: only the top-level keys `packages` and `runcmd` and
//! the words of their items are looked at, and nothing is ever written back.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};

use super::bootstrap::{AlreadyThere, GUEST_AGENT_PACKAGE};
use super::invalid;
use crate::guest::GuestError;

/// Checks the `#cloud-config` `text`: it must parse, be a mapping (or empty), and have
/// lists for `packages` and `runcmd` when it has them. Errors name `field` and at most a
/// line and column, never the content.
pub(super) fn check(text: &str, field: &str) -> Result<AlreadyThere, GuestError> {
    let root: Node = serde_norway::from_str(text).map_err(|e| {
        let at = e
            .location()
            .map(|l| format!(" at line {} column {}", l.line(), l.column()))
            .unwrap_or_default();
        invalid(field, format!("the #cloud-config is not valid YAML{at}"))
    })?;
    let entries = match root {
        Node::Map(entries) => entries,
        Node::Null => return Ok(AlreadyThere::default()),
        _ => {
            return Err(invalid(
                field,
                "a #cloud-config must be a YAML mapping (key: value pairs)",
            ));
        }
    };
    let list = |key: &str| -> Result<Option<&Vec<Node>>, GuestError> {
        // The last occurrence wins, as in cloud-init.
        match entries.iter().rev().find(|(k, _)| k.text() == Some(key)) {
            None => Ok(None),
            Some((_, Node::List(items))) => Ok(Some(items)),
            Some((_, Node::Null)) => Err(invalid(
                field,
                format!(
                    "`{key}` is empty: cloud-init wants a list; write `{key}: []` or remove the key"
                ),
            )),
            Some(_) => Err(invalid(field, format!("`{key}` must be a list"))),
        }
    };
    let packages = list("packages")?;
    let runcmd = list("runcmd")?;
    Ok(AlreadyThere {
        package: packages.is_some_and(|items| items.iter().any(installs_guest_agent)),
        runcmd: runcmd.is_some_and(|items| items.iter().any(starts_guest_agent)),
    })
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

/// A YAML node, reduced to what [`check`] needs.
#[derive(Debug)]
enum Node {
    Null,
    Text(String),
    /// A number or boolean.
    OtherScalar,
    List(Vec<Node>),
    /// Entries in document order, duplicates kept.
    Map(Vec<(Node, Node)>),
}

impl Node {
    fn text(&self) -> Option<&str> {
        match self {
            Node::Text(text) => Some(text),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> de::Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }

    fn visit_none<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        Node::deserialize(d)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
        Ok(Node::OtherScalar)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
        Ok(Node::OtherScalar)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
        Ok(Node::OtherScalar)
    }

    fn visit_i128<E>(self, _: i128) -> Result<Node, E> {
        Ok(Node::OtherScalar)
    }

    fn visit_u128<E>(self, _: u128) -> Result<Node, E> {
        Ok(Node::OtherScalar)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
        Ok(Node::OtherScalar)
    }

    fn visit_str<E>(self, text: &str) -> Result<Node, E> {
        Ok(Node::Text(text.to_owned()))
    }

    fn visit_string<E>(self, text: String) -> Result<Node, E> {
        Ok(Node::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = map.next_entry()? {
            entries.push(entry);
        }
        Ok(Node::Map(entries))
    }

    /// A node with a tag (`!foo value`): the value counts, the tag does not.
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Node, A::Error> {
        let (_tag, value): (de::IgnoredAny, _) = data.variant()?;
        value.newtype_variant()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn already(text: &str) -> AlreadyThere {
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
            let found = already(&format!("#cloud-config\npackages: {packages}\n"));
            assert_eq!(
                found,
                AlreadyThere {
                    package: true,
                    runcmd: false
                },
                "{packages}"
            );
        }
        for packages in [
            "[qemu-guest-agent-extra]",
            "[[curl, qemu-guest-agent]]",
            "[]",
        ] {
            let found = already(&format!("#cloud-config\npackages: {packages}\n"));
            assert!(!found.package, "{packages}");
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
            assert!(
                already(&format!("#cloud-config\nruncmd: {runcmd}\n")).runcmd,
                "{runcmd}"
            );
        }
        for runcmd in [
            "[systemctl stop qemu-guest-agent]",
            "[systemctl enable qemu-guest-agent]",
            "[[systemctl, start, squid]]",
        ] {
            assert!(
                !already(&format!("#cloud-config\nruncmd: {runcmd}\n")).runcmd,
                "{runcmd}"
            );
        }
    }

    #[test]
    fn duplicate_keys_are_accepted_and_the_last_one_counts() {
        let found = already(
            "#cloud-config\npackages: [qemu-guest-agent]\nhostname: a\nhostname: b\n\
             packages: [squid]\nwrite_files: [{path: /a, path: /b}]\n",
        );
        assert!(!found.package);
        let err = check("#cloud-config\nruncmd: [a]\nruncmd: a\n", "f").unwrap_err();
        assert!(err.to_string().contains("`runcmd` must be a list"), "{err}");
    }

    #[test]
    fn anchors_tags_and_empty_documents_are_read() {
        let found = already(
            "#cloud-config\nbase: &agent [qemu-guest-agent]\npackages: *agent\n\
             runcmd: !!seq [!custom systemctl enable --now qemu-guest-agent]\n",
        );
        assert_eq!(
            found,
            AlreadyThere {
                package: true,
                runcmd: true
            }
        );
        assert_eq!(already("#cloud-config\n"), AlreadyThere::default());
        assert_eq!(
            already("#cloud-config\n# only a comment\n"),
            AlreadyThere::default()
        );
    }
}
