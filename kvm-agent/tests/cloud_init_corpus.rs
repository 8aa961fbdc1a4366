//! The seed's user-data, judged by cloud-init's own code: for every document of
//! `tests/cloud-init-corpus/`, what a guest's cloud-init assembles from the agent's
//! user-data must be what it assembles from the user's document alone, plus the
//! guest-agent bootstrap appended to `packages` and `runcmd`.
//!
//! The judge is `tests/cloud_init_oracle.py`, which runs the installed cloud-init
//! package (Debian 12's 22.4, the one in the guest image) the way a guest does:
//! `UserDataProcessor`, the default part handlers (cloud-config merging with each
//! part's merge type, jinja rendering, scripts) and `ConfigMerger`, then
//! `cloud-init schema` on the assembled `cloud-config.txt`.
//!
//! Files named `invalid-*` are documents cloud-init would ignore or reject; the agent
//! refuses them. `included/` holds what `include.txt` includes; it is copied to
//! [`INCLUDE_DIR`], because `#include` takes absolute paths or URLs only.
//!
//! Needs `/usr/bin/python3` and the `cloud-init` Debian package.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine;
use kvm_agent::guest::cloud_init::{
    GUEST_AGENT_PACKAGE, GUEST_AGENT_RUNCMD, GuestAgent, MERGE_TYPE, seed_documents,
};
use serde::Deserialize;
use serde_json::{Value, json};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cloud-init-corpus");
const ORACLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cloud_init_oracle.py");
/// Where `include.txt` expects its included document.
const INCLUDE_DIR: &str = "/tmp/egressproxy-cloud-init-corpus";

