//! `flatmesh control demo`: E3's orchestration on this machine, with real parts.
//!
//! - Two servers, each a host node and one SmartNIC node; every node is a network namespace on a
//!   bridge (the ToR). SmartNIC nodes are emulated: their microservices run in a CPU cgroup limited
//!   to a fraction of a core (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` in a hybrid layout).
//! - Table 2's KVS, Count, EMA and an API gateway with a rate limiter run as processes, placed by
//!   HCM (the gateway stays on a host by the offload rule; the others go to a SmartNIC).
//! - A flatmesh node proxy (`flatmesh node --config FILE`) in every namespace routes `/api/`,
//!   `/kvs/`, `/count/`, `/ema/`; the orchestrator rewrites those files (`ProxyConfigSink`) and the
//!   proxies reload them without dropping requests.
//! - A node agent per namespace sends 16-byte heartbeats over UDP every 50 ms; the controller
//!   (`orchestrator::Controller`) detects the overloaded SmartNIC and migrates its hottest
//!   microservice to the host, cold, in the paper's steps.
//! - Load steps up part-way through; the demo reports per-second throughput, latency, failures,
//!   the SmartNIC's execution times, and every detection and migration step.

pub mod cgroup;
pub mod load;
pub mod netns;
pub mod node_agent;
pub mod runtime;
pub mod services;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;

use crate::control::services::{burn_rate, Kind};
use crate::{LabError, Result};
use flatmesh_control::agent::{receive, Gate, GateConfig, NodeCredentials};
use flatmesh_control::endpoints::{service_of, EndpointSnapshot, ProxyConfigSink};
use flatmesh_control::heartbeat::{Heartbeat, HeartbeatKey};
use flatmesh_control::model::{parse_app, parse_cluster};
use flatmesh_control::orchestrator::{Controller, DetectorConfig, LogEntry, Signal};
use flatmesh_control::placement::{hcm, State};
use flatmesh_control::topology::{NodeKind, Topology};
use flatmesh_control::workload::Workload;

use cgroup::{CpuGroups, Interface};
use load::{LoadPlan, LoadStats};
use netns::Fabric;
use runtime::{
    spawn_in, InstanceSpec, Launcher, NodeEnv, ProcessRuntime, ServiceParams, StepEvent,
};

/// The demo cluster: two servers of a host and one SmartNIC each (E3's Type1-SmartNIC, scaled
/// down to this machine: one modelled core per node).
pub const CLUSTER_YAML: &str = r#"
name: demo
server_types:
  DemoServer:
    description: a host plus one emulated SmartNIC (a CPU-throttled namespace)
    host:     {core: beefy, cores: 2, memory_mb: 4096, idle_watts: 83, peak_watts: 201, cost_usd: 4500, bandwidth_gbps: 0}
    smartnic: {core: wimpy, cores: 1, memory_mb: 1024, idle_watts: 15, peak_watts: 21, cost_usd: 150, bandwidth_gbps: 10}
    smartnic_count: 1
racks:
  - name: r0
    servers: [{type: DemoServer, count: 2}]
"#;

/// The applications: the API gateway (Table 2) and a telemetry pipeline KVS -> Count -> EMA.
pub const APPS_YAML: [&str; 2] = [
    r#"
name: gateway
rps: 20000
replicas: 0
stages: [{name: api, microservice: API gw, shards: 1}]
"#,
    r#"
name: telemetry
rps: 20000
replicas: 0
stages:
  - {name: kvs, microservice: KVS, shards: 1}
  - {name: count, microservice: Count, shards: 1, after: [kvs]}
  - {name: ema, microservice: EMA, shards: 1, after: [count]}
"#,
];

/// First port of the instances (instance k listens on BASE_PORT + k; statistics on +1000).
const BASE_PORT: u16 = 9100;
const PROXY_PORT: u16 = 8080;
const ADMIN_PORT: u16 = 15000;

