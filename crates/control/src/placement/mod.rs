//! Placement of instances on compute nodes: the shared resource state and constraint checks, the
//! three algorithms (HCM, simulated annealing, ILP) and the JSON output contract.

pub mod anneal;
pub mod hcm;
pub mod ilp;

use serde::Serialize;

use crate::energy::{self, Metrics};
use crate::error::{ControlError, Result};
use crate::model::Pin;
use crate::topology::{NodeKind, Topology};
use crate::workload::Workload;

/// Slack for floating-point core sums, so a node filled to exactly 100% still fits.
const EPS: f64 = 1e-9;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Hcm,
    Anneal,
    Ilp,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Hcm => "hcm",
            Algorithm::Anneal => "anneal",
            Algorithm::Ilp => "ilp",
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = ControlError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "hcm" => Ok(Algorithm::Hcm),
            "anneal" => Ok(Algorithm::Anneal),
            "ilp" => Ok(Algorithm::Ilp),
            _ => Err(ControlError::Invalid {
                what: "algorithm",
                message: format!("{s:?} is not an algorithm; use hcm, anneal or ilp"),
            }),
        }
    }
}

/// Resources in use on every node and server, and where each instance is.
#[derive(Debug, Clone)]
pub struct State<'a> {
    pub topo: &'a Topology,
    pub wl: &'a Workload,
    pub cores_used: Vec<f64>,
    pub mem_used: Vec<u64>,
    /// Per server: bandwidth of the shared ports in use.
    pub bw_used: Vec<f64>,
    pub assign: Vec<Option<usize>>,
    /// Per fault-domain group: the servers its placed members occupy.
    group_servers: Vec<Vec<usize>>,
    /// Nodes removed from service (failed); nothing fits on them.
    pub dead: Vec<bool>,
}

impl<'a> State<'a> {
    pub fn new(topo: &'a Topology, wl: &'a Workload) -> Self {
        State {
            topo,
            wl,
            cores_used: vec![0.0; topo.nodes.len()],
            mem_used: vec![0; topo.nodes.len()],
            bw_used: vec![0.0; topo.servers.len()],
            assign: vec![None; wl.instances.len()],
            group_servers: vec![Vec::new(); wl.instances.len()],
            dead: vec![false; topo.nodes.len()],
        }
    }

    /// Placement rules that do not depend on load: pinning (§4), the SmartNIC offload rule, and
    /// fault domains (§3.5: no two replicas of a shard on one server; host and SmartNICs share it).
    pub fn allowed(&self, i: usize, n: usize) -> bool {
        let inst = &self.wl.instances[i];
        let node = &self.topo.nodes[n];
        if self.dead[n] {
            return false;
        }
        if node.kind == NodeKind::Smartnic && (inst.pin == Pin::Host || !inst.offloadable) {
            return false;
        }
        let here = self.assign[i].map(|m| self.topo.nodes[m].server);
        !self.group_servers[inst.group]
            .iter()
            .any(|&s| s == node.server && Some(s) != here)
    }

    /// Whether instance `i` (not currently on `n`) fits on node `n` now.
    pub fn fits(&self, i: usize, n: usize) -> bool {
        if !self.allowed(i, n) {
            return false;
        }
        let inst = &self.wl.instances[i];
        let node = &self.topo.nodes[n];
        let server = &self.topo.servers[node.server];
        // Resources already held on this node/server by `i` count as free for it.
        let (own_cores, own_mem, own_bw) = match self.assign[i] {
            Some(m) if m == n => (
                inst.cores_on(node.core),
                inst.memory_mb,
                inst.bandwidth_gbps,
            ),
            Some(m) if self.topo.nodes[m].server == node.server => (0.0, 0, inst.bandwidth_gbps),
            _ => (0.0, 0, 0.0),
        };
        self.cores_used[n] - own_cores + inst.cores_on(node.core) <= node.cores + EPS
            && self.mem_used[n] - own_mem + inst.memory_mb <= node.memory_mb
            && self.bw_used[node.server] - own_bw + inst.bandwidth_gbps
                <= server.bandwidth_gbps + EPS
    }

