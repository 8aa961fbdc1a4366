//! Durations in the configuration: humantime's notation (`10s`, `1m 30s`, `2h`) on the way
//! in, and the range each setting may take.

use std::fmt;
use std::time::Duration;

use serde::Deserializer;

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_str(DurationVisitor)
}

/// Fails inside the YAML deserializer, while it is still at the value: the error then
/// carries the field's own path and line, not those of the enclosing mapping.
struct DurationVisitor;

impl serde::de::Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration such as \"10s\" or \"1m 30s\"")
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Duration, E> {
        humantime::parse_duration(text).map_err(|e| {
            E::custom(format!(
                "{text:?} is not a duration ({e}); write e.g. \"10s\" or \"1m 30s\""
            ))
        })
    }
}

/// The range a duration setting may take. A value outside it is a typo (`90000s` for
/// `90s`) or a setting that would make the agent look hung (a call that may wait a day)
/// or busy-loop (a keepalive every millisecond); neither is worth starting with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationBounds {
    /// The shortest value that makes sense.
    pub min: Duration,
    /// The longest value that makes sense.
    pub max: Duration,
    /// Why the minimum is what it is, when that is not obvious.
    pub min_reason: &'static str,
}

impl DurationBounds {
    const fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            min_reason: "",
        }
    }

    /// `Err` with what is wrong and the allowed range when `value` is outside the bounds.
    pub fn check(&self, value: Duration) -> Result<(), String> {
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if value.is_zero() {
            Err(format!(
                "must be longer than zero; use {} to {}",
                show(self.min),
                show(self.max)
            ))
        } else if value < self.min {
            Err(format!(
                "{} is below the minimum {}{}",
                show(value),
                show(self.min),
                self.min_reason
            ))
        } else if value > self.max {
            Err(format!(
                "{} is above the maximum {}",
                show(value),
                show(self.max)
            ))
        } else {
            Ok(())
        }
    }
}

const SECOND: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

/// `transport.sshHandshakeTimeout`: a handshake over a slow WAN link takes seconds; ten
/// minutes without one means the host is not there.
pub(super) const SSH_HANDSHAKE_TIMEOUT: DurationBounds =
    DurationBounds::new(Duration::from_millis(100), Duration::from_secs(600));
/// `transport.sshKeepaliveInterval`: a dead session is found after `sshKeepaliveMax`
/// intervals; more than ten minutes leaves calls hanging on a dead host for too long.
pub(super) const SSH_KEEPALIVE_INTERVAL: DurationBounds =
    DurationBounds::new(Duration::from_millis(100), Duration::from_secs(600));
/// `transport.libvirtKeepaliveInterval`: libvirt takes whole seconds.
pub(super) const LIBVIRT_KEEPALIVE_INTERVAL: DurationBounds = DurationBounds {
    min: SECOND,
    max: Duration::from_secs(600),
    min_reason: "; libvirt counts keepalives in whole seconds",
};
/// `transport.defaultCallTimeout`: a libvirt call that has not answered in an hour will
/// not; the operator's own calls carry shorter deadlines anyway.
pub(super) const DEFAULT_CALL_TIMEOUT: DurationBounds =
    DurationBounds::new(Duration::from_millis(100), HOUR);
/// `transport.imageDownloadTimeout`: a base image is a few hundred MiB to a few GiB; a
/// day covers a slow link, and less than a minute cannot fetch and upload one.
pub(super) const IMAGE_DOWNLOAD_TIMEOUT: DurationBounds =
    DurationBounds::new(MINUTE, Duration::from_secs(24 * 3600));