#[derive(Debug, Clone)]
pub struct DemoConfig {
    pub launcher: Launcher,
    pub duration: Duration,
    /// When the load steps up, as a share of the duration.
    pub step_at: f64,
    pub low_rps: u32,
    pub high_rps: u32,
    pub greedy_rps: u32,
    /// The gateway's limit per client (req/s) and burst.
    pub rate_limit: f64,
    /// CPU a SmartNIC node gets, in cores (0.2 = a fifth of one host core).
    pub nic_cpu: f64,
    /// Per-request CPU work of KVS, Count and EMA on a host core, in µs.
    pub work_us: u64,
    /// Keep the working directory (logs, configs, checkpoints) after the run.
    pub keep: bool,
    /// End the run this long after the last migration instead of at `duration` (which stays the
    /// limit): long enough to watch the recovery, without guessing how soon detection comes or
    /// how many moves relieve a node (each move pushes the end back).
    pub end_after_move: Option<Duration>,
}

/// Everything the demo shows while it runs.
#[derive(Debug, Clone)]
pub enum DemoEvent {
    Info(String),
    /// The cluster is up: its nodes, services, call graph and HCM's placement (sent once, before
    /// the load starts; the web console is built from it).
    Started(DemoStart),
    Tick(TickRow),
    Controller {
        at: Duration,
        entry: LogEntry,
    },
    Step(StepEvent),
}

