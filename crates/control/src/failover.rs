//! Failover and membership (E3 §3.5).
//!
//! Membership is a consistent-hash ring of fault domains. A fault domain is a whole server: its
//! SmartNICs share the host's power supply, so host and SmartNICs fail together and replicas never
//! share one. Each member is watched by its successor on the ring, so when a member leaves only the
//! keys (and the watch duty) of that member move.
//!
//! When nodes die, their instances are re-placed (see [`fail_nodes`]): a lost primary is replaced by
//! promoting a live backup replica, and every instance still without a node is placed again with
//! HCM's MS_PLACE, near its primary or near the member that now owns it on the ring, which keeps the
//! fault-domain rule.

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
///
/// 1. A lost primary with a live backup is promoted: it takes over the backup's node (and state)
///    when its full load fits there; a passive backup (`backup_load` < 1) may not have room.
/// 2. Everything still unplaced is placed again with HCM's MS_PLACE, primaries first, anchored at:
///    its primary's node (a backup: the fault-domain rule sends it to another server); else, when
///    only a SmartNIC died, its own server's host (the work falls back to the host CPU, as
///    HeteroK8s does when a DPU fails); else the host of the server that now owns the instance on
///    the membership ring. The dead member's instances so spread over its ring successors, and
///    nothing else moves.
pub fn fail_nodes(
    st: &mut State,
    dead: &[usize],
    ring: &Ring,
) -> Result<Vec<Moved>, crate::ControlError> {
    let wl = st.wl;
    let topo = st.topo;
    for &n in dead {
        if let Some(d) = st.dead.get_mut(n) {
            *d = true;
        }
    }
    let lost: Vec<(usize, usize)> = (0..wl.instances.len())
        .filter_map(|i| st.assign[i].filter(|n| st.dead[*n]).map(|n| (i, n)))
        .collect();
    for &(i, _) in &lost {
        st.unplace(i);
    }
    let mut moved = Vec::new();
    // Where each unplaced instance came from (for the log and for anchoring).
    let mut origin: Vec<Option<usize>> = vec![None; wl.instances.len()];
    for &(i, n) in &lost {
        origin[i] = Some(n);
    }
    for &(i, from) in &lost {
        if !wl.instances[i].is_primary() {
            continue;
        }
        for &r in &wl.replicas[i] {
            let Some(rn) = st.assign[r] else { continue };
            st.unplace(r);
            if st.fits(i, rn) {
                st.place(i, rn);
                origin[r] = Some(rn);
                moved.push(Moved {
                    instance: i,
                    from,
                    to: rn,
                    promoted: true,
                });
                break;
            }
            st.place(r, rn);
        }
    }
    let mut todo: Vec<usize> = (0..wl.instances.len())
        .filter(|&i| st.assign[i].is_none())
        .collect();
    todo.sort_by_key(|&i| (!wl.instances[i].is_primary(), i));
    for i in todo {
        let from = origin[i].unwrap_or(0);
        let anchor = match wl.instances[i].replica_of.and_then(|p| st.assign[p]) {
            Some(primary_node) => Some(primary_node),
            None => {
                let host = topo.servers[topo.nodes[from].server].nodes[0];
                if !st.dead[host] {
                    Some(host)
                } else {
                    ring.owner(&wl.instances[i].id)
                        .map(|s| topo.servers[s].nodes[0])
                        .filter(|&h| !st.dead[h])
                }
            }
        };
        let to = match anchor {
            Some(a) => hcm::ms_place(st, i, a),
            None => hcm::find_first_fit(st, i),
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
    use crate::topology::Topology;

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
        let mut ring = Ring::new(0..topo.servers.len());
        ring.remove(0);
        let moved = fail_nodes(&mut st, &server0, &ring).unwrap();
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
        ring.remove(1);
        let err = fail_nodes(&mut st, &server1, &ring)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fits on no node"), "{err}");
    }

    #[test]
    fn a_dead_smartnic_falls_back_to_its_host() {
        // Without backups, what ran on a failed SmartNIC restarts on its own server's host (the
        // rest of the fault domain is alive), as HeteroK8s falls back to the CPU when a DPU fails.
        let (topo, _) = setup("preset:3xType1-SmartNIC", "preset:RTA-SHM");
        let mut app = crate::model::load_app("preset:RTA-SHM").unwrap();
        app.replicas = 0;
        let wl = crate::workload::Workload::from_apps(&[app]).unwrap();
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let nic = topo.first_fit_order[0];
        let host = topo.servers[topo.nodes[nic].server].nodes[0];
        let on_nic: Vec<usize> = (0..wl.instances.len())
            .filter(|&i| st.assign[i] == Some(nic))
            .collect();
        assert!(!on_nic.is_empty());
        let ring = Ring::new(0..topo.servers.len());
        let moved = fail_nodes(&mut st, &[nic], &ring).unwrap();
        assert_eq!(moved.len(), on_nic.len());
        verify(&topo, &wl, &st.complete().unwrap()).unwrap();
        for i in on_nic {
            assert_eq!(st.assign[i], Some(host), "{}", wl.instances[i].id);
        }
    }

    #[test]
    fn a_dead_servers_unprotected_instances_go_to_its_ring_successors() {
        // No backups: every instance of the dead server is re-placed near the member that owns it
        // on the ring now, so they spread over several servers instead of piling onto the first.
        let topo = Topology::build(&crate::model::uniform_cluster(
            "c",
            "Type2-SmartNIC",
            12,
            40,
        ))
        .unwrap();
        let mut app = crate::model::load_app("preset:NFV-FIN").unwrap();
        app.replicas = 0;
        let wl = crate::workload::Workload::from_apps(&[app]).unwrap();
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).unwrap();
        let victim = st.assign[0].map(|n| topo.nodes[n].server).unwrap();
        let lost: Vec<usize> = (0..wl.instances.len())
            .filter(|&i| st.assign[i].map(|n| topo.nodes[n].server) == Some(victim))
            .collect();
        let mut ring = Ring::new(0..topo.servers.len());
        ring.remove(victim);
        let moved = fail_nodes(&mut st, &topo.servers[victim].nodes.clone(), &ring).unwrap();
        assert_eq!(moved.len(), lost.len());
        verify(&topo, &wl, &st.complete().unwrap()).unwrap();
        let mut servers: Vec<usize> = lost
            .iter()
            .map(|&i| topo.nodes[st.assign[i].unwrap()].server)
            .collect();
        servers.sort_unstable();
        servers.dedup();
        assert!(!servers.contains(&victim));
        assert!(
            servers.len() >= 3,
            "the lost instances landed on only {servers:?}"
        );
        // Each instance went to (or next to) its ring owner's server first.
        let owner_hits = lost
            .iter()
            .filter(|&&i| {
                Some(topo.nodes[st.assign[i].unwrap()].server) == ring.owner(&wl.instances[i].id)
            })
            .count();
        assert!(
            owner_hits * 2 >= lost.len(),
            "{owner_hits} of {}",
            lost.len()
        );
    }
}
