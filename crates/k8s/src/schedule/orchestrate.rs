//! E3's orchestrator on a Kubernetes cluster (E3 §3.4–3.5; `flatmesh control --kubeconfig
//! --schedule --heartbeats ADDR --heartbeat-keys FILE`): the node agents' heartbeats in, and a
//! migration or failover out as the re-creation of the moved pods on their new nodes
//! ([`Migrator`]). The pods' EndpointSlices then follow them; the orchestrator publishes no
//! endpoints of its own.
//!
//! It works on the scheduler's latest round: the cluster of the labelled Nodes, the apps of the
//! pods of `schedulerName: flatmesh`, and the node of each. When a round shows something else
//! (a node or pod came or went, a pod is on another node than the orchestrator put it), the
//! orchestrator starts again from it; a migration of its own shows up as no change.
//!
//! Its input is one of two ([`Beats`]):
//!
//! - **Sealed heartbeats** from node agents (`--heartbeats ADDR --heartbeat-keys FILE`), E3's
//!   own transport. The heartbeat's node field is the node's position in the keys file, whose
//!   names are Kubernetes node names, in sorted order (the file does not change while the
//!   control plane runs, so neither do the numbers). A heartbeat is taken only from its node's
//!   `InternalIP`. A node's slots are its pods of `schedulerName: flatmesh` ordered by E3
//!   instance id ([`SlotOrder::InstanceId`]): what an agent on the node can work out alone.
//! - **The node proxies' load reports** (`--load-reports PERIOD`, LRS): every node proxy
//!   reports, per period, the time each endpoint took to answer it. An endpoint that is a pod
//!   of ours (by `status.podIPs`) gives its E3 instance's execution time: the mean over every
//!   caller's answered tries, weighted by their number. Each period, the orchestrator makes
//!   every node's heartbeat of that ([`LoadWindow`]). Load reports carry no link utilisation
//!   or queue, so they drive E3's overload signal only (not its starvation signal), and
//!   every node counts as alive: a dead node is Kubernetes' own to handle (the node
//!   lifecycle controller taints it and its pods are evicted).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use flatmesh_control::agent::{unix_now_us, Gate, GateConfig, HeartbeatBuilder, NodeSample};
use flatmesh_control::endpoints::{EndpointSink, EndpointSnapshot};
use flatmesh_control::heartbeat::{Heartbeat, WIRE_LEN};
use flatmesh_control::model::parse_cluster;
use flatmesh_control::orchestrator::{slots_in, Controller, DetectorConfig, LogEntry, SlotOrder};
use flatmesh_control::placement::State;
use flatmesh_control::serve::heartbeat_keys::HeartbeatKeys;
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;
use flatmesh_xds::lrs::NodeLoad;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::bind::Migrator;
use super::scheduler::Round;

/// E3's detector, but a node is failed over after 5 s of silence rather than 150 ms: on
/// Kubernetes a failover re-creates every pod of the node elsewhere, which an agent's restart
/// must not cost.
pub fn detector() -> DetectorConfig {
    DetectorConfig {
        dead_after: std::time::Duration::from_secs(5),
        ..DetectorConfig::default()
    }
}

/// E3's detector on load reports of `period`: one sample per period, and an overload must
/// last two periods (one slow period of a shared machine moves nothing). Every node is sent a
/// heartbeat each period, so none is ever found dead here.
pub fn load_report_detector(period: Duration) -> DetectorConfig {
    DetectorConfig {
        interval: period,
        overload_beats: 2,
        dead_after: period.saturating_mul(10),
        ..DetectorConfig::default()
    }
}

/// Where the orchestrator learns how the nodes do.
pub enum Beats {
    /// Node agents' sealed heartbeats over UDP.
    Sealed {
        /// Where they arrive (bound by the caller, so a busy address fails at start).
        socket: std::net::UdpSocket,
        /// Each Kubernetes node's heartbeat key.
        keys: HeartbeatKeys,
    },
    /// The node proxies' load reports (the control plane's LRS server), every `period`.
    LoadReports {
        reports: mpsc::Receiver<NodeLoad>,
        period: Duration,
    },
}

/// What the orchestrator needs besides the scheduler's rounds.
pub struct OrchestratorOptions {
    pub beats: Beats,
    pub detector: DetectorConfig,
    /// Receives a copy of every decision (besides the log).
    pub observer: Option<mpsc::UnboundedSender<LogEntry>>,
}

/// The running orchestrator; dropping it stops it.
pub struct Orchestrator {
    task: JoinHandle<()>,
}