#[derive(Debug, Clone, Serialize)]
pub struct DemoStart {
    pub nodes: Vec<DemoNode>,
    /// Every service (`APP/STAGE`).
    pub services: Vec<String>,
    /// (caller, callee): who sends requests to whom through the node proxies. The gateway calls
    /// every other service; the load generator calls the gateway.
    pub calls: Vec<(String, String)>,
    /// instance -> node, as HCM placed them.
    pub placement: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DemoNode {
    pub id: String,
    pub smartnic: bool,
    /// The node proxy's admin endpoint (reachable from the root namespace).
    pub admin: SocketAddr,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeView {
    pub node: String,
    pub smartnic: bool,
    /// Mean of the slots' execution times in the last heartbeat, µs.
    pub exec_us: Option<u32>,
    pub queue: u16,
    /// How long ago its last heartbeat arrived, ms (`None`: none yet).
    pub heartbeat_age_ms: Option<u64>,
    pub instances: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TickRow {
    pub t_s: f64,
    pub target_rps: u32,
    pub ok_rps: u64,
    pub limited: u64,
    pub failed: u64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub nodes: Vec<NodeView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Migration {
    pub instance: String,
    pub from: String,
    pub to: String,
    pub at_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Detection {
    pub node: String,
    pub signal: String,
    pub at_s: f64,
    /// For an overload: the slot's execution time that tripped it. The per-second timeline
    /// averages a heartbeat's slots, so a short peak may show only here.
    pub exec_us: Option<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub throttle: String,
    pub nic_cpu: f64,
    pub duration_s: f64,
    pub step_at_s: f64,
    pub sent: u64,
    pub ok: u64,
    pub limited: u64,
    pub failed: u64,
    pub shed: u64,
    pub failures: Vec<String>,
    /// Heartbeats the orchestrator took (authentic, fresh, from the node's address).
    pub heartbeats: u64,
    /// Datagrams its gate dropped (none in a healthy run).
    pub heartbeats_refused: u64,
    pub detections: Vec<Detection>,
    pub migrations: Vec<Migration>,
    pub placement_before: BTreeMap<String, String>,
    pub placement_after: BTreeMap<String, String>,
    pub endpoint_versions: u64,
    /// (times throttled, seconds throttled) per SmartNIC cgroup.
    pub throttled: BTreeMap<String, (u64, f64)>,
    pub timeline: Vec<TickRow>,
    pub cleanup_left: Vec<String>,
}

/// Removes everything the demo created, in order: processes, namespaces and bridge, cgroups,
/// working directory. Runs on return, on error, and when the demo's future is dropped (Ctrl-C).
struct Teardown {
    runtime: Option<ProcessRuntime>,
    fabric: Option<Fabric>,
    groups: Option<CpuGroups>,
    workdir: Option<PathBuf>,
    left: Arc<Mutex<Vec<String>>>,
}

impl Drop for Teardown {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown();
        }
        if let Some(mut f) = self.fabric.take() {
            f.teardown();
        }
        if let Some(mut g) = self.groups.take() {
            let left = g.remove();
            self.left.lock().extend(left);
        }
        if let Some(dir) = self.workdir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Renders one node proxy's config from an endpoint snapshot.
fn proxy_yaml(
    node_ip: std::net::Ipv4Addr,
    snap: &EndpointSnapshot,
    address_of: &dyn Fn(&str, &str) -> Option<SocketAddr>,
    kind_of: &dyn Fn(&str) -> Option<Kind>,
) -> String {
    let mut routes = String::new();
    let mut clusters = String::new();
    for (service, endpoints) in &snap.services {
        let Some(kind) = kind_of(service) else {
            continue;
        };
        let name = service.replace('/', "-");
        routes.push_str(&format!(
            "      - name: {name}\n        match: {{ path: {{ prefix: {} }} }}\n        cluster: {name}\n        timeout: 10s\n        retries: {{ attempts: 2, on: [connect-failure] }}\n",
            kind.path_prefix()
        ));
        let addrs: Vec<String> = endpoints
            .iter()
            .filter_map(|e| address_of(&e.instance, &e.node))
            .map(|a| a.to_string())
            .collect();
        clusters.push_str(&format!(
            "  - name: {name}\n    endpoints: [ {} ]\n",
            addrs.join(", ")
        ));
    }
    format!(
        "# Written by the flatmesh control demo's orchestrator, endpoint version {}.\nadmin: {{ address: \"{node_ip}:{ADMIN_PORT}\", allow_remote: true, hosts: [admin] }}\nworkers: 1\nlisteners:\n  - name: entrance\n    address: {node_ip}:{PROXY_PORT}\n    protocol: http\n    routes:\n{routes}clusters:\n{clusters}",
        snap.version
    )
}

fn check_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(LabError::Demo {
            what: "flatmesh control demo".into(),
            message: "needs root: it creates network namespaces, a bridge and CPU cgroups (run it with sudo)".into(),
        });
    }
    Ok(())
}

/// Runs the demo; `events` receives progress as it happens.
pub async fn run(cfg: DemoConfig, events: mpsc::UnboundedSender<DemoEvent>) -> Result<Summary> {
    check_root()?;
    let info = |m: String| {
        let _ = events.send(DemoEvent::Info(m));
    };
    let interface = Interface::detect()?;
    let mut swept = netns::sweep_stale();
    swept.extend(cgroup::sweep_stale(&interface));
    if !swept.is_empty() {
        info(format!(
            "removed leftovers of earlier runs: {}",
            swept.join(", ")
        ));
    }

    // The model and the placement.
    let spec = parse_cluster("demo cluster", CLUSTER_YAML)?;
    let apps = APPS_YAML
        .iter()
        .map(|t| parse_app("demo app", t))
        .collect::<Result<Vec<_>, _>>()?;
    let topo = Topology::build(&spec)?;
    let wl = Workload::from_apps(&apps)?;
    let mut state = State::new(&topo, &wl);
    hcm::run(&mut state)?;

    let tag = format!("fmd{}", std::process::id());
    let left = Arc::new(Mutex::new(Vec::new()));
    let workdir = workdir_of(std::process::id());
    let mut teardown = Teardown {
        runtime: None,
        fabric: None,
        groups: None,
        workdir: (!cfg.keep).then(|| workdir.clone()),
        left: left.clone(),
    };
    std::fs::create_dir_all(&workdir).map_err(|cause| LabError::Write {
        path: workdir.display().to_string(),
        cause,
    })?;

    // Network and cgroups.
    let mut fabric = Fabric::create(&tag)?;
    let mut groups = CpuGroups::create(
        interface.clone(),
        &format!("flatmesh-demo-{}", std::process::id()),
    )?;
    info(format!(
        "SmartNIC nodes are emulated: wimpy cores = {} CPU each via {}",
        cfg.nic_cpu,
        interface.describe()
    ));
    let mut nodes = Vec::new();
    for (k, n) in topo.nodes.iter().enumerate() {
        let ns = fabric.add_node(k)?;
        let dir = workdir.join(n.id.replace('/', "_"));
        std::fs::create_dir_all(&dir).map_err(|cause| LabError::Write {
            path: dir.display().to_string(),
            cause,
        })?;
        let smartnic = n.kind == NodeKind::Smartnic;
        let cgroup_procs = if smartnic {
            Some(groups.limit(&n.id.replace('/', "_"), cfg.nic_cpu)?)
        } else {
            None
        };
        let ip = fabric.node_ip(k);
        nodes.push(NodeEnv {
            id: n.id.clone(),
            index: k,
            smartnic,
            ns,
            ip,
            dir,
            cgroup_procs,
            proxy: SocketAddr::new(ip.into(), PROXY_PORT),
        });
    }
    teardown.fabric = Some(fabric);
    let fabric_ip = teardown.fabric.as_ref().map(|f| f.gateway_ip());
    let Some(controller_ip) = fabric_ip else {
        return Err(LabError::Demo {
            what: "demo".into(),
            message: "network not set up".into(),
        });
    };

    // Services and their per-request work.
    let per_us = burn_rate();
    let params = ServiceParams {
        backend_iterations: per_us * cfg.work_us,
        gateway_iterations: per_us * cfg.work_us / 3,
        rate: cfg.rate_limit,
        burst: (cfg.rate_limit / 5.0).max(1.0),
    };
    let specs: Vec<InstanceSpec> = wl
        .instances
        .iter()
        .enumerate()
        .map(|(k, inst)| {
            let kind =
                Kind::from_microservice(&inst.microservice).ok_or_else(|| LabError::Invalid {
                    what: "demo app",
                    message: format!("{} has no implementation in the demo", inst.microservice),
                })?;
            Ok(InstanceSpec {
                id: inst.id.clone(),
                kind,
                port: BASE_PORT + k as u16,
            })
        })
        .collect::<Result<_>>()?;
    let (step_tx, mut step_rx) = mpsc::unbounded_channel();
    let runtime = ProcessRuntime::new(
        cfg.launcher.clone(),
        nodes.clone(),
        specs.clone(),
        params,
        step_tx,
    );
    teardown.runtime = Some(runtime.clone());
    teardown.groups = Some(groups);

    // Endpoints reach the node proxies through their config files.
    let kinds: BTreeMap<String, Kind> = specs
        .iter()
        .map(|s| (service_of(&s.id).to_string(), s.kind))
        .collect();
    // The console's copy (the sink takes `kinds`).
    let service_kinds = kinds.clone();
    let ips: BTreeMap<String, std::net::Ipv4Addr> =
        nodes.iter().map(|n| (n.id.clone(), n.ip)).collect();
    let ports: BTreeMap<String, u16> = specs.iter().map(|s| (s.id.clone(), s.port)).collect();
    let targets: Vec<(PathBuf, std::net::Ipv4Addr)> = nodes
        .iter()
        .map(|n| (n.dir.join("proxy.yaml"), n.ip))
        .collect();
    let sink = ProxyConfigSink::new(move |snap: &EndpointSnapshot| {
        let address_of = |instance: &str, node: &str| {
            Some(SocketAddr::new(
                (*ips.get(node)?).into(),
                *ports.get(instance)?,
            ))
        };
        let kind_of = |service: &str| kinds.get(service).copied();
        targets
            .iter()
            .map(|(path, ip)| (path.clone(), proxy_yaml(*ip, snap, &address_of, &kind_of)))
            .collect()
    });

    // Start: binaries pushed, instances where HCM placed them, then the controller (which writes
    // the proxies' configs), then the proxies and the agents.
    for n in &nodes {
        runtime.push_binary(&n.id).map_err(|m| LabError::Demo {
            what: format!("preparing {}", n.id),
            message: m,
        })?;
    }
    let placement_before: BTreeMap<String, String> = wl
        .instances
        .iter()
        .enumerate()
        .filter_map(|(i, inst)| Some((inst.id.clone(), topo.nodes[state.assign[i]?].id.clone())))
        .collect();
    for (inst, node) in &placement_before {
        runtime
            .start_instance(inst, node, None)
            .await
            .map_err(|m| LabError::Demo {
                what: format!("starting {inst} on {node}"),
                message: m,
            })?;
        info(format!("HCM placed {inst} on {node}; started"));
    }
    let detector = DetectorConfig {
        // Eight heartbeats in a row (400 ms) above 1.2 x EMA, not one: this machine is shared and
        // noisy. The EMA (alpha 1/8) catches up with a step in execution time, so a step stays
        // 20% above it for fewer than 8 heartbeats unless it is larger than ~2x: the noise of other
        // jobs (1.5x for a while) is not acted on, a throttled SmartNIC (several x) is.
        overload_beats: 8,
        // The EMA learns for two seconds (40 heartbeats) before it judges: connection set-up and
        // first-touch page faults make the first requests slow on any node.
        warmup: 40,
        // The agents are not throttled, but the machine may stall them; a false "dead" would
        // fail over a healthy node.
        dead_after: Duration::from_secs(1),
        ..DetectorConfig::default()
    };
    let mut controller = Controller::new(state, detector, runtime.clone(), sink)?;
    let (obs_tx, mut obs_rx) = mpsc::unbounded_channel();
    controller.observer = Some(obs_tx);

    let heartbeat_socket = UdpSocket::bind(SocketAddr::new(controller_ip.into(), 0))
        .await
        .map_err(|e| LabError::Demo {
            what: "orchestrator".into(),
            message: format!("cannot bind the heartbeat socket on {controller_ip}: {e}"),
        })?;
    let orchestrator = heartbeat_socket.local_addr().map_err(|e| LabError::Demo {
        what: "orchestrator".into(),
        message: e.to_string(),
    })?;
    // One heartbeat key per node, given to its agent in a file only root reads; the orchestrator
    // takes a node's heartbeats only with its key and from its address on the bridge.
    let mut credentials = Vec::new();
    for n in &nodes {
        let key = HeartbeatKey::generate()?;
        write_secret(&n.dir.join("heartbeat.key"), &key.to_hex())?;
        credentials.push((
            n.index,
            NodeCredentials {
                key,
                address: Some(n.ip.into()),
            },
        ));
    }
    let mut gate_nodes = vec![None; topo.nodes.len()];
    for (index, c) in credentials {
        if let Some(slot) = gate_nodes.get_mut(index) {
            *slot = Some(c);
        }
    }
    let gate = Gate::new(gate_nodes, GateConfig::default());
    let gate_stats = gate.stats();
    for n in &nodes {
        let mut args = vec!["node".to_string(), "--config".into()];
        args.push(n.dir.join("proxy.yaml").display().to_string());
        let child = spawn_in(
            &n.ns,
            None,
            &n.dir.join("bin/flatmesh"),
            &args,
            &n.dir.join("proxy.log"),
        )?;
        runtime.adopt(child);
        let mut args = cfg.launcher.agent_args.clone();
        args.extend([
            "--node".into(),
            n.index.to_string(),
            "--orchestrator".into(),
            orchestrator.to_string(),
            "--instances".into(),
            runtime::agent_list_path(n).display().to_string(),
            "--key-file".into(),
            n.dir.join("heartbeat.key").display().to_string(),
        ]);
        let child = spawn_in(
            &n.ns,
            None,
            &n.dir.join("bin/flatmesh"),
            &args,
            &n.dir.join("agent.log"),
        )?;
        runtime.adopt(child);
    }
    for n in &nodes {
        wait_proxy_ready(n).await?;
    }
    info(format!(
        "{} node proxies ready; agents send authenticated heartbeats every 50 ms over UDP to {orchestrator}",
        nodes.len()
    ));
    let gateways: Vec<&String> = service_kinds
        .iter()
        .filter(|(_, k)| **k == Kind::Gateway)
        .map(|(s, _)| s)
        .collect();
    let _ = events.send(DemoEvent::Started(DemoStart {
        nodes: nodes
            .iter()
            .map(|n| DemoNode {
                id: n.id.clone(),
                smartnic: n.smartnic,
                admin: SocketAddr::new(n.ip.into(), ADMIN_PORT),
            })
            .collect(),
        services: service_kinds.keys().cloned().collect(),
        calls: gateways
            .iter()
            .flat_map(|g| {
                service_kinds
                    .keys()
                    .filter(move |s| s != g)
                    .map(move |s| ((*g).clone(), s.clone()))
            })
            .collect(),
        placement: placement_before.clone(),
    }));

    // Run: heartbeats in (and into the live view), the controller, the load, a tick per second.
    let view: Arc<Mutex<BTreeMap<usize, (Heartbeat, Instant)>>> =
        Arc::new(Mutex::new(BTreeMap::new()));
    let heartbeats = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (admitted_tx, mut admitted_rx) = mpsc::channel::<Heartbeat>(4096);
    let (hb_tx, hb_rx) = mpsc::channel::<Heartbeat>(4096);
    let receiver = tokio::spawn(async move {
        if let Err(e) = receive(&heartbeat_socket, gate, admitted_tx).await {
            tracing::error!(error = %e, "heartbeat socket failed");
        }
    });
    let tee = {
        let view = view.clone();
        let heartbeats = heartbeats.clone();
        tokio::spawn(async move {
            while let Some(hb) = admitted_rx.recv().await {
                view.lock().insert(hb.node as usize, (hb, Instant::now()));
                heartbeats.fetch_add(1, Ordering::Relaxed);
                if hb_tx.send(hb).await.is_err() {
                    return;
                }
            }
        })
    };
    let plan = LoadPlan {
        entrances: nodes.iter().map(|n| n.proxy).collect(),
        duration: cfg.duration,
        low_rps: cfg.low_rps,
        high_rps: cfg.high_rps,
        step_at: cfg.duration.mul_f64(cfg.step_at),
        greedy_rps: cfg.greedy_rps,
        clients: 8,
    };
    let stats = Arc::new(LoadStats::default());
    let stop_load = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(load::run(plan.clone(), stats.clone(), stop_load.clone()));
    let started = Instant::now();
    let mut timeline = Vec::new();
    let mut detections = Vec::new();
    let mut migrations = Vec::new();
    {
        let ctl = controller.run(hb_rx);
        tokio::pin!(ctl);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let mut last_ok = 0;
        let limit = tokio::time::Instant::now() + cfg.duration;
        let deadline = tokio::time::sleep_until(limit);
        tokio::pin!(deadline);
        let mut stopping = false;
        loop {
            tokio::select! {
                r = &mut ctl => { r?; break; }
                _ = &mut deadline, if !stopping => {
                    // Stop the load and the heartbeats; the controller returns once it has
                    // drained them.
                    stop_load.store(true, Ordering::Relaxed);
                    receiver.abort();
                    tee.abort();
                    stopping = true;
                }
                _ = tick.tick(), if !stopping => {
                    let ok = stats.ok.load(Ordering::Relaxed);
                    let (p50, p99) = stats.take_percentiles().unzip();
                    let locations = runtime.locations();
                    let hbs = view.lock().clone();
                    let row = TickRow {
                        t_s: started.elapsed().as_secs_f64(),
                        target_rps: plan.rate_at(started.elapsed()) + plan.greedy_rps,
                        ok_rps: ok - last_ok,
                        limited: stats.limited.load(Ordering::Relaxed),
                        failed: stats.failed.load(Ordering::Relaxed),
                        p50_ms: p50,
                        p99_ms: p99,
                        nodes: nodes.iter().map(|n| node_view(n, hbs.get(&n.index), &locations)).collect(),
                    };
                    last_ok = ok;
                    timeline.push(row.clone());
                    let _ = events.send(DemoEvent::Tick(row));
                }
                Some(entry) = obs_rx.recv() => {
                    let at = started.elapsed();
                    match &entry {
                        LogEntry::Detected(s) => {
                            let (node, signal) = describe(&topo, s);
                            let exec_us = match s {
                                Signal::Overload { exec_us, .. } => Some(u32::from(*exec_us)),
                                _ => None,
                            };
                            detections.push(Detection { node, signal, at_s: at.as_secs_f64(), exec_us });
                        }
                        LogEntry::Migrated { instance, from, to, .. } => {
                            if let Some(settle) = cfg.end_after_move {
                                // Never past the first deadline (`duration`), which stays the limit.
                                let end = (tokio::time::Instant::now() + settle).min(limit);
                                deadline.as_mut().reset(end);
                            }
                            migrations.push(Migration {
                                instance: instance.clone(), from: from.clone(), to: to.clone(), at_s: at.as_secs_f64(),
                            });
                        }
                        _ => {}
                    }
                    let _ = events.send(DemoEvent::Controller { at, entry });
                }
                Some(mut step) = step_rx.recv() => {
                    // One clock for the whole log: the demo's.
                    step.at = started.elapsed();
                    let _ = events.send(DemoEvent::Step(step));
                }
            }
        }
    }
    let run_for = started.elapsed();
    // Late log entries (the controller may have finished a migration while stopping).
    while let Ok(entry) = obs_rx.try_recv() {
        if let LogEntry::Migrated {
            instance, from, to, ..
        } = &entry
        {
            migrations.push(Migration {
                instance: instance.clone(),
                from: from.clone(),
                to: to.clone(),
                at_s: started.elapsed().as_secs_f64(),
            });
        }
        let _ = events.send(DemoEvent::Controller {
            at: started.elapsed(),
            entry,
        });
    }
    while let Ok(mut step) = step_rx.try_recv() {
        step.at = started.elapsed();
        let _ = events.send(DemoEvent::Step(step));
    }
    let _ = load.await;
    let throttled = teardown
        .groups
        .as_ref()
        .map(|g| {
            nodes
                .iter()
                .filter(|n| n.smartnic)
                .filter_map(|n| Some((n.id.clone(), g.throttled(&n.id.replace('/', "_"))?)))
                .collect()
        })
        .unwrap_or_default();
    let placement_after = runtime.locations();
    let endpoint_versions = controller.version;
    drop(controller);
    drop(teardown);
    let summary = Summary {
        throttle: interface.describe(),
        nic_cpu: cfg.nic_cpu,
        duration_s: run_for.as_secs_f64(),
        step_at_s: plan.step_at.as_secs_f64(),
        sent: stats.sent.load(Ordering::Relaxed),
        ok: stats.ok.load(Ordering::Relaxed),
        limited: stats.limited.load(Ordering::Relaxed),
        failed: stats.failed.load(Ordering::Relaxed),
        shed: stats.shed.load(Ordering::Relaxed),
        failures: stats.failures.lock().clone(),
        heartbeats: heartbeats.load(Ordering::Relaxed),
        heartbeats_refused: gate_stats.read().refused(),
        detections,
        migrations,
        placement_before,
        placement_after,
        endpoint_versions,
        throttled,
        timeline,
        cleanup_left: left.lock().clone(),
    };
    Ok(summary)
}

fn node_view(
    n: &NodeEnv,
    seen: Option<&(Heartbeat, Instant)>,
    locations: &BTreeMap<String, String>,
) -> NodeView {
    let hb = seen.map(|(hb, _)| hb);
    let samples: Vec<u32> = hb
        .map(|h| h.samples().map(|(_, e)| u32::from(e)).collect())
        .unwrap_or_default();
    NodeView {
        node: n.id.clone(),
        smartnic: n.smartnic,
        exec_us: (!samples.is_empty()).then(|| samples.iter().sum::<u32>() / samples.len() as u32),
        queue: hb.map_or(0, |h| h.queue_len),
        heartbeat_age_ms: seen.map(|(_, at)| at.elapsed().as_millis() as u64),
        instances: locations
            .iter()
            .filter(|(_, node)| **node == n.id)
            .map(|(i, _)| i.clone())
            .collect(),
    }
}

/// (node, what was seen) for a signal.
pub fn describe(topo: &Topology, s: &Signal) -> (String, String) {
    let name = |n: usize| {
        topo.nodes
            .get(n)
            .map_or_else(|| n.to_string(), |x| x.id.clone())
    };
    match s {
        Signal::Overload {
            node,
            slot,
            exec_us,
            ema_us,
        } => (
            name(*node),
            format!("overload: slot {slot} took {exec_us} µs, EMA {ema_us:.0} µs (> +20%)"),
        ),
        Signal::HostStarvation {
            node,
            queue_len,
            bw_util_pct,
        } => (
            name(*node),
            format!("host starvation: standing queue {queue_len} with links {bw_util_pct}% used"),
        ),
        Signal::NodeDead { node } => (name(*node), "no heartbeat: node dead".into()),
    }
}

/// Writes a file that only its owner can read (created so, never readable by others meanwhile).
fn write_secret(path: &Path, text: &str) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |e: std::io::Error| LabError::Demo {
        what: "heartbeat key".into(),
        message: format!("cannot write {}: {e}", path.display()),
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)
}

async fn wait_proxy_ready(n: &NodeEnv) -> Result<()> {
    let admin = SocketAddr::new(n.ip.into(), ADMIN_PORT);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(mut s) = tokio::net::TcpStream::connect(admin).await {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = s
                .write_all(b"GET /ready HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n")
                .await;
            let mut buf = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut buf)).await;
            if buf.starts_with(b"HTTP/1.1 200") {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(n.dir.join("proxy.log")).unwrap_or_default();
            return Err(LabError::Demo {
                what: format!("node proxy of {}", n.id),
                message: format!(
                    "not ready after 15 s; its log: {}",
                    log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The demo's working directory for a given run (for docs and tests).
pub fn workdir_of(pid: u32) -> PathBuf {
    std::env::temp_dir().join(format!("flatmesh-control-demo-{pid}"))
}

/// Whether anything of run `pid` is left: namespaces, bridge, cgroup, working directory.
pub fn leftovers(pid: u32) -> Vec<String> {
    let tag = format!("fmd{pid}");
    let mut left = Vec::new();
    if let Ok(list) = netns::ip(&["netns", "list"]) {
        left.extend(
            list.lines()
                .filter(|l| l.starts_with(&format!("{tag}-")))
                .map(|l| format!("namespace {l}")),
        );
    }
    if netns::ip(&["link", "show", &format!("{tag}br")]).is_ok() {
        left.push(format!("bridge {tag}br"));
    }
    if let Ok(i) = Interface::detect() {
        let root = match i {
            Interface::V2(r) | Interface::V1(r) => r,
        };
        let d = root.join(format!("flatmesh-demo-{pid}"));
        if d.exists() {
            left.push(format!("cgroup {}", d.display()));
        }
    }
    if Path::new(&workdir_of(pid)).exists() {
        left.push(format!("directory {}", workdir_of(pid).display()));
    }
    left
}
