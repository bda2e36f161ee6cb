//! Rate limits (`rate_limit` on an http listener or a route, `connection_rate_limit` on a tcp
//! listener): a token bucket per node, not per worker, so the configured rate is the node's.
//!
//! The bucket is kept as GCRA's "theoretical arrival time" (TAT): the time at which the
//! bucket would be full again. A request at `now` is admitted when
//! `max(TAT, now) + interval <= now + burst × interval`, and then moves the TAT on by one
//! `interval`. The TAT of an unkeyed limit is one `AtomicU64` (nanoseconds since the
//! limiter's epoch) updated by compare-and-swap: exact across workers, no lock and no
//! allocation on the request path.
//!
//! A keyed limit (`key: client_address` or `key: { header: NAME }`) keeps one TAT per key
//! value in a table of fixed size, allocated once: [`SETS`] sets of [`WAYS`] slots, a key's
//! set chosen by a hash with a per-process random seed (so a client cannot aim its values at
//! one set). A new key value takes the slot of its set whose bucket is the fullest (the
//! smallest TAT). A slot whose bucket is full holds nothing a fresh bucket would not, so most
//! replacements lose nothing; one that does evicts a key whose bucket then starts full again
//! (it may pass up to `burst` more requests), and is counted. A client that floods the table
//! with random header values pushes out the idlest buckets first, never the ones it is
//! competing with that are being limited (those have the largest TATs). Each set has a lock of
//! its own, held for a few loads and stores.
//!
//! Time is tokio's (`tokio::time::Instant`), read by the caller and passed in, so tests drive
//! the limiter on a paused clock or on made-up instants.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flatmesh_config::{RateLimit, RATE_LIMIT_MAX_KEYS};
use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::time::Instant;

/// Slots per set of a keyed limit's table.
pub const WAYS: usize = 4;
/// Sets of a keyed limit's table: [`RATE_LIMIT_MAX_KEYS`] keys in all.
pub const SETS: usize = RATE_LIMIT_MAX_KEYS / WAYS;

/// Which limit refused a request: the value of `x-flatmesh-ratelimited`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// An http listener's `rate_limit`, before routing.
    Listener,
    /// A route's `rate_limit`, after it matched.
    Route,
    /// A tcp listener's `connection_rate_limit`.
    Connections,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Listener => "listener",
            Scope::Route => "route",
            Scope::Connections => "connections",
        }
    }
}

/// One slot of a keyed table: the key's hash and its bucket's TAT (0: empty or full).
#[derive(Clone, Copy, Default)]
struct Slot {
    hash: u64,
    tat: u64,
}

enum Buckets {
    One(AtomicU64),
    Keyed {
        seed: RandomState,
        sets: Box<[Mutex<[Slot; WAYS]>]>,
        /// Keys pushed out while their bucket was not full.
        evicted: AtomicU64,
    },
}

/// One configured limit, shared by every worker.
pub struct RateLimiter {
    /// Nanoseconds between two requests at the sustained rate.
    interval: u64,
    /// `burst × interval`: how far past `now` the TAT may run.
    tolerance: u64,
    epoch: Instant,
    buckets: Buckets,
    /// Requests (or connections) refused; kept by the registry across reloads.
    limited: Arc<AtomicU64>,
}

/// What a keyed limit tells its buckets apart by, read from the request.
#[derive(Clone, Copy)]
pub enum Key<'a> {
    /// An unkeyed limit ignores it.
    None,
    Bytes(&'a [u8]),
}

impl RateLimiter {
    /// A limiter for `config` whose clock starts at `epoch`, counting refusals into `limited`.
    pub fn new(config: &RateLimit, epoch: Instant, limited: Arc<AtomicU64>) -> RateLimiter {
        let (interval, tolerance) = gcra(config);
        let buckets = match config.key {
            None => Buckets::One(AtomicU64::new(0)),
            Some(_) => Buckets::Keyed {
                seed: RandomState::new(),
                sets: (0..SETS)
                    .map(|_| Mutex::new([Slot::default(); WAYS]))
                    .collect(),
                evicted: AtomicU64::new(0),
            },
        };
        RateLimiter {
            interval,
            tolerance,
            epoch,
            buckets,
            limited,
        }
    }

