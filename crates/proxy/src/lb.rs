//! Load balancing: which endpoint of a cluster gets the next request or connection.
//!
//! Each worker owns its own `Balancer` per cluster (shared-nothing), so round-robin
//! cursors and least-request counts are per worker, as in Envoy. Priority levels, weighted
//! schedules, hash rings and Maglev tables ([`levels`]) are immutable and shared by all
//! workers of a snapshot; slow start ([`slow_start`]) is shared by the node.
//!
//! Every policy skips the endpoints that are out (`crate::resilience::Out`: ejected by
//! outlier detection or failing their health check), unless all of them are: then it picks
//! among all, as Envoy's panic threshold does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use flatmesh_config::LbPolicy;

use crate::resilience::{Out, Permit};

pub mod levels;
mod registry;
pub mod slow_start;

pub use levels::{Level, Tables};
pub use registry::Registry;

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

/// Consistent-hash ring (ketama style): each endpoint owns points on a 64-bit circle, as
/// many as its share of the weight.
pub struct Ring {
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// Envoy's default minimum ring size.
    const MIN_SIZE: usize = 1024;

    /// `weights[i]` is endpoint i's weight.
    pub fn weighted(endpoints: &[SocketAddr], weights: &[u32]) -> Ring {
        let total: u64 = weights.iter().map(|w| u64::from(*w)).sum::<u64>().max(1);
        let per = |w: u32| (Self::MIN_SIZE as u64 * u64::from(w)).div_ceil(total) as usize;
        let mut points = Vec::with_capacity(Self::MIN_SIZE + endpoints.len());
        for (i, (ep, w)) in endpoints.iter().zip(weights).enumerate() {
            for j in 0..per(*w) {
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

    /// `weights[i]` is endpoint i's weight: per round of the fill, an endpoint takes a slot
    /// as often as its weight over the largest (Envoy's weighted Maglev).
    pub fn weighted(endpoints: &[SocketAddr], weights: &[u32]) -> Maglev {
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
        let max_weight = weights.iter().copied().max().unwrap_or(1).max(1);
        let mut credit = vec![0u32; n];
        let mut next = vec![0u64; n];
        let mut table = vec![u32::MAX; Self::SIZE];
        let mut filled = 0;
        'fill: loop {
            for (i, (offset, skip)) in perms.iter().enumerate() {
                credit[i] += weights.get(i).copied().unwrap_or(1).max(1);
                if credit[i] < max_weight {
                    continue;
                }
                credit[i] -= max_weight;
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

/// One worker's balancer for one cluster.
pub struct Balancer {
    policy: LbPolicy,
    endpoints: Arc<[SocketAddr]>,
    cursor: AtomicUsize,
    in_flight: Arc<[AtomicU32]>,
    /// Levels, weighted schedules, hash tables and slow start: the snapshot's, shared.
    tables: Arc<Tables>,
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
    /// Counts nothing: a try that no balancer picked (an `original_dst` cluster's).
    pub fn untracked() -> InFlight {
        InFlight {
            counts: Arc::from([]),
            index: 0,
            permit: None,
        }
    }

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

/// Tries within a level before taking any endpoint that is in (a ramping endpoint turned
/// away, or one found out).
const TRIES: usize = 8;

impl Balancer {
    pub fn new(
        policy: LbPolicy,
        endpoints: Arc<[SocketAddr]>,
        tables: &Arc<Tables>,
        seed: usize,
    ) -> Balancer {
        let in_flight: Arc<[AtomicU32]> = endpoints.iter().map(|_| AtomicU32::new(0)).collect();
        Balancer {
            policy,
            cursor: AtomicUsize::new(seed),
            in_flight,
            tables: tables.clone(),
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
        self.pick_excluding(hash, attempt, &[])
    }

    /// As [`Balancer::pick`], avoiding the endpoints in `exclude` (say, those a request's
    /// earlier tries failed on) while its level has another one that is in, else while
    /// another level has one; only when none has does it take an excluded one.
    pub fn pick_excluding(
        &self,
        hash: u64,
        attempt: usize,
        exclude: &[usize],
    ) -> Option<(usize, InFlight)> {
        let n = self.endpoints.len();
        let tables = &*self.tables;
        if n == 0 || tables.levels.is_empty() {
            return None;
        }
        let out = &self.out;
        // Slow start, when configured, is told what the balancer sees; it weighs the picks
        // only while active (an endpoint ramps, or one seen out may come back).
        let slow = tables.slow_start.as_deref().map(|s| (s, s.now()));
        let ramping = slow.filter(|(s, now)| s.active(*now));
        // A load or two while nothing is out and nothing ramps: the first level, no checks.
        let fast = (!out.any() && ramping.is_none())
            .then(|| self.choose(&tables.levels[0], hash, attempt))
            .filter(|i| !exclude.contains(i));
        let index = if let Some(index) = fast {
            index
        } else {
            let now = out.now();
            let (level, panic) = if out.any() || ramping.is_some_and(|(s, _)| s.watching()) {
                let health = tables.health(out, now, |i, is_out| {
                    if let Some((s, at)) = slow {
                        s.seen(i, is_out, at);
                    }
                });
                let loads = tables.loads(&health);
                if loads.iter().all(|l| *l == 0) {
                    // Every endpoint is out: panic routing over the first level, as Envoy
                    // sends to all hosts below its panic threshold.
                    (0, true)
                } else if tables.levels.len() == 1 {
                    (0, false)
                } else {
                    let draw = match self.policy {
                        LbPolicy::RingHash | LbPolicy::Maglev => {
                            (hash.rotate_left(32) % 100) as u32
                        }
                        _ => rand::random_range(0..100),
                    };
                    (Tables::level_for(&loads, draw), false)
                }
            } else {
                (0, false)
            };
            let level = &tables.levels[level];
            let usable = |i: usize| {
                (panic || !out.is_out(i, now))
                    && !exclude.contains(&i)
                    && ramping.is_none_or(|(s, at)| {
                        let f = s.factor(i, at);
                        f >= 1.0 || rand::random::<f64>() < f
                    })
            };
            let first = self.choose(level, hash, attempt);
            // The policy's own next choices first (a round-robin cursor moves on, a random
            // pick draws again, a hash walks the ring), then any member that is in and not
            // excluded, then any that is in; none: the policy's first choice.
            let members = || level.members.iter().map(|&i| i as usize);
            let is_in = |i: usize| panic || !out.is_out(i, now);
            std::iter::once(first)
                .chain((1..TRIES).map(|k| self.choose(level, hash, attempt + k)))
                .find(|&i| usable(i))
                .or_else(|| members().find(|&i| is_in(i) && !exclude.contains(&i)))
                // Every member of this level failed this request or is out: an endpoint of
                // another level, highest priority first, before a repeat (the retry spills to
                // the next priority, as Envoy's `previous_priorities` retry plugin does).
                .or_else(|| {
                    tables
                        .levels
                        .iter()
                        .flat_map(|l| l.members.iter().map(|&i| i as usize))
                        .find(|&i| !out.is_out(i, now) && !exclude.contains(&i))
                })
                .or_else(|| members().find(|&i| is_in(i)))
                .unwrap_or(first)
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

    /// The policy's weighted choice within `level` for the `attempt`th try.
    fn choose(&self, level: &Level, hash: u64, attempt: usize) -> usize {
        let schedule = level.schedule();
        let drawn = || schedule[rand::random_range(0..schedule.len())] as usize;
        match self.policy {
            LbPolicy::RoundRobin => {
                schedule[self.cursor.fetch_add(1, Ordering::Relaxed) % schedule.len()] as usize
            }
            LbPolicy::Random => drawn(),
            LbPolicy::LeastRequest => {
                // Power of two choices, as Envoy's least_request does by default, with the
                // two drawn by weight: idle endpoints share by weight, and a busy one loses
                // to one with fewer outstanding requests.
                let (a, b) = (drawn(), drawn());
                let load = |i: usize| self.in_flight[i].load(Ordering::Relaxed);
                if load(b) < load(a) {
                    b
                } else {
                    a
                }
            }
            LbPolicy::RingHash | LbPolicy::Maglev => level.hashed(hash, attempt),
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
        let b = Balancer::new(policy, e.clone(), &Arc::new(Tables::plain(policy, &e)), 0);
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
            let b = Balancer::new(policy, e.clone(), &Arc::new(Tables::plain(policy, &e)), 0);
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
        let (a, b) = (
            Maglev::weighted(&all, &[1; 5]),
            Maglev::weighted(&fewer, &[1; 4]),
        );
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
            let b = Balancer::new(policy, e.clone(), &Arc::new(Tables::plain(policy, &e)), 0)
                .with_out(crate::resilience::Out {
                    outlier: Some(outlier.clone()),
                    health: None,
                });
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
            let b = Balancer::new(policy, e.clone(), &Arc::new(Tables::plain(policy, &e)), 0)
                .with_out(Out {
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
        let b = Balancer::new(
            LbPolicy::LeastRequest,
            e.clone(),
            &Arc::new(Tables::plain(LbPolicy::LeastRequest, &e)),
            0,
        );
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

    fn entry(
        port: u16,
        weight: u32,
        priority: u32,
        locality: Option<&str>,
    ) -> flatmesh_config::Endpoint {
        flatmesh_config::Endpoint {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            weight,
            priority,
            locality: locality.map(str::to_owned),
        }
    }

    fn balancer(
        policy: LbPolicy,
        entries: &[flatmesh_config::Endpoint],
        node: Option<&str>,
        out: Out,
    ) -> Balancer {
        let e: Arc<[SocketAddr]> = entries.iter().map(|e| e.address).collect();
        let tables = Tables::from_entries(policy, entries, node, 140, None);
        Balancer::new(policy, e, &Arc::new(tables), 0).with_out(out)
    }

    fn counts(b: &Balancer, n: usize, picks: u64) -> Vec<usize> {
        let mut counts = vec![0; n];
        for i in 0..picks {
            counts[b.pick(hash64(&i.to_le_bytes()), 0).unwrap().0] += 1;
        }
        counts
    }

    #[test]
    fn every_policy_honours_weights() {
        let entries = [entry(9000, 3, 0, None), entry(9001, 1, 0, None)];
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest,
            LbPolicy::RingHash,
            LbPolicy::Maglev,
        ] {
            let c = counts(&balancer(policy, &entries, None, Out::default()), 2, 8000);
            assert!(
                (5500..6500).contains(&c[0]),
                "{policy:?}: 3:1 weights gave {c:?}"
            );
        }
        let c = counts(
            &balancer(LbPolicy::RoundRobin, &entries, None, Out::default()),
            2,
            4000,
        );
        assert_eq!(c, vec![3000, 1000], "round robin is exact");
    }

    /// Envoy's worked example: half of priority 0 is out, so it is 70% healthy (× 1.4) and
    /// priority 1 takes the other 30%.
    #[test]
    fn partial_failover_by_the_overprovisioning_factor() {
        use crate::resilience::{ClusterHealth, ProbeResult};
        let mut entries: Vec<_> = (0..10).map(|i| entry(9000 + i, 1, 0, None)).collect();
        entries.push(entry(9100, 1, 1, None));
        let addrs: Vec<SocketAddr> = entries.iter().map(|e| e.address).collect();
        let check = flatmesh_config::HealthCheck {
            unhealthy_threshold: 1,
            healthy_threshold: 1,
            ..flatmesh_config::HealthCheck::new(flatmesh_config::HealthCheckKind::Tcp)
        };
        let health = ClusterHealth::new("c", &check, &addrs, Arc::default());
        let out = Out {
            outlier: None,
            health: Some(health.clone()),
        };
        for policy in [LbPolicy::RoundRobin, LbPolicy::Random, LbPolicy::Maglev] {
            let b = balancer(policy, &entries, None, out.clone());
            assert_eq!(
                counts(&b, 11, 1000)[10],
                0,
                "{policy:?}: all healthy, P1 idle"
            );
            for i in 0..5 {
                health.record(i, ProbeResult::Fail);
            }
            let c = counts(&b, 11, 20_000);
            assert!(
                (5200..6800).contains(&c[10]),
                "{policy:?}: P1 took {} of 20000, not ~30%",
                c[10]
            );
            assert_eq!(c[..5].iter().sum::<usize>(), 0, "{policy:?}: {c:?}");
            // 8 of 10 in: 112% healthy, P1 idle again.
            for i in 0..3 {
                health.record(i, ProbeResult::Pass);
            }
            assert_eq!(counts(&b, 11, 1000)[10], 0, "{policy:?}");
            for i in 0..5 {
                health.record(i, ProbeResult::Pass);
            }
        }
    }

    #[test]
    fn the_local_locality_takes_the_traffic_while_healthy() {
        use crate::resilience::{ClusterHealth, ProbeResult};
        let entries = [
            entry(9000, 1, 0, Some("eu/a")),
            entry(9001, 1, 0, Some("us/a")),
            entry(9002, 1, 0, Some("us/b")),
        ];
        let addrs: Vec<SocketAddr> = entries.iter().map(|e| e.address).collect();
        let check = flatmesh_config::HealthCheck {
            unhealthy_threshold: 1,
            ..flatmesh_config::HealthCheck::new(flatmesh_config::HealthCheckKind::Tcp)
        };
        let health = ClusterHealth::new("c", &check, &addrs, Arc::default());
        let out = Out {
            outlier: None,
            health: Some(health.clone()),
        };
        let b = balancer(LbPolicy::RoundRobin, &entries, Some("us/a"), out);
        assert_eq!(counts(&b, 3, 300), vec![0, 300, 0]);
        // The local one down: the same region next, then the rest of the world.
        health.record(1, ProbeResult::Fail);
        assert_eq!(counts(&b, 3, 300), vec![0, 0, 300]);
        health.record(2, ProbeResult::Fail);
        assert_eq!(counts(&b, 3, 300), vec![300, 0, 0]);
        // Without a node locality, localities are labels only.
        let plain = balancer(LbPolicy::RoundRobin, &entries, None, Out::default());
        assert_eq!(counts(&plain, 3, 300), vec![100, 100, 100]);
    }

    /// An endpoint back from a failed health check gets a share that grows over the window.
    #[tokio::test(start_paused = true)]
    async fn slow_start_ramps_an_endpoint_back_from_its_health_check() {
        use crate::resilience::{ClusterHealth, ProbeResult};
        use std::time::Duration;
        let entries = [entry(9000, 1, 0, None), entry(9001, 1, 0, None)];
        let addrs: Vec<SocketAddr> = entries.iter().map(|e| e.address).collect();
        let check = flatmesh_config::HealthCheck {
            unhealthy_threshold: 1,
            healthy_threshold: 1,
            ..flatmesh_config::HealthCheck::new(flatmesh_config::HealthCheckKind::Tcp)
        };
        let health = ClusterHealth::new("c", &check, &addrs, Arc::default());
        let config = flatmesh_config::SlowStart {
            window: Duration::from_secs(10),
            aggression: 1.0,
            min_weight_percent: 10,
        };
        let slow = Arc::new(slow_start::SlowStart::new(&config, 2));
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest,
        ] {
            let tables = Tables::from_entries(policy, &entries, None, 140, Some(slow.clone()));
            let b =
                Balancer::new(policy, addrs.clone().into(), &Arc::new(tables), 0).with_out(Out {
                    outlier: None,
                    health: Some(health.clone()),
                });
            let start = counts(&b, 2, 1000)[1];
            assert!(
                (420..580).contains(&start),
                "{policy:?}: no ramp at the start: {start}"
            );
            health.record(1, ProbeResult::Fail);
            assert_eq!(counts(&b, 2, 100)[1], 0, "{policy:?}");
            health.record(1, ProbeResult::Pass);
            // Share of endpoint 1 at 0, 25%, 50% and 75% of the window, then after it:
            // weight f against 1 is f / (1 + f).
            let mut shares = Vec::new();
            for _ in 0..4 {
                shares.push(counts(&b, 2, 4000)[1] as f64 / 4000.0);
                tokio::time::advance(Duration::from_millis(2500)).await;
            }
            tokio::time::advance(Duration::from_millis(100)).await;
            shares.push(counts(&b, 2, 4000)[1] as f64 / 4000.0);
            let expected = [0.1 / 1.1, 0.25 / 1.25, 0.5 / 1.5, 0.75 / 1.75, 0.5];
            for (got, want) in shares.iter().zip(expected) {
                assert!(
                    (got - want).abs() < 0.05,
                    "{policy:?}: shares {shares:?}, expected {expected:?}"
                );
            }
        }
    }

    #[test]
    fn pick_excluding_avoids_the_endpoints_a_request_failed_on() {
        let entries = [
            entry(9000, 1, 0, None),
            entry(9001, 1, 0, None),
            entry(9002, 5, 0, None),
        ];
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest,
            LbPolicy::RingHash,
            LbPolicy::Maglev,
        ] {
            let b = balancer(policy, &entries, None, Out::default());
            for i in 0..300u64 {
                let key = hash64(&i.to_le_bytes());
                let (index, _) = b.pick_excluding(key, 1, &[2]).unwrap();
                assert_ne!(index, 2, "{policy:?}");
                let (index, _) = b.pick_excluding(key, 2, &[2, 0]).unwrap();
                assert_eq!(index, 1, "{policy:?}");
            }
            // All excluded: one is still given.
            assert!(b.pick_excluding(0, 3, &[0, 1, 2]).is_some());
        }
    }

    #[test]
    fn pick_excluding_spills_to_the_next_priority_before_a_repeat() {
        let entries = [
            entry(9000, 1, 0, None),
            entry(9001, 1, 0, None),
            entry(9002, 1, 1, None),
            entry(9003, 1, 2, None),
        ];
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest,
            LbPolicy::RingHash,
            LbPolicy::Maglev,
        ] {
            let b = balancer(policy, &entries, None, Out::default());
            for i in 0..100u64 {
                let key = hash64(&i.to_le_bytes());
                let (index, _) = b.pick_excluding(key, 2, &[0, 1]).unwrap();
                assert_eq!(index, 2, "{policy:?}: priority 1 before a repeat");
                let (index, _) = b.pick_excluding(key, 3, &[0, 1, 2]).unwrap();
                assert_eq!(index, 3, "{policy:?}: then priority 2");
                let (index, _) = b.pick_excluding(key, 4, &[0, 1, 2, 3]).unwrap();
                assert!(index < 2, "{policy:?}: all failed: the first level again");
            }
        }
    }
}
