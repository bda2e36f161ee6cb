//! The simulator behind `flatmesh simulate`:
//! - `scale` (E3 Table 6): per-microservice deployment time of HCM, annealing and the ILP while
//!   10,000 microservices are deployed on 100-1,000 Type2-SmartNIC servers in a FatTree of 40
//!   servers per rack;
//! - `energy` (E3 Table 5 and Fig. 10): peak throughput, energy efficiency and cost efficiency of
//!   Table 3's apps on Table 4's clusters.

use std::time::Instant;

use serde::Serialize;

use crate::energy::{avg_hops, cluster_power, cost_efficiency};
use crate::error::{ControlError, Result};
use crate::model::{load_app, load_cluster, uniform_cluster, AppSpec};
use crate::placement::{anneal, hcm, ilp, verify, Algorithm, State};
use crate::topology::Topology;
use crate::workload::Workload;

/// Servers per rack in the simulated FatTree (§5.6).
pub const SERVERS_PER_RACK: u32 = 40;
/// Rate scale of the background apps: small enough that 10,000 microservices fit 100 servers.
const BACKGROUND_SCALE: f64 = 0.05;
/// The ILP gives up on one microservice after this long (Table 6 prints "≫1s").
const ILP_BUDGET_SECONDS: f64 = 1.0;
/// Microservices the ILP deploys per measurement (it is far too slow for all 10,000).
const ILP_SAMPLES: usize = 8;

#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    pub servers: u32,
    pub algorithm: &'static str,
    /// Microservice instances deployed (shards and replicas).
    pub microservices: usize,
    /// Mean wall time to deploy one microservice, ms; None when the algorithm gave up.
    pub ms_per_microservice: Option<f64>,
    /// Mean hops over the DAG edges of what was deployed.
    pub avg_hops: Option<f64>,
    pub note: String,
}

/// Copies of Table 3's apps, renamed `NAME#k`, until `target` instances (shards and replicas).
pub fn background_apps(target: usize) -> Result<Vec<AppSpec>> {
    let presets: Vec<AppSpec> = crate::model::app_preset_names()?
        .iter()
        .map(|n| load_app(&format!("preset:{n}")))
        .collect::<Result<_>>()?;
    let mut apps = Vec::new();
    let mut total = 0usize;
    let mut k = 0usize;
    while total < target {
        let mut a = presets[k % presets.len()].clone();
        a.name = format!("{}#{k}", a.name);
        a.rps *= BACKGROUND_SCALE;
        total += a.dag_nodes() as usize;
        apps.push(a);
        k += 1;
    }
    Ok(apps)
}

/// One Table 6 cell: deploy `target` microservices on `servers` Type2-SmartNIC servers with `algo`.
pub fn scale(servers: u32, target: usize, algo: Algorithm, seed: u64) -> Result<ScaleRow> {
    let topo = Topology::build(&uniform_cluster(
        "fattree",
        "Type2-SmartNIC",
        servers,
        SERVERS_PER_RACK,
    ))?;
    let apps = background_apps(target)?;
    let wl = Workload::from_apps(&apps)?;
    let mut st = State::new(&topo, &wl);
    let mut row = ScaleRow {
        servers,
        algorithm: algo.name(),
        microservices: wl.instances.len(),
        ms_per_microservice: None,
        avg_hops: None,
        note: String::new(),
    };
    match algo {
        Algorithm::Hcm | Algorithm::Anneal => {
            let mut spent = 0.0;
            for (a, app) in wl.apps.iter().enumerate() {
                let range = app.first_instance..app.end_instance;
                let t = Instant::now();
                if algo == Algorithm::Hcm {
                    hcm::run_range(&mut st, range)?;
                } else {
                    let movable: Vec<usize> = range.collect();
                    let p = anneal::Params::for_size(movable.len(), seed.wrapping_add(a as u64));
                    anneal::run(&mut st, &movable, &p)?;
                }
                spent += t.elapsed().as_secs_f64();
            }
            let assign = st.complete()?;
            verify(&topo, &wl, &assign)?;
            row.ms_per_microservice = Some(spent * 1e3 / wl.instances.len() as f64);
            row.avg_hops = Some(avg_hops(&topo, &wl, &assign));
        }
        Algorithm::Ilp => {
            // Background with HCM (untimed); then the ILP deploys a few more microservices, each
            // (a shard and its replicas) as one ILP over the remaining capacity.
            let Some(last) = wl.apps.last() else {
                return Ok(row);
            };
            hcm::run_range(&mut st, 0..last.first_instance)?;
            let primaries: Vec<usize> = (last.first_instance..last.end_instance)
                .filter(|&i| wl.instances[i].is_primary())
                .take(ILP_SAMPLES)
                .collect();
            let mut spent = 0.0;
            let mut placed = 0usize;
            for p in primaries {
                let mut group = vec![p];
                group.extend(&wl.replicas[p]);
                let t = Instant::now();
                let r = ilp::place_into(&mut st, &group, ILP_BUDGET_SECONDS, usize::MAX);
                let dt = t.elapsed().as_secs_f64();
                match r {
                    Ok(()) if dt < ILP_BUDGET_SECONDS => {
                        spent += dt;
                        placed += group.len();
                    }
                    Ok(()) | Err(ControlError::Solver(_)) => {
                        row.note =
                            format!(">> {ILP_BUDGET_SECONDS} s per microservice (time limit hit)");
                        return Ok(row);
                    }
                    Err(e) => return Err(e),
                }
            }
            if placed > 0 {
                row.ms_per_microservice = Some(spent * 1e3 / placed as f64);
                row.note = format!(
                    "mean over {placed} microservices deployed by ILP after {} by HCM",
                    last.first_instance
                );
            }
        }
    }
    Ok(row)
}