    /// Takes one token for `key` at `now`: `Ok` to go on, or `Err` with how long until the
    /// next one (the `retry-after`). A refusal is counted.
    pub fn admit(&self, now: Instant, key: Key<'_>) -> Result<(), Duration> {
        let now =
            u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        let taken = match (&self.buckets, key) {
            (Buckets::One(tat), _) => self.take_shared(tat, now),
            (
                Buckets::Keyed {
                    seed,
                    sets,
                    evicted,
                },
                key,
            ) => {
                let bytes = match key {
                    Key::Bytes(b) => b,
                    Key::None => &[],
                };
                let hash = seed.hash_one(bytes);
                let set = &sets[(hash as usize) % sets.len()];
                self.take_keyed(&mut set.lock(), hash, now, evicted)
            }
        };
        taken.map_err(|wait| {
            self.limited.fetch_add(1, Ordering::Relaxed);
            Duration::from_nanos(wait)
        })
    }

    /// GCRA on the one shared TAT: the new TAT, or the wait until it would fit.
    fn next_tat(&self, tat: u64, now: u64) -> Result<u64, u64> {
        let next = tat.max(now).saturating_add(self.interval);
        let limit = now.saturating_add(self.tolerance);
        if next <= limit {
            Ok(next)
        } else {
            Err(next - limit)
        }
    }

    fn take_shared(&self, tat: &AtomicU64, now: u64) -> Result<(), u64> {
        let mut old = tat.load(Ordering::Acquire);
        loop {
            let next = self.next_tat(old, now)?;
            match tat.compare_exchange_weak(old, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(current) => old = current,
            }
        }
    }

    fn take_keyed(
        &self,
        set: &mut [Slot; WAYS],
        hash: u64,
        now: u64,
        evicted: &AtomicU64,
    ) -> Result<(), u64> {
        let slot = match set.iter().position(|s| s.hash == hash && s.tat != 0) {
            Some(i) => &mut set[i],
            None => {
                // The fullest bucket of the set makes room (an empty slot has TAT 0).
                let slot = set
                    .iter_mut()
                    .min_by_key(|s| s.tat)
                    .unwrap_or_else(|| unreachable!("a set has {WAYS} slots"));
                if slot.tat > now {
                    evicted.fetch_add(1, Ordering::Relaxed);
                }
                *slot = Slot { hash, tat: 0 };
                slot
            }
        };
        slot.tat = self.next_tat(slot.tat, now)?;
        Ok(())
    }

    /// Keys pushed out of a keyed table while their bucket was not full.
    pub fn evicted(&self) -> u64 {
        match &self.buckets {
            Buckets::One(_) => 0,
            Buckets::Keyed { evicted, .. } => evicted.load(Ordering::Relaxed),
        }
    }

    /// Slots of a keyed table holding a key (0 for an unkeyed limit).
    #[cfg(test)]
    pub fn keys(&self) -> usize {
        match &self.buckets {
            Buckets::One(_) => 0,
            Buckets::Keyed { sets, .. } => sets
                .iter()
                .map(|s| s.lock().iter().filter(|s| s.tat != 0).count())
                .sum(),
        }
    }
}

/// GCRA's parameters of `config` in nanoseconds: the interval between two admissions at the
/// sustained rate, and the tolerance, `burst × interval`. Tier K's connection filter
/// (`crate::kernel`) takes the same two numbers.
pub fn gcra(config: &RateLimit) -> (u64, u64) {
    let rate = u64::from(config.requests_per_s.max(1));
    let interval = (1_000_000_000 / rate).max(1);
    (
        interval,
        interval.saturating_mul(u64::from(config.burst().max(1))),
    )
}

/// The seconds a `retry-after` says: the wait rounded up, at least 1.
pub fn retry_after_secs(wait: Duration) -> u64 {
    wait.as_nanos().div_ceil(1_000_000_000).max(1) as u64
}

/// Where a limit is configured: (listener, route name or "" for the listener's own, scope).
type Place = (String, String, Scope);

struct Entry {
    config: RateLimit,
    limiter: Arc<RateLimiter>,
    limited: Arc<AtomicU64>,
}

/// Reads the SYNs tier K dropped over each listener's `connection_rate_limit`, by listener.
pub type KernelDrops = Box<dyn Fn() -> Vec<(String, u64)> + Send + Sync>;

/// Every configured limit, by where it is; lives as long as the node, so a reload that
/// leaves a limit alone keeps its buckets (and its count).
#[derive(Default)]
pub struct Registry {
    limits: Mutex<HashMap<Place, Entry>>,
    /// Set when tier K enforces connection rate limits (`crate::kernel`).
    kernel_drops: Mutex<Option<KernelDrops>>,
}