    /// How far `i` is from fitting on `n` (0 when it fits): used to name the closest node in errors.
    pub fn shortfall(&self, i: usize, n: usize) -> (f64, String) {
        let inst = &self.wl.instances[i];
        let node = &self.topo.nodes[n];
        if !self.allowed(i, n) {
            return (
                f64::INFINITY,
                format!(
                    "{} is not allowed (pinning, offload rule or fault domain)",
                    node.id
                ),
            );
        }
        let cores = (self.cores_used[n] + inst.cores_on(node.core) - node.cores).max(0.0);
        let mem = (self.mem_used[n] + inst.memory_mb).saturating_sub(node.memory_mb);
        let server = &self.topo.servers[node.server];
        let bw = (self.bw_used[node.server] + inst.bandwidth_gbps - server.bandwidth_gbps).max(0.0);
        let score = cores / node.cores
            + mem as f64 / node.memory_mb as f64
            + bw / server.bandwidth_gbps.max(1e-9);
        (
            score,
            format!(
                "closest node {} lacks {cores:.2} cores, {mem} MB and {bw:.3} Gb/s",
                node.id
            ),
        )
    }

    pub fn place(&mut self, i: usize, n: usize) {
        self.unplace(i);
        let inst = &self.wl.instances[i];
        let node = &self.topo.nodes[n];
        self.cores_used[n] += inst.cores_on(node.core);
        self.mem_used[n] += inst.memory_mb;
        self.bw_used[node.server] += inst.bandwidth_gbps;
        self.group_servers[inst.group].push(node.server);
        self.assign[i] = Some(n);
    }

    pub fn unplace(&mut self, i: usize) {
        let Some(n) = self.assign[i].take() else {
            return;
        };
        let inst = &self.wl.instances[i];
        let node = &self.topo.nodes[n];
        self.cores_used[n] -= inst.cores_on(node.core);
        self.mem_used[n] -= inst.memory_mb;
        self.bw_used[node.server] -= inst.bandwidth_gbps;
        let gs = &mut self.group_servers[inst.group];
        if let Some(pos) = gs.iter().position(|&s| s == node.server) {
            gs.swap_remove(pos);
        }
    }

    /// The NoFit error for `i`, naming the node that came closest.
    pub fn no_fit(&self, i: usize) -> ControlError {
        let best = (0..self.topo.nodes.len())
            .map(|n| self.shortfall(i, n))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let inst = &self.wl.instances[i];
        ControlError::NoFit {
            instance: inst.id.clone(),
            reason: format!(
                "needs {:.3} beefy or {:.3} wimpy cores, {} MB{}; {}",
                inst.cores_beefy,
                inst.cores_wimpy,
                inst.memory_mb,
                if inst.offloadable { "" } else { ", host only" },
                best.map(|b| b.1)
                    .unwrap_or_else(|| "the cluster has no nodes".into())
            ),
        }
    }

    /// Every instance's node, or an error naming the first unplaced instance.
    pub fn complete(&self) -> Result<Vec<usize>> {
        self.assign
            .iter()
            .enumerate()
            .map(|(i, a)| a.ok_or_else(|| self.no_fit(i)))
            .collect()
    }
}

