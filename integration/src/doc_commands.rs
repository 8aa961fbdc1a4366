//! A document's commands run as written: the fenced blocks of a Markdown file, found by
//! their heading, with the names that differ from site to site filled in, then run by
//! bash the way a user pastes them.
//!
//! 1. [`fenced_blocks`] / [`blocks_under`]: the blocks of one language, in the whole
//!    document or under one heading (up to the next heading, whatever its level).
//! 2. [`fill_in`]: each `(as written, here)` pair replaces every occurrence; a pair that
//!    matches nothing is an error, so a document that changed fails the test instead of
//!    running something else than it says.
//! 3. [`DocShell::run`] runs a block with `bash -euo pipefail` in one directory, with
//!    the cluster's kubeconfig and the pinned tools first on `PATH`;
//!    [`DocShell::run_command`] runs one command of [`commands_of`] and keeps its
//!    outcome, for a block whose commands a test expects to fail (a refused uninstall).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::tools;

/// The fenced blocks of `lang` (the word after the opening fence) in `doc`, in order.
pub fn fenced_blocks(doc: &str, lang: &str) -> Vec<String> {
    blocks_in(doc.lines(), lang)
}

/// The fenced blocks of `lang` under the heading whose text (after the `#`s) starts with
/// `heading`, up to the next heading of any level.
pub fn blocks_under(doc: &str, heading: &str, lang: &str) -> anyhow::Result<Vec<String>> {
    let mut section: Option<Vec<&str>> = None;
    let mut in_fence = false;
    for line in doc.lines() {
        let is_heading = !in_fence && line.starts_with('#');
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        }
        match &mut section {
            None if is_heading && heading_text(line).starts_with(heading) => {
                section = Some(Vec::new());
            }
            Some(_) if is_heading => break,
            Some(lines) => lines.push(line),
            None => {}
        }
    }
    let Some(lines) = section else {
        bail!("the document has no heading that starts with {heading:?}");
    };
    Ok(blocks_in(lines.into_iter(), lang))
}

/// The text of a heading line: `## 2a. Agent…` is `"2a. Agent…"`.
fn heading_text(line: &str) -> &str {
    line.trim_start_matches('#').trim()
}

fn blocks_in<'a>(lines: impl Iterator<Item = &'a str>, lang: &str) -> Vec<String> {
    let opening = format!("```{lang}");
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in lines {
        let trimmed = line.trim();
        match &mut current {
            Some(block) if trimmed == "```" => {
                found.push(std::mem::take(block));
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None if trimmed == opening => current = Some(String::new()),
            None => {}
        }
    }
    found
}

/// `block` with every `(as_written, here)` pair replaced; an error names a pair that is
/// not in the block.
pub fn fill_in(block: &str, pairs: &[(&str, String)]) -> anyhow::Result<String> {
    let mut filled = block.to_owned();
    for (as_written, here) in pairs {
        if !filled.contains(as_written) {
            bail!("the document's block no longer says {as_written:?}:\n{block}");
        }
        filled = filled.replace(as_written, here);
    }
    Ok(filled)
}

/// What one command line of a block did.
#[derive(Debug, Clone)]
pub struct LineOutcome {
    /// The line as run.
    pub line: String,
    /// Whether it exited 0.
    pub succeeded: bool,
    /// Its standard output and standard error, in that order.
    pub output: String,
}

/// Runs a document's blocks as a user would, in one working directory.
#[derive(Debug)]
pub struct DocShell {
    dir: PathBuf,
    env: Vec<(String, OsString)>,
}

impl DocShell {
    /// A shell in `dir` that talks to the cluster of `kubeconfig`, with the pinned tools
    /// (helm, grpcurl) first on `PATH` and helm's state in `dir`.
    pub fn new(dir: &Path, kubeconfig: &Path) -> anyhow::Result<Self> {
        let mut path = OsString::from(tools::bin_dir()?);
        path.push(":");
        path.push(std::env::var_os("PATH").unwrap_or_default());
        let helm_home = dir.join(".helm");
        Ok(Self {
            dir: dir.to_owned(),
            env: vec![
                ("PATH".into(), path),
                ("KUBECONFIG".into(), kubeconfig.into()),
                ("HELM_CACHE_HOME".into(), helm_home.join("cache").into()),
                ("HELM_CONFIG_HOME".into(), helm_home.join("config").into()),
                ("HELM_DATA_HOME".into(), helm_home.join("data").into()),
            ],
        })
    }

    /// The working directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn bash(&self, script: &str) -> anyhow::Result<std::process::Output> {
        Command::new("bash")
            .args(["-euo", "pipefail", "-c", script])
            .current_dir(&self.dir)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .context("run bash")
    }

    /// Runs `block` whole; its output, or an error with the block and its output.
    pub fn run(&self, block: &str) -> anyhow::Result<String> {
        let output = self.bash(block)?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if !output.status.success() {
            bail!(
                "the block failed ({}):\n{block}\n--- output\n{text}",
                output.status
            );
        }
        Ok(text)
    }

    /// Runs one command (see [`commands_of`]) and keeps its outcome, failed or not.
    pub fn run_command(&self, command: &str) -> anyhow::Result<LineOutcome> {
        let output = self.bash(command)?;
        Ok(LineOutcome {
            line: command.to_owned(),
            succeeded: output.status.success(),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        })
    }
}

