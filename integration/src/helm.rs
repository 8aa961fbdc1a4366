//! The project's Helm chart driven by the real `helm` and `kubectl` binaries, the way a
//! user installs it.
//!
//! - [`chart_dir`]: `charts/egressproxy` in this repository.
//! - [`Helm`]: `helm` with a kubeconfig: `lint`, `template`, `install`, `upgrade`,
//!   `uninstall`; each returns stdout, or an error holding helm's stderr (the message a
//!   user would see, which the schema tests assert on).
//! - [`Kubectl`]: `kubectl` with a kubeconfig, for server-side dry runs and
//!   `auth can-i --as`.
//!
//! Both render against the apiserver's version with `--kube-version` when they do not
//! talk to it, because the chart requires a recent Kubernetes and `helm template`
//! otherwise assumes an old one.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::tools;

/// Kubernetes version `helm template` renders for (the kube-harness's apiserver).
pub const KUBE_VERSION: &str = "1.37.2";

/// `charts/egressproxy` of this repository.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/egressproxy")
}

/// The example values files shipped with the chart, sorted by name.
pub fn example_values() -> anyhow::Result<Vec<PathBuf>> {
    let dir = chart_dir().join("examples");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "yaml") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Runs `command`, feeding `stdin`; stdout on success, else an error with stderr.
fn run(mut command: Command, stdin: Option<&str>) -> anyhow::Result<String> {
    let shown = format!("{command:?}");
    command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().with_context(|| format!("spawn {shown}"))?;
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().context("stdin")?;
        pipe.write_all(text.as_bytes())
            .with_context(|| format!("write stdin of {shown}"))?;
    }
    let output = child
        .wait_with_output()
        .with_context(|| format!("wait for {shown}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "{shown} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            stdout
        );
    }
    Ok(stdout)
}

/// `helm` against one cluster, with its state (cache, config) in a private directory.
#[derive(Debug)]
pub struct Helm {
    binary: PathBuf,
    kubeconfig: PathBuf,
    home: tempfile::TempDir,
}

impl Helm {
    /// `helm` from the tools cache, talking to the cluster of `kubeconfig`.
    pub fn new(kubeconfig: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            binary: tools::bin("helm")?,
            kubeconfig: kubeconfig.to_owned(),
            home: tempfile::tempdir().context("helm home directory")?,
        })
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        let home = self.home.path();
        command
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"));
        command
    }

    /// `helm lint --strict` with `values` files.
    pub fn lint(&self, values: &[&Path]) -> anyhow::Result<String> {
        let mut command = self.command();
        command.arg("lint").arg("--strict").arg(chart_dir());
        for file in values {
            command.arg("-f").arg(file);
        }
        run(command, None)
    }

    /// `helm template` of release `release` in `namespace` with `values` files and
    /// `--set` pairs.
    pub fn template(
        &self,
        release: &str,
        namespace: &str,
        values: &[&Path],
        set: &[&str],
    ) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args(["template", release]).arg(chart_dir()).args([
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
        ]);
        add_values(&mut command, values, set);
        run(command, None)
    }

    /// `helm install` (no waiting: the test apiserver runs no pods).
    pub fn install(
        &self,
        release: &str,
        namespace: &str,
        values: &[&Path],
        set: &[&str],
    ) -> anyhow::Result<String> {
        let mut command = self.command();
        command
            .args(["install", release])
            .arg(chart_dir())
            .args(["--namespace", namespace]);
        add_values(&mut command, values, set);
        run(command, None)
    }

    /// The NOTES.txt a user would see after `helm install` with `values` files, from an
    /// install with `--dry-run=server` (nothing is stored).
    pub fn install_notes(
        &self,
        release: &str,
        namespace: &str,
        values: &[&Path],
    ) -> anyhow::Result<String> {
        let mut command = self.command();
        command
            .args(["install", release, "--dry-run=server"])
            .arg(chart_dir())
            .args(["--namespace", namespace]);
        add_values(&mut command, values, &[]);
        let output = run(command, None)?;
        let (_, notes) = output
            .split_once("\nNOTES:\n")
            .context("helm install printed no NOTES")?;
        Ok(notes.to_owned())
    }

    /// `helm upgrade` with new values (replacing, not reusing, the old ones).
    pub fn upgrade(
        &self,
        release: &str,
        namespace: &str,
        values: &[&Path],
        set: &[&str],
    ) -> anyhow::Result<String> {
        let mut command = self.command();
        command
            .args(["upgrade", release])
            .arg(chart_dir())
            .args(["--namespace", namespace]);
        add_values(&mut command, values, set);
        run(command, None)
    }

    /// The hooks of installed release `release` (`helm get hooks`), as YAML.
    pub fn get_hooks(&self, release: &str, namespace: &str) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args(["get", "hooks", release, "--namespace", namespace]);
        run(command, None)
    }

    /// `helm test` of installed release `release`; fails when a test pod fails or does
    /// not finish within `timeout` (helm's `--timeout`). No `--logs`: helm reads the logs
    /// after the hook's delete policy removed a pod that succeeded, and then fails.
    pub fn test(&self, release: &str, namespace: &str, timeout: &str) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args([
            "test",
            release,
            "--namespace",
            namespace,
            "--timeout",
            timeout,
        ]);
        run(command, None)
    }

    /// `helm uninstall`.
    pub fn uninstall(&self, release: &str, namespace: &str) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args(["uninstall", release, "--namespace", namespace]);
        run(command, None)
    }

    /// `helm uninstall --no-hooks`: the test apiserver runs no pods, so a hook's Job
    /// would never finish (tests run the hook's pod themselves, with
    /// [`crate::chart_pod::run_pod_to_completion`]).
    pub fn uninstall_without_hooks(
        &self,
        release: &str,
        namespace: &str,
    ) -> anyhow::Result<String> {
        let mut command = self.command();
        command.args(["uninstall", release, "--namespace", namespace, "--no-hooks"]);
        run(command, None)
    }
}

