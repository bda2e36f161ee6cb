//! HCM, E3's hierarchical communication-aware placement (Algorithm 1, §3.3).
//!
//! MS_DAG_TRAVERSE walks the DAG breadth-first from its sources. An undeployed node goes to
//! find_first_fit (topology-blind); each direct descendant goes to MS_PLACE relative to its parent's
//! node, which searches the parent's hierarchical topology level by level with find_best_fit and
//! falls back to find_first_fit.
//!
//! Two points the pseudo-code leaves open, decided here: (1) a descendant that an earlier parent
//! already placed in this traversal is neither moved again nor re-enqueued (line 13 would otherwise
//! move it on every visit, and a diamond in the DAG would enqueue it once per path); for tree-shaped
//! DAGs this is exactly Algorithm 1. (2) Backup replicas are placed right after their primary with
//! MS_PLACE relative to the primary's node; the fault-domain rule then skips levels 1-2.

use std::collections::VecDeque;

use super::State;
use crate::error::Result;

/// Runs MS_DAG_TRAVERSE over every instance of the workload that is not deployed yet.
pub fn run(st: &mut State) -> Result<()> {
    run_range(st, 0..st.wl.instances.len())
}

/// Runs MS_DAG_TRAVERSE over the instances in `range` (one application of a larger workload: the
/// simulator deploys applications one after another this way).
pub fn run_range(st: &mut State, range: std::ops::Range<usize>) -> Result<()> {
    let wl = st.wl;
    let mut queued = vec![false; wl.instances.len()];
    let mut q: VecDeque<usize> = VecDeque::new();
    for &s in &wl.sources {
        if range.contains(&s) && !queued[s] {
            queued[s] = true;
            q.push_back(s);
        }
    }
    while let Some(v) = q.pop_front() {
        let n = match st.assign[v] {
            Some(n) => n,
            None => {
                let n = find_first_fit(st, v).ok_or_else(|| st.no_fit(v))?;
                deploy(st, v, n)?;
                n
            }
        };
        for &w in &wl.children[v] {
            if queued[w] {
                continue;
            }
            if st.assign[w].is_none() {
                let nw = ms_place(st, w, n).ok_or_else(|| st.no_fit(w))?;
                deploy(st, w, nw)?;
            }
            queued[w] = true;
            q.push_back(w);
        }
    }
    // Instances unreachable from a source (none in a valid app, but a caller may pass a partial
    // workload) are placed topology-blind so nothing is silently left out.
    for v in range {
        if st.assign[v].is_none() && wl.instances[v].is_primary() {
            let n = find_first_fit(st, v).ok_or_else(|| st.no_fit(v))?;
            deploy(st, v, n)?;
        }
    }
    Ok(())
}

/// set_deployed_node, plus the primary's backup replicas placed near it.
fn deploy(st: &mut State, v: usize, n: usize) -> Result<()> {
    st.place(v, n);
    for &r in &st.wl.replicas[v] {
        if st.assign[r].is_none() {
            let nr = ms_place(st, r, n).ok_or_else(|| st.no_fit(r))?;
            st.place(r, nr);
        }
    }
    Ok(())
}

/// MS_PLACE(V, N, T): the best fit in the closest level of N's hierarchical topology that has room.
pub fn ms_place(st: &State, v: usize, n: usize) -> Option<usize> {
    for level in st.topo.levels(n) {
        if let Some(found) = find_best_fit(st, v, &level) {
            return Some(found);
        }
    }
    find_first_fit(st, v)
}

/// find_first_fit: the first node (SmartNICs first, see Topology::first_fit_order) with room,
/// ignoring topology. Unlike the paper it never returns a node that does not fit: every placement
/// must respect capacity, so "no node" becomes an error naming the closest node instead.
pub fn find_first_fit(st: &State, v: usize) -> Option<usize> {
    st.topo
        .first_fit_order
        .iter()
        .copied()
        .find(|&n| st.fits(v, n))
}

/// find_best_fit: among the level's nodes with room, the one left with the fewest free cores
/// (classic best fit: it packs communicating services together and keeps big holes for big services).
fn find_best_fit(st: &State, v: usize, level: &crate::topology::Level) -> Option<usize> {
    let inst = &st.wl.instances[v];
    let mut best: Option<(f64, usize)> = None;
    level.for_each(|n| {
        if st.fits(v, n) {
            let node = &st.topo.nodes[n];
            let left = node.cores - st.cores_used[n] - inst.cores_on(node.core);
            if best.is_none_or(|(b, _)| left < b) {
                best = Some((left, n));
            }
        }
    });
    best.map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::tests::setup;
    use crate::placement::{place, verify, Algorithm};
    use crate::topology::{hops, NodeKind};

    #[test]
    fn children_land_next_to_their_parent() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let p = place(&topo, &wl, Algorithm::Hcm, 0).unwrap();
        // NFV-FIN is all offloadable: SmartNICs first. Level 2 of a Type1 SmartNIC is its own host,
        // so once a SmartNIC's 4 GB are full its descendants spill to that host, as Algorithm 1 says.
        let on_nic = p
            .assign
            .iter()
            .filter(|&&n| topo.nodes[n].kind == NodeKind::Smartnic)
            .count();
        assert!(on_nic * 2 >= wl.instances.len(), "{on_nic}");
        // Level 1 has room for the first chain, so its edges cost 0 hops.
        let (a, b) = (0, wl.children[0][0]);
        assert_eq!(hops(&topo, p.assign[a], p.assign[b]), 0);
    }

    #[test]
    fn sql_goes_to_hosts_and_replicas_to_other_servers() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:IOT-TS");
        let p = place(&topo, &wl, Algorithm::Hcm, 0).unwrap();
        verify(&topo, &wl, &p.assign).unwrap();
        for (i, inst) in wl.instances.iter().enumerate() {
            let node = &topo.nodes[p.assign[i]];
            if inst.microservice == "SQL" || inst.microservice == "API gw" {
                assert_eq!(node.kind, NodeKind::Host, "{}", inst.id);
            }
            if let Some(prim) = inst.replica_of {
                assert_ne!(node.server, topo.nodes[p.assign[prim]].server);
            }
        }
    }

    #[test]
    fn first_fit_prefers_smartnics_then_best_fit_packs() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let mut st = State::new(&topo, &wl);
        assert_eq!(find_first_fit(&st, 0), Some(1));
        st.place(0, 1);
        // MS_PLACE of its child from node 1: same node first.
        let child = wl.children[0][0];
        assert_eq!(ms_place(&st, child, 1), Some(1));
        // Its replica cannot share server 0: the closest other SmartNIC.
        assert_eq!(ms_place(&st, 1, 1), Some(3));
    }
}
