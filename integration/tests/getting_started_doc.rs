//! `docs/getting-started.md` as written: its agent config passes `kvm-agent
//! check-config`, every option its commands use exists in the binaries' `--help`, and
//! the files it names exist. The path itself (the same steps, run by the harness) is
//! `e2e_proxy.rs`.

use std::path::Path;
use std::process::Command;

use egressproxy_integration::doc_commands::fenced_blocks;
use egressproxy_integration::reference_provider::workspace_binary;

const DOC: &str = include_str!("../../docs/getting-started.md");

/// The fenced blocks of `lang` in the document.
fn blocks(lang: &str) -> Vec<String> {
    fenced_blocks(DOC, lang)
}

fn help(binary: &str, subcommand: Option<&str>) -> String {
    let mut command = Command::new(workspace_binary(binary).unwrap());
    command.args(subcommand).arg("--help");
    let out = command.output().unwrap();
    assert!(out.status.success(), "{binary} --help: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_agent_config_of_the_guide_passes_check_config() {
    let config = blocks("yaml")
        .into_iter()
        .find(|b| b.starts_with("hosts:"))
        .expect("the guide has the agent's config");
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("id_ed25519");
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", ""])
        .arg("-f")
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success(), "ssh-keygen: {out:?}");
    // The hypervisor's host key, as `ssh-keyscan` would have collected it.
    let host_key = std::fs::read_to_string(dir.path().join("id_ed25519.pub")).unwrap();
    let known_hosts = dir.path().join("known_hosts");
    std::fs::write(&known_hosts, format!("hv1.example.org {host_key}")).unwrap();
    let config = config
        .replace("/keys/id_ed25519", &key.display().to_string())
        .replace("/keys/known_hosts", &known_hosts.display().to_string())
        .replace("<hypervisor>", "hv1.example.org")
        .replace("<mirror>/<hash>.qcow2", "mirror.example.org/guest.qcow2")
        .replace("<sha256sum of the image>", &"0".repeat(64));
    assert!(
        !config.contains('<'),
        "every placeholder is filled in:\n{config}"
    );
    let file = dir.path().join("kvm-agent.yaml");
    std::fs::write(&file, &config).unwrap();
    let out = Command::new(workspace_binary("kvm-agent").unwrap())
        .args(["check-config", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvm-agent check-config of the guide's config:\n{config}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_commands_of_the_guide_use_options_that_exist() {
    let commands: Vec<String> = blocks("sh")
        .iter()
        .flat_map(|b| b.lines().map(str::to_owned).collect::<Vec<_>>())
        .collect();
    let mut checked = 0;
    for (binary, subcommand) in [
        ("kvm-agent", Some("serve")),
        ("kvm-agent", Some("check-host")),
        ("egressproxy-operator", None),
    ] {
        let prefix = match subcommand {
            Some(sub) => format!("{binary} {sub}"),
            None => format!("{binary} "),
        };
        let text = help(binary, subcommand);
        for line in commands.iter().filter(|l| l.contains(&prefix)) {
            // A command continued on the next line ends with a backslash.
            let index = commands.iter().position(|l| l == line).unwrap();
            let mut full = line.clone();
            let mut next = index + 1;
            while full.trim_end().ends_with('\\') && next < commands.len() {
                full.push_str(&commands[next]);
                next += 1;
            }
            for option in full.split_whitespace().filter(|w| w.starts_with("--")) {
                assert!(
                    text.contains(option),
                    "`{prefix}` has no option {option} (guide line: {full})"
                );
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 6,
        "the guide's commands were found ({checked} options)"
    );
}

#[test]
fn the_files_the_guide_names_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for path in [
        "integration/tools/install-system-packages.sh",
        "integration/guest-image/build.sh",
        "charts/egressproxy/files/crds.yaml",
        "docs/examples/proxy-squid.yaml",
    ] {
        assert!(DOC.contains(path), "the guide names {path}");
        assert!(root.join(path).exists(), "{path} exists");
    }
}
