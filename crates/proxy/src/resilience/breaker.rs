//! A cluster's circuit breaker (Envoy's `circuit_breakers`, default priority): per node,
//! shared by every worker, four limits on what is outstanding to the cluster at once. A
//! request over one is refused at once, never queued.
//!
//! On the request path a permit costs a compare-and-swap to take and a subtraction to give
//! back (plus the `Arc` that lets it outlive the borrow of the snapshot); nothing locks.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use flatmesh_config::CircuitBreaker;

/// Which limit a request ran into; the value of `x-flatmesh-overflow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    Connections = 0,
    Pending = 1,
    Requests = 2,
    Retries = 3,
}

impl Overflow {
    pub const ALL: [Overflow; 4] = [
        Overflow::Connections,
        Overflow::Pending,
        Overflow::Requests,
        Overflow::Retries,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Overflow::Connections => "connections",
            Overflow::Pending => "pending",
            Overflow::Requests => "requests",
            Overflow::Retries => "retries",
        }
    }

    /// The config key that sets the limit, for messages.
    pub fn key(self) -> &'static str {
        match self {
            Overflow::Connections => "max_connections",
            Overflow::Pending => "max_pending",
            Overflow::Requests => "max_requests",
            Overflow::Retries => "max_retries",
        }
    }
}

/// Overflows of one cluster by kind. Kept by cluster name across reloads (a counter must not
/// go back), while a breaker whose limits change is replaced.
#[derive(Default)]
pub struct OverflowCounts([AtomicU64; 4]);

impl OverflowCounts {
    pub fn get(&self, kind: Overflow) -> u64 {
        self.0[kind as usize].load(Ordering::Relaxed)
    }
}

pub struct Breaker {
    limits: [u32; 4],
    open: [AtomicU32; 4],
    overflows: Arc<OverflowCounts>,
}

impl Breaker {
    pub fn new(config: &CircuitBreaker, overflows: Arc<OverflowCounts>) -> Arc<Breaker> {
        Arc::new(Breaker {
            limits: [
                config.max_connections,
                config.max_pending,
                config.max_requests,
                config.max_retries,
            ],
            open: Default::default(),
            overflows,
        })
    }

    /// Takes one unit of `kind`, or refuses (and counts the overflow) when the limit is
    /// reached. The unit is given back when the permit drops.
    #[inline]
    pub fn acquire(self: &Arc<Self>, kind: Overflow) -> Result<Permit, Overflow> {
        let limit = self.limits[kind as usize];
        let taken =
            self.open[kind as usize].fetch_update(Ordering::AcqRel, Ordering::Relaxed, |open| {
                (open < limit).then_some(open + 1)
            });
        match taken {
            Ok(_) => Ok(Permit {
                breaker: self.clone(),
                kind,
            }),
            Err(_) => {
                self.overflows.0[kind as usize].fetch_add(1, Ordering::Relaxed);
                Err(kind)
            }
        }
    }

    /// What is outstanding of `kind` right now (the gauge).
    pub fn open(&self, kind: Overflow) -> u32 {
        self.open[kind as usize].load(Ordering::Relaxed)
    }

    pub fn limit(&self, kind: Overflow) -> u32 {
        self.limits[kind as usize]
    }
}

/// One unit of a breaker's limit, held while the connection, pending connect, request or
/// retry it stands for is outstanding.
pub struct Permit {
    breaker: Arc<Breaker>,
    kind: Overflow,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.breaker.open[self.kind as usize].fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_refuses_at_once_and_frees_on_drop() {
        let config = CircuitBreaker {
            max_requests: 2,
            ..Default::default()
        };
        let counts = Arc::new(OverflowCounts::default());
        let b = Breaker::new(&config, counts.clone());
        let one = b.acquire(Overflow::Requests).unwrap();
        let _two = b.acquire(Overflow::Requests).unwrap();
        assert_eq!(
            b.acquire(Overflow::Requests).err(),
            Some(Overflow::Requests)
        );
        assert_eq!(b.open(Overflow::Requests), 2);
        assert_eq!(counts.get(Overflow::Requests), 1);
        drop(one);
        assert!(b.acquire(Overflow::Requests).is_ok());
        // The other kinds are untouched.
        assert_eq!(b.open(Overflow::Retries), 0);
        assert_eq!(b.limit(Overflow::Retries), 3);
    }

    #[test]
    fn the_limit_holds_across_threads() {
        let config = CircuitBreaker {
            max_connections: 10,
            ..Default::default()
        };
        let b = Breaker::new(&config, Arc::default());
        let held: Vec<Permit> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..10)
                            .filter_map(|_| b.acquire(Overflow::Connections).ok())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(held.len(), 10);
        assert_eq!(b.open(Overflow::Connections), 10);
        drop(held);
        assert_eq!(b.open(Overflow::Connections), 0);
    }
}