/// Checks a complete assignment against every constraint, independently of how it was made.
pub fn verify(topo: &Topology, wl: &Workload, assign: &[usize]) -> Result<()> {
    if assign.len() != wl.instances.len() {
        return Err(ControlError::Violation(format!(
            "{} instances but {} assignments",
            wl.instances.len(),
            assign.len()
        )));
    }
    let mut cores = vec![0.0; topo.nodes.len()];
    let mut mem = vec![0u64; topo.nodes.len()];
    let mut bw = vec![0.0; topo.servers.len()];
    let mut groups: std::collections::HashMap<(usize, usize), &str> = Default::default();
    for (i, &n) in assign.iter().enumerate() {
        let inst = &wl.instances[i];
        let Some(node) = topo.nodes.get(n) else {
            return Err(ControlError::Violation(format!(
                "{} is on unknown node {n}",
                inst.id
            )));
        };
        if node.kind == NodeKind::Smartnic && (inst.pin == Pin::Host || !inst.offloadable) {
            return Err(ControlError::Violation(format!(
                "{} ({}) is on SmartNIC {} but must run on a host",
                inst.id, inst.microservice, node.id
            )));
        }
        if let Some(other) = groups.insert((inst.group, node.server), &inst.id) {
            return Err(ControlError::Violation(format!(
                "{} and {other} are replicas of one shard on the same server {}",
                inst.id, topo.servers[node.server].name
            )));
        }
        cores[n] += inst.cores_on(node.core);
        mem[n] += inst.memory_mb;
        bw[node.server] += inst.bandwidth_gbps;
    }
    for (n, node) in topo.nodes.iter().enumerate() {
        if cores[n] > node.cores + 1e-6 || mem[n] > node.memory_mb {
            return Err(ControlError::Violation(format!(
                "node {} is over capacity: {:.2}/{} cores, {}/{} MB",
                node.id, cores[n], node.cores, mem[n], node.memory_mb
            )));
        }
    }
    for (s, server) in topo.servers.iter().enumerate() {
        if bw[s] > server.bandwidth_gbps + 1e-6 {
            return Err(ControlError::Violation(format!(
                "server {} needs {:.2} Gb/s but has {}",
                server.name, bw[s], server.bandwidth_gbps
            )));
        }
    }
    Ok(())
}

/// A finished placement.
#[derive(Debug, Clone)]
pub struct Placement {
    pub algorithm: Algorithm,
    pub seconds: f64,
    pub assign: Vec<usize>,
}

/// Places `wl` on `topo` from scratch with `algo`, verifies the result and times it.
pub fn place(topo: &Topology, wl: &Workload, algo: Algorithm, seed: u64) -> Result<Placement> {
    let start = std::time::Instant::now();
    let assign = match algo {
        Algorithm::Hcm => {
            let mut st = State::new(topo, wl);
            hcm::run(&mut st)?;
            st.complete()?
        }
        Algorithm::Anneal => {
            let mut st = State::new(topo, wl);
            let all: Vec<usize> = (0..wl.instances.len()).collect();
            anneal::run(&mut st, &all, &anneal::Params::for_size(all.len(), seed))?;
            st.complete()?
        }
        Algorithm::Ilp => ilp::run(topo, wl, ilp::TIME_LIMIT_SECONDS)?,
    };
    let seconds = start.elapsed().as_secs_f64();
    verify(topo, wl, &assign)?;
    Ok(Placement {
        algorithm: algo,
        seconds,
        assign,
    })
}

#[derive(Debug, Serialize)]
pub struct JsonNode<'a> {
    pub id: &'a str,
    pub server: &'a str,
    pub rack: &'a str,
    pub kind: NodeKind,
    pub cores: f64,
    pub memory_mb: u64,
}

#[derive(Debug, Serialize)]
pub struct JsonPlacement<'a> {
    pub instance: &'a str,
    pub microservice: &'a str,
    pub node: &'a str,
    pub cores: f64,
    pub memory_mb: u64,
    pub replica_of: Option<&'a str>,
}

/// The JSON output contract of `flatmesh place --json` (issue 8).
#[derive(Debug, Serialize)]
pub struct JsonOutput<'a> {
    pub algorithm: &'static str,
    pub seconds: f64,
    pub nodes: Vec<JsonNode<'a>>,
    pub placements: Vec<JsonPlacement<'a>>,
    pub metrics: Metrics,
}

