//! A cluster's retry budget, Linkerd's model: over a sliding window of [`WINDOW_S`] seconds,
//! the cluster's retries may be at most `ratio` × its requests plus `min_per_s` per second
//! of the window. Per node, shared by every worker: each second of the window is one slot
//! of two atomic counters (requests, retries) tagged with the second they count, so a
//! request or a retry costs one compare-and-swap, never a lock. A slot whose tag is older
//! than the window counts nothing and is reused by the next second that maps to it.
//!
//! Two workers that decide at the same instant may both take the last retry left: the
//! budget can be overdrawn by at most one retry per worker deciding at once.

use std::sync::atomic::{AtomicU64, Ordering};

use flatmesh_config::RetryBudget;
use tokio::time::Instant;

/// The window the budget looks back over, in seconds (Linkerd's `ttl`: 10 s).
pub const WINDOW_S: u64 = 10;

/// Bits of a slot word that hold the count; the rest hold the second it counts.
const COUNT_BITS: u32 = 40;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// Requests and retries to one cluster over the last [`WINDOW_S`] seconds.
pub struct Budget {
    /// Seconds are counted from here, on tokio's clock (paused in tests).
    start: Instant,
    requests: [AtomicU64; WINDOW_S as usize],
    retries: [AtomicU64; WINDOW_S as usize],
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            start: Instant::now(),
            requests: Default::default(),
            retries: Default::default(),
        }
    }
}

impl Budget {
    /// A request to the cluster (its first try).
    pub fn request(&self) {
        add(&self.requests, self.second());
    }

    /// Takes a retry from the budget of `config`: false, and nothing taken, when the
    /// cluster's retries in the window are at the cap already.
    pub fn try_retry(&self, config: &RetryBudget) -> bool {
        let now = self.second();
        let requests = sum(&self.requests, now) as f64;
        let retries = sum(&self.retries, now) as f64;
        let cap = config.ratio * requests + f64::from(config.min_per_s) * WINDOW_S as f64;
        if retries + 1.0 > cap {
            return false;
        }
        add(&self.retries, now);
        true
    }

    /// The retries counted in the window now.
    #[cfg(test)]
    pub fn retries(&self) -> u64 {
        sum(&self.retries, self.second())
    }

    /// The requests counted in the window now.
    #[cfg(test)]
    pub fn requests(&self) -> u64 {
        sum(&self.requests, self.second())
    }

    /// The current second, as a slot tag.
    fn second(&self) -> u64 {
        // The tag takes the bits above the count: wraps after ~530 years at 24 bits.
        self.start.elapsed().as_secs() & (u64::MAX >> COUNT_BITS)
    }
}

/// One more in the slot of second `now`, resetting it if it counted an older second.
fn add(slots: &[AtomicU64; WINDOW_S as usize], now: u64) {
    let slot = &slots[(now % WINDOW_S) as usize];
    let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
        Some(if word >> COUNT_BITS == now {
            // Saturate rather than carry into the tag.
            word + u64::from(word & COUNT_MASK < COUNT_MASK)
        } else {
            (now << COUNT_BITS) | 1
        })
    });
}

/// The counts of the slots whose second is inside the window ending at `now`.
fn sum(slots: &[AtomicU64; WINDOW_S as usize], now: u64) -> u64 {
    slots
        .iter()
        .map(|slot| slot.load(Ordering::Relaxed))
        .filter(|word| now.wrapping_sub(word >> COUNT_BITS) < WINDOW_S)
        .map(|word| word & COUNT_MASK)
        .sum()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn budget(ratio: f64, min_per_s: u32) -> RetryBudget {
        RetryBudget { ratio, min_per_s }
    }

    #[tokio::test(start_paused = true)]
    async fn retries_are_capped_at_the_ratio_plus_the_reserve() {
        let b = Budget::default();
        for _ in 0..1000 {
            b.request();
        }
        let config = budget(0.2, 1);
        let taken = (0..1000).filter(|_| b.try_retry(&config)).count();
        // 0.2 × 1000 + 1/s × 10 s.
        assert_eq!(taken, 210);
        assert_eq!((b.requests(), b.retries()), (1000, 210));
    }

    #[tokio::test(start_paused = true)]
    async fn the_reserve_alone_allows_min_per_s_over_the_window() {
        let b = Budget::default();
        let taken = (0..100).filter(|_| b.try_retry(&budget(0.2, 3))).count();
        assert_eq!(taken, 30);
        assert!(!b.try_retry(&budget(0.0, 0)), "a zero budget allows none");
    }

    #[tokio::test(start_paused = true)]
    async fn what_leaves_the_window_is_forgotten() {
        let b = Budget::default();
        let config = budget(0.0, 1);
        assert_eq!((0..20).filter(|_| b.try_retry(&config)).count(), 10);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!b.try_retry(&config), "still inside the window");
        tokio::time::sleep(Duration::from_secs(5)).await;
        // The second those retries counted in is out of the window now.
        assert_eq!((0..20).filter(|_| b.try_retry(&config)).count(), 10);
        for _ in 0..100 {
            b.request();
        }
        tokio::time::sleep(Duration::from_secs(WINDOW_S)).await;
        assert_eq!((b.requests(), b.retries()), (0, 0));
    }
}