fn add_values(command: &mut Command, values: &[&Path], set: &[&str]) {
    for file in values {
        command.arg("-f").arg(file);
    }
    for pair in set {
        command.args(["--set", pair]);
    }
}

/// `kubectl` (the machine's) against one cluster.
#[derive(Debug, Clone)]
pub struct Kubectl {
    kubeconfig: PathBuf,
}

impl Kubectl {
    /// `kubectl` talking to the cluster of `kubeconfig`.
    pub fn new(kubeconfig: &Path) -> Self {
        Self {
            kubeconfig: kubeconfig.to_owned(),
        }
    }

    /// `kubectl` with `args`; stdout, or an error with stderr.
    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        let mut command = Command::new("kubectl");
        command.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        run(command, stdin)
    }

    /// Sends `manifests` (multi-document YAML) to the apiserver as a server-side apply
    /// with `--dry-run=server`: admission, schemas and CEL rules run, nothing is stored.
    pub fn dry_run_apply(&self, manifests: &str) -> anyhow::Result<String> {
        self.run(
            &[
                "apply",
                "--server-side",
                "--dry-run=server",
                "--field-manager=egressproxy-chart-test",
                "-f",
                "-",
            ],
            Some(manifests),
        )
    }

    /// What of Helm release `release` is in the cluster: the objects labelled with its
    /// instance in `namespace` (every kind the chart makes) and cluster-wide, and every
    /// Lease in `namespace` (the operator makes its leader Lease itself, so no label
    /// tells it; a test's namespace holds no other). Empty once it is uninstalled.
    pub fn release_leftovers(&self, namespace: &str, release: &str) -> Vec<String> {
        let label = format!("app.kubernetes.io/instance={release}");
        let questions: [Vec<&str>; 3] = [
            vec![
                "get",
                "all,configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,\
                 poddisruptionbudgets",
                "-n",
                namespace,
                "-l",
                &label,
            ],
            vec!["get", "clusterroles,clusterrolebindings", "-l", &label],
            vec!["get", "leases", "-n", namespace],
        ];
        let mut left = Vec::new();
        for question in questions {
            let mut args = question;
            args.extend(["-o", "name"]);
            match self.run(&args, None) {
                Ok(names) => left.extend(names.lines().map(str::to_owned)),
                Err(err) => left.push(format!("(could not list: {err:#})")),
            }
        }
        left
    }

    /// Whether `user` may do what `question` asks (`kubectl auth can-i --as USER
    /// QUESTION...`, e.g. `["get", "secrets", "-n", "team-a"]` or
    /// `["patch", "proxies.egressproxy.dev", "--subresource=status", "-A"]`).
    pub fn can_i(&self, user: &str, question: &[&str]) -> anyhow::Result<bool> {
        let output = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["auth", "can-i", "--as", user])
            .args(question)
            .stdin(Stdio::null())
            .output()
            .context("run kubectl auth can-i")?;
        // "yes" (exit 0) or "no" (exit 1); anything else is an error.
        match String::from_utf8_lossy(&output.stdout).trim() {
            "yes" => Ok(true),
            "no" => Ok(false),
            other => bail!(
                "kubectl auth can-i --as {user} {}: unexpected answer {other:?}: {}",
                question.join(" "),
                String::from_utf8_lossy(&output.stderr)
            ),
        }
    }
}
