//! Load balancing: which endpoint of a cluster gets the next request or connection.
//!
//! Each worker owns its own `Balancer` per cluster (shared-nothing), so round-robin
//! cursors and least-request counts are per worker, as in Envoy. Hash rings and Maglev
//! tables are immutable and shared by all workers of a snapshot.
//!
//! Every policy skips the endpoints that are out (`crate::resilience::Out`: ejected by
//! outlier detection or failing their health check), unless all of them are: then it picks
//! among all, as Envoy's panic threshold does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use flatmesh_config::LbPolicy;

use crate::resilience::{Out, Permit};

/// Stable 64-bit hash (FNV-1a, then murmur3's finalizer to spread near-identical keys).
pub fn hash64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Hash key of a client address: what ring_hash / maglev fall back to.
pub fn hash_client(ip: std::net::IpAddr) -> u64 {
    match ip {
        std::net::IpAddr::V4(ip) => hash64(&ip.octets()),
        std::net::IpAddr::V6(ip) => hash64(&ip.octets()),
    }
}

/// Consistent-hash ring (ketama style): each endpoint owns many points on a 64-bit circle.
pub struct Ring {
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// Envoy's default minimum ring size.
    const MIN_SIZE: usize = 1024;

    pub fn new(endpoints: &[SocketAddr]) -> Ring {
        let per = Self::MIN_SIZE.div_ceil(endpoints.len().max(1));
        let mut points = Vec::with_capacity(per * endpoints.len());
        for (i, ep) in endpoints.iter().enumerate() {
            for j in 0..per {
                points.push((hash64(format!("{ep}_{j}").as_bytes()), i as u32));
            }
        }
        points.sort_unstable();
        Ring { points }
    }

    pub fn lookup(&self, key: u64) -> usize {
        if self.points.is_empty() {
            return 0;
        }
        let at = self.points.partition_point(|(h, _)| *h < key);
        self.points[at % self.points.len()].1 as usize
    }
}

/// Maglev lookup table (Eisenbud et al., NSDI'16): even spread, minimal disruption.
pub struct Maglev {
    table: Vec<u32>,
}

impl Maglev {
    /// Prime table size, Envoy's default.
    pub const SIZE: usize = 65537;

    pub fn new(endpoints: &[SocketAddr]) -> Maglev {
        let n = endpoints.len();
        let m = Self::SIZE as u64;
        if n == 0 {
            return Maglev {
                table: vec![0; Self::SIZE],
            };
        }
        let perms: Vec<(u64, u64)> = endpoints
            .iter()
            .map(|ep| {
                let name = ep.to_string();
                let offset = hash64(name.as_bytes()) % m;
                let skip = hash64(format!("{name}#skip").as_bytes()) % (m - 1) + 1;
                (offset, skip)
            })
            .collect();
        let mut next = vec![0u64; n];
        let mut table = vec![u32::MAX; Self::SIZE];
        let mut filled = 0;
        'fill: loop {
            for (i, (offset, skip)) in perms.iter().enumerate() {
                let mut slot = (offset + next[i] * skip) % m;
                while table[slot as usize] != u32::MAX {
                    next[i] += 1;
                    slot = (offset + next[i] * skip) % m;
                }
                table[slot as usize] = i as u32;
                next[i] += 1;
                filled += 1;
                if filled == Self::SIZE {
                    break 'fill;
                }
            }
        }
        Maglev { table }
    }

    pub fn lookup(&self, key: u64) -> usize {
        self.table[(key % Self::SIZE as u64) as usize] as usize
    }
}

/// Shared, immutable per-snapshot hashing structure for a cluster.
pub enum HashTable {
    None,
    Ring(Arc<Ring>),
    Maglev(Arc<Maglev>),
}

