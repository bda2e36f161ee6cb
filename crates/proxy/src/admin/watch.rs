//! The reload triggers of a node started from a file: SIGHUP (at once) and a change to the
//! file (once it has settled).
//!
//! An editor or a `cp` writes a file in several steps, and a copy cut short can still parse
//! (a config that lost its last routes is a valid config). So a change is applied only when
//! the file has stayed the same (size, modification time and content) for [`SETTLE`]. The
//! safe way to update it is still to write a temporary file and rename it over the config
//! (docs/config.md); SIGHUP says "the file is ready" and is applied at once.

use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::control::{ConfigSource, Shared};

/// How often the file is looked at.
pub const POLL: Duration = Duration::from_millis(250);
/// How long a changed file must stay unchanged before it is applied.
pub const SETTLE: Duration = Duration::from_secs(1);

/// What identifies one version of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    len: u64,
    modified: Option<SystemTime>,
    content: u64,
}

impl Fingerprint {
    /// The file as it is now; `None` while it cannot be read (in the middle of a rename).
    pub fn of(path: &Path) -> Option<Fingerprint> {
        let meta = std::fs::metadata(path).ok()?;
        let bytes = std::fs::read(path).ok()?;
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut hasher);
        Some(Fingerprint {
            len: bytes.len() as u64,
            modified: meta.modified().ok(),
            content: hasher.finish(),
        })
    }
}

/// Decides when a changed file is settled enough to apply.
#[derive(Debug, Default)]
pub struct Settle {
    /// The version last applied (or refused): not applied again.
    applied: Option<Fingerprint>,
    /// A new version and when it was first seen.
    candidate: Option<(Fingerprint, Instant)>,
}

impl Settle {
    pub fn new(applied: Option<Fingerprint>) -> Settle {
        Settle {
            applied,
            candidate: None,
        }
    }

    /// The file looked like `now` at `at`: whether to apply it now.
    pub fn observe(&mut self, now: Option<Fingerprint>, at: Instant) -> bool {
        let Some(now) = now else {
            self.candidate = None;
            return false;
        };
        if Some(now) == self.applied {
            self.candidate = None;
            return false;
        }
        match self.candidate {
            Some((seen, since)) if seen == now => {
                if at.duration_since(since) >= SETTLE {
                    self.applied(now);
                    return true;
                }
                false
            }
            _ => {
                self.candidate = Some((now, at));
                false
            }
        }
    }

    /// `version` was applied by other means (SIGHUP).
    pub fn applied(&mut self, version: Fingerprint) {
        self.applied = Some(version);
        self.candidate = None;
    }
}

/// SIGHUP, or a settled change to the config file, re-reads the config.
pub async fn watch_reloads(shared: Arc<Shared>) {
    let ConfigSource::File(path) = shared.source.clone() else {
        return std::future::pending().await;
    };
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(err) => {
            tracing::warn!(error = %err, "cannot watch SIGHUP; reload by changing the file instead");
            None
        }
    };
    let mut settle = Settle::new(Fingerprint::of(&path));
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let by_signal = tokio::select! {
            _ = async { match hup.as_mut() { Some(h) => { h.recv().await; } None => std::future::pending().await } } => true,
            _ = tick.tick() => false,
        };
        let now = Fingerprint::of(&path);
        let apply = if by_signal {
            if let Some(version) = now {
                settle.applied(version);
            }
            true
        } else {
            settle.observe(now, Instant::now())
        };
        if apply {
            let shared = shared.clone();
            // Compiling a large config must not stall the admin endpoint.
            let _ = tokio::task::spawn_blocking(move || shared.reload_from_source()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(len: u64, content: u64) -> Option<Fingerprint> {
        Some(Fingerprint {
            len,
            modified: None,
            content,
        })
    }

    #[test]
    fn a_change_is_applied_only_once_it_has_settled() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s = Settle::new(version(10, 1));
        assert!(!s.observe(version(10, 1), at(0)), "unchanged");
        // The first half of a write: seen, not applied while it keeps changing.
        assert!(!s.observe(version(5, 2), at(250)));
        assert!(!s.observe(version(5, 2), at(750)));
        // The second half lands before the first settled: the clock starts again.
        assert!(!s.observe(version(20, 3), at(1000)));
        assert!(!s.observe(version(20, 3), at(1750)));
        assert!(s.observe(version(20, 3), at(2000)), "settled for 1 s");
        assert!(!s.observe(version(20, 3), at(2250)), "applied once");
        // A file that is briefly unreadable (a rename) is no change.
        assert!(!s.observe(None, at(2500)));
        assert!(!s.observe(version(20, 3), at(3750)));
    }

    #[test]
    fn a_signal_marks_the_file_applied() {
        let t0 = Instant::now();
        let mut s = Settle::new(version(1, 1));
        assert!(!s.observe(version(2, 2), t0));
        s.applied(Fingerprint {
            len: 2,
            modified: None,
            content: 2,
        });
        assert!(!s.observe(version(2, 2), t0 + SETTLE * 2));
    }
}