impl Registry {
    /// The limiter of `listener`/`route` (`route` empty for the listener's own limit) for a
    /// new snapshot: the one in force when `config` did not change, else a new one. Called
    /// when a snapshot is built, never per request.
    pub fn limiter(
        &self,
        listener: &str,
        route: &str,
        scope: Scope,
        config: &RateLimit,
    ) -> Arc<RateLimiter> {
        let mut limits = self.limits.lock();
        let place = (listener.to_owned(), route.to_owned(), scope);
        let limited = limits
            .get(&place)
            .map(|e| e.limited.clone())
            .unwrap_or_default();
        let entry = limits.entry(place).or_insert_with(|| Entry {
            config: config.clone(),
            limiter: Arc::new(RateLimiter::new(config, Instant::now(), limited.clone())),
            limited: limited.clone(),
        });
        if entry.config != *config {
            entry.config = config.clone();
            entry.limiter = Arc::new(RateLimiter::new(config, Instant::now(), limited));
        }
        entry.limiter.clone()
    }

    /// Drops the limits a reload removed: those of `config` stay.
    pub fn retain(&self, config: &flatmesh_config::Config) {
        let mut keep = std::collections::HashSet::new();
        for l in &config.listeners {
            if l.rate_limit.is_some() {
                keep.insert((l.name.clone(), String::new(), Scope::Listener));
            }
            if l.connection_rate_limit.is_some() {
                keep.insert((l.name.clone(), String::new(), Scope::Connections));
            }
            for (i, r) in l.routes.iter().enumerate() {
                if r.rate_limit.is_some() {
                    keep.insert((l.name.clone(), r.display_name(&l.name, i), Scope::Route));
                }
            }
        }
        self.limits.lock().retain(|place, _| keep.contains(place));
    }

    /// Where `/metrics` reads tier K's dropped SYNs from.
    pub fn count_kernel_drops(&self, read: KernelDrops) {
        *self.kernel_drops.lock() = Some(read);
    }

