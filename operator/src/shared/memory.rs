//! Giving freed memory back to the system once a burst of work is over.
//!
//! glibc's allocator keeps what a thread freed in that thread's arena, and returns pages
//! to the system only from the top of the main heap. After thousands of Proxies came
//! and went, most of the pages they used hold nothing live, yet stay resident: the
//! operator would keep its peak for ever. `malloc_trim(0)` releases every whole free
//! page of every arena.
//!
//! The flow: forgetting a Proxy [`marks`](Trimmer::mark) the trimmer; its task
//! ([`Trimmer::run`]) waits for a mark, then for [`QUIET`] without another (a mass
//! delete forgets Proxies for a minute; trimming in the middle would only hand back
//! pages about to be reused), but no longer than [`AT_MOST_EVERY`] while marks keep
//! coming, and trims. glibc walks and locks each arena while it trims, which takes
//! about a millisecond here, so trimming at most once per quiet moment costs nothing
//! measurable. Other allocators (musl's) return memory on their own: there it does
//! nothing. ADR 0036 says why this is a libc call and not another allocator.
//!
//! A trim hands back only free pages, and a map keyed by Proxy keeps the table it grew
//! to at its peak after its entries are gone: `tables::shrink_when_sparse`, called
//! after each removal, gives the table back too once most of it is empty.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::metrics::Metrics;

/// How long no Proxy must have been forgotten before the trimmer trims.
pub const QUIET: Duration = Duration::from_secs(2);
/// The longest a trim waits for quiet while Proxies keep being forgotten.
pub const AT_MOST_EVERY: Duration = Duration::from_secs(60);

/// Trims the allocator after Proxies were forgotten (module docs).
#[derive(Debug)]
pub struct Trimmer {
    marked: Notify,
    marks: Mutex<Marks>,
    metrics: Arc<Metrics>,
}

/// How many marks were made, and how many of them the last finished trim covered.
#[derive(Debug, Default)]
struct Marks {
    made: u64,
    trimmed: u64,
}

impl Trimmer {
    /// A trimmer that reports in `metrics`: `egressproxy_allocator_trim_pending` is 1
    /// from a mark until a trim that started after it has finished, and
    /// `egressproxy_allocator_trims_total` counts finished trims. A reader that sees
    /// nothing pending knows the memory freed before it looked went back.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Trimmer {
            marked: Notify::new(),
            marks: Mutex::default(),
            metrics,
        }
    }

    /// Says that memory was freed: the next quiet moment trims.
    pub fn mark(&self) {
        {
            let mut marks = self.marks.lock().expect("trimmer marks poisoned");
            marks.made += 1;
            // Set under the lock, so a trim finishing meanwhile cannot clear it after.
            self.metrics.set_allocator_trim_pending(true);
        }
        // A mark made while the task trims is kept (one stored permit) and starts the
        // next wait, so no burst goes untrimmed.
        self.marked.notify_one();
    }

    /// Trims after each burst of marks, for ever. The trim locks each arena in turn,
    /// for longer the larger and more scattered the heap: it runs in `block_in_place`,
    /// so the tasks queued on this worker move to the others meanwhile.
    ///
    /// # Panics
    ///
    /// On a current-thread runtime, where `block_in_place` cannot hand tasks over.
    pub async fn run(&self) {
        self.run_with(|| {
            let started = Instant::now();
            let released = tokio::task::block_in_place(release_free_memory);
            tracing::debug!(released, took = ?started.elapsed(), "trimmed the allocator");
        })
        .await;
    }

    /// [`Trimmer::run`] with the trim given.
    async fn run_with(&self, mut trim: impl FnMut()) {
        loop {
            self.marked.notified().await;
            let first = Instant::now();
            while first.elapsed() < AT_MOST_EVERY {
                if tokio::time::timeout(QUIET, self.marked.notified())
                    .await
                    .is_err()
                {
                    break;
                }
            }
            self.trim_now(&mut trim);
        }
    }

    /// Runs one trim and records which marks it covered: those made before it started.
    fn trim_now(&self, trim: &mut impl FnMut()) {
        let covered = self.marks.lock().expect("trimmer marks poisoned").made;
        trim();
        let mut marks = self.marks.lock().expect("trimmer marks poisoned");
        marks.trimmed = covered;
        self.metrics.allocator_trimmed();
        self.metrics
            .set_allocator_trim_pending(marks.made > marks.trimmed);
    }
}

