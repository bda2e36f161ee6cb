//! Repeated warnings, rate-limited: a dead upstream under load would otherwise write one
//! warning per request. Warnings and errors are keyed by where they are logged and by their
//! field values (so each upstream, each error text, is its own key); each key may pass
//! [`BURST`] times per [`WINDOW`], and the rest are counted. When a window with suppressed
//! events ends, one line says how many were left out.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// Events of one key that pass per window.
pub const BURST: u32 = 5;
pub const WINDOW: Duration = Duration::from_secs(10);
/// Keys tracked at most; beyond, windows that have ended are forgotten first, and events of
/// keys that find no room pass (never lose a new kind of warning).
const MAX_KEYS: usize = 4096;
/// The example of a suppressed event quoted in its summary is cut to this many bytes.
const SAMPLE_BYTES: usize = 300;

struct Window {
    started: Instant,
    passed: u32,
    /// Left out in the current window.
    suppressed: u64,
    /// Left out in windows that have ended, not reported yet.
    unreported: u64,
    /// The event's message and fields, for the summary line.
    sample: String,
}

impl Window {
    /// Start a new window at `now` if the current one has ended.
    fn roll(&mut self, now: Instant) {
        if now.duration_since(self.started) >= WINDOW {
            self.unreported += std::mem::take(&mut self.suppressed);
            self.passed = 0;
            self.started = now;
        }
    }
}

/// The limiter's state, shared by the layer (which admits events) and the log writer's tick
/// (which reports suppressed ones).
#[derive(Clone, Default)]
pub struct RateLimit {
    windows: Arc<Mutex<HashMap<u64, Window>>>,
    suppressed: Arc<AtomicU64>,
}

impl RateLimit {
    /// Whether an event with `key` may pass at `now`; `sample` describes it (built only for
    /// a key seen for the first time).
    pub fn admit(&self, key: u64, now: Instant, sample: impl FnOnce() -> String) -> bool {
        let mut windows = self.windows.lock();
        if let Some(w) = windows.get_mut(&key) {
            w.roll(now);
            if w.passed < BURST {
                w.passed += 1;
                return true;
            }
            w.suppressed += 1;
            drop(windows);
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if windows.len() >= MAX_KEYS {
            windows.retain(|_, w| {
                now.duration_since(w.started) < WINDOW || w.suppressed + w.unreported > 0
            });
            if windows.len() >= MAX_KEYS {
                return true;
            }
        }
        windows.insert(
            key,
            Window {
                started: now,
                passed: 1,
                suppressed: 0,
                unreported: 0,
                sample: sample(),
            },
        );
        true
    }

    /// What was left out in windows that have ended, as (how many, an example); each is
    /// reported once. Keys whose window has ended with nothing to report are forgotten.
    pub fn ended(&self, now: Instant) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        let mut windows = self.windows.lock();
        windows.retain(|_, w| {
            w.roll(now);
            if w.unreported > 0 {
                out.push((std::mem::take(&mut w.unreported), w.sample.clone()));
            }
            w.passed > 0 || w.suppressed > 0
        });
        out
    }

    /// Events suppressed so far, for `/metrics`.
    pub fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }

    /// Say, through the process log, what was left out; called from the log writer's tick.
    pub fn report_ended(&self) {
        for (count, sample) in self.ended(Instant::now()) {
            tracing::warn!(
                suppressed = count,
                "repeated warning logged {BURST} times in {WINDOW:?} and then left out {count} more times: {sample}"
            );
        }
    }
}

/// The key and the example of an event: its call site and every field's value.
struct Describe {
    text: String,
}

impl Visit for Describe {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.text, "{value:?}");
        } else {
            let _ = write!(self.text, " {}={value:?}", field.name());
        }
    }
}

impl<S: Subscriber> Layer<S> for RateLimit {
    fn event_enabled(&self, event: &Event<'_>, _cx: Context<'_, S>) -> bool {
        // Info and below are not per-request in this code base; only warnings repeat.
        if *event.metadata().level() > Level::WARN {
            return true;
        }
        let mut describe = Describe {
            text: String::new(),
        };
        event.record(&mut describe);
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        event.metadata().callsite().hash(&mut hasher);
        describe.text.hash(&mut hasher);
        let key = hasher.finish();
        self.admit(key, Instant::now(), || {
            let mut sample = describe.text;
            if sample.len() > SAMPLE_BYTES {
                let mut cut = SAMPLE_BYTES;
                while !sample.is_char_boundary(cut) {
                    cut -= 1;
                }
                sample.truncate(cut);
                sample.push_str("...");
            }
            sample
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_passes_a_burst_per_window_and_the_rest_is_reported_once() {
        let limit = RateLimit::default();
        let t0 = Instant::now();
        let passed = (0..100)
            .filter(|i| {
                limit.admit(1, t0 + Duration::from_millis(*i), || {
                    "connect failed endpoint=10.0.0.1:80".into()
                })
            })
            .count();
        assert_eq!(passed, BURST as usize);
        assert_eq!(limit.suppressed(), 100 - u64::from(BURST));
        // Another key (another upstream) has its own budget.
        assert!(limit.admit(2, t0, || "connect failed endpoint=10.0.0.2:80".into()));
        // Nothing ended yet.
        assert!(limit.ended(t0 + Duration::from_secs(1)).is_empty());
        let later = t0 + WINDOW + Duration::from_millis(200);
        let ended = limit.ended(later);
        assert_eq!(
            ended,
            vec![(95, "connect failed endpoint=10.0.0.1:80".to_string())]
        );
        assert!(limit.ended(later).is_empty(), "reported twice");
        // A new window: the key passes again.
        assert!(limit.admit(1, later, || "connect failed endpoint=10.0.0.1:80".into()));
    }

    #[test]
    fn a_suppressed_count_survives_until_reported_even_when_the_key_comes_back() {
        let limit = RateLimit::default();
        let t0 = Instant::now();
        for _ in 0..(BURST + 3) {
            limit.admit(7, t0, || "x".into());
        }
        // The window ended, the key came back before the report ran.
        let later = t0 + WINDOW;
        assert!(limit.admit(7, later, || "x".into()));
        let ended = limit.ended(later + WINDOW);
        assert_eq!(ended, vec![(3, "x".to_string())]);
    }
}
