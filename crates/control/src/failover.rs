//! Failover and membership (E3 §3.5).
//!
//! Membership is a consistent-hash ring of fault domains. A fault domain is a whole server: its
//! SmartNICs share the host's power supply, so host and SmartNICs fail together and replicas never
//! share one. Each member is watched by its successor on the ring, so when a member leaves only the
//! keys (and the watch duty) of that member move.
//!
//! When nodes die, their instances are re-placed: a lost primary is replaced by promoting a live
//! backup replica (the primary now runs where the backup was), and every instance still without a
//! node (lost backups, primaries without a live backup) is placed again with HCM's MS_PLACE relative
//! to its primary, which keeps the fault-domain rule.

use std::collections::BTreeMap;

use crate::placement::{hcm, State};

/// Virtual points per member; more points spread keys more evenly.
const POINTS_PER_MEMBER: u32 = 16;

/// FNV-1a, 64 bit: stable across runs and platforms, which a membership ring needs.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64 finaliser: FNV alone leaves similar short keys ("3#0", "3#1") clustered on the ring.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A consistent-hash ring over fault domains (servers), identified by index.
#[derive(Debug, Clone, Default)]
pub struct Ring {
    points: BTreeMap<u64, usize>,
}

impl Ring {
    pub fn new(members: impl IntoIterator<Item = usize>) -> Self {
        let mut r = Ring::default();
        for m in members {
            r.insert(m);
        }
        r
    }

    pub fn insert(&mut self, member: usize) {
        for k in 0..POINTS_PER_MEMBER {
            self.points
                .insert(fnv1a(format!("{member}#{k}").as_bytes()), member);
        }
    }

    pub fn remove(&mut self, member: usize) {
        self.points.retain(|_, m| *m != member);
    }

    pub fn contains(&self, member: usize) -> bool {
        self.points.values().any(|&m| m == member)
    }

    /// The member owning `key`: the first point clockwise from the key's hash.
    pub fn owner(&self, key: &str) -> Option<usize> {
        let h = fnv1a(key.as_bytes());
        self.points
            .range(h..)
            .next()
            .or_else(|| self.points.iter().next())
            .map(|(_, &m)| m)
    }

    /// The member that watches `member`'s heartbeats: the next distinct member clockwise from its
    /// first point.
    pub fn watcher_of(&self, member: usize) -> Option<usize> {
        let start = fnv1a(format!("{member}#0").as_bytes());
        self.points
            .range(start..)
            .chain(self.points.range(..start))
            .map(|(_, &m)| m)
            .find(|&m| m != member)
    }
}

/// What happened to one instance during failover.
#[derive(Debug, Clone, PartialEq)]
pub struct Moved {
    pub instance: usize,
    pub from: usize,
    pub to: usize,
    /// The instance took over a backup replica's node (and state) instead of being re-placed.
    pub promoted: bool,
}

/// Marks `dead` nodes out of service and re-places everything that ran on them.
pub fn fail_nodes(st: &mut State, dead: &[usize]) -> Result<Vec<Moved>, crate::ControlError> {
    let wl = st.wl;
    for &n in dead {
        st.dead[n] = true;
    }
    let lost: Vec<(usize, usize)> = (0..wl.instances.len())
        .filter_map(|i| st.assign[i].filter(|n| st.dead[*n]).map(|n| (i, n)))
        .collect();
    for &(i, _) in &lost {
        st.unplace(i);
    }
    let mut moved = Vec::new();
    // Promote a live backup for every lost primary.
    for &(i, from) in &lost {
        if !wl.instances[i].is_primary() {
            continue;
        }
        let backup = wl.replicas[i]
            .iter()
            .copied()
            .find(|&r| st.assign[r].is_some());
        if let Some(r) = backup {
            let Some(rn) = st.assign[r] else { continue };
            st.unplace(r);
            st.place(i, rn);
            moved.push(Moved {
                instance: i,
                from,
                to: rn,
                promoted: true,
            });
        }
    }
    // Re-place whatever is still unplaced (lost backups, promoted backups, unprotected primaries):
    // primaries first, so backups can be placed relative to them.
    let mut todo: Vec<(usize, usize)> = (0..wl.instances.len())
        .filter(|&i| st.assign[i].is_none())
        .map(|i| {
            let from = lost
                .iter()
                .find(|(j, _)| *j == i)
                .map(|(_, n)| *n)
                .or_else(|| {
                    moved
                        .iter()
                        .find(|m| wl.replicas[m.instance].contains(&i))
                        .map(|m| m.to)
                })
                .unwrap_or(0);
            (i, from)
        })
        .collect();
    todo.sort_by_key(|&(i, _)| (!wl.instances[i].is_primary(), i));
    for (i, from) in todo {
        let anchor = wl.instances[i]
            .replica_of
            .and_then(|p| st.assign[p])
            .unwrap_or(from);
        let to = if st.dead[anchor] {
            hcm::find_first_fit(st, i)
        } else {
            hcm::ms_place(st, i, anchor)
        }
        .ok_or_else(|| st.no_fit(i))?;
        st.place(i, to);
        moved.push(Moved {
            instance: i,
            from,
            to,
            promoted: false,
        });
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::tests::setup;
    use crate::placement::{hcm, verify};

    #[test]
    fn ring_moves_only_the_leavers_keys() {
        let mut ring = Ring::new(0..50);
        let keys: Vec<String> = (0..2000).map(|k| format!("key{k}")).collect();
        let before: Vec<usize> = keys.iter().map(|k| ring.owner(k).unwrap()).collect();
        ring.remove(7);
        assert!(!ring.contains(7));
        for (k, b) in keys.iter().zip(&before) {
            let now = ring.owner(k).unwrap();
            if *b != 7 {
                assert_eq!(now, *b, "{k} moved although its owner stayed");
            } else {
                assert_ne!(now, 7);
            }
        }
        // Every member has some keys (the virtual points spread them).
        let ring = Ring::new(0..8);
        let mut seen = [false; 8];
        for k in &keys {
            seen[ring.owner(k).unwrap()] = true;
        }
        assert!(seen.iter().all(|s| *s));
        assert_ne!(ring.watcher_of(3), Some(3));
        assert_eq!(Ring::new([1]).watcher_of(1), None);
    }

    #[test]
    fn server_failure_promotes_backups_and_replaces_the_rest() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:IOT-TS");
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let server0: Vec<usize> = topo.servers[0].nodes.clone();
        let on0: Vec<usize> = (0..wl.instances.len())
            .filter(|&i| server0.contains(&st.assign[i].unwrap()))
            .collect();
        assert!(!on0.is_empty());
        let moved = fail_nodes(&mut st, &server0).unwrap();
        let assign = st.complete().unwrap();
        verify(&topo, &wl, &assign).unwrap();
        for &i in &on0 {
            assert!(!server0.contains(&assign[i]));
        }
        // Lost primaries were promoted, not cold-started.
        let lost_primaries = on0
            .iter()
            .filter(|&&i| wl.instances[i].is_primary())
            .count();
        assert_eq!(moved.iter().filter(|m| m.promoted).count(), lost_primaries);
        // A second server failure leaves one server: backups have nowhere to go.
        let server1 = topo.servers[1].nodes.clone();
        let err = fail_nodes(&mut st, &server1).unwrap_err().to_string();
        assert!(err.contains("fits on no node"), "{err}");
    }
}
