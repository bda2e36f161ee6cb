//! Idle timeouts for connections whose bytes flatmesh does not read itself at every step:
//! HTTP/2 client connections (the h2 crate reads and writes them), TCP relays and upgraded
//! HTTP connections (a two-way copy). Every read and write bumps an activity counter through
//! a [`Tapped`](crate::tap::Tapped) socket, and a watchdog samples it. (HTTP/1 connections
//! time their reads directly, in `crate::h1`.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::tap::Tap;

/// Bumped on every read or write that moved bytes; shared between a socket's tap and the
/// connection's watchdog.
#[derive(Default)]
pub struct Activity(AtomicU64);

impl Activity {
    fn bump(&self) {
        // Only the connection's own task bumps it: load + store is exact.
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counts a connection's activity for its idle timeout.
pub struct ActivityTap(pub Arc<Activity>);

impl Tap for ActivityTap {
    fn on_read(&mut self, _bytes: &[u8]) {
        self.0.bump();
    }

    fn on_write(&mut self, written: usize) {
        if written > 0 {
            self.0.bump();
        }
    }
}

/// Resolves once nothing has moved for `idle` (checked every quarter of it).
pub async fn idle(activity: &Activity, idle: Duration) {
    let step = (idle / 4).max(Duration::from_millis(10));
    let mut last = activity.get();
    let mut quiet = Duration::ZERO;
    loop {
        tokio::time::sleep(step).await;
        let now = activity.get();
        if now == last {
            quiet += step;
            if quiet >= idle {
                return;
            }
        } else {
            last = now;
            quiet = Duration::ZERO;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_fires_only_after_quiet_time() {
        let s = Activity::default();
        let started = tokio::time::Instant::now();
        idle(&s, Duration::from_secs(4)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(4));
        // Activity within the window starts the quiet time over (counted from the first
        // check that sees it: the watchdog looks every quarter of the timeout).
        let s = Arc::new(Activity::default());
        let bumper = {
            let s = s.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(2500)).await;
                s.bump();
            })
        };
        let started = tokio::time::Instant::now();
        idle(&s, Duration::from_secs(4)).await;
        bumper.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(started.elapsed(), Duration::from_secs(7));
    }
}
