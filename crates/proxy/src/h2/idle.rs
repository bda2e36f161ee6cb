//! Idle tracking for HTTP/2 client connections, which hyper serves: hyper's own timers do
//! not cover a connection that sits open without streams, so every read and write bumps an
//! activity counter that the connection's watchdog samples. (HTTP/1 connections are
//! flatmesh's own and time their reads directly, in `crate::h1`.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::tap::Tap;

/// Shared between the socket's tap and the connection's watchdog.
#[derive(Default)]
pub struct ConnSignals {
    /// Bumped on every read or write that moved bytes.
    pub activity: AtomicU64,
}

/// Counts a connection's activity for the idle timeout.
pub struct ActivityTap(pub Arc<ConnSignals>);

impl ActivityTap {
    fn bump(&self) {
        // Only this connection's task writes the counter: load + store is exact.
        let a = &self.0.activity;
        a.store(a.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }
}

impl Tap for ActivityTap {
    fn on_read(&mut self, _bytes: &[u8]) {
        self.bump();
    }

    fn on_write(&mut self, written: usize) {
        if written > 0 {
            self.bump();
        }
    }
}

/// Resolves once no byte has moved for `idle` (checked every quarter of it).
pub async fn idle(signals: &ConnSignals, idle: std::time::Duration) {
    let step = (idle / 4).max(std::time::Duration::from_millis(10));
    let mut last = signals.activity.load(Ordering::Relaxed);
    let mut quiet = std::time::Duration::ZERO;
    loop {
        tokio::time::sleep(step).await;
        let now = signals.activity.load(Ordering::Relaxed);
        if now == last {
            quiet += step;
            if quiet >= idle {
                return;
            }
        } else {
            last = now;
            quiet = std::time::Duration::ZERO;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_fires_only_after_quiet_time() {
        let s = ConnSignals::default();
        let started = tokio::time::Instant::now();
        idle(&s, std::time::Duration::from_secs(4)).await;
        assert!(started.elapsed() >= std::time::Duration::from_secs(4));
    }
}