/// What cloud-init made of one seed (see the oracle's docs).
#[derive(Debug, Clone, Deserialize)]
struct Assembled {
    config: Value,
    schema_errors: String,
    parts: Vec<Part>,
    vendor_parts: Vec<Part>,
    scripts: BTreeMap<String, String>,
    warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
struct Part {
    content_type: String,
    merge_type: Option<String>,
    payload: String,
}

impl Part {
    fn payload(&self) -> Vec<u8> {
        base64::engine::general_purpose::STANDARD
            .decode(&self.payload)
            .unwrap()
    }
}

/// Each part's content type and payload: what cloud-init's handlers get.
fn content(parts: &[Part]) -> Vec<(String, Vec<u8>)> {
    parts
        .iter()
        .map(|p| (p.content_type.clone(), p.payload()))
        .collect()
}

/// The corpus, sorted by name.
fn corpus() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(CORPUS)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .map(|path| {
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&path).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

fn valid_corpus() -> Vec<(String, Vec<u8>)> {
    corpus()
        .into_iter()
        .filter(|(name, _)| !name.starts_with("invalid-"))
        .collect()
}

/// One seed: user-data, and vendor-data when there is any.
type Seed<'a> = (&'a [u8], Option<&'a [u8]>);

/// Starts the oracle on `seeds`, each assembled alone.
fn spawn_oracle(dir: &Path, tag: &str, seeds: &[Seed<'_>]) -> std::process::Child {
    std::fs::create_dir_all(INCLUDE_DIR).unwrap();
    std::fs::copy(
        Path::new(CORPUS).join("included/included.yaml"),
        Path::new(INCLUDE_DIR).join("included.yaml"),
    )
    .unwrap();
    let mut command = Command::new("/usr/bin/python3");
    command.arg(ORACLE);
    for (i, (user, vendor)) in seeds.iter().enumerate() {
        match vendor {
            Some(vendor) => {
                let path = dir.join(format!("{tag}-{i}-vendor-data"));
                std::fs::write(&path, vendor).unwrap();
                command.arg("--vendor-data").arg(path);
            }
            None => {
                command.arg("--no-vendor-data");
            }
        }
        let path: PathBuf = dir.join(format!("{tag}-{i}"));
        std::fs::write(&path, user).unwrap();
        command.arg(path);
    }
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 runs (Debian packages python3 and cloud-init)")
}

fn oracle_output(child: std::process::Child) -> Vec<Assembled> {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the oracle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What cloud-init assembles from each of `documents`.
fn assemble(documents: &[&[u8]], vendor_data: Option<&[u8]>) -> Vec<Assembled> {
    let seeds: Vec<Seed<'_>> = documents.iter().map(|d| (*d, vendor_data)).collect();
    let dir = tempfile::tempdir().unwrap();
    oracle_output(spawn_oracle(dir.path(), "seed", &seeds))
}

/// The raw documents and the agent's user-data for them, assembled side by side.
fn assemble_both(raw: &[&[u8]], agent: &[&[u8]]) -> (Vec<Assembled>, Vec<Assembled>) {
    let raw: Vec<Seed<'_>> = raw.iter().map(|d| (*d, None)).collect();
    let agent: Vec<Seed<'_>> = agent.iter().map(|d| (*d, None)).collect();
    assemble_seeds_both(&raw, &agent)
}

/// The caller's seeds and the agent's for them, assembled side by side.
fn assemble_seeds_both(raw: &[Seed<'_>], agent: &[Seed<'_>]) -> (Vec<Assembled>, Vec<Assembled>) {
    let dir = tempfile::tempdir().unwrap();
    let raw = spawn_oracle(dir.path(), "raw", raw);
    let agent = spawn_oracle(dir.path(), "agent", agent);
    (oracle_output(raw), oracle_output(agent))
}

/// `config` with what the bootstrap for `guest_agent` adds, unless `config` already
/// installs or starts the agent (the rules documented for the agent, written again
/// here over cloud-init's merged result).
fn plus_bootstrap(mut config: Value, guest_agent: GuestAgent) -> Value {
    let map = config.as_object_mut().unwrap();
    let installs = |item: &Value| {
        let name = match item {
            Value::Array(pair) => pair.first().and_then(Value::as_str),
            other => other.as_str(),
        };
        name.is_some_and(|n| {
            n == GUEST_AGENT_PACKAGE || n.starts_with(&format!("{GUEST_AGENT_PACKAGE}="))
        })
    };
    let starts = |item: &Value| {
        let words: Vec<String> = match item {
            Value::Array(words) => words
                .iter()
                .filter_map(Value::as_str)
                .flat_map(|w| w.split_whitespace().map(str::to_owned))
                .collect(),
            other => other
                .as_str()
                .map(|s| s.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default(),
        };
        let has = |w: &str| words.iter().any(|x| x == w);
        words
            .iter()
            .any(|w| w.trim_end_matches(".service") == GUEST_AGENT_PACKAGE)
            && (has("start") || has("restart") || (has("enable") && has("--now")))
    };
    let has_item =
        |map: &serde_json::Map<String, Value>, key: &str, test: &dyn Fn(&Value) -> bool| {
            map.get(key)
                .and_then(Value::as_array)
                .is_some_and(|items| items.iter().any(test))
        };
    if guest_agent == GuestAgent::Install && !has_item(map, "packages", &installs) {
        let packages = map.entry("packages").or_insert_with(|| json!([]));
        packages
            .as_array_mut()
            .unwrap()
            .push(json!(GUEST_AGENT_PACKAGE));
    }
    if !has_item(map, "runcmd", &starts) {
        let runcmd = map.entry("runcmd").or_insert_with(|| json!([]));
        runcmd
            .as_array_mut()
            .unwrap()
            .push(json!(GUEST_AGENT_RUNCMD));
    }
    config
}

/// Compares the agent's seed with the user's document alone, as cloud-init sees them;
/// returns what differs.
fn judge(
    name: &str,
    input: &[u8],
    sent: &[u8],
    raw: &Assembled,
    agent: &Assembled,
    guest_agent: GuestAgent,
) -> Vec<String> {
    let mut wrong = Vec::new();
    let want = plus_bootstrap(raw.config.clone(), guest_agent);
    if agent.config != want {
        wrong.push(format!(
            "{name}: cloud-init assembled\n  {}\nwanted\n  {}",
            agent.config, want
        ));
    }
    if raw.schema_errors.is_empty() && !agent.schema_errors.is_empty() {
        wrong.push(format!(
            "{name}: cloud-init schema passes the input but fails the seed: {}",
            agent.schema_errors
        ));
    }
    // The user's parts reach the handlers unchanged, then at most the bootstrap.
    let user_parts = if sent == input {
        &agent.parts[..]
    } else {
        let Some((bootstrap, user_parts)) = agent.parts.split_last() else {
            wrong.push(format!("{name}: no parts at all"));
            return wrong;
        };
        if bootstrap.content_type != "text/cloud-config"
            || bootstrap.merge_type.as_deref() != Some(MERGE_TYPE)
        {
            wrong.push(format!(
                "{name}: the last part is not the bootstrap: {bootstrap:?}"
            ));
        }
        user_parts
    };
    if content(user_parts) != content(&raw.parts) {
        wrong.push(format!(
            "{name}: the user's parts changed:\n  {:?}\nvs\n  {:?}",
            content(user_parts),
            content(&raw.parts)
        ));
    }
    // A script is still the same script, where cloud-init puts scripts to run.
    if agent.scripts != raw.scripts {
        wrong.push(format!(
            "{name}: scripts differ: {:?} vs {:?}",
            agent.scripts, raw.scripts
        ));
    }
    if agent.warnings != raw.warnings {
        wrong.push(format!(
            "{name}: cloud-init warned {:?} instead of {:?}",
            agent.warnings, raw.warnings
        ));
    }
    wrong
}

#[test]
fn the_corpus_covers_every_kind_of_user_data() {
    let names: Vec<String> = corpus().into_iter().map(|(name, _)| name).collect();
    assert!(names.len() >= 30, "{} documents: {names:?}", names.len());
    for kind in [
        "plain",
        "comments",
        "anchors",
        "flow",
        "quoted-on",
        "quoted-sexagesimal",
        "quoted-octal",
        "quoted-equals",
        "dates",
        "jinja",
        "script",
        "include",
        "gzip",
        "multipart",
        "cloud-config-archive",
        "crlf",
        "no-final-newline",
        "bootstrap",
        "merge-key",
        "invalid-list",
        "invalid-scalar",
    ] {
        assert!(
            names.iter().any(|name| name.contains(kind)),
            "no {kind} document in {names:?}"
        );
    }
}

#[test]
fn cloud_init_assembles_the_users_config_plus_the_bootstrap() {
    let corpus = valid_corpus();
    let sent: Vec<Vec<u8>> = corpus
        .iter()
        .map(|(name, input)| {
            seed_documents(input, None, GuestAgent::Install)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .user_data
        })
        .collect();
    let inputs: Vec<&[u8]> = corpus.iter().map(|(_, input)| &input[..]).collect();
    let outputs: Vec<&[u8]> = sent.iter().map(Vec::as_slice).collect();
    let (raw, agent) = assemble_both(&inputs, &outputs);
    let mut wrong = Vec::new();
    for (i, (name, input)) in corpus.iter().enumerate() {
        wrong.extend(judge(
            name,
            input,
            &sent[i],
            &raw[i],
            &agent[i],
            GuestAgent::Install,
        ));
        // cloud-init keeps the user's scalars as the user typed them: the YAML 1.1
        // look-alikes stay strings.
        if name.starts_with("quoted-") || name.contains("flow-pair") {
            let text = agent[i].config.to_string();
            for typed in ["65.7", "true", "90", "{\"date\""] {
                assert!(!text.contains(typed), "{name}: {text}");
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    // The documents that already install and start the agent reach the guest as they are.
    for (i, (name, input)) in corpus.iter().enumerate() {
        if name == "bootstrap-present.yaml" || name == "bootstrap-flow-and-runcmd-list.yaml" {
            assert_eq!(&sent[i], input, "{name}");
        }
    }
}

#[test]
fn a_preinstalled_agent_is_only_started() {
    let corpus = valid_corpus();
    let sent: Vec<Vec<u8>> = corpus
        .iter()
        .map(|(_, input)| {
            seed_documents(input, None, GuestAgent::Preinstalled)
                .unwrap()
                .user_data
        })
        .collect();
    let inputs: Vec<&[u8]> = corpus.iter().map(|(_, input)| &input[..]).collect();
    let outputs: Vec<&[u8]> = sent.iter().map(Vec::as_slice).collect();
    let (raw, agent) = assemble_both(&inputs, &outputs);
    let mut wrong = Vec::new();
    for (i, (name, input)) in corpus.iter().enumerate() {
        wrong.extend(judge(
            name,
            input,
            &sent[i],
            &raw[i],
            &agent[i],
            GuestAgent::Preinstalled,
        ));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

#[test]
fn documents_cloud_init_would_not_use_are_refused() {
    let invalid: Vec<(String, Vec<u8>)> = corpus()
        .into_iter()
        .filter(|(name, _)| name.starts_with("invalid-"))
        .collect();
    assert!(invalid.len() >= 4);
    let inputs: Vec<&[u8]> = invalid.iter().map(|(_, input)| &input[..]).collect();
    let assembled = assemble(&inputs, None);
    for ((name, input), cloud_init) in invalid.iter().zip(&assembled) {
        let err = egressproxy_provider::ProviderError::from(
            seed_documents(input, None, GuestAgent::Install).unwrap_err(),
        );
        assert_eq!(err.reason, "INVALID_CLOUD_CONFIG", "{name}: {err}");
        assert_eq!(
            err.field_violations[0].field, "cloud_init.user_data",
            "{name}: {err}"
        );
        // cloud-init drops the document with a warning, or assembles a config that its
        // own schema rejects.
        let dropped = cloud_init.config == json!({}) && !cloud_init.warnings.is_empty();
        assert!(
            dropped || !cloud_init.schema_errors.is_empty(),
            "{name}: cloud-init would use it: {cloud_init:?}"
        );
    }
}

#[test]
fn debian_12_cloud_init_honours_the_merge_type() {
    let version = Command::new("cloud-init")
        .arg("--version")
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&version.stdout).into_owned()
        + &String::from_utf8_lossy(&version.stderr);
    assert!(
        version.contains(" 22.4"),
        "the guest image (Debian 12) has cloud-init 22.4; this machine has {version}: \
         check that the guest's cloud-init honours the merge type before changing this"
    );
    let user = b"#cloud-config\npackages: [squid]\nruncmd: [echo user]\n";
    let seeded = seed_documents(user, None, GuestAgent::Install)
        .unwrap()
        .user_data;
    let header = format!("X-Merge-Type: {MERGE_TYPE}\n");
    let text = String::from_utf8(seeded.clone()).unwrap();
    assert!(text.contains(&header), "{text}");
    let without_merge_type = text.replace(&header, "");
    let assembled = assemble(&[&seeded, without_merge_type.as_bytes()], None);
    assert_eq!(
        assembled[0].config,
        json!({
            "packages": ["squid", GUEST_AGENT_PACKAGE],
            "runcmd": ["echo user", GUEST_AGENT_RUNCMD],
        })
    );
    // Without it, cloud-init's default lets the last part's lists replace the user's.
    assert_eq!(
        assembled[1].config,
        json!({"packages": [GUEST_AGENT_PACKAGE], "runcmd": [GUEST_AGENT_RUNCMD]})
    );
}

/// Vendor-data that sets `packages` and `runcmd` (or not, or cannot be read before the
/// guest renders it) beside user-data of every kind.
const VENDOR_DATA: [(&str, &[u8]); 5] = [
    (
        "vendor lists",
        b"#cloud-config\npackages: [curl]\nruncmd: [echo vendor]\nntp: {enabled: true}\n",
    ),
    (
        "vendor starts the agent",
        b"#cloud-config\nruncmd:\n  - [systemctl, enable, --now, qemu-guest-agent]\n",
    ),
    ("vendor script", b"#!/bin/sh\necho vendor\n"),
    (
        "vendor jinja",
        b"## template: jinja\n#cloud-config\npackages: [curl]\nhostname: {{ v1.local_hostname }}\n",
    ),
    ("vendor empty", b""),
];
const USER_DATA: [(&str, &[u8]); 11] = [
    ("user script", b"#!/bin/sh\necho user\n"),
    ("user config without lists", b"#cloud-config\nhostname: h\n"),
    ("user empty", b""),
    ("user packages", b"#cloud-config\npackages: [squid]\n"),
    (
        "user packages and runcmd",
        b"#cloud-config\npackages: [squid]\nruncmd: [echo user]\n",
    ),
    (
        "user turns vendor-data off",
        b"#cloud-config\nvendor_data: {enabled: false}\n",
    ),
    (
        "user merges its lists in",
        b"#cloud-config\nbase: &b {runcmd: [echo user]}\n<<: *b\n",
    ),
    (
        "user leaves vendor-data on",
        b"#cloud-config\nvendor_data: {enabled: 'Yes', prefix: []}\n",
    ),
    (
        "user sets vendor_data to null",
        b"#cloud-config\nvendor_data:\n",
    ),
    (
        "user MIME without lists",
        b"Content-Type: multipart/mixed; boundary=\"b\"\nMIME-Version: 1.0\n\n--b\n\
          Content-Type: text/cloud-config\n\n#cloud-config\nhostname: m\n\n--b--\n",
    ),
    (
        "user jinja without lists",
        b"## template: jinja\n#cloud-config\nhostname: {{ v1.local_hostname }}\n",
    ),
];

/// For every pair of [`USER_DATA`] and [`VENDOR_DATA`], cloud-init assembles from the
/// agent's seed what it assembles from the caller's, plus the bootstrap: nothing of the
/// vendor's lists is lost because the bootstrap gave user-data a list of the same name.
#[test]
fn vendor_data_lists_are_kept_beside_the_bootstrap() {
    for guest_agent in [GuestAgent::Install, GuestAgent::Preinstalled] {
        let mut names = Vec::new();
        let mut raw = Vec::new();
        let mut seeds = Vec::new();
        for (vendor_name, vendor) in VENDOR_DATA {
            for (user_name, user) in USER_DATA {
                let seed = seed_documents(user, Some(vendor), guest_agent)
                    .unwrap_or_else(|e| panic!("{user_name} + {vendor_name}: {e}"));
                names.push(format!("{user_name} + {vendor_name} ({guest_agent:?})"));
                raw.push((user, Some(vendor)));
                seeds.push(seed);
            }
        }
        let agent: Vec<Seed<'_>> = seeds
            .iter()
            .map(|s| (&s.user_data[..], s.vendor_data.as_deref()))
            .collect();
        let (raw_assembled, agent_assembled) = assemble_seeds_both(&raw, &agent);
        let mut wrong = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let (raw, agent) = (&raw_assembled[i], &agent_assembled[i]);
            let want = plus_bootstrap(raw.config.clone(), guest_agent);
            if agent.config != want {
                wrong.push(format!(
                    "{name}: cloud-init assembled\n  {}\nwanted\n  {}",
                    agent.config, want
                ));
            }
            if agent.scripts != raw.scripts || agent.warnings != raw.warnings {
                wrong.push(format!(
                    "{name}: scripts or warnings differ: {agent:?} vs {raw:?}"
                ));
            }
            // The caller's vendor parts reach the handlers unchanged, then at most the
            // bootstrap.
            let vendor_parts = match agent.vendor_parts.split_last() {
                Some((last, before)) if last.merge_type.as_deref() == Some(MERGE_TYPE) => before,
                _ => &agent.vendor_parts[..],
            };
            if content(vendor_parts) != content(&raw.vendor_parts) {
                wrong.push(format!(
                    "{name}: the vendor's parts changed: {:?} vs {:?}",
                    agent.vendor_parts, raw.vendor_parts
                ));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    }
}

#[test]
fn vendor_data_stays_the_callers_when_the_bootstrap_has_nothing_to_add_there() {
    let vendor = b"#cloud-config\nntp: {enabled: true}\n";
    let user = b"#!/bin/sh\necho user\n";
    let docs = seed_documents(user, Some(vendor), GuestAgent::Install).unwrap();
    assert_eq!(docs.vendor_data.as_deref(), Some(&vendor[..]));
    let assembled = assemble(&[&docs.user_data], Some(vendor));
    assert_eq!(assembled[0].config["ntp"], json!({"enabled": true}));
    assert_eq!(
        assembled[0].config["packages"],
        json!([GUEST_AGENT_PACKAGE])
    );
    assert_eq!(
        assembled[0].scripts.values().next().map(String::as_str),
        Some(
            base64::engine::general_purpose::STANDARD
                .encode(user)
                .as_str()
        )
    );
}

/// What `docs/kvm-agent.md` says of an `#include` that cannot be fetched: cloud-init
/// stops before it applies any part, the bootstrap's included.
#[test]
fn an_include_that_cannot_be_fetched_stops_cloud_init_before_anything_applies() {
    let user = b"#include\nfile:///nonexistent/egressproxy-included.yaml\n";
    let seeded = seed_documents(user, None, GuestAgent::Install)
        .unwrap()
        .user_data;
    let dir = tempfile::tempdir().unwrap();
    let out = spawn_oracle(dir.path(), "include", &[(&seeded, None)])
        .wait_with_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "cloud-init went on: {stderr}");
    assert!(
        stderr.contains("for url: file:///nonexistent/egressproxy-included.yaml"),
        "{stderr}"
    );
    assert!(
        stderr.contains("UserDataProcessor") || stderr.contains("user_data.py"),
        "{stderr}"
    );
}
