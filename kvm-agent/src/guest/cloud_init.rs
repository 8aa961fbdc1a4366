//! The cloud-init documents of an instance: the user's, with the qemu-guest-agent
//! bootstrap merged in.
//!
//! The agent finds guest addresses through qemu-guest-agent (lesson 8), so every guest
//! must install and start it. cloud-init merges vendor-data badly: a user-data
//! `packages:` or `runcmd:` *replaces* the vendor-data's lists (lesson 4). So:
//! 1. **User-data that is a `#cloud-config`** gets the bootstrap merged into it: the
//!    package is appended to `packages` and the command to `runcmd`, each skipped when
//!    already there. The document is edited line by line, so the user's key order,
//!    comments and formatting stay; the edit is then checked by parsing the result and
//!    comparing it with the intended value, and when the document's style defeats the
//!    line edit (anchors, flow collections over several lines, quoted keys, a `...`
//!    end marker) the whole mapping is re-serialized instead, which is always correct
//!    but drops comments.
//! 2. **Other user-data** (a script, MIME multipart, `#include`, gzip, a jinja
//!    template) is passed through untouched and the bootstrap goes into vendor-data:
//!    merged into the caller's vendor-data when that is a cloud-config, else combined
//!    with it in a MIME multipart.
//! 3. A `#cloud-config` that is not a YAML mapping, does not parse, or whose `packages`
//!    or `runcmd` is not a list is INVALID_ARGUMENT naming the field: cloud-init would
//!    ignore it and the VM would never report an address.
//!
//! Either document is at most [`MAX_USER_DATA_BYTES`]. Error messages name a line and
//! column at most, never the content: user-data may hold secrets.

use egressproxy_provider::ProviderError;
use egressproxy_provider::validation::MAX_USER_DATA_BYTES;
use serde_yaml::{Mapping, Value};
use sha2::{Digest, Sha256};

/// The package that reports guest addresses to libvirt.
pub const GUEST_AGENT_PACKAGE: &str = "qemu-guest-agent";
/// The command that starts it once installed.
pub const GUEST_AGENT_RUNCMD: [&str; 4] = ["systemctl", "enable", "--now", "qemu-guest-agent"];

const USER_DATA_FIELD: &str = "cloud_init.user_data";
const VENDOR_DATA_FIELD: &str = "cloud_init.vendor_data";

/// The documents that go into the NoCloud seed.
#[derive(Clone, PartialEq, Eq)]
pub struct SeedDocuments {
    /// `user-data`.
    pub user_data: Vec<u8>,
    /// `vendor-data`, when there is any.
    pub vendor_data: Option<Vec<u8>>,
}

impl std::fmt::Debug for SeedDocuments {
    // Never print the documents: they may hold secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedDocuments")
            .field("user_data_bytes", &self.user_data.len())
            .field(
                "vendor_data_bytes",
                &self.vendor_data.as_ref().map(Vec::len),
            )
            .finish()
    }
}

/// Builds the seed's documents from the caller's user-data and vendor-data.
pub fn seed_documents(
    user_data: &[u8],
    vendor_data: Option<&[u8]>,
) -> Result<SeedDocuments, ProviderError> {
    check_size(USER_DATA_FIELD, user_data)?;
    if let Some(vendor) = vendor_data {
        check_size(VENDOR_DATA_FIELD, vendor)?;
    }
    if user_data.iter().all(u8::is_ascii_whitespace) {
        return Ok(SeedDocuments {
            user_data: bootstrap_document().into_bytes(),
            vendor_data: vendor_data.map(<[u8]>::to_vec),
        });
    }
    if let Some(text) = as_cloud_config(user_data) {
        return Ok(SeedDocuments {
            user_data: merge_bootstrap(text, USER_DATA_FIELD)?.into_bytes(),
            vendor_data: vendor_data.map(<[u8]>::to_vec),
        });
    }
    let vendor = match vendor_data {
        None => bootstrap_document().into_bytes(),
        Some(vendor) => match as_cloud_config(vendor) {
            Some(text) => merge_bootstrap(text, VENDOR_DATA_FIELD)?.into_bytes(),
            None => multipart(&[bootstrap_document().as_bytes(), vendor]),
        },
    };
    Ok(SeedDocuments {
        user_data: user_data.to_vec(),
        vendor_data: Some(vendor),
    })
}

