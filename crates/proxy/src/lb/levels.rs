//! A cluster's priority levels and weighted tables, computed once per snapshot and shared by
//! every worker (docs/resilience.md, "Weights, priorities and locality").
//!
//! Endpoints are grouped by priority (0 first) and, when the node has a locality, within a
//! priority by how closely their locality matches the node's (same subzone, same zone, same
//! region, other): Istio's locality failover, which makes localities sub-priorities. Each
//! group is a [`Level`]. Traffic goes to the levels by Envoy's priority-load formula: a
//! level's health is healthy/total × the overprovisioning factor, capped at 100%, and each
//! level takes its health's share of what the levels before it left.
//!
//! Within a level, each policy is weighted: round robin walks a smooth weighted schedule
//! (Envoy's EDF shares, interleaved), random draws from the same schedule,
//! least_request draws two from it and keeps the one with fewer requests per weight, and
//! the ring_hash / maglev tables give each endpoint entries in proportion to its weight.

use std::net::SocketAddr;
use std::sync::Arc;

use flatmesh_config::{Cluster, Endpoint, LbPolicy};

use super::slow_start::SlowStart;
use super::{Maglev, Ring};
use crate::resilience::Out;

/// The shared, immutable hashing structure of one level.
pub enum HashTable {
    None,
    Ring(Ring),
    Maglev(Maglev),
}

impl HashTable {
    pub fn build(policy: LbPolicy, endpoints: &[SocketAddr], weights: &[u32]) -> HashTable {
        match policy {
            LbPolicy::RingHash => HashTable::Ring(Ring::weighted(endpoints, weights)),
            LbPolicy::Maglev => HashTable::Maglev(Maglev::weighted(endpoints, weights)),
            _ => HashTable::None,
        }
    }

    /// The position (in the level's member list) that `key` hashes to.
    pub fn lookup(&self, key: u64, members: usize) -> usize {
        match self {
            HashTable::Ring(r) => r.lookup(key),
            HashTable::Maglev(m) => m.lookup(key),
            HashTable::None => (key % members.max(1) as u64) as usize,
        }
    }
}

/// How an endpoint's locality relates to the node's, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proximity {
    /// The node has no locality, or the endpoint matches it entirely.
    Same = 0,
    SameZone = 1,
    SameRegion = 2,
    Other = 3,
}

impl Proximity {
    /// `endpoint` against `node` (`region/zone/subzone`, leading parts).
    pub fn of(node: Option<&str>, endpoint: Option<&str>) -> Proximity {
        let Some(node) = node else {
            return Proximity::Same;
        };
        let node: Vec<&str> = node.split('/').collect();
        let endpoint: Vec<&str> = endpoint.map_or(Vec::new(), |e| e.split('/').collect());
        let matching = node
            .iter()
            .zip(&endpoint)
            .take_while(|(a, b)| a == b)
            .count();
        if matching == node.len() {
            Proximity::Same
        } else {
            match matching {
                2 => Proximity::SameZone,
                1 => Proximity::SameRegion,
                _ => Proximity::Other,
            }
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Proximity::Same => "local",
            Proximity::SameZone => "same_zone",
            Proximity::SameRegion => "same_region",
            Proximity::Other => "other",
        }
    }
}

/// One priority level: the endpoints of one priority (and locality proximity).
pub struct Level {
    pub priority: u32,
    pub proximity: Proximity,
    /// Indices into the cluster's endpoint list.
    pub members: Box<[u32]>,
    /// Endpoint indices, each as often as its weight (divided by the weights' gcd), in a
    /// smooth order ([`schedule`]).
    schedule: Box<[u32]>,
    table: HashTable,
}

/// A cluster's levels, weights and slow start, for one snapshot.
pub struct Tables {
    pub levels: Box<[Level]>,
    /// In percent (140: Envoy's 1.4).
    pub overprovisioning: u32,
    pub slow_start: Option<Arc<SlowStart>>,
}

/// Percent of traffic per level; sums to 100 unless every endpoint is out.
pub type Loads = Vec<u32>;

impl Tables {
    /// The tables of `cluster` as the node at `node_locality` sees them.
    pub fn build(
        cluster: &Cluster,
        node_locality: Option<&str>,
        slow_start: Option<Arc<SlowStart>>,
    ) -> Tables {
        Tables::from_entries(
            cluster.lb,
            cluster.endpoints.entries(),
            node_locality,
            cluster.overprovisioning(),
            slow_start,
        )
    }

