//! Simulated annealing in Azure Service Fabric's style (§3.3): start from a random valid placement
//! and move single instances to random nodes, accepting worse states with the Metropolis rule
//! while the temperature cools. Like Service Fabric, the cost favours spreading load; communication
//! distance enters with a small weight only (E3 §5.4: "highest weight on minimizing co-execution
//! interference").

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::State;
use crate::error::Result;
use crate::topology::hops;

/// Weight of the load-spread term (sum of squared node utilisations).
const W_SPREAD: f64 = 1.0;
/// Weight of the communication term (hops summed over DAG edges, per edge).
const W_COMM: f64 = 0.05;

#[derive(Debug, Clone)]
pub struct Params {
    pub seed: u64,
    pub steps: usize,
    /// Final temperature as a fraction of the initial one.
    pub cooling_to: f64,
}

impl Params {
    /// A budget that grows with the instance count but stays bounded.
    pub fn for_size(instances: usize, seed: u64) -> Self {
        Params {
            seed,
            steps: (instances * 200).clamp(2_000, 400_000),
            cooling_to: 1e-3,
        }
    }
}

/// Places (or re-places) the `movable` instances; everything else stays where it is.
pub fn run(st: &mut State, movable: &[usize], p: &Params) -> Result<()> {
    if movable.is_empty() {
        return Ok(());
    }
    let mut rng = StdRng::seed_from_u64(p.seed);
    let nodes = st.topo.nodes.len();
    // Random valid start: random node, falling back to a scan from a random offset.
    for &i in movable {
        if st.assign[i].is_some() {
            continue;
        }
        let mut chosen = None;
        for _ in 0..32 {
            let n = rng.random_range(0..nodes);
            if st.fits(i, n) {
                chosen = Some(n);
                break;
            }
        }
        if chosen.is_none() {
            let off = rng.random_range(0..nodes);
            chosen = (0..nodes)
                .map(|k| (off + k) % nodes)
                .find(|&n| st.fits(i, n));
        }
        match chosen {
            Some(n) => st.place(i, n),
            None => return Err(st.no_fit(i)),
        }
    }
    let parents = parents_of(st);
    // Per-hop weight, normalised so the two terms are of similar size whatever the instance count.
    let edges = st.wl.edges().count().max(1) as f64;
    let comm_w = W_COMM / edges * st.wl.instances.len() as f64 / nodes as f64;
    // Initial temperature: the mean |delta| of a sample of moves.
    let mut sample = 0.0;
    let mut count = 0usize;
    for _ in 0..64 {
        let i = movable[rng.random_range(0..movable.len())];
        let n = rng.random_range(0..nodes);
        if st.assign[i] != Some(n) && st.fits(i, n) {
            sample += delta(st, &parents, comm_w, i, n).abs();
            count += 1;
        }
    }
    let t0 = if count > 0 && sample > 0.0 {
        sample / count as f64
    } else {
        1e-3
    };
    let alpha = p.cooling_to.powf(1.0 / p.steps.max(1) as f64);
    let mut t = t0;
    for _ in 0..p.steps {
        let i = movable[rng.random_range(0..movable.len())];
        let n = rng.random_range(0..nodes);
        if st.assign[i] != Some(n) && st.fits(i, n) {
            let d = delta(st, &parents, comm_w, i, n);
            if d <= 0.0 || rng.random::<f64>() < (-d / t).exp() {
                st.place(i, n);
            }
        }
        t *= alpha;
    }
    Ok(())
}

fn parents_of(st: &State) -> Vec<Vec<usize>> {
    let mut parents = vec![Vec::new(); st.wl.instances.len()];
    for (p, c) in st.wl.edges() {
        parents[c].push(p);
    }
    parents
}

/// The cost change of moving instance `i` from its node to `n`.
fn delta(st: &State, parents: &[Vec<usize>], comm_w: f64, i: usize, n: usize) -> f64 {
    let Some(from) = st.assign[i] else {
        return 0.0;
    };
    let inst = &st.wl.instances[i];
    let util = |node: usize, extra: f64| {
        let nd = &st.topo.nodes[node];
        (st.cores_used[node] + extra) / nd.cores
    };
    let (cf, ct) = (
        inst.cores_on(st.topo.nodes[from].core),
        inst.cores_on(st.topo.nodes[n].core),
    );
    let spread = util(from, -cf).powi(2) + util(n, ct).powi(2)
        - util(from, 0.0).powi(2)
        - util(n, 0.0).powi(2);
    let mut comm = 0.0;
    for &o in st.wl.children[i].iter().chain(&parents[i]) {
        if let Some(on) = st.assign[o] {
            comm += f64::from(hops(st.topo, n, on)) - f64::from(hops(st.topo, from, on));
        }
    }
    W_SPREAD * spread + comm_w * comm
}

#[cfg(test)]
mod tests {
    use crate::placement::tests::setup;
    use crate::placement::{place, Algorithm};

    fn max_util(
        topo: &crate::topology::Topology,
        wl: &crate::workload::Workload,
        a: &[usize],
    ) -> f64 {
        let mut used = vec![0.0; topo.nodes.len()];
        for (i, &n) in a.iter().enumerate() {
            used[n] += wl.instances[i].cores_on(topo.nodes[n].core);
        }
        used.iter()
            .zip(&topo.nodes)
            .map(|(u, n)| u / n.cores)
            .fold(0.0, f64::max)
    }

    #[test]
    fn anneal_spreads_load_more_than_hcm() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let h = place(&topo, &wl, Algorithm::Hcm, 3).unwrap();
        let a = place(&topo, &wl, Algorithm::Anneal, 3).unwrap();
        assert!(max_util(&topo, &wl, &a.assign) < max_util(&topo, &wl, &h.assign));
    }

    #[test]
    fn same_seed_same_placement() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:RTA-SHM");
        let a = place(&topo, &wl, Algorithm::Anneal, 11).unwrap();
        let b = place(&topo, &wl, Algorithm::Anneal, 11).unwrap();
        assert_eq!(a.assign, b.assign);
    }
}