impl Drop for Orchestrator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Orchestrator {
    /// Runs on the current tokio runtime, on the rounds of a [`super::Scheduler`].
    pub fn spawn(
        client: kube::Client,
        rounds: watch::Receiver<Option<Arc<Round>>>,
        options: OrchestratorOptions,
    ) -> std::io::Result<Orchestrator> {
        let source = match options.beats {
            Beats::Sealed { socket, keys } => {
                socket.set_nonblocking(true)?;
                let socket = UdpSocket::from_std(socket)?;
                let names: Vec<String> = keys.names().map(str::to_string).collect();
                tracing::info!(
                    address = ?socket.local_addr().ok(),
                    nodes = ?names.iter().enumerate().collect::<Vec<_>>(),
                    "orchestrator: receiving heartbeats (node number = position in --heartbeat-keys)"
                );
                Source::Sealed {
                    socket,
                    gate: keys.gate_by_name(GateConfig::default()),
                    names,
                }
            }
            Beats::LoadReports { reports, period } => {
                tracing::info!(?period, "orchestrator: on the node proxies' load reports");
                Source::LoadReports {
                    reports,
                    period,
                    window: LoadWindow::default(),
                }
            }
        };
        let (log_tx, log_rx) = mpsc::unbounded_channel();
        tokio::spawn(log_entries(log_rx, options.observer));
        let run = Run {
            client,
            source,
            detector: options.detector,
            log: log_tx,
        };
        Ok(Orchestrator {
            task: tokio::spawn(run.run(rounds)),
        })
    }
}

struct Run {
    client: kube::Client,
    source: Source,
    detector: DetectorConfig,
    log: mpsc::UnboundedSender<LogEntry>,
}

enum Source {
    Sealed {
        socket: UdpSocket,
        gate: Gate,
        /// Heartbeat node number -> Kubernetes node name.
        names: Vec<String>,
    },
    LoadReports {
        reports: mpsc::Receiver<NodeLoad>,
        period: Duration,
        window: LoadWindow,
    },
}

/// The load reports of the current period, summed per E3 instance.
#[derive(Default)]
struct LoadWindow {
    /// Pod IP -> E3 instance id, from the scheduler's latest round.
    instances: HashMap<IpAddr, String>,
    /// Instance id -> (answered tries, their summed time in µs).
    answered: HashMap<String, (u64, u64)>,
    /// Each topology node's heartbeat builder (it rotates the slot base past four slots).
    builders: HashMap<usize, HeartbeatBuilder>,
    /// When the current period ends (set by the first wait).
    ends: Option<tokio::time::Instant>,
}

impl LoadWindow {
    fn add(&mut self, load: &NodeLoad) {
        for e in &load.endpoints {
            if let Some(instance) = self.instances.get(&e.endpoint.ip()) {
                let sum = self.answered.entry(instance.clone()).or_default();
                sum.0 = sum.0.saturating_add(e.answered);
                sum.1 = sum.1.saturating_add(e.answer_us);
            }
        }
    }

    /// Every node's heartbeat of the period that ends, its slots as `controller` orders them;
    /// then a new period.
    fn heartbeats(&mut self, controller: &K8sController<'_>, period: Duration) -> Vec<Heartbeat> {
        let state = &controller.state;
        let mut beats = Vec::with_capacity(state.topo.nodes.len());
        for node in 0..state.topo.nodes.len() {
            let exec_us = slots_in(state, node, controller.slot_order)
                .into_iter()
                .map(|i| {
                    let (n, us) = *self.answered.get(&state.wl.instances[i].id)?;
                    (n > 0).then(|| us / n)
                })
                .collect();
            let builder = self
                .builders
                .entry(node)
                .or_insert_with(|| HeartbeatBuilder::new(node as u32, 1, period));
            beats.push(builder.build(&NodeSample {
                queue_len: 0,
                bytes: 0,
                exec_us,
            }));
        }
        self.answered.clear();
        beats
    }
}

