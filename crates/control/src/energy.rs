//! E3's energy and cost model (§2.3, §5.5).
//!
//! Power: a node draws its idle power always, plus the active energy of the requests it serves
//! (Table 1's active watts / RPS, per request, on the node's core class), capped at its peak.
//! Cluster power is the sum over every node of the cluster, idle or not, as the paper measures wall
//! power of the whole cluster. Energy efficiency = throughput / cluster power (requests per joule).
//! Cost efficiency = throughput x T / (CAPEX + power x T x electricity price), the §5.5 metric, with
//! the average U.S. price of $0.0733/kWh; in requests per dollar.

use serde::Serialize;

use crate::topology::{hops, Topology};
use crate::workload::Workload;

/// §5.5: average U.S. electricity price.
pub const USD_PER_KWH: f64 = 0.0733;
/// Ownership period for the single cost_efficiency number of `place --json` (Fig. 10's right edge).
pub const OWNERSHIP_YEARS: f64 = 5.0;
const SECONDS_PER_YEAR: f64 = 365.0 * 24.0 * 3600.0;

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Metrics {
    /// Mean network hops over the DAG's edges (0 same node, 1 PCIe, 2 same rack, 4 across racks).
    pub avg_hops: f64,
    /// Requests per joule at the apps' design rate.
    pub energy_rpj: f64,
    /// Requests per dollar over OWNERSHIP_YEARS.
    pub cost_efficiency: f64,
    /// Total entry rate of the placed apps (requests/s).
    pub throughput_rps: f64,
    /// Cluster wall power at that rate (W).
    pub power_watts: f64,
    pub capex_usd: f64,
}

/// Wall power of the cluster when the primaries of `wl` run at their design rates on `assign`.
pub fn cluster_power(topo: &Topology, wl: &Workload, assign: &[usize]) -> f64 {
    let mut active = vec![0.0; topo.nodes.len()];
    for (inst, &n) in wl.instances.iter().zip(assign) {
        if inst.is_primary() {
            active[n] += inst.rps * inst.joules_on(topo.nodes[n].core);
        }
    }
    topo.nodes
        .iter()
        .zip(active)
        .map(|(node, a)| node.idle_watts + a.min(node.peak_watts - node.idle_watts))
        .sum()
}

/// Requests per dollar over `years` of ownership.
pub fn cost_efficiency(throughput_rps: f64, power_watts: f64, capex_usd: f64, years: f64) -> f64 {
    let seconds = years * SECONDS_PER_YEAR;
    let energy_usd = power_watts / 1000.0 * (seconds / 3600.0) * USD_PER_KWH;
    throughput_rps * seconds / (capex_usd + energy_usd)
}

pub fn avg_hops(topo: &Topology, wl: &Workload, assign: &[usize]) -> f64 {
    let (sum, n) = wl.edges().fold((0u64, 0u64), |(s, c), (a, b)| {
        (s + u64::from(hops(topo, assign[a], assign[b])), c + 1)
    });
    if n == 0 {
        0.0
    } else {
        sum as f64 / n as f64
    }
}

pub fn metrics(topo: &Topology, wl: &Workload, assign: &[usize]) -> Metrics {
    let throughput: f64 = wl.apps.iter().map(|a| a.rps).sum();
    let power = cluster_power(topo, wl, assign);
    let capex = topo.capex_usd();
    Metrics {
        avg_hops: avg_hops(topo, wl, assign),
        energy_rpj: if power > 0.0 { throughput / power } else { 0.0 },
        cost_efficiency: cost_efficiency(throughput, power, capex, OWNERSHIP_YEARS),
        throughput_rps: throughput,
        power_watts: power,
        capex_usd: capex,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::tests::setup;
    use crate::placement::{place, Algorithm};

    #[test]
    fn power_is_idle_plus_capped_active() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let p = place(&topo, &wl, Algorithm::Hcm, 0).unwrap();
        let power = cluster_power(&topo, &wl, &p.assign);
        assert!(power > topo.idle_watts() && power <= topo.peak_watts());
        // Hand computation: all of NFV-FIN on SmartNICs; each request costs Flow mon. + IPsec + NIDS
        // wimpy joules, unless a node hits its peak cap.
        let j = 24.3 / 2032600.0 + 23.4 / 1851100.0 + 23.4 / 1988800.0;
        let uncapped = topo.idle_watts() + 400000.0 * j;
        assert!(power <= uncapped + 1e-6);
    }

    #[test]
    fn cost_efficiency_tends_to_energy_efficiency_over_time() {
        // §5.5: over long ownership, cost efficiency is dominated by energy efficiency:
        // requests/$ -> rpj / (price per joule).
        let usd_per_joule = USD_PER_KWH / 3.6e6;
        let (rps, watts) = (1e6, 500.0);
        let limit = rps / watts / usd_per_joule;
        let ce = cost_efficiency(rps, watts, 10_000.0, 100_000.0);
        assert!((ce - limit).abs() / limit < 0.01);
        assert!(
            cost_efficiency(rps, watts, 10_000.0, 1.0) < cost_efficiency(rps, watts, 10_000.0, 5.0)
        );
    }

    #[test]
    fn smartnic_cluster_beats_beefy_on_energy() {
        let (t1, w1) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let (tb, wb) = setup("preset:3xBeefy", "preset:NFV-FIN");
        let a = place(&t1, &w1, Algorithm::Hcm, 0).unwrap();
        let b = place(&tb, &wb, Algorithm::Hcm, 0).unwrap();
        let (ma, mb) = (metrics(&t1, &w1, &a.assign), metrics(&tb, &wb, &b.assign));
        assert!(ma.energy_rpj > mb.energy_rpj, "{ma:?} vs {mb:?}");
    }
}
