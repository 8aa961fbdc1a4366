//! Where the machine's CPU went, read from `/proc`: benchmarks that time a guest's boot
//! print what everything else took meanwhile, so that a slow boot explains itself.
//!
//! [`sample`] reads the machine's busy time (`/proc/stat`: user, nice, system, irq,
//! softirq and steal; a guest's own time is inside user) and the time of every QEMU
//! process (`/proc/<pid>/stat`, for a TCG guest almost all of it its vCPUs);
//! [`CpuSample::since`] turns two samples into seconds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;

/// The kernel's clock tick for `/proc` times (`USER_HZ`, 100 on every Linux ABI).
const TICKS_PER_SECOND: f64 = 100.0;

/// A process told apart from a later one that reuses its pid: pid and start time.
type ProcessId = (u32, u64);

/// Cumulative CPU ticks at one moment.
#[derive(Debug, Clone)]
pub struct CpuSample {
    at: Instant,
    busy: u64,
    /// Each QEMU process's user and system ticks.
    guests: HashMap<ProcessId, u64>,
}

/// The CPU used between two samples, in seconds.
#[derive(Debug, Clone, Copy)]
pub struct CpuUse {
    /// The time between the samples.
    pub wall: Duration,
    /// By every process of the machine.
    pub busy: f64,
    /// By the guests' QEMU processes.
    pub guests: f64,
}

impl CpuUse {
    /// By everything but the guests: the stack, the benchmark, the rest of the machine.
    pub fn besides_guests(&self) -> f64 {
        (self.busy - self.guests).max(0.0)
    }
}

/// Reads the machine's busy ticks and the QEMU processes' ticks.
pub fn sample() -> anyhow::Result<CpuSample> {
    let stat = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
    let total = stat
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("cpu "))
        .context("/proc/stat has no cpu line")?;
    let fields: Vec<u64> = total
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| fields.get(i).copied().unwrap_or(0))
        .sum();
    Ok(CpuSample {
        at: Instant::now(),
        busy,
        guests: qemu_ticks(),
    })
}

impl CpuSample {
    /// What was used from `earlier` until this sample. A guest started in between
    /// counts from zero; one that exited in between takes its ticks with it: sample
    /// while it runs.
    pub fn since(&self, earlier: &CpuSample) -> CpuUse {
        let seconds = |ticks: u64| ticks as f64 / TICKS_PER_SECOND;
        let guests = self
            .guests
            .iter()
            .map(|(process, now)| {
                now.saturating_sub(earlier.guests.get(process).copied().unwrap_or(0))
            })
            .sum();
        CpuUse {
            wall: self.at.duration_since(earlier.at),
            busy: seconds(self.busy.saturating_sub(earlier.busy)),
            guests: seconds(guests),
        }
    }
}

/// User and system ticks of every QEMU process (`qemu-system-*`, or `qemu-kvm` as some
/// distributions name it), by process.
fn qemu_ticks() -> HashMap<ProcessId, u64> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return HashMap::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let (head, rest) = stat.rsplit_once(')')?;
            let name = head.split_once('(')?.1;
            if !(name.starts_with("qemu-system") || name == "qemu-kvm") {
                return None;
            }
            // After the name: state is field 3, utime 14, stime 15, starttime 22.
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            let started: u64 = fields.get(19)?.parse().ok()?;
            Some(((pid, started), utime + stime))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_grows_with_work_done_here() {
        let before = sample().unwrap();
        let started = std::time::Instant::now();
        let mut x = 0u64;
        while started.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = sample().unwrap().since(&before);
        assert!(used.busy >= 0.2, "300 ms of spinning counted as {used:?}");
        assert!(used.wall >= std::time::Duration::from_millis(300));
        assert!(used.besides_guests() <= used.busy);
    }
}