/// Asks the allocator to release its free pages; whether it released any.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[expect(unsafe_code, reason = "glibc's malloc_trim has no safe binding")]
pub fn release_free_memory() -> bool {
    // SAFETY: malloc_trim takes no pointer and touches only glibc's own free lists,
    // under the arena locks every other allocator call takes too.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Asks the allocator to release its free pages: nothing to ask outside glibc.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// The trimmer's task with a trim that counts.
    fn counting(trimmer: &Arc<Trimmer>) -> Arc<AtomicU32> {
        let trims = Arc::new(AtomicU32::new(0));
        tokio::spawn({
            let (trimmer, trims) = (trimmer.clone(), trims.clone());
            async move {
                trimmer
                    .run_with(|| {
                        trims.fetch_add(1, Ordering::SeqCst);
                    })
                    .await;
            }
        });
        trims
    }

    /// Lets the spawned task run up to the next instant it waits for.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    /// Marks `times` times, `apart` apart, letting the task run after each step.
    async fn mark_every(trimmer: &Trimmer, apart: Duration, times: u32) {
        for _ in 0..times {
            trimmer.mark();
            settle().await;
            tokio::time::advance(apart).await;
            settle().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_marks_trims_once_after_the_quiet_period() {
        let trimmer = Arc::new(Trimmer::new(Arc::default()));
        let trims = counting(&trimmer);
        settle().await;
        assert_eq!(trims.load(Ordering::SeqCst), 0, "a trim before any mark");
        mark_every(&trimmer, QUIET / 2, 5).await;
        assert_eq!(
            trims.load(Ordering::SeqCst),
            0,
            "a trim in the middle of a burst"
        );
        tokio::time::advance(QUIET).await;
        settle().await;
        assert_eq!(trims.load(Ordering::SeqCst), 1, "no trim once quiet");
        tokio::time::advance(AT_MOST_EVERY * 2).await;
        settle().await;
        assert_eq!(trims.load(Ordering::SeqCst), 1, "a trim without a mark");
    }

    #[tokio::test(start_paused = true)]
    async fn marks_that_never_stop_still_trim_at_most_a_period_apart() {
        let trimmer = Arc::new(Trimmer::new(Arc::default()));
        let trims = counting(&trimmer);
        settle().await;
        let marks = (AT_MOST_EVERY.as_millis() / (QUIET / 2).as_millis()) as u32 + 2;
        mark_every(&trimmer, QUIET / 2, marks).await;
        assert_eq!(
            trims.load(Ordering::SeqCst),
            1,
            "marks {QUIET:?} apart held off the trim"
        );
    }

    /// The metric's line, read as Prometheus would.
    fn pending(metrics: &Metrics) -> bool {
        metrics
            .encode()
            .lines()
            .any(|line| line == "egressproxy_allocator_trim_pending 1")
    }

    #[test]
    fn pending_is_cleared_by_a_trim_that_covers_every_mark() {
        let metrics = Arc::new(Metrics::default());
        let trimmer = Trimmer::new(metrics.clone());
        assert!(!pending(&metrics), "pending before any mark");
        trimmer.mark();
        assert!(pending(&metrics), "a mark left nothing pending");
        // A Proxy forgotten while the trim runs: that trim may have missed its memory.
        trimmer.trim_now(&mut || trimmer.mark());
        assert!(
            pending(&metrics),
            "a trim cleared a mark made after it started"
        );
        trimmer.trim_now(&mut || {});
        assert!(
            !pending(&metrics),
            "a trim after every mark left it pending"
        );
        assert!(
            metrics
                .encode()
                .contains("egressproxy_allocator_trims_total 2"),
            "trims not counted: {}",
            metrics.encode()
        );
    }
}
