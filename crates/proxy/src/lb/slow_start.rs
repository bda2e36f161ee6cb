//! Slow start (Envoy's `slow_start_config`): for `window` after an endpoint comes back, its
//! weight is scaled by max(min_weight_percent, (time since it came back / window)^(1/aggression)).
//!
//! An endpoint comes back when it is seen in again after being seen out (its health check
//! passes again, its ejection ends): the balancer reports each endpoint's state while it
//! looks at them anyway (while something is out, or while an endpoint seen out has not been
//! seen back), so nothing polls. An endpoint new in a config update starts ramping when the
//! snapshot is built. State lives per node, shared by workers, and survives reloads that keep
//! the endpoint ([`super::Registry`]). Time is tokio's clock.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// One cluster's slow-start state.
pub struct SlowStart {
    window_ms: u64,
    /// 1 / aggression.
    exponent: f64,
    min_fraction: f64,
    epoch: tokio::time::Instant,
    /// By endpoint: when it came back (clock ms); 0: not ramping.
    since: Box<[AtomicU64]>,
    /// By endpoint: seen out and not yet seen back.
    was_out: Box<[AtomicBool]>,
    /// How many `was_out` are set.
    watching: AtomicU32,
    /// No endpoint ramps after this (clock ms).
    ramp_until: AtomicU64,
}

impl SlowStart {
    pub fn new(config: &flatmesh_config::SlowStart, endpoints: usize) -> SlowStart {
        SlowStart {
            window_ms: u64::try_from(config.window.as_millis())
                .unwrap_or(u64::MAX / 4)
                .max(1),
            exponent: 1.0 / config.aggression.max(f64::MIN_POSITIVE),
            min_fraction: f64::from(config.min_weight_percent.min(100)) / 100.0,
            epoch: tokio::time::Instant::now(),
            since: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            was_out: (0..endpoints).map(|_| AtomicBool::new(false)).collect(),
            watching: AtomicU32::new(0),
            ramp_until: AtomicU64::new(0),
        }
    }

    /// The state for a new endpoint list: kept endpoints carry theirs over from `previous`
    /// (a reload neither restarts nor ends a ramp), new ones start ramping now.
    pub fn carried(
        config: &flatmesh_config::SlowStart,
        endpoints: &[SocketAddr],
        previous: &SlowStart,
        previous_endpoints: &[SocketAddr],
    ) -> SlowStart {
        let next = SlowStart::new(config, endpoints.len());
        let next = SlowStart {
            epoch: previous.epoch,
            ..next
        };
        let now = next.now();
        for (i, e) in endpoints.iter().enumerate() {
            match previous_endpoints.iter().position(|p| p == e) {
                Some(j) => {
                    let since = previous.since[j].load(Ordering::Relaxed);
                    if since != 0 {
                        next.begin_at(i, since);
                    }
                    if previous.was_out[j].load(Ordering::Relaxed) {
                        next.was_out[i].store(true, Ordering::Relaxed);
                        next.watching.fetch_add(1, Ordering::Relaxed);
                    }
                }
                None => next.begin_at(i, now),
            }
        }
        next
    }

    /// Clock milliseconds; never 0.
    pub fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX / 2) + 1
    }

    /// Whether the balancer must look: an endpoint ramps, or one seen out may come back.
    #[inline]
    pub fn active(&self, now: u64) -> bool {
        self.watching.load(Ordering::Relaxed) > 0 || now < self.ramp_until.load(Ordering::Relaxed)
    }

    /// Whether an endpoint seen out may come back (the balancer must look at every endpoint).
    #[inline]
    pub fn watching(&self) -> bool {
        self.watching.load(Ordering::Relaxed) > 0
    }

    /// The balancer saw endpoint `index` out (or in) at `now`.
    pub fn seen(&self, index: usize, out: bool, now: u64) {
        let Some(flag) = self.was_out.get(index) else {
            return;
        };
        if out {
            if !flag.load(Ordering::Relaxed) && !flag.swap(true, Ordering::AcqRel) {
                self.watching.fetch_add(1, Ordering::AcqRel);
            }
        } else if flag.load(Ordering::Relaxed) && flag.swap(false, Ordering::AcqRel) {
            self.watching.fetch_sub(1, Ordering::AcqRel);
            self.begin_at(index, now);
        }
    }

    fn begin_at(&self, index: usize, at: u64) {
        self.since[index].store(at, Ordering::Relaxed);
        self.ramp_until
            .fetch_max(at.saturating_add(self.window_ms), Ordering::Relaxed);
    }

    /// The share of its weight endpoint `index` gets at `now`: 1 once its window is over.
    pub fn factor(&self, index: usize, now: u64) -> f64 {
        let since = self
            .since
            .get(index)
            .map_or(0, |s| s.load(Ordering::Relaxed));
        if since == 0 {
            return 1.0;
        }
        let elapsed = now.saturating_sub(since);
        if elapsed >= self.window_ms {
            return 1.0;
        }
        let ramp = (elapsed as f64 / self.window_ms as f64).powf(self.exponent);
        ramp.max(self.min_fraction)
    }

    /// Endpoints ramping at `now` (the gauge).
    pub fn ramping(&self, now: u64) -> usize {
        (0..self.since.len())
            .filter(|&i| self.factor(i, now) < 1.0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn config(aggression: f64) -> flatmesh_config::SlowStart {
        flatmesh_config::SlowStart {
            window: Duration::from_secs(10),
            aggression,
            min_weight_percent: 10,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_weight_ramps_over_the_window() {
        let s = SlowStart::new(&config(1.0), 2);
        let now = s.now();
        assert!(!s.active(now));
        s.seen(1, true, now);
        assert!(s.active(now) && s.watching());
        tokio::time::advance(Duration::from_secs(5)).await;
        s.seen(1, false, s.now());
        assert!(!s.watching());
        assert_eq!(s.factor(0, s.now()), 1.0);
        assert_eq!(s.factor(1, s.now()), 0.1, "the minimum at the start");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!((s.factor(1, s.now()) - 0.5).abs() < 0.01);
        assert_eq!(s.ramping(s.now()), 1);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(s.factor(1, s.now()), 1.0);
        assert!(!s.active(s.now()));
    }

    #[tokio::test(start_paused = true)]
    async fn aggression_ramps_faster_at_first_and_new_endpoints_ramp() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let old = SlowStart::new(&config(2.0), 1);
        let s = SlowStart::carried(&config(2.0), &[a, b], &old, &[a]);
        assert_eq!(s.factor(0, s.now()), 1.0, "a kept endpoint does not ramp");
        tokio::time::advance(Duration::from_millis(2500)).await;
        // (0.25)^(1/2) = 0.5
        assert!((s.factor(1, s.now()) - 0.5).abs() < 0.01);
    }
}