    /// Plain endpoints: one level, weight 1 each.
    #[cfg(test)]
    pub fn plain(policy: LbPolicy, endpoints: &[SocketAddr]) -> Tables {
        let entries: Vec<Endpoint> = endpoints.iter().copied().map(Endpoint::new).collect();
        Tables::from_entries(
            policy,
            &entries,
            None,
            flatmesh_config::DEFAULT_OVERPROVISIONING,
            None,
        )
    }

    pub fn from_entries(
        policy: LbPolicy,
        entries: &[Endpoint],
        node_locality: Option<&str>,
        overprovisioning: u32,
        slow_start: Option<Arc<SlowStart>>,
    ) -> Tables {
        let weights: Box<[u32]> = entries.iter().map(|e| e.weight.max(1)).collect();
        let key = |e: &Endpoint| {
            (
                e.priority,
                Proximity::of(node_locality, e.locality.as_deref()),
            )
        };
        let mut keys: Vec<(u32, Proximity)> = entries.iter().map(key).collect();
        keys.sort_unstable();
        keys.dedup();
        let levels = keys
            .into_iter()
            .map(|(priority, proximity)| {
                let members: Box<[u32]> = (0..entries.len())
                    .filter(|&i| key(&entries[i]) == (priority, proximity))
                    .map(|i| i as u32)
                    .collect();
                let addresses: Vec<SocketAddr> = members
                    .iter()
                    .map(|&i| entries[i as usize].address)
                    .collect();
                let member_weights: Vec<u32> =
                    members.iter().map(|&i| weights[i as usize]).collect();
                Level {
                    priority,
                    proximity,
                    schedule: schedule(&members, &member_weights),
                    table: HashTable::build(policy, &addresses, &member_weights),
                    members,
                }
            })
            .collect();
        Tables {
            levels,
            overprovisioning: overprovisioning.max(1),
            slow_start,
        }
    }

    /// In and total endpoints per level under `out` at `now`; `seen` is told each one's state.
    pub fn health(
        &self,
        out: &Out,
        now: u64,
        mut seen: impl FnMut(usize, bool),
    ) -> Vec<(u32, u32)> {
        self.levels
            .iter()
            .map(|level| {
                let mut healthy = 0;
                for &i in level.members.iter() {
                    let is_out = out.is_out(i as usize, now);
                    seen(i as usize, is_out);
                    healthy += u32::from(!is_out);
                }
                (healthy, level.members.len() as u32)
            })
            .collect()
    }

    /// Envoy's priority load: each level's share of traffic, in percent, from its health.
    pub fn loads(&self, health: &[(u32, u32)]) -> Loads {
        priority_loads(health, self.overprovisioning)
    }

    /// The level `draw` (0..100) falls in under `loads`.
    pub fn level_for(loads: &[u32], draw: u32) -> usize {
        let mut sum = 0;
        for (i, load) in loads.iter().enumerate() {
            sum += load;
            if draw < sum {
                return i;
            }
        }
        0
    }
}

/// Envoy's priority-load formula. A level's health is healthy/total × `factor`% capped at
/// 100; levels take `health × 100 / min(100, Σ health)` of what the ones before left, so a
/// cluster whose levels together are less than 100% healthy still sends everything to them.
/// Rounding leftovers go to the first healthy level. All zero: every endpoint is out.
pub fn priority_loads(health: &[(u32, u32)], factor: u32) -> Loads {
    let health: Vec<u64> = health
        .iter()
        .map(|&(healthy, total)| {
            if total == 0 {
                0
            } else {
                (u64::from(healthy) * u64::from(factor) / u64::from(total)).min(100)
            }
        })
        .collect();
    let normalized = health.iter().sum::<u64>().min(100);
    if normalized == 0 {
        return vec![0; health.len()];
    }
    let mut remaining = 100u64;
    let mut loads: Vec<u32> = health
        .iter()
        .map(|h| {
            let load = (h * 100 / normalized).min(remaining);
            remaining -= load;
            load as u32
        })
        .collect();
    if remaining > 0 {
        if let Some(first) = health.iter().position(|h| *h > 0) {
            loads[first] += remaining as u32;
        }
    }
    loads
}