impl Run {
    async fn run(mut self, mut rounds: watch::Receiver<Option<Arc<Round>>>) {
        let mut said = String::new();
        loop {
            let round = rounds.borrow_and_update().clone();
            let model = match round.as_deref().map(|r| Model::of(r, self.source.names())) {
                Some(Ok(model)) => Some(model),
                Some(Err(why)) => {
                    if why != said {
                        tracing::warn!("orchestrator: waiting: {why}");
                        said = why;
                    }
                    None
                }
                None => None,
            };
            if let Some(round) = &round {
                self.set_addresses(round);
            }
            match model {
                Some(model) => {
                    said.clear();
                    if !self.orchestrate(&model, &mut rounds).await {
                        return;
                    }
                }
                None => loop {
                    // Nothing to orchestrate yet: the nodes' load reports are read and let go,
                    // so that their server does not find its reader lagging.
                    tokio::select! {
                        changed = rounds.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            break;
                        }
                        alive = self.source.discard() => if !alive {
                            return;
                        },
                    }
                },
            }
        }
    }

    /// Runs E3's controller on `model` until a round shows a different one (true) or the
    /// scheduler or the socket is gone (false).
    async fn orchestrate(
        &mut self,
        model: &Model,
        rounds: &mut watch::Receiver<Option<Arc<Round>>>,
    ) -> bool {
        let mut state = State::new(&model.topo, &model.wl);
        for (i, node) in model.assign.iter().enumerate() {
            if let Some(n) = *node {
                state.place(i, n);
            }
        }
        let migrator = Migrator {
            client: self.client.clone(),
            pods: model.pods.clone(),
            nodes: model.node_names.clone(),
        };
        let mut controller =
            match Controller::new(state, self.detector.clone(), migrator, EndpointSlicesFollow) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!("orchestrator: {e}");
                    return rounds.changed().await.is_ok();
                }
            };
        controller.slot_order = SlotOrder::InstanceId;
        controller.observer = Some(self.log.clone());
        let mut tick = tokio::time::interval(self.detector.interval);
        loop {
            tokio::select! {
                // Heartbeats first, as `Controller::run` does: a busy orchestrator must not take
                // its own delay for silent nodes.
                biased;
                beats = self.source.next(model, &controller) => {
                    let Some(beats) = beats else { return false };
                    for beat in &beats {
                        controller.on_heartbeat(beat).await;
                    }
                }
                _ = tick.tick() => controller.tick().await,
                changed = rounds.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                    let Some(next) = rounds.borrow_and_update().clone() else { continue };
                    self.set_addresses(&next);
                    if Shape::of_round(&next) != model.shape_with(&controller.state.assign) {
                        tracing::info!("orchestrator: the cluster or its pods changed; starting again from the scheduler's round");
                        return true;
                    }
                }
            }
        }
    }

    /// Follows the addresses in `round`: each node's heartbeats are taken from its
    /// `InternalIP` (none without one); each pod's load is known by its IPs.
    fn set_addresses(&mut self, round: &Round) {
        let plan = &round.plan;
        match &mut self.source {
            Source::Sealed { gate, names, .. } => {
                for (k, name) in names.iter().enumerate() {
                    gate.set_address(k, plan.cluster.addresses.get(name).copied());
                }
            }
            Source::LoadReports { window, .. } => {
                let instance_of: HashMap<&super::PodKey, &String> = plan
                    .apps
                    .iter()
                    .flat_map(|app| app.pods.iter().map(|(id, pod)| (pod, id)))
                    .collect();
                window.instances = plan
                    .addresses
                    .iter()
                    .filter_map(|(ip, pod)| Some((*ip, (*instance_of.get(pod)?).clone())))
                    .collect();
            }
        }
    }
}

type K8sController<'a> = Controller<'a, Migrator, EndpointSlicesFollow>;

impl Source {
    /// Heartbeat node number -> Kubernetes node name (sealed heartbeats only).
    fn names(&self) -> &[String] {
        match self {
            Source::Sealed { names, .. } => names,
            Source::LoadReports { .. } => &[],
        }
    }

    /// Takes and drops what arrives while there is nothing to orchestrate (load reports; a
    /// heartbeat socket is left to its buffer). False once the source is gone.
    async fn discard(&mut self) -> bool {
        match self {
            Source::Sealed { .. } => std::future::pending().await,
            Source::LoadReports { reports, .. } => reports.recv().await.is_some(),
        }
    }

    /// The next heartbeats, with topology node numbers; `None` once the source is gone.
    async fn next(
        &mut self,
        model: &Model,
        controller: &K8sController<'_>,
    ) -> Option<Vec<Heartbeat>> {
        match self {
            Source::Sealed {
                socket,
                gate,
                names,
            } => {
                let mut buf = [0u8; WIRE_LEN + 1];
                loop {
                    let (n, from) = match socket.recv_from(&mut buf).await {
                        Ok(r) => r,
                        Err(e) => {
                            tracing::error!(error = %e, "heartbeat socket failed; the orchestrator stops");
                            return None;
                        }
                    };
                    let Ok(mut beat) = gate.admit(&buf[..n], from, unix_now_us()) else {
                        continue;
                    };
                    match model
                        .wire_to_topo
                        .get(beat.node as usize)
                        .copied()
                        .flatten()
                    {
                        Some(node) => {
                            beat.node = node as u32;
                            return Some(vec![beat]);
                        }
                        None => tracing::debug!(
                            node = names.get(beat.node as usize).map(String::as_str),
                            "heartbeat of a node the scheduler does not place on"
                        ),
                    }
                }
            }
            Source::LoadReports {
                reports,
                period,
                window,
            } => loop {
                // The period's end is kept in the window: this future is dropped whenever the
                // orchestrator's other work comes first.
                let ends = *window
                    .ends
                    .get_or_insert_with(|| tokio::time::Instant::now() + *period);
                tokio::select! {
                    load = reports.recv() => match load {
                        Some(load) => window.add(&load),
                        None => {
                            tracing::error!("the load reports stopped; the orchestrator stops");
                            return None;
                        }
                    },
                    () = tokio::time::sleep_until(ends) => {
                        let now = tokio::time::Instant::now();
                        // A late wake-up starts the next period now rather than catching up.
                        window.ends = Some(ends.max(now.checked_sub(*period).unwrap_or(now)) + *period);
                        return Some(window.heartbeats(controller, *period));
                    }
                }
            },
        }
    }
}