    /// The rate-limit families of `/metrics`.
    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut requests = Vec::new();
        let mut connections = Vec::new();
        let mut evicted = Vec::new();
        {
            let limits = self.limits.lock();
            let mut places: Vec<&Place> = limits.keys().collect();
            places.sort_by(|a, b| (&a.0, &a.1, a.2.as_str()).cmp(&(&b.0, &b.1, b.2.as_str())));
            for place in places {
                let e = &limits[place];
                let (listener, route, scope) = place.clone();
                let limited = e.limited.load(Ordering::Relaxed);
                match scope {
                    Scope::Connections => connections.push((listener, limited)),
                    Scope::Listener | Scope::Route => {
                        if e.config.key.is_some() {
                            evicted.push((listener.clone(), route.clone(), e.limiter.evicted()));
                        }
                        requests.push((listener, route, scope.as_str(), limited));
                    }
                }
            }
        }
        let rows: Vec<_> = requests
            .iter()
            .map(|(l, r, s, v)| {
                (
                    [
                        ("listener", l.as_str()),
                        ("route", r.as_str()),
                        ("scope", *s),
                    ],
                    *v,
                )
            })
            .collect();
        crate::metrics::counter(
            enc,
            "flatmesh_rate_limited_requests",
            "Requests answered 429 by a rate limit, by listener and route (route empty and scope `listener` for the listener's own limit)",
            &rows,
        )?;
        let rows: Vec<_> = connections
            .iter()
            .map(|(l, v)| ([("listener", l.as_str())], *v))
            .collect();
        crate::metrics::counter(
            enc,
            "flatmesh_rate_limited_connections",
            "Connections of a tcp listener closed at once by its connection_rate_limit, in user space",
            &rows,
        )?;
        if let Some(read) = &*self.kernel_drops.lock() {
            let dropped = read();
            let rows: Vec<_> = dropped
                .iter()
                .map(|(l, v)| ([("listener", l.as_str())], *v))
                .collect();
            crate::metrics::counter(
                enc,
                "flatmesh_kernel_rate_limited_syns",
                "SYNs to a tcp listener dropped in the kernel (socket filter on its listening sockets) by its connection_rate_limit; a client retransmits an unanswered SYN, so one refused connection may count more than once",
                &rows,
            )?;
        }
        let rows: Vec<_> = evicted
            .iter()
            .map(|(l, r, v)| ([("listener", l.as_str()), ("route", r.as_str())], *v))
            .collect();
        crate::metrics::counter(
            enc,
            "flatmesh_rate_limit_keys_evicted",
            "Keys of a keyed rate limit pushed out of its table while their bucket was not full",
            &rows,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatmesh_config::{RateLimitKey, RateLimitKeyName};

    fn limit(rate: u32, burst: u32, keyed: bool) -> RateLimit {
        RateLimit {
            requests_per_s: rate,
            burst: Some(burst),
            key: keyed.then_some(RateLimitKey::Named(RateLimitKeyName::ClientAddress)),
        }
    }

    fn limiter(rate: u32, burst: u32, keyed: bool) -> RateLimiter {
        RateLimiter::new(&limit(rate, burst, keyed), Instant::now(), Arc::default())
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_then_the_rate() {
        let l = limiter(10, 3, false);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(l.admit(t0, Key::None).is_ok());
        }
        let wait = l.admit(t0, Key::None).expect_err("the bucket is empty");
        assert_eq!(wait, Duration::from_millis(100));
        assert_eq!(retry_after_secs(wait), 1);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(l.admit(Instant::now(), Key::None).is_ok());
        assert!(l.admit(Instant::now(), Key::None).is_err());
        assert_eq!(l.limited.load(Ordering::Relaxed), 2);
    }

    /// Offered load at twice the rate for 10 s on the paused clock, from one thread and from
    /// two at once (the workers share the bucket): exactly the burst and then the rate get in.
    #[tokio::test(start_paused = true)]
    async fn twice_the_rate_for_ten_seconds_admits_the_rate() {
        for threads in [1usize, 2] {
            let l = Arc::new(limiter(100, 10, false));
            let start = Instant::now();
            // 200/s offered in all: every 5 ms one request per thread, `threads` ticks apart.
            let step = Duration::from_millis(5) * threads as u32;
            let mut admitted = 0u64;
            let mut sent = 0u64;
            while Instant::now() - start < Duration::from_secs(10) {
                let now = Instant::now();
                let got: u64 = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..threads)
                        .map(|_| {
                            let l = l.clone();
                            s.spawn(move || u64::from(l.admit(now, Key::None).is_ok()))
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
                });
                admitted += got;
                sent += threads as u64;
                tokio::time::advance(step).await;
            }
            assert_eq!(sent, 2000);
            // The burst at 0, then one every 10 ms until the last request, at 9.99 s or
            // later: 999 more.
            assert_eq!(admitted, 10 + 999, "{threads} threads");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn each_key_has_its_own_bucket() {
        let l = limiter(1, 2, true);
        let now = Instant::now();
        for _ in 0..2 {
            assert!(l.admit(now, Key::Bytes(b"alice")).is_ok());
        }
        assert!(l.admit(now, Key::Bytes(b"alice")).is_err());
        assert!(l.admit(now, Key::Bytes(b"bob")).is_ok(), "bob's own bucket");
        assert_eq!(l.keys(), 2);
    }

    /// A flood of new key values stays within the table, and pushes out idle buckets before
    /// the one being limited.
    #[tokio::test(start_paused = true)]
    async fn the_key_table_is_bounded_and_keeps_limited_keys() {
        let l = limiter(1, 5, true);
        let now = Instant::now();
        while l.admit(now, Key::Bytes(b"limited")).is_ok() {}
        for i in 0..(RATE_LIMIT_MAX_KEYS * 20) {
            let _ = l.admit(now, Key::Bytes(&i.to_le_bytes()));
        }
        assert!(l.keys() <= RATE_LIMIT_MAX_KEYS, "{} keys", l.keys());
        assert_eq!(l.keys(), RATE_LIMIT_MAX_KEYS, "the table filled up");
        assert!(l.evicted() > 0, "the flood pushed keys out");
        assert!(
            l.admit(now, Key::Bytes(b"limited")).is_err(),
            "the limited key kept its bucket through the flood"
        );
        // Once every bucket has refilled, a replacement loses nothing and counts nothing.
        let before = l.evicted();
        let later = now + Duration::from_secs(60);
        for i in 0..100u32 {
            let _ = l.admit(later, Key::Bytes(&(u64::from(i) << 40).to_le_bytes()));
        }
        assert_eq!(l.evicted(), before);
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reload_keeps_an_unchanged_limit_and_its_count() {
        let r = Registry::default();
        let a = r.limiter("web", "", Scope::Listener, &limit(1, 1, false));
        assert!(a.admit(Instant::now(), Key::None).is_ok());
        assert!(a.admit(Instant::now(), Key::None).is_err());
        let b = r.limiter("web", "", Scope::Listener, &limit(1, 1, false));
        assert!(Arc::ptr_eq(&a, &b));
        let c = r.limiter("web", "", Scope::Listener, &limit(2, 1, false));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.limited.load(Ordering::Relaxed), 1, "the count goes on");
    }
}
