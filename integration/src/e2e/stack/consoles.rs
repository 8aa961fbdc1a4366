//! Records the serial console of every guest the private libvirtd starts, to
//! `consoles/<domain>.log` under the stack's directory, so a guest that never got an
//! address can be read after the fact: stalled in the firmware, in GRUB, in the kernel
//! or in cloud-init.
//!
//! A `virsh event --loop` child reports each domain start; the recorder then asks
//! `virsh ttyconsole` for the domain's pty and copies it to the file on a thread of its
//! own until QEMU closes it. QEMU puts the pty in raw mode when it creates it, so
//! reading the slave side here takes what the guest writes and echoes nothing back.
//! When the event stream ends (libvirtd restarted), it is opened again after a pause,
//! and the running domains are scanned once, so a guest started meanwhile is not missed.
//!
//! These files are the guests' output, not the product's logs; they stay out of the
//! `*.log` files of the stack's directory that tests grep for secrets.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the recorder waits before opening the event stream again after it ended.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// Lines of each console [`tails`] shows.
const TAIL_LINES: usize = 30;

/// Stops recording when dropped.
#[derive(Debug)]
pub(crate) struct ConsoleRecorder {
    stop: Arc<AtomicBool>,
    events: Arc<Mutex<Option<Child>>>,
}

impl ConsoleRecorder {
    /// Records the consoles of the libvirtd at `uri` into `dir` (created here).
    pub(crate) fn start(uri: String, dir: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        let stop = Arc::new(AtomicBool::new(false));
        let events = Arc::new(Mutex::new(None));
        let watcher = Watcher {
            uri,
            dir,
            stop: stop.clone(),
            events: events.clone(),
            recorded: HashSet::new(),
        };
        std::thread::Builder::new()
            .name("console-recorder".into())
            .spawn(move || watcher.run())?;
        Ok(Self { stop, events })
    }
}

impl Drop for ConsoleRecorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(mut child) = self.events.lock().ok().and_then(|mut c| c.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Watcher {
    uri: String,
    dir: PathBuf,
    stop: Arc<AtomicBool>,
    events: Arc<Mutex<Option<Child>>>,
    /// (domain, pty) pairs already being copied.
    recorded: HashSet<(String, String)>,
}

impl Watcher {
    fn run(mut self) {
        while !self.stop.load(Ordering::SeqCst) {
            let child = Command::new("virsh")
                .args(["-c", &self.uri, "event", "--loop", "--event", "lifecycle"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn();
            let Ok(mut child) = child else { return };
            let stdout = child.stdout.take();
            {
                let Ok(mut slot) = self.events.lock() else {
                    return;
                };
                // Checked under the lock the recorder's drop takes after setting it:
                // either it finds this child in the slot, or this sees `stop`.
                if self.stop.load(Ordering::SeqCst) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
                *slot = Some(child);
            }
            self.scan_running();
            if let Some(stdout) = stdout {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if let Some(domain) = started_domain(&line) {
                        self.record(domain);
                    }
                }
            }
            if let Ok(mut slot) = self.events.lock()
                && let Some(mut child) = slot.take()
            {
                let _ = child.kill();
                let _ = child.wait();
            }
            if !self.stop.load(Ordering::SeqCst) {
                std::thread::sleep(REOPEN_AFTER);
            }
        }
    }

    fn scan_running(&mut self) {
        let Some(out) = self.virsh(&["list", "--name"]) else {
            return;
        };
        for domain in out.lines().map(str::trim).filter(|d| !d.is_empty()) {
            self.record(domain);
        }
    }

    /// Starts copying `domain`'s console, unless it is copied already.
    fn record(&mut self, domain: &str) {
        let Some(pty) = self.virsh(&["ttyconsole", domain]) else {
            return;
        };
        let pty = pty.trim().to_owned();
        if pty.is_empty() || !self.recorded.insert((domain.to_owned(), pty.clone())) {
            return;
        }
        let file = self.dir.join(format!("{domain}.log"));
        let _ = std::thread::Builder::new()
            .name(format!("console-{domain}"))
            .spawn(move || copy_console(Path::new(&pty), &file));
    }

    fn virsh(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("virsh")
            .args(["-c", &self.uri])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The domain of a `virsh event` line reporting a start:
/// `event 'lifecycle' for domain 'NAME': Started Booted`.
fn started_domain(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("event 'lifecycle' for domain '")?;
    let (domain, what) = rest.split_once("': ")?;
    what.starts_with("Started").then_some(domain)
}

/// Appends what the pty at `pty` gives to `file` until it ends (EIO once QEMU exits).
fn copy_console(pty: &Path, file: &Path) {
    let Ok(mut console) = std::fs::File::open(pty) else {
        return;
    };
    let Ok(mut out) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
    else {
        return;
    };
    let _ = std::io::copy(&mut console, &mut out);
}

/// The last lines of every console recorded in `dir`, terminal escapes removed.
pub(crate) fn tails(dir: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return String::new();
    };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
    files.sort();
    files
        .iter()
        .map(|path| {
            let text = printable(&std::fs::read(path).unwrap_or_default());
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            last_lines(&format!("console {name}"), &text, TAIL_LINES)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `--- title (last lines)` and the last `count` non-blank lines of `text`.
pub(crate) fn last_lines(title: &str, text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(count)..];
    format!("--- {title} (last lines)\n{}", tail.join("\n"))
}

/// `bytes` as text without terminal control sequences (firmware and GRUB draw with
/// them) or other control characters but newlines and tabs.
fn printable(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                if chars.peek() == Some(&'[') {
                    chars.next();
                    // A CSI sequence ends with a byte in '@'..='~'.
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                } else if matches!(chars.next(), Some('(' | ')')) {
                    // A character set choice: one more byte.
                    chars.next();
                }
            }
            '\r' => {}
            '\n' | '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{printable, started_domain};

    #[test]
    fn started_domain_reads_only_start_events() {
        assert_eq!(
            started_domain("event 'lifecycle' for domain 'egressproxy-a-0': Started Booted"),
            Some("egressproxy-a-0")
        );
        assert_eq!(
            started_domain("event 'lifecycle' for domain 'egressproxy-a-0': Stopped Destroyed"),
            None
        );
        assert_eq!(started_domain("events received: 3"), None);
    }

    #[test]
    fn printable_drops_terminal_sequences_and_control_characters() {
        assert_eq!(
            printable(b"\x1b[2J\x1b[01;01HBdsDxe: loading\r\n\x1b(Bok\x07\n"),
            "BdsDxe: loading\nok\n"
        );
        assert_eq!(printable(b"\xffboot\tdone"), "\u{fffd}boot\tdone");
    }
}