pub fn to_json<'a>(topo: &'a Topology, wl: &'a Workload, p: &Placement) -> JsonOutput<'a> {
    let nodes = topo
        .nodes
        .iter()
        .map(|n| JsonNode {
            id: &n.id,
            server: &topo.servers[n.server].name,
            rack: &topo.racks[n.rack].name,
            kind: n.kind,
            cores: n.cores,
            memory_mb: n.memory_mb,
        })
        .collect();
    let placements = wl
        .instances
        .iter()
        .zip(&p.assign)
        .map(|(inst, &n)| JsonPlacement {
            instance: &inst.id,
            microservice: &inst.microservice,
            node: &topo.nodes[n].id,
            cores: round6(inst.cores_on(topo.nodes[n].core)),
            memory_mb: inst.memory_mb,
            replica_of: inst.replica_of.map(|r| wl.instances[r].id.as_str()),
        })
        .collect();
    JsonOutput {
        algorithm: p.algorithm.name(),
        seconds: p.seconds,
        nodes,
        placements,
        metrics: energy::metrics(topo, wl, &p.assign),
    }
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{load_app, load_cluster};

    pub(crate) fn setup(cluster: &str, app: &str) -> (Topology, Workload) {
        let topo = Topology::build(&load_cluster(cluster).unwrap()).unwrap();
        let wl = Workload::from_apps(&[load_app(app).unwrap()]).unwrap();
        (topo, wl)
    }

    #[test]
    fn every_algorithm_places_every_table3_app_validly() {
        for app in crate::model::app_preset_names().unwrap() {
            let (topo, wl) = setup("preset:3xType1-SmartNIC", &format!("preset:{app}"));
            for algo in [Algorithm::Hcm, Algorithm::Anneal] {
                let p =
                    place(&topo, &wl, algo, 7).unwrap_or_else(|e| panic!("{app} {algo:?}: {e}"));
                verify(&topo, &wl, &p.assign).unwrap();
            }
        }
    }

    #[test]
    fn verify_catches_each_violation() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:IOT-TS");
        let good = place(&topo, &wl, Algorithm::Hcm, 1).unwrap().assign;
        // SQL on a SmartNIC.
        let sql = wl
            .instances
            .iter()
            .position(|i| i.microservice == "SQL")
            .unwrap();
        let mut bad = good.clone();
        bad[sql] = 1;
        assert!(verify(&topo, &wl, &bad)
            .unwrap_err()
            .to_string()
            .contains("must run on a host"));
        // Replica on its primary's server.
        let mut bad = good.clone();
        bad[1] = bad[0];
        assert!(verify(&topo, &wl, &bad)
            .unwrap_err()
            .to_string()
            .contains("same server"));
        // Everything on one host: over capacity (or a fault-domain clash, which comes first).
        let bad = vec![0; wl.instances.len()];
        assert!(verify(&topo, &wl, &bad).is_err());
    }

    #[test]
    fn too_much_load_is_a_clear_error() {
        let topo = Topology::build(&load_cluster("preset:Type1-SmartNIC").unwrap()).unwrap();
        let mut app = load_app("preset:IOT-TS").unwrap();
        app.rps *= 1000.0;
        let wl = Workload::from_apps(&[app]).unwrap();
        let err = place(&topo, &wl, Algorithm::Hcm, 1)
            .unwrap_err()
            .to_string();
        // One server cannot hold a replica apart from its primary, or the load: either way it names an instance.
        assert!(err.contains("fits on no node"), "{err}");
    }

    #[test]
    fn json_contract_has_the_issue_fields() {
        let (topo, wl) = setup("preset:3xType1-SmartNIC", "preset:NFV-FIN");
        let p = place(&topo, &wl, Algorithm::Hcm, 1).unwrap();
        let v = serde_json::to_value(to_json(&topo, &wl, &p)).unwrap();
        assert_eq!(v["algorithm"], "hcm");
        assert!(v["seconds"].is_f64());
        let node = &v["nodes"][1];
        for k in ["id", "server", "rack", "kind", "cores", "memory_mb"] {
            assert!(!node[k].is_null(), "node.{k}");
        }
        assert_eq!(node["kind"], "smartnic");
        let pl = &v["placements"][1];
        for k in ["instance", "microservice", "node", "cores", "memory_mb"] {
            assert!(!pl[k].is_null(), "placement.{k}");
        }
        assert_eq!(pl["replica_of"], v["placements"][0]["instance"]);
        assert!(v["placements"][0]["replica_of"].is_null());
        for k in ["avg_hops", "energy_rpj", "cost_efficiency"] {
            assert!(v["metrics"][k].is_f64(), "metrics.{k}");
        }
    }
}