fn check_size(field: &str, data: &[u8]) -> Result<(), ProviderError> {
    if data.len() > MAX_USER_DATA_BYTES {
        return Err(ProviderError::invalid_argument(
            field,
            format!(
                "{} bytes is over the {MAX_USER_DATA_BYTES}-byte limit",
                data.len()
            ),
        ));
    }
    Ok(())
}

/// The text of `data` if cloud-init would read it as a `#cloud-config`.
fn as_cloud_config(data: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(data).ok()?;
    (text.starts_with("#cloud-config") && !text.starts_with("#cloud-config-archive"))
        .then_some(text)
}

/// A cloud-config that only installs and starts the guest agent.
pub fn bootstrap_document() -> String {
    format!(
        "#cloud-config\npackages:\n  - {GUEST_AGENT_PACKAGE}\nruncmd:\n  - {}\n",
        runcmd_flow()
    )
}

fn runcmd_flow() -> String {
    format!("[{}]", GUEST_AGENT_RUNCMD.join(", "))
}

fn runcmd_value() -> Value {
    Value::Sequence(
        GUEST_AGENT_RUNCMD
            .iter()
            .map(|s| Value::String((*s).to_owned()))
            .collect(),
    )
}

fn invalid(field: &str, description: impl Into<String>) -> ProviderError {
    ProviderError::invalid_argument(field, description).with_reason("INVALID_CLOUD_CONFIG")
}

/// Merges the bootstrap into a `#cloud-config` document. See the module docs.
fn merge_bootstrap(text: &str, field: &str) -> Result<String, ProviderError> {
    let parsed: Value = serde_yaml::from_str(text).map_err(|e| {
        let at = e
            .location()
            .map(|l| format!(" at line {} column {}", l.line(), l.column()))
            .unwrap_or_default();
        invalid(field, format!("the #cloud-config is not valid YAML{at}"))
    })?;
    let mut mapping = match parsed {
        Value::Mapping(mapping) => mapping,
        Value::Null => Mapping::new(),
        _ => {
            return Err(invalid(
                field,
                "a #cloud-config must be a YAML mapping (key: value pairs)",
            ));
        }
    };
    let mut text = text.to_owned();
    let mut line_edit_ok = true;
    let additions = [
        (
            "packages",
            Value::String(GUEST_AGENT_PACKAGE.into()),
            GUEST_AGENT_PACKAGE.to_owned(),
        ),
        ("runcmd", runcmd_value(), runcmd_flow()),
    ];
    for (key, item, item_flow) in additions {
        let list = mapping
            .entry(Value::String(key.into()))
            .or_insert(Value::Null);
        if let Value::Null = list {
            *list = Value::Sequence(Vec::new());
        }
        let Value::Sequence(items) = list else {
            return Err(invalid(field, format!("`{key}` must be a list")));
        };
        if items
            .iter()
            .any(|existing| same_bootstrap_item(existing, &item))
        {
            continue;
        }
        items.push(item);
        if line_edit_ok {
            match append_to_top_level_list(&text, key, &item_flow) {
                Some(edited) => text = edited,
                None => line_edit_ok = false,
            }
        }
    }
    let expected = Value::Mapping(mapping);
    if line_edit_ok && serde_yaml::from_str::<Value>(&text).ok().as_ref() == Some(&expected) {
        return Ok(text);
    }
    let body = serde_yaml::to_string(&expected)
        .map_err(|_| invalid(field, "the merged #cloud-config cannot be written back"))?;
    Ok(format!("#cloud-config\n{body}"))
}