impl HashTable {
    pub fn build(policy: LbPolicy, endpoints: &[SocketAddr]) -> HashTable {
        match policy {
            LbPolicy::RingHash => HashTable::Ring(Arc::new(Ring::new(endpoints))),
            LbPolicy::Maglev => HashTable::Maglev(Arc::new(Maglev::new(endpoints))),
            _ => HashTable::None,
        }
    }

    fn share(&self) -> HashTable {
        match self {
            HashTable::None => HashTable::None,
            HashTable::Ring(r) => HashTable::Ring(r.clone()),
            HashTable::Maglev(m) => HashTable::Maglev(m.clone()),
        }
    }
}

/// One worker's balancer for one cluster.
pub struct Balancer {
    policy: LbPolicy,
    endpoints: Arc<[SocketAddr]>,
    cursor: AtomicUsize,
    in_flight: Arc<[AtomicU32]>,
    table: HashTable,
    /// What takes endpoints out (shared by the node's workers).
    out: Out,
}

/// Held while a request is outstanding; least_request counts it. It also holds the
/// request's place in the cluster's circuit breaker, when the retry driver gives it one.
pub struct InFlight {
    counts: Arc<[AtomicU32]>,
    index: usize,
    permit: Option<Permit>,
}

impl InFlight {
    /// Keeps `permit` for as long as the request is outstanding.
    pub fn hold(&mut self, permit: Option<Permit>) {
        self.permit = permit;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(c) = self.counts.get(self.index) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Balancer {
    pub fn new(
        policy: LbPolicy,
        endpoints: Arc<[SocketAddr]>,
        table: &HashTable,
        seed: usize,
    ) -> Balancer {
        let in_flight: Arc<[AtomicU32]> = endpoints.iter().map(|_| AtomicU32::new(0)).collect();
        Balancer {
            policy,
            cursor: AtomicUsize::new(seed),
            in_flight,
            table: table.share(),
            endpoints,
            out: Out::default(),
        }
    }

    /// Skips the endpoints that `out` takes out.
    pub fn with_out(mut self, out: Out) -> Balancer {
        self.out = out;
        self
    }

    /// Pick an endpoint. `hash` is the request's hash key (ring_hash / maglev);
    /// `attempt` > 0 on retries, which move to a different endpoint where there is one.
    /// Returns the endpoint's index in the cluster's endpoint list.
    pub fn pick(&self, hash: u64, attempt: usize) -> Option<(usize, InFlight)> {
        let n = self.endpoints.len();
        if n == 0 {
            return None;
        }
        let first = self.choose(hash, attempt, n);
        let out = &self.out;
        // A load or two while nothing is out.
        let index = if out.any() {
            let now = out.now();
            // The policy's own next choices first (a round-robin cursor moves on, a
            // random pick draws again, a hash walks the ring), then any endpoint that
            // is in; none: panic routing, to the policy's first choice.
            let all_out = || out.count() >= n && (0..n).all(|i| out.is_out(i, now));
            if out.is_out(first, now) && !all_out() {
                (1..n)
                    .map(|k| self.choose(hash, attempt + k, n))
                    .chain(0..n)
                    .find(|&i| !out.is_out(i, now))
                    .unwrap_or(first)
            } else {
                first
            }
        } else {
            first
        };
        self.in_flight[index].fetch_add(1, Ordering::Relaxed);
        Some((
            index,
            InFlight {
                counts: self.in_flight.clone(),
                index,
                permit: None,
            },
        ))
    }

    /// Like [`Balancer::pick`], but not one of `excluded` (the endpoints that failed this
    /// request already) while another endpoint is in: the retry driver's way to move off
    /// them. The policy's own next choices come first; when they keep landing on excluded
    /// endpoints (a random draw can), the first other endpoint that is in.
    pub fn pick_other(
        &self,
        hash: u64,
        attempt: usize,
        excluded: &[usize],
    ) -> Option<(usize, InFlight)> {
        let n = self.endpoints.len();
        let mut picked = self.pick(hash, attempt)?;
        if excluded.is_empty() {
            return Some(picked);
        }
        for k in 1..n {
            if !excluded.contains(&picked.0) {
                return Some(picked);
            }
            picked = self.pick(hash, attempt + k)?;
        }
        if !excluded.contains(&picked.0) {
            return Some(picked);
        }
        let now = self.out.now();
        match (0..n).find(|i| !excluded.contains(i) && !self.out.is_out(*i, now)) {
            Some(index) => {
                drop(picked);
                self.in_flight[index].fetch_add(1, Ordering::Relaxed);
                Some((
                    index,
                    InFlight {
                        counts: self.in_flight.clone(),
                        index,
                        permit: None,
                    },
                ))
            }
            // Every endpoint that is in failed already: the policy's choice.
            None => Some(picked),
        }
    }

    /// The policy's choice among all `n` endpoints for the `attempt`th try.
    fn choose(&self, hash: u64, attempt: usize, n: usize) -> usize {
        match self.policy {
            LbPolicy::RoundRobin => self.cursor.fetch_add(1, Ordering::Relaxed) % n,
            LbPolicy::Random => rand::random_range(0..n),
            LbPolicy::LeastRequest => {
                // Power of two choices, as Envoy's least_request does by default.
                let a = rand::random_range(0..n);
                let b = rand::random_range(0..n);
                let load = |i: usize| self.in_flight[i].load(Ordering::Relaxed);
                if load(b) < load(a) {
                    b
                } else {
                    a
                }
            }
            LbPolicy::RingHash | LbPolicy::Maglev => {
                let base = match &self.table {
                    HashTable::Ring(r) => r.lookup(hash),
                    HashTable::Maglev(m) => m.lookup(hash),
                    HashTable::None => (hash % n as u64) as usize,
                };
                (base + attempt) % n
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(n: u16) -> Arc<[SocketAddr]> {
        (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 9000 + i)))
            .collect()
    }

    fn spread(policy: LbPolicy, n: u16, picks: usize, key: impl Fn(usize) -> u64) -> Vec<usize> {
        let e = eps(n);
        let b = Balancer::new(policy, e.clone(), &HashTable::build(policy, &e), 0);
        let mut counts = vec![0; n as usize];
        for i in 0..picks {
            let (index, _guard) = b.pick(key(i), 0).expect("endpoint");
            counts[index] += 1;
        }
        counts
    }

    #[test]
    fn round_robin_is_exact() {
        assert_eq!(
            spread(LbPolicy::RoundRobin, 3, 300, |_| 0),
            vec![100, 100, 100]
        );
    }

    #[test]
    fn hash_policies_are_sticky_and_spread() {
        for policy in [LbPolicy::RingHash, LbPolicy::Maglev] {
            let c = spread(policy, 4, 4000, |i| hash64(format!("user-{i}").as_bytes()));
            for n in &c {
                assert!((600..1400).contains(n), "{policy:?} uneven: {c:?}");
            }
            let e = eps(4);
            let b = Balancer::new(policy, e.clone(), &HashTable::build(policy, &e), 0);
            let k = hash64(b"alice");
            let first = b.pick(k, 0).map(|p| p.0);
            for _ in 0..10 {
                assert_eq!(b.pick(k, 0).map(|p| p.0), first);
            }
            assert_ne!(b.pick(k, 1).map(|p| p.0), first, "retry must move");
        }
    }

    #[test]
    fn maglev_removal_moves_few_keys() {
        let all = eps(5);
        let fewer: Vec<SocketAddr> = all[..4].to_vec();
        let (a, b) = (Maglev::new(&all), Maglev::new(&fewer));
        let moved = (0..10_000u64)
            .filter(|k| {
                let k = hash64(&k.to_le_bytes());
                let before = all[a.lookup(k)];
                before != all[4] && before != fewer[b.lookup(k)]
            })
            .count();
        assert!(
            moved < 2_000,
            "maglev moved {moved} of 10000 keys that did not need to move"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn every_policy_skips_ejected_endpoints_unless_all_are() {
        use crate::resilience::{Outcome, Outlier};
        let e = eps(3);
        let config = flatmesh_config::OutlierDetection {
            consecutive_5xx: 1,
            max_ejection_percent: 100,
            ..Default::default()
        };
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest,
            LbPolicy::RingHash,
            LbPolicy::Maglev,
        ] {
            let outlier = Outlier::new("c", &config, &e, Arc::default());
            let b = Balancer::new(policy, e.clone(), &HashTable::build(policy, &e), 0).with_out(
                crate::resilience::Out {
                    outlier: Some(outlier.clone()),
                    health: None,
                },
            );
            outlier.report(1, Outcome::Answered(503));
            let mut counts = [0; 3];
            for i in 0..300u64 {
                counts[b.pick(hash64(&i.to_le_bytes()), 0).unwrap().0] += 1;
            }
            assert_eq!(
                counts[1], 0,
                "{policy:?} picked the ejected endpoint: {counts:?}"
            );
            assert!(counts[0] > 60 && counts[2] > 60, "{policy:?}: {counts:?}");
            // All out: panic routing sends to all of them again.
            outlier.report(0, Outcome::Answered(503));
            outlier.report(2, Outcome::Answered(503));
            let picked: std::collections::HashSet<usize> = (0..300u64)
                .map(|i| b.pick(hash64(&i.to_le_bytes()), 0).unwrap().0)
                .collect();
            assert_eq!(picked.len(), 3, "{policy:?}: panic routing");
        }
    }

    #[test]
    fn every_policy_skips_endpoints_failing_their_health_check() {
        use crate::resilience::{ClusterHealth, Out, ProbeResult};
        let e = eps(3);
        let check = flatmesh_config::HealthCheck {
            unhealthy_threshold: 1,
            ..flatmesh_config::HealthCheck::new(flatmesh_config::HealthCheckKind::Tcp)
        };
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest,
            LbPolicy::RingHash,
            LbPolicy::Maglev,
        ] {
            let health = ClusterHealth::new("c", &check, &e, Arc::default());
            let b =
                Balancer::new(policy, e.clone(), &HashTable::build(policy, &e), 0).with_out(Out {
                    outlier: None,
                    health: Some(health.clone()),
                });
            health.record(2, ProbeResult::Fail);
            let mut counts = [0; 3];
            for i in 0..300u64 {
                counts[b.pick(hash64(&i.to_le_bytes()), 0).unwrap().0] += 1;
            }
            assert_eq!(
                counts[2], 0,
                "{policy:?} picked a failing endpoint: {counts:?}"
            );
            assert!(counts[0] > 60 && counts[1] > 60, "{policy:?}: {counts:?}");
            health.record(0, ProbeResult::Timeout);
            health.record(1, ProbeResult::Fail);
            let picked: std::collections::HashSet<usize> = (0..300u64)
                .map(|i| b.pick(hash64(&i.to_le_bytes()), 0).unwrap().0)
                .collect();
            assert_eq!(picked.len(), 3, "{policy:?}: panic routing");
        }
    }

    #[test]
    fn least_request_avoids_busy_endpoint() {
        let e = eps(2);
        let b = Balancer::new(LbPolicy::LeastRequest, e.clone(), &HashTable::None, 0);
        let mut held = Vec::new();
        for _ in 0..20 {
            if let Some((index, g)) = b.pick(0, 0) {
                if index == 0 {
                    held.push(g);
                }
            }
        }
        // With endpoint 0 loaded by held requests, most new picks go to endpoint 1.
        let to_one = (0..200)
            .filter(|_| b.pick(0, 0).map(|p| p.0) == Some(1))
            .count();
        assert!(
            to_one > 120,
            "least_request sent only {to_one}/200 to the idle endpoint"
        );
    }
}
