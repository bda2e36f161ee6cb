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
    /// Microservice instances deployed in all (shards and replicas).
    pub microservices: usize,
    /// Mean wall time to deploy one microservice, ms; None when the algorithm gave up.
    pub ms_per_microservice: Option<f64>,
    /// The same for the last application only, deployed when all the others already are: one
    /// microservice placed with ~`microservices` deployed (the 26 ms target).
    pub ms_per_microservice_last_app: Option<f64>,
    /// Mean hops over the DAG edges this algorithm placed (for the ILP: between its samples).
    pub avg_hops: Option<f64>,
    pub note: String,
}

/// Largest simulated cluster and workload: bounds that keep a typo from eating the machine.
pub const MAX_SIM_SERVERS: u32 = 100_000;
pub const MAX_SIM_MICROSERVICES: usize = 1_000_000;

fn check_scale_args(servers: u32, target: usize) -> Result<()> {
    if servers == 0 || servers > MAX_SIM_SERVERS {
        return Err(ControlError::Invalid {
            what: "simulation",
            message: format!("{servers} servers: use 1 to {MAX_SIM_SERVERS}"),
        });
    }
    if target == 0 || target > MAX_SIM_MICROSERVICES {
        return Err(ControlError::Invalid {
            what: "simulation",
            message: format!("{target} microservices: use 1 to {MAX_SIM_MICROSERVICES}"),
        });
    }
    Ok(())
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

/// The simulated FatTree of `servers` Type2-SmartNIC servers, 40 per rack.
pub fn fat_tree(servers: u32) -> Result<Topology> {
    Topology::build(&uniform_cluster(
        "fattree",
        "Type2-SmartNIC",
        servers,
        SERVERS_PER_RACK,
    ))
}

/// Mean hops over the DAG edges with both endpoints in `placed`.
fn hops_of(topo: &Topology, wl: &Workload, st: &State, placed: &[bool]) -> Option<f64> {
    let (mut sum, mut n) = (0u64, 0u64);
    for (a, b) in wl.edges() {
        if !(placed[a] && placed[b]) {
            continue;
        }
        if let (Some(na), Some(nb)) = (st.assign[a], st.assign[b]) {
            sum += u64::from(crate::topology::hops(topo, na, nb));
            n += 1;
        }
    }
    (n > 0).then(|| sum as f64 / n as f64)
}

/// One Table 6 cell: deploy `target` microservices on `servers` Type2-SmartNIC servers with `algo`.
pub fn scale(servers: u32, target: usize, algo: Algorithm, seed: u64) -> Result<ScaleRow> {
    check_scale_args(servers, target)?;
    let topo = fat_tree(servers)?;
    let apps = background_apps(target)?;
    let wl = Workload::from_apps(&apps)?;
    let mut st = State::new(&topo, &wl);
    let mut row = ScaleRow {
        servers,
        algorithm: algo.name(),
        microservices: wl.instances.len(),
        ms_per_microservice: None,
        ms_per_microservice_last_app: None,
        avg_hops: None,
        note: String::new(),
    };
    match algo {
        Algorithm::Hcm | Algorithm::Anneal => {
            let mut spent = 0.0;
            let mut last = 0.0;
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
                last = t.elapsed().as_secs_f64();
                spent += last;
            }
            let assign = st.complete()?;
            verify(&topo, &wl, &assign)?;
            row.ms_per_microservice = Some(spent * 1e3 / wl.instances.len() as f64);
            if let Some(app) = wl.apps.last() {
                let n = (app.end_instance - app.first_instance).max(1);
                row.ms_per_microservice_last_app = Some(last * 1e3 / n as f64);
            }
            row.avg_hops = Some(avg_hops(&topo, &wl, &assign));
        }
        Algorithm::Ilp => {
            // Background with HCM (untimed); then the ILP deploys a few more microservices, each
            // (a shard and its replicas) as one ILP over the remaining capacity; then HCM places
            // the rest of that app (untimed) and the whole placement is verified.
            let Some(last) = wl.apps.last() else {
                return Ok(row);
            };
            hcm::run_range(&mut st, 0..last.first_instance)?;
            // Samples along DAG paths (source, its first child, that one's first child, ...), so
            // that the ILP's own edges show how far apart it puts communicating microservices.
            let mut primaries: Vec<usize> = Vec::new();
            for &src in wl.sources.iter().filter(|&&v| v >= last.first_instance) {
                let mut v = Some(src);
                while let Some(x) = v {
                    if primaries.len() == ILP_SAMPLES || primaries.contains(&x) {
                        break;
                    }
                    primaries.push(x);
                    v = wl.children[x].first().copied();
                }
                if primaries.len() == ILP_SAMPLES {
                    break;
                }
            }
            let mut spent = 0.0;
            let mut placed = 0usize;
            let mut by_ilp = vec![false; wl.instances.len()];
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
                        for &g in &group {
                            by_ilp[g] = true;
                        }
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
                hcm::run_range(&mut st, last.first_instance..last.end_instance)?;
                verify(&topo, &wl, &st.complete()?)?;
                let ms = spent * 1e3 / placed as f64;
                row.ms_per_microservice = Some(ms);
                row.ms_per_microservice_last_app = Some(ms);
                row.avg_hops = hops_of(&topo, &wl, &st, &by_ilp);
                row.note = format!(
                    "mean over {placed} microservices (DAG paths) deployed by ILP after {} by HCM; hops between them",
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

/// The orchestrator's side of §5.6 / Fig. 11: a detector that has seen `warm_rounds` rounds of
/// heartbeats from every SmartNIC of `servers` Type2-SmartNIC servers (4 each), and the next
/// round's 16-byte reports, ready to be judged. One SmartNIC in 1,000 reports a slow microservice
/// in that round, so judging it also produces signals. The transport's check of each datagram
/// (its HMAC, [`crate::agent::Gate`]) comes before this and is not part of the round.
pub struct HeartbeatRound {
    detector: crate::orchestrator::Detector,
    round: Vec<[u8; crate::heartbeat::PAYLOAD_LEN]>,
    now: tokio::time::Instant,
}

impl HeartbeatRound {
    pub fn new(servers: u32, warm_rounds: u32) -> Result<Self> {
        use crate::heartbeat::{Heartbeat, NO_SAMPLE};
        use crate::orchestrator::{Detector, DetectorConfig};
        if servers == 0 || servers > MAX_SIM_SERVERS {
            return Err(ControlError::Invalid {
                what: "simulation",
                message: format!("{servers} servers: use 1 to {MAX_SIM_SERVERS}"),
            });
        }
        let nics = servers as usize * 4;
        let nodes = servers as usize * 5;
        let mut detector = Detector::new(DetectorConfig::default(), nodes);
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
                detector.observe(&beat(nic, 100), now)?;
            }
            now += std::time::Duration::from_millis(50);
        }
        let round = (0..nics)
            .map(|nic| beat(nic, if nic % 1000 == 0 { 400 } else { 100 }).encode())
            .collect();
        Ok(HeartbeatRound {
            detector,
            round,
            now,
        })
    }

    pub fn heartbeats(&self) -> usize {
        self.round.len()
    }

    /// Decodes and judges every heartbeat of the round, then sweeps for silent nodes: one
    /// decision round. Returns the signals raised.
    pub fn judge(&mut self) -> usize {
        use crate::heartbeat::Heartbeat;
        let mut signals = 0usize;
        for bytes in &self.round {
            if let Ok(hb) = Heartbeat::decode(bytes) {
                if let Ok(Some(_)) = self.detector.observe(&hb, self.now) {
                    signals += 1;
                }
            }
        }
        signals + self.detector.sweep(self.now).len()
    }
}

/// §5.6 / Fig. 11: the wall time of one decision round over heartbeats from every SmartNIC of
/// `servers` Type2-SmartNIC servers, after `warm_rounds` rounds of warm-up.
pub fn orchestrator_round(servers: u32, warm_rounds: u32) -> Result<OrchestratorRow> {
    let mut r = HeartbeatRound::new(servers, warm_rounds)?;
    let t = Instant::now();
    let signals = r.judge();
    Ok(OrchestratorRow {
        servers,
        heartbeats: r.heartbeats(),
        round_ms: t.elapsed().as_secs_f64() * 1e3,
        signals,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn orchestrator_round_flags_the_slow_smartnics() {
        let row = orchestrator_round(2000, 6).unwrap();
        assert_eq!(row.heartbeats, 8000);
        assert_eq!(row.signals, 8, "one SmartNIC in 1,000 is slow");
        assert!(orchestrator_round(0, 1).is_err());
    }

    #[test]
    fn scale_runs_small_verifies_and_hcm_keeps_edges_short() {
        // Two racks of 40, so distances of 0, 1, 2 and 4 hops all occur.
        let hcm = scale(80, 1000, Algorithm::Hcm, 1).unwrap();
        let anneal = scale(80, 1000, Algorithm::Anneal, 1).unwrap();
        let ilp = scale(80, 1000, Algorithm::Ilp, 1).unwrap();
        for row in [&hcm, &anneal] {
            assert!(row.microservices >= 1000);
            assert!(row.ms_per_microservice.unwrap() > 0.0);
            assert!(row.ms_per_microservice_last_app.unwrap() > 0.0);
        }
        // Communication-aware placement: HCM's edges are shorter than the baselines' (§5.4).
        let h = hcm.avg_hops.unwrap();
        assert!(h < anneal.avg_hops.unwrap(), "{hcm:?} vs {anneal:?}");
        if let Some(i) = ilp.avg_hops {
            assert!(h < i, "{hcm:?} vs {ilp:?}");
        } else {
            assert!(!ilp.note.is_empty(), "{ilp:?}");
        }
        for (servers, micro) in [(0, 10), (10, 0), (MAX_SIM_SERVERS + 1, 10)] {
            let err = scale(servers, micro, Algorithm::Hcm, 1)
                .unwrap_err()
                .to_string();
            assert!(err.contains("use 1 to"), "{err}");
        }
    }

    #[test]
    fn energy_and_cost_have_the_shape_of_table5_and_fig10() {
        let table: Vec<(&str, Vec<EnergyRow>)> = PAPER_TABLE5
            .iter()
            .map(|(app, _)| {
                let spec = load_app(&format!("preset:{app}")).unwrap();
                let rows = crate::model::TABLE5_CLUSTERS
                    .iter()
                    .map(|c| energy(&spec, &format!("preset:{c}")).unwrap())
                    .collect();
                (*app, rows)
            })
            .collect();
        let rank = |rows: &[EnergyRow], key: &dyn Fn(&EnergyRow) -> f64| {
            let mut r: Vec<&EnergyRow> = rows.iter().collect();
            r.sort_by(|a, b| key(b).total_cmp(&key(a)));
            r.into_iter().map(|r| r.cluster.clone()).collect::<Vec<_>>()
        };
        let five_years = |r: &EnergyRow| r.cost_efficiency.last().unwrap().1;
        for (app, rows) in &table {
            let energy = rank(rows, &|r| r.krpj);
            let cost = rank(rows, &five_years);
            let pos = |v: &[String], c: &str| v.iter().position(|x| x == c).unwrap();
            // SmartNICs beat the all-Beefy cluster for every app (§5.5).
            assert!(
                pos(&energy, "2xType2-SmartNIC") < pos(&energy, "4xBeefy"),
                "{app}: {energy:?}"
            );
            if *app == "NFV-FIN" {
                // Everything runs on low-power cores: 4xWimpy first, 2xType2 second, in energy
                // and in 5-year cost efficiency.
                assert_eq!(&energy[..2], ["4xWimpy", "2xType2-SmartNIC"], "{app}");
                assert_eq!(&cost[..2], ["4xWimpy", "2xType2-SmartNIC"], "{app}");
            } else {
                // Mixed apps: 2xType2-SmartNIC is the most energy- and cost-efficient, 1xSuperBeefy
                // the second most energy-efficient, 4xWimpy the least.
                assert_eq!(energy[0], "2xType2-SmartNIC", "{app}: {energy:?}");
                assert_eq!(energy[1], "1xSuperBeefy", "{app}: {energy:?}");
                assert_eq!(energy[4], "4xWimpy", "{app}: {energy:?}");
                assert_eq!(cost[0], "2xType2-SmartNIC", "{app}: {cost:?}");
            }
            if *app == "RTA-SHM" {
                // Table 5's whole RTA-SHM row in order, and Fig. 10's runner-up after 5 years.
                assert_eq!(
                    energy,
                    [
                        "2xType2-SmartNIC",
                        "1xSuperBeefy",
                        "4xBeefy",
                        "2xBeefy+2xWimpy",
                        "4xWimpy"
                    ]
                );
                assert_eq!(cost[1], "4xBeefy");
            }
            for r in rows {
                // Fig. 10: cost efficiency grows with ownership time towards the energy bound.
                let ce: Vec<f64> = r.cost_efficiency.iter().map(|c| c.1).collect();
                assert!(
                    ce.windows(2).all(|w| w[0] < w[1]),
                    "{app} {}: {ce:?}",
                    r.cluster
                );
                let bound = r.krpj * 1000.0 * 3.6e6 / crate::energy::USD_PER_KWH;
                assert!(*ce.last().unwrap() < bound, "{app} {}", r.cluster);
            }
        }
    }
}