/// What the orchestrator works on, from one round.
struct Model {
    topo: Topology,
    wl: Workload,
    /// Instance -> topology node.
    assign: Vec<Option<usize>>,
    /// Heartbeat node number -> topology node.
    wire_to_topo: Vec<Option<usize>>,
    /// E3 instance id -> pod.
    pods: BTreeMap<String, super::PodKey>,
    /// E3 node id -> Kubernetes node name.
    node_names: BTreeMap<String, String>,
    shape: Shape,
}

/// What makes two rounds the same to the orchestrator: the cluster, the apps, and which
/// Kubernetes node each instance is on.
#[derive(Debug, PartialEq)]
struct Shape {
    cluster: String,
    apps: Vec<String>,
    placed: BTreeMap<String, String>,
}

impl Shape {
    fn of_round(round: &Round) -> Shape {
        let plan = &round.plan;
        let failed: Vec<&super::PodKey> = round.failed.iter().map(|(b, _)| &b.pod).collect();
        let placed = plan
            .apps
            .iter()
            .flat_map(|app| &app.pods)
            .filter(|(_, pod)| !failed.contains(pod))
            .filter_map(|(id, pod)| Some((id.clone(), plan.placed.get(pod)?.clone())))
            .collect();
        Shape {
            cluster: plan.cluster.yaml(),
            apps: plan.apps.iter().map(|a| a.yaml()).collect(),
            placed,
        }
    }
}

impl Model {
    fn of(round: &Round, names: &[String]) -> Result<Model, String> {
        let plan = &round.plan;
        if plan.apps.is_empty() {
            return Err("no pods of schedulerName: flatmesh".into());
        }
        let spec = parse_cluster("kubernetes", &plan.cluster.yaml())
            .map_err(|e| format!("the nodes do not make an E3 cluster: {e}"))?;
        let topo = Topology::build(&spec).map_err(|e| e.to_string())?;
        let specs: Vec<_> = plan.apps.iter().map(|a| a.spec.clone()).collect();
        let wl = Workload::from_apps(&specs).map_err(|e| e.to_string())?;
        let shape = Shape::of_round(round);
        let topo_node = |name: &str| {
            plan.cluster
                .node_id(name)
                .and_then(|id| topo.node_index(id))
        };
        let assign = wl
            .instances
            .iter()
            .map(|inst| topo_node(shape.placed.get(&inst.id)?))
            .collect();
        let wire_to_topo = names.iter().map(|name| topo_node(name)).collect();
        Ok(Model {
            assign,
            wire_to_topo,
            pods: plan.apps.iter().flat_map(|app| app.pods.clone()).collect(),
            node_names: plan.cluster.node_names.clone(),
            shape,
            topo,
            wl,
        })
    }

    /// The shape of this model with the instances where `assign` has them (the controller's
    /// state after its own migrations).
    fn shape_with(&self, assign: &[Option<usize>]) -> Shape {
        let placed = self
            .wl
            .instances
            .iter()
            .zip(assign)
            .filter_map(|(inst, node)| {
                let id = &self.topo.nodes[(*node)?].id;
                Some((inst.id.clone(), self.node_names.get(id)?.clone()))
            })
            .collect();
        Shape {
            cluster: self.shape.cluster.clone(),
            apps: self.shape.apps.clone(),
            placed,
        }
    }
}

/// Kubernetes moves the endpoints itself: a re-created pod's EndpointSlice entry follows it,
/// and the control plane's watch of EndpointSlices serves that to the nodes.
struct EndpointSlicesFollow;

impl EndpointSink for EndpointSlicesFollow {
    fn publish(&mut self, _snapshot: &EndpointSnapshot) -> flatmesh_control::error::Result<()> {
        Ok(())
    }
}

async fn log_entries(
    mut entries: mpsc::UnboundedReceiver<LogEntry>,
    observer: Option<mpsc::UnboundedSender<LogEntry>>,
) {
    while let Some(entry) = entries.recv().await {
        entry.log("the pod is re-created on its new node");
        if let Some(observer) = &observer {
            let _ = observer.send(entry);
        }
    }
}