/// Each member as often as its weight over the weights' gcd, ordered by earliest deadline
/// with entry k (from 1) of a member of weight w due at (k - ½)/w, ties by position: the
/// half-step offset interleaves the entries (3:1:1 gives 0 1 0 2 0 rather than Envoy's EDF
/// burst 0 0 0 1 2, same shares).
fn schedule(members: &[u32], weights: &[u32]) -> Box<[u32]> {
    let g = weights.iter().copied().fold(0, gcd).max(1);
    let mut entries: Vec<(u64, u64, usize, u32)> = Vec::new();
    for (pos, (&m, &w)) in members.iter().zip(weights).enumerate() {
        let w = u64::from(w / g);
        for k in 1..=w {
            // Deadline (2k - 1) / 2w, kept as a fraction to compare exactly.
            entries.push((2 * k - 1, w, pos, m));
        }
    }
    entries.sort_by(|a, b| (a.0 * b.1).cmp(&(b.0 * a.1)).then(a.2.cmp(&b.2)));
    entries.into_iter().map(|e| e.3).collect()
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Level {
    /// The weighted schedule (endpoint indices).
    pub fn schedule(&self) -> &[u32] {
        &self.schedule
    }

    /// The endpoint `key` hashes to, `step` places on.
    pub fn hashed(&self, key: u64, step: usize) -> usize {
        let n = self.members.len();
        let at = self.table.lookup(key, n);
        self.members[(at + step) % n] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_priority_load_examples() {
        // Envoy's docs: P0 healthy 100% → all to P0.
        assert_eq!(priority_loads(&[(10, 10), (10, 10)], 140), vec![100, 0]);
        // 80% healthy × 1.4 = 112% → still all to P0.
        assert_eq!(priority_loads(&[(8, 10), (10, 10)], 140), vec![100, 0]);
        // 50% healthy × 1.4 = 70%: P1 takes the other 30%.
        assert_eq!(priority_loads(&[(5, 10), (10, 10)], 140), vec![70, 30]);
        // P0 at 20% → 28%; P1 at 50% → 70%; P2 gets the remaining 2%.
        assert_eq!(
            priority_loads(&[(2, 10), (5, 10), (10, 10)], 140),
            vec![28, 70, 2]
        );
        // Together under 100%: normalized, nothing is lost.
        assert_eq!(priority_loads(&[(2, 10), (2, 10)], 140), vec![50, 50]);
        // P0 entirely down: P1 takes everything.
        assert_eq!(priority_loads(&[(0, 2), (1, 1)], 140), vec![0, 100]);
        // Nothing in: all zero (the balancer panics over everything).
        assert_eq!(priority_loads(&[(0, 2), (0, 1)], 140), vec![0, 0]);
        // A factor of 100: no headroom, 90% healthy spills 10%.
        assert_eq!(priority_loads(&[(9, 10), (1, 1)], 100), vec![90, 10]);
    }

    #[test]
    fn schedule_is_weighted_and_smooth() {
        let s = schedule(&[0, 1, 2], &[3, 1, 1]);
        assert_eq!(s.len(), 5);
        assert_eq!(s.iter().filter(|&&i| i == 0).count(), 3);
        // Never two of the other two in a row, nor the heavy one three times in a row.
        assert!(!s.windows(3).any(|w| w.iter().all(|&i| i == 0)), "{s:?}");
        // The gcd keeps equal weights at one entry each (plain round robin).
        assert_eq!(&*schedule(&[4, 5], &[7, 7]), &[4, 5]);
    }

    #[test]
    fn localities_rank_by_the_longest_common_prefix() {
        let node = Some("us-east1/b/r1");
        let p = |e: Option<&str>| Proximity::of(node, e);
        assert_eq!(p(Some("us-east1/b/r1")), Proximity::Same);
        assert_eq!(p(Some("us-east1/b/r2")), Proximity::SameZone);
        assert_eq!(p(Some("us-east1/c")), Proximity::SameRegion);
        assert_eq!(p(Some("eu-west1/b")), Proximity::Other);
        assert_eq!(p(None), Proximity::Other);
        assert_eq!(Proximity::of(None, Some("x")), Proximity::Same);
        assert_eq!(
            Proximity::of(Some("us-east1"), Some("us-east1/a")),
            Proximity::Same
        );
    }
}