#[derive(Debug, Clone, Serialize)]
pub struct EnergyRow {
    pub app: String,
    pub cluster: String,
    /// Peak entry rate HCM can place (requests/s); 0 when the app does not fit at all.
    pub peak_rps: f64,
    pub power_watts: f64,
    pub capex_usd: f64,
    /// Energy efficiency in thousands of requests per joule (Table 5's unit).
    pub krpj: f64,
    /// (years of ownership, requests per dollar): Fig. 10's curves.
    pub cost_efficiency: Vec<(f64, f64)>,
}

/// Ownership periods of Fig. 10's x axis.
pub const YEARS: &[f64] = &[0.5, 1.0, 2.0, 3.0, 4.0, 5.0];

/// Finds the highest rate HCM can place `app` at on `cluster` (peak utilisation, as §5.1 measures
/// at the knee) and reports the energy and cost efficiency there.
pub fn energy(app: &AppSpec, cluster: &str) -> Result<EnergyRow> {
    let spec = load_cluster(cluster)?;
    let topo = Topology::build(&spec)?;
    // A backup must sit on another server: a one-server cluster (1xSuperBeefy) runs without backups,
    // as the paper's single-server measurements did.
    let mut app = app.clone();
    app.replicas = app
        .replicas
        .min(topo.servers.len().saturating_sub(1) as u32);
    let app = &app;
    let fits = |scale: f64| -> Option<(Workload, Vec<usize>)> {
        let mut wl = Workload::default();
        wl.add_app(app, scale).ok()?;
        let mut st = State::new(&topo, &wl);
        hcm::run(&mut st).ok()?;
        let a = st.complete().ok()?;
        Some((wl, a))
    };
    let mut row = EnergyRow {
        app: app.name.clone(),
        cluster: spec.name.clone(),
        peak_rps: 0.0,
        power_watts: topo.idle_watts(),
        capex_usd: topo.capex_usd(),
        krpj: 0.0,
        cost_efficiency: YEARS.iter().map(|&y| (y, 0.0)).collect(),
    };
    // Bracket the peak: halve until it fits, double until it does not, then bisect.
    let mut lo = 1.0;
    while fits(lo).is_none() {
        lo /= 2.0;
        if lo < 1e-6 {
            return Ok(row);
        }
    }
    let mut hi = lo * 2.0;
    while fits(hi).is_some() {
        lo = hi;
        hi *= 2.0;
        if hi > 1e9 {
            break;
        }
    }
    for _ in 0..30 {
        let mid = (lo + hi) / 2.0;
        if fits(mid).is_some() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let Some((wl, assign)) = fits(lo) else {
        return Ok(row);
    };
    let throughput = app.rps * lo;
    let power = cluster_power(&topo, &wl, &assign);
    row.peak_rps = throughput;
    row.power_watts = power;
    row.krpj = throughput / power / 1000.0;
    row.cost_efficiency = YEARS
        .iter()
        .map(|&y| (y, cost_efficiency(throughput, power, row.capex_usd, y)))
        .collect();
    Ok(row)
}

/// E3 Table 5 (KRPJ): rows NFV-FIN, RTA-SHM, IOT-TS; columns in model::TABLE5_CLUSTERS order.
pub const PAPER_TABLE5: &[(&str, [f64; 5])] = &[
    ("NFV-FIN", [5.1, 29.9, 8.2, 29.0, 8.8]),
    ("RTA-SHM", [1.9, 0.4, 1.4, 4.5, 2.9]),
    ("IOT-TS", [2.7, 0.1, 1.9, 6.1, 5.0]),
];

/// E3 Table 6 (ms per microservice); None = "≫1s".
pub const PAPER_TABLE6: &[(&str, [Option<f64>; 6])] = &[
    (
        "hcm",
        [
            Some(4.85),
            Some(8.31),
            Some(19.83),
            Some(34.32),
            Some(74.39),
            Some(263.46),
        ],
    ),
    (
        "anneal",
        [
            Some(3.15),
            Some(4.73),
            Some(7.43),
            Some(15.64),
            Some(23.50),
            Some(61.42),
        ],
    ),
    (
        "ilp",
        [
            Some(7.64),
            Some(19.43),
            Some(84.83),
            Some(361.85),
            None,
            None,
        ],
    ),
];
pub const TABLE6_SERVERS: [u32; 6] = [100, 200, 400, 600, 800, 1000];

#[derive(Debug, Clone, Serialize)]
pub struct OrchestratorRow {
    pub servers: u32,
    pub heartbeats: usize,
    /// Wall time to decode and judge one 50 ms round of heartbeats, plus the liveness sweep (ms).
    pub round_ms: f64,
    pub signals: usize,
}

/// §5.6 / Fig. 11: one decision round of the orchestrator over heartbeats from every SmartNIC of
/// `servers` Type2-SmartNIC servers (4 each), after `warm_rounds` rounds of warm-up. One SmartNIC
/// in 1,000 reports a slow microservice, so the round also produces signals.
pub fn orchestrator_round(servers: u32, warm_rounds: u32) -> OrchestratorRow {
    use crate::heartbeat::{Heartbeat, NO_SAMPLE};
    use crate::orchestrator::{Detector, DetectorConfig};
    let nics = servers as usize * 4;
    let nodes = servers as usize * 5;
    let mut det = Detector::new(DetectorConfig::default(), nodes);
    let beat = |nic: usize, exec: u16| {
        let node = (nic / 4) * 5 + 1 + nic % 4;
        Heartbeat {
            node: node as u32,
            queue_len: 0,
            bw_util_pct: 30,
            slot_base: 0,
            exec_us: [exec, 100, NO_SAMPLE, NO_SAMPLE],
        }
    };
    let mut now = tokio::time::Instant::now();
    for _ in 0..warm_rounds {
        for nic in 0..nics {
            let _ = det.observe(&beat(nic, 100), now);
        }
        now += std::time::Duration::from_millis(50);
    }
    let round: Vec<[u8; 16]> = (0..nics)
        .map(|nic| beat(nic, if nic % 1000 == 0 { 400 } else { 100 }).encode())
        .collect();
    let t = Instant::now();
    let mut signals = 0usize;
    for bytes in &round {
        if let Ok(hb) = Heartbeat::decode(bytes) {
            if let Ok(Some(_)) = det.observe(&hb, now) {
                signals += 1;
            }
        }
    }
    signals += det.sweep(now).len();
    OrchestratorRow {
        servers,
        heartbeats: nics,
        round_ms: t.elapsed().as_secs_f64() * 1e3,
        signals,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn orchestrator_round_flags_the_slow_smartnics() {
        let row = orchestrator_round(2000, 6);
        assert_eq!(row.heartbeats, 8000);
        assert_eq!(row.signals, 8, "one SmartNIC in 1,000 is slow");
    }

    #[test]
    fn scale_runs_small_and_verifies() {
        for algo in [Algorithm::Hcm, Algorithm::Anneal] {
            let row = scale(20, 500, algo, 1).unwrap();
            assert!(row.microservices >= 500);
            assert!(row.ms_per_microservice.unwrap() > 0.0);
            assert!(row.avg_hops.unwrap() >= 0.0);
        }
        let row = scale(4, 100, Algorithm::Ilp, 1).unwrap();
        assert!(row.ms_per_microservice.is_some() || !row.note.is_empty());
    }

    #[test]
    fn energy_ranks_clusters_like_table5() {
        // The shape of Table 5: for the mixed apps the 2xType2-SmartNIC cluster is the most
        // energy-efficient, and SmartNICs beat the all-Beefy cluster for every app.
        for (app, _) in PAPER_TABLE5 {
            let spec = load_app(&format!("preset:{app}")).unwrap();
            let rows: Vec<EnergyRow> = crate::model::TABLE5_CLUSTERS
                .iter()
                .map(|c| energy(&spec, &format!("preset:{c}")).unwrap())
                .collect();
            let by = |c: &str| rows.iter().find(|r| r.cluster == c).unwrap().krpj;
            assert!(by("2xType2-SmartNIC") > by("4xBeefy"), "{app}: {rows:?}");
            if *app != "NFV-FIN" {
                let best = rows
                    .iter()
                    .max_by(|a, b| a.krpj.total_cmp(&b.krpj))
                    .unwrap();
                assert_eq!(best.cluster, "2xType2-SmartNIC", "{app}: {rows:?}");
            }
        }
    }
}
