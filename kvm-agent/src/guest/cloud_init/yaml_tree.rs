//! A YAML document as cloud-init's loader (PyYAML's safe loader) builds it, reduced to
//! what the agent asks of a cloud-config.
//!
//! - Duplicate keys are kept, the last one winning, as in PyYAML (a `Value` DOM would
//!   refuse them).
//! - Merge keys are resolved as PyYAML resolves them ([`Node::entries`]): `<<: *base`
//!   (or `<<: [*a, *b]`) brings the entries of the named mappings in beneath the
//!   mapping's own, the first of a list above the later ones. A `<<` whose value is not
//!   a mapping or a list of mappings makes PyYAML refuse the whole document
//!   ([`Node::check_merge_keys`]).
//! - Scalars keep what the agent needs: text, booleans, integers (for cloud-init's
//!   truth test, [`Node::is_true`]).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};

/// The key PyYAML reads as a merge.
const MERGE_KEY: &str = "<<";

/// cloud-init's `util.TRUE_STRINGS`.
const TRUE_STRINGS: [&str; 4] = ["true", "1", "on", "yes"];

/// One entry of a mapping, with merge keys resolved.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry<'a> {
    pub(super) key: &'a Node,
    pub(super) value: &'a Node,
    /// It came in through a merge key, not from the mapping itself.
    pub(super) merged: bool,
}

/// A merge key whose value is neither a mapping nor a list of mappings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BadMergeKey;

impl Node {
    /// A mapping's entries as PyYAML constructs it: first the entries merged in (each
    /// `<<` in order; of a list, the last mapping first), then its own, so that the last
    /// entry of a key is the one that counts. `None` when the node is not a mapping.
    pub(super) fn entries(&self) -> Option<Result<Vec<Entry<'_>>, BadMergeKey>> {
        let Node::Map(own) = self else {
            return None;
        };
        Some(resolve(own, false))
    }

    /// The value of `key` in a mapping's [`Node::entries`], the last one winning.
    pub(super) fn last<'a>(entries: &[Entry<'a>], key: &str) -> Option<Entry<'a>> {
        entries
            .iter()
            .rev()
            .find(|e| e.key.text() == Some(key))
            .copied()
    }

    /// Every merge key in the document names a mapping or a list of mappings.
    pub(super) fn check_merge_keys(&self) -> Result<(), BadMergeKey> {
        match self {
            Node::Map(entries) => {
                for (key, value) in entries {
                    if key.text() == Some(MERGE_KEY) {
                        merged_maps(value)?;
                    }
                    key.check_merge_keys()?;
                    value.check_merge_keys()?;
                }
                Ok(())
            }
            Node::List(items) => items.iter().try_for_each(Node::check_merge_keys),
            _ => Ok(()),
        }
    }

    /// cloud-init's `util.is_true`: `true`, or a value whose text is `true`, `1`, `on` or
    /// `yes` in any case.
    pub(super) fn is_true(&self) -> bool {
        match self {
            Node::Bool(value) => *value,
            Node::Int(value) => *value == 1,
            Node::Text(text) => TRUE_STRINGS.contains(&text.trim().to_lowercase().as_str()),
            _ => false,
        }
    }
}

fn resolve(own: &[(Node, Node)], merged: bool) -> Result<Vec<Entry<'_>>, BadMergeKey> {
    let mut before = Vec::new();
    let mut after = Vec::new();
    for (key, value) in own {
        if key.text() == Some(MERGE_KEY) {
            for map in merged_maps(value)?.into_iter().rev() {
                before.extend(resolve(map, true)?);
            }
        } else {
            after.push(Entry { key, value, merged });
        }
    }
    before.extend(after);
    Ok(before)
}

/// The mappings a merge key's value names, in the order written.
fn merged_maps(value: &Node) -> Result<Vec<&[(Node, Node)]>, BadMergeKey> {
    match value {
        Node::Map(entries) => Ok(vec![entries]),
        Node::List(items) => items
            .iter()
            .map(|item| match item {
                Node::Map(entries) => Ok(&entries[..]),
                _ => Err(BadMergeKey),
            })
            .collect(),
        _ => Err(BadMergeKey),
    }
}

/// A YAML node, reduced to what the agent asks of a cloud-config.
#[derive(Debug)]
pub(super) enum Node {
    Null,
    Text(String),
    Bool(bool),
    Int(i128),
    /// A floating-point number.
    OtherScalar,
    List(Vec<Node>),
    /// Entries in document order, duplicates and merge keys (`<<`) kept; see
    /// [`Node::entries`].
    Map(Vec<(Node, Node)>),
}

impl Node {
    pub(super) fn text(&self) -> Option<&str> {
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

    fn visit_bool<E>(self, value: bool) -> Result<Node, E> {
        Ok(Node::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Node, E> {
        Ok(Node::Int(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Node, E> {
        Ok(Node::Int(value.into()))
    }

    fn visit_i128<E>(self, value: i128) -> Result<Node, E> {
        Ok(Node::Int(value))
    }

    fn visit_u128<E>(self, value: u128) -> Result<Node, E> {
        // Beyond i128 only the truth test looks at it, and only 1 is true.
        Ok(Node::Int(i128::try_from(value).unwrap_or(i128::MAX)))
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

    fn parse(text: &str) -> Node {
        serde_norway::from_str(text).unwrap()
    }

    fn value_of(text: &str, key: &str) -> Option<(String, bool)> {
        let root = parse(text);
        let entries = root.entries().unwrap().unwrap();
        Node::last(&entries, key).map(|e| (format!("{:?}", e.value), e.merged))
    }

    #[test]
    fn merge_keys_bring_entries_in_beneath_the_mappings_own() {
        let text = "a: &a {x: 1, y: 1}\nb: &b {x: 2, z: 2}\n<<: [*a, *b]\ny: 3\n";
        assert_eq!(value_of(text, "x"), Some(("Int(1)".into(), true)));
        assert_eq!(value_of(text, "y"), Some(("Int(3)".into(), false)));
        assert_eq!(value_of(text, "z"), Some(("Int(2)".into(), true)));
        // Merges nest: a merged mapping's own merge keys are resolved too.
        let text = "a: &a {x: 1}\nb: &b {<<: *a, y: 2}\n<<: *b\n";
        assert_eq!(value_of(text, "x"), Some(("Int(1)".into(), true)));
        // Two merge keys: the later one's entries come later and win.
        let text = "a: &a {x: 1}\nb: &b {x: 2}\n<<: *a\n<<: *b\n";
        assert_eq!(value_of(text, "x"), Some(("Int(2)".into(), true)));
    }

    #[test]
    fn a_merge_key_must_name_mappings() {
        for text in [
            "<<: 1\n",
            "<<:\n",
            "a: &a [x]\n<<: *a\n",
            "a: &a {x: 1}\n<<: [*a, 2]\n",
            "list:\n  - {<<: text}\n",
        ] {
            assert_eq!(parse(text).check_merge_keys(), Err(BadMergeKey), "{text}");
        }
        assert_eq!(
            parse("a: &a {x: 1}\nb: {<<: *a}\n").check_merge_keys(),
            Ok(())
        );
    }

    #[test]
    fn truth_is_cloud_inits() {
        for (text, want) in [
            ("true", true),
            ("'yes'", true),
            ("' On '", true),
            ("1", true),
            ("'1'", true),
            ("false", false),
            ("2", false),
            ("1.0", false),
            ("~", false),
            ("'no'", false),
        ] {
            assert_eq!(parse(text).is_true(), want, "{text}");
        }
    }
}