/// The commands of a block, each to run on its own: its lines that are not empty or
/// comments, a line ending in `\` joined with the next.
pub fn commands_of(block: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut pending = String::new();
    for line in block.lines() {
        let trimmed = line.trim();
        if pending.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if let Some(start) = trimmed.strip_suffix('\\') {
            pending.push_str(start);
            pending.push(' ');
            continue;
        }
        pending.push_str(trimmed);
        commands.push(std::mem::take(&mut pending));
    }
    commands
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "# Title\n\
        ```sh\nintro\n```\n\
        ## 2a. In the cluster\n\
        text\n\
        ```sh\nkubectl create namespace x\n```\n\
        ```yaml\na: 1\n```\n\
        ### A detail\n\
        ```sh\n# Not a heading: a comment in a block\ndetail\n```\n\
        ## 2b. Elsewhere\n\
        ```sh\nelsewhere\n```\n";

    #[test]
    fn a_section_holds_its_blocks_up_to_the_next_heading() {
        assert_eq!(
            blocks_under(DOC, "2a.", "sh").unwrap(),
            ["kubectl create namespace x\n"]
        );
        assert_eq!(
            blocks_under(DOC, "A detail", "sh").unwrap(),
            ["# Not a heading: a comment in a block\ndetail\n"]
        );
        assert_eq!(blocks_under(DOC, "2a.", "yaml").unwrap(), ["a: 1\n"]);
        assert_eq!(blocks_under(DOC, "2b.", "sh").unwrap(), ["elsewhere\n"]);
        let missing = blocks_under(DOC, "9.", "sh").unwrap_err().to_string();
        assert!(missing.contains("\"9.\""), "{missing}");
    }

    #[test]
    fn every_block_of_a_language_in_order() {
        assert_eq!(
            fenced_blocks(DOC, "sh"),
            [
                "intro\n",
                "kubectl create namespace x\n",
                "# Not a heading: a comment in a block\ndetail\n",
                "elsewhere\n"
            ]
        );
    }

    #[test]
    fn filling_in_a_name_the_block_does_not_have_is_an_error() {
        let block = "kubectl create namespace egressproxy\n";
        assert_eq!(
            fill_in(
                block,
                &[("namespace egressproxy", "namespace e2e-1".into())]
            )
            .unwrap(),
            "kubectl create namespace e2e-1\n"
        );
        let drifted = fill_in(block, &[("hv1.example.org", "192.0.2.1".into())])
            .unwrap_err()
            .to_string();
        assert!(drifted.contains("hv1.example.org"), "{drifted}");
    }

    #[test]
    fn commands_skip_comments_and_join_continued_lines() {
        let block = "# a comment\nhelm uninstall x   # fails\n\n\
                     kubectl logs \\\n  job/y\n";
        assert_eq!(
            commands_of(block),
            ["helm uninstall x   # fails", "kubectl logs  job/y"]
        );
    }
}