/// Whether `existing` already does what the bootstrap `item` does.
fn same_bootstrap_item(existing: &Value, item: &Value) -> bool {
    let words = |v: &Value| -> Option<Vec<String>> {
        match v {
            Value::String(s) => Some(s.split_whitespace().map(str::to_owned).collect()),
            Value::Sequence(items) => items
                .iter()
                .map(|i| i.as_str().map(str::to_owned))
                .collect(),
            _ => None,
        }
    };
    match item {
        // A package may be given as `[name, version]`.
        Value::String(package) => match existing {
            Value::String(s) => s == package,
            Value::Sequence(items) => items.first().and_then(Value::as_str) == Some(package),
            _ => false,
        },
        _ => words(existing).is_some() && words(existing) == words(item),
    }
}

/// Appends `item` (a YAML flow scalar or sequence) to the top-level list `key` by editing
/// lines; `None` when the document's layout is not one this understands.
fn append_to_top_level_list(text: &str, key: &str, item: &str) -> Option<String> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let key_line = lines.iter().position(|line| {
        line.strip_prefix(key)
            .and_then(|rest| rest.strip_prefix(':'))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r', '\n']))
    });
    let Some(at) = key_line else {
        // The key is absent: add it at the end.
        let mut out = text.to_owned();
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&format!("{key}:\n  - {item}\n"));
        return Some(out);
    };
    let rest = lines[at][key.len() + 1..].trim();
    if rest.starts_with('[') && rest.ends_with(']') {
        let inner = rest[1..rest.len() - 1].trim();
        let list = if inner.is_empty() {
            format!("[{item}]")
        } else {
            format!("[{inner}, {item}]")
        };
        let mut out: String = lines[..at].concat();
        out.push_str(&format!("{key}: {list}\n"));
        out.push_str(&lines[at + 1..].concat());
        return Some(out);
    }
    if !(rest.is_empty() || rest.starts_with('#') || rest == "null" || rest == "~") {
        return None;
    }
    let in_block = |line: &str| {
        line.trim().is_empty() || line.starts_with([' ', '\t', '#']) || line.starts_with('-')
    };
    let block_end = lines[at + 1..]
        .iter()
        .position(|line| !in_block(line))
        .map_or(lines.len(), |n| at + 1 + n);
    let content = |line: &&str| !line.trim().is_empty() && !line.trim_start().starts_with('#');
    let last_content = lines[at + 1..block_end]
        .iter()
        .rposition(&content)
        .map(|n| at + 1 + n);
    let indent = lines[at + 1..block_end]
        .iter()
        .find(|line| content(line))
        .map_or("  ", |line| &line[..line.len() - line.trim_start().len()]);
    let insert_after = last_content.unwrap_or(at);
    let mut out: String = lines[..at].concat();
    if last_content.is_none() {
        // `key:` or `key: null` with no items: make it a block list.
        out.push_str(&format!("{key}:\n"));
    } else {
        out.push_str(&lines[at..=insert_after].concat());
    }
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(&format!("{indent}- {item}\n"));
    out.push_str(&lines[insert_after + 1..].concat());
    Some(out)
}

/// A MIME multipart of `parts`, each typed by cloud-init from its first line.
fn multipart(parts: &[&[u8]]) -> Vec<u8> {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update(part);
    }
    let digest = hash.finalize();
    let boundary: String = format!(
        "==egressproxy-{}==",
        digest[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    let mut out =
        format!("Content-Type: multipart/mixed; boundary=\"{boundary}\"\nMIME-Version: 1.0\n\n")
            .into_bytes();
    for part in parts {
        out.extend_from_slice(format!("--{boundary}\n").as_bytes());
        // A MIME document brings its own headers; anything else is typed by cloud-init
        // from its first line (`#!`, `#include`, ...).
        if !part.starts_with(b"Content-Type:") {
            out.extend_from_slice(
                b"Content-Type: text/x-not-multipart; charset=\"utf-8\"\nMIME-Version: 1.0\n\n",
            );
        }
        out.extend_from_slice(part);
        if !part.ends_with(b"\n") {
            out.push(b'\n');
        }
    }
    out.extend_from_slice(format!("--{boundary}--\n").as_bytes());
    out
}

#[cfg(test)]
mod tests;
