//! Looking at and acting on the running stack from outside: kubectl in the run's
//! namespace, virsh on its libvirtd, files in guests and in the pool, curl from inside
//! the network namespace.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};

use super::Stack;
use crate::e2e::wait_for;
use crate::netns::command_in;

impl Stack {
    /// Field `path` (a kubectl jsonpath) of Proxy `name`; empty when the Proxy or the
    /// field does not exist (yet).
    pub fn proxy_field(&self, name: &str, path: &str) -> String {
        self.kubectl(&["get", "proxy", name, "-o", &format!("jsonpath={path}")])
            .unwrap_or_default()
    }

    /// `kubectl ARGS` against the apiserver, in this run's namespace.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(["--namespace", &self.kube.namespace])
            .args(args)
            .output()
            .context("run kubectl")?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// `kubectl apply -f -` of `manifest`.
    pub fn kubectl_apply(&self, manifest: &str) -> anyhow::Result<()> {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .args(["--namespace", &self.kube.namespace, "apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .context("kubectl stdin")?
            .write_all(manifest.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl apply: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// `virsh ARGS` against the private libvirtd.
    pub fn virsh(&self, args: &[&str]) -> anyhow::Result<String> {
        super::virsh(&self.libvirtd, args)
    }

    /// The contents of `path` in running `domain`'s guest, read through its
    /// qemu-guest-agent (`guest-file-open`, `-read`, `-close`).
    pub fn read_guest_file(&self, domain: &str, path: &str) -> anyhow::Result<String> {
        use base64::Engine;
        let call = |command: serde_json::Value| -> anyhow::Result<serde_json::Value> {
            let out = self.virsh(&["qemu-agent-command", domain, &command.to_string()])?;
            let answer: serde_json::Value = serde_json::from_str(&out)
                .with_context(|| format!("qemu-guest-agent's answer: {out}"))?;
            Ok(answer["return"].clone())
        };
        let handle = call(serde_json::json!({
            "execute": "guest-file-open",
            "arguments": {"path": path, "mode": "r"},
        }))?;
        let mut bytes = Vec::new();
        loop {
            let chunk = call(serde_json::json!({
                "execute": "guest-file-read",
                "arguments": {"handle": handle, "count": 65536},
            }))?;
            let data = chunk["buf-b64"].as_str().unwrap_or_default();
            bytes.extend(base64::engine::general_purpose::STANDARD.decode(data)?);
            if chunk["eof"].as_bool() != Some(false) {
                break;
            }
        }
        call(serde_json::json!({
            "execute": "guest-file-close",
            "arguments": {"handle": handle},
        }))?;
        String::from_utf8(bytes).with_context(|| format!("{path} in the guest is not UTF-8"))
    }

    /// Names of every domain (defined or running), sorted.
    pub fn domains(&self) -> anyhow::Result<Vec<String>> {
        let mut names: Vec<String> = self
            .virsh(&["list", "--all", "--name"])?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        names.sort();
        Ok(names)
    }

    /// Names of the files in `dir`, sorted (none when it does not exist).
    pub fn files_in(dir: &Path) -> Vec<String> {
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
    }

    /// `curl ARGS` run inside the network namespace: stdout, or the error.
    pub fn curl_in_netns(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = command_in(self.netns(), "curl").args(args).output()?;
        if !out.status.success() {
            bail!(
                "curl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Deletes the Proxy `name` without waiting in kubectl, then waits up to `within`
    /// until no Proxy is left in the namespace (its finalizer has run) and checks that
    /// no domain is left.
    pub async fn delete_proxy(&self, name: &str, within: Duration) {
        self.kubectl(&["delete", "proxy", name, "--wait=false"])
            .expect("kubectl delete proxy");
        wait_for(&format!("{name} to be gone"), within, || {
            self.kubectl(&["get", "proxies", "-o", "name"])
                .unwrap_or_default()
                .trim()
                .is_empty()
        })
        .await;
        assert_eq!(
            self.domains().expect("list domains"),
            Vec::<String>::new(),
            "no VM is left after deleting {name}"
        );
    }

    /// The last 40 lines of the operator's and the agent's logs and the last lines of
    /// every guest console, for a failed test's output; with the chart, the release's
    /// pods and the cluster's parts too.
    pub fn log_tails(&self) -> String {
        self.collect_pod_logs();
        let logs = ["operator.log", "kvm-agent.log"]
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(self.dir().join(name)).unwrap_or_default();
                super::consoles::last_lines(name, &text, 40)
            })
            .collect::<Vec<_>>()
            .join("\n");
        let consoles = super::consoles::tails(&self.dir().join(super::CONSOLES_DIR));
        format!("{logs}\n{consoles}\n{}", self.cluster_report())
    }
}
