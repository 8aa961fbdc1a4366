//! The one wait for a condition nothing can be watched for: a count in a process's
//! memory or `/proc`, a `/metrics` or `/healthz` page, a server that is still starting
//! (nothing listens yet), a provider's call counters or instance list, spans held by an
//! exporter. Objects the apiserver serves are waited for by watching them; everything
//! else goes through [`eventually`], so no test of the workspace writes its own
//! sleep-and-look-again loop.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

/// The first pause between two looks; later pauses double up to [`LONGEST_PAUSE`], so
/// a quick change is seen at once and a slow one costs few looks.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two looks.
const LONGEST_PAUSE: Duration = Duration::from_millis(100);

/// Looks (`look`) until it finds what is awaited (`Ok`), and returns that. Each `Err`
/// is what the look saw instead; if nothing is found `within`, panics naming `what`
/// and the last thing seen. A look still running at the deadline is abandoned.
pub async fn eventually<T, Seen, Look, Fut>(what: &str, within: Duration, look: Look) -> T
where
    Seen: Display,
    Look: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Seen>>,
{
    match try_eventually(what, within, look).await {
        Ok(found) => found,
        Err(timed_out) => panic!("{timed_out}"),
    }
}

/// What [`try_eventually`] says when nothing was found in time.
#[derive(Debug)]
pub struct TimedOut {
    what: String,
    within: Duration,
    last_seen: String,
}

impl Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}; last seen: {}",
            self.within, self.what, self.last_seen
        )
    }
}

/// [`eventually`] for a caller that adds to the failure (a guest's console, a
/// daemon's log) before it fails the test: returns what went wrong instead of
/// panicking.
pub async fn try_eventually<T, Seen, Look, Fut>(
    what: &str,
    within: Duration,
    mut look: Look,
) -> Result<T, TimedOut>
where
    Seen: Display,
    Look: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Seen>>,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut pause = FIRST_PAUSE;
    let mut last_seen = String::from("nothing: the first look did not finish");
    loop {
        match tokio::time::timeout_at(deadline, look()).await {
            Ok(Ok(found)) => return Ok(found),
            Ok(Err(seen)) => last_seen = seen.to_string(),
            Err(_) => break,
        }
        if tokio::time::Instant::now() + pause >= deadline {
            break;
        }
        // Nothing to watch here: the next look is the only way to learn of a change.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
    Err(TimedOut {
        what: what.to_owned(),
        within,
        last_seen,
    })
}

/// A look at a counter for [`eventually`]: found once `count` has reached `target`,
/// else what was seen, counted in `unit` ("reconciles", "GetInstance calls").
pub fn count_reached(count: u64, target: u64, unit: &str) -> Result<(), String> {
    if count >= target {
        Ok(())
    } else {
        Err(format!("{count} {unit}, waiting for {target}"))
    }
}
