//! `flatmesh control`: the control center serving xDS (docs/xds.md, docs/control.md).
//!
//! It serves a [`Feed`]: a state file in flatmesh's config model (listeners, routes, clusters;
//! watched, reloaded on change) and, with [`PlacementOptions`], the endpoints of the placed
//! instances ([`sink::XdsSink`], resolved through an [`addresses::Addresses`] file). With
//! [`OrchestratorOptions`] the E3 orchestrator runs too: overloaded SmartNICs shed their
//! hottest instance to a host and dead nodes fail over, and every move is an EDS push to the
//! nodes and Envoy.
//!
//! With `ui`, the web console ([`crate::console`]) shows the placement, the orchestrator's log,
//! the nodes' heartbeats and the certificates' expiry.
//!
//! [`ControlCenter::new`] reads and checks every input and binds the heartbeat socket, so a bad
//! input fails before anything serves; [`ControlCenter::run`] serves until its shutdown future
//! resolves. The binary only parses arguments and waits for SIGINT/SIGTERM.

pub mod addresses;
pub mod ca;
pub mod heartbeat_keys;
pub mod metrics;
pub mod sds;
pub mod sink;
pub mod step_command;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use flatmesh_xds::feed::Feed;
use flatmesh_xds::server::Store;

use crate::agent::{Gate, GateConfig, GateStats};
use crate::console::{callers_of, Certificate, Console, NodeInfo};
use crate::endpoints::service_of;
use crate::endpoints::{snapshot, EndpointSink as _};
use crate::error::{ControlError, Result};
use crate::model::{load_app, load_cluster};
use crate::orchestrator::{Controller, DetectorConfig, LogEntry};
use crate::placement::{place, Algorithm, State};
use crate::topology::NodeKind;
use crate::topology::Topology;
use crate::workload::Workload;
use addresses::Addresses;
use ca::{CaStats, NodeCa, NodeTokens, Placements};
use flatmesh_xds::certificates::CertificateServer;
use flatmesh_xds::secure::ServerTls;
use flatmesh_xds::server::ServeOptions;
use heartbeat_keys::HeartbeatKeys;
use sink::XdsSink;
use std::sync::Arc;
use step_command::StepCommand;

/// How often the state file is checked for changes.
const STATE_POLL: Duration = Duration::from_secs(1);

/// What to serve and where.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where to serve xDS (ADS over plaintext gRPC).
    pub listen: SocketAddr,
    /// The state file (a flatmesh config whose clusters may list no endpoints); without one the
    /// placement's clusters alone are served.
    pub state: Option<PathBuf>,
    pub placement: Option<PlacementOptions>,
    /// Be the nodes' CA, and protect the channel: TLS, bootstrap tokens.
    pub ca: Option<CaOptions>,
    /// Serve Prometheus text on `GET /metrics` here ([`metrics`]).
    pub metrics: Option<SocketAddr>,
    /// Serve the web console here ([`crate::console`]).
    pub ui: Option<SocketAddr>,
}

/// `flatmesh control --ca-dir DIR --node-tokens FILE`.
#[derive(Debug, Clone)]
pub struct CaOptions {
    /// The CA directory of `flatmesh ca init`.
    pub dir: PathBuf,
    /// Each node's bootstrap token (its SHA-256) and outright grants ([`ca::NodeTokens`]).
    pub node_tokens: PathBuf,
    /// The longest lifetime of a node's certificate (nodes may ask for less).
    pub ttl: Duration,
}

/// Place applications on a cluster and serve each placed service `APP/STAGE` as the EDS
/// cluster of that name.
#[derive(Debug, Clone)]
pub struct PlacementOptions {
    /// The cluster: a YAML file or `preset:NAME`, as in `flatmesh place`.
    pub cluster: String,
    /// The applications, each a YAML file or `preset:NAME`.
    pub apps: Vec<String>,
    pub algorithm: Algorithm,
    /// Seed for annealing.
    pub seed: u64,
    /// Where placed instances serve (see [`Addresses`]).
    pub addresses: PathBuf,
    pub orchestrator: Option<OrchestratorOptions>,
}

/// Run the orchestrator on node heartbeats.
#[derive(Debug, Clone)]
pub struct OrchestratorOptions {
    /// The UDP address the node heartbeats arrive on.
    pub heartbeats: SocketAddr,
    /// Each node's heartbeat key ([`HeartbeatKeys`]); a heartbeat must be sealed with its node's
    /// key and come from the node's address in the addresses file.
    pub heartbeat_keys: PathBuf,
    /// The program run for each migration step ([`StepCommand`]); `None` only logs the steps.
    pub step_command: Option<PathBuf>,
}

/// A control center ready to serve.
pub struct ControlCenter {
    listen: SocketAddr,
    feed: Feed,
    state: Option<StateFile>,
    placed: Option<Placed>,
    ca: Option<Arc<NodeCa>>,
    placements: Placements,
    /// The identities of each node's Kubernetes pods, for the CA ([`ControlCenter::pod_identities`]).
    pods: Placements,
    /// The bound `/metrics` socket.
    metrics: Option<std::net::TcpListener>,
    placement_stats: Arc<metrics::PlacementStats>,
    /// The bound console socket and what it shows.
    ui: Option<(std::net::TcpListener, Console)>,
    /// Where the nodes' load reports go, when something reads them ([`ControlCenter::read_load_reports`]).
    load_reports: Option<flatmesh_xds::lrs::LoadReportServer>,
}

/// The state file and when it was last read.
struct StateFile {
    path: PathBuf,
    loaded: Option<SystemTime>,
}

impl ControlCenter {
    /// Reads and validates the state file, places the applications, checks the addresses file
    /// against them and binds the heartbeat socket.
    pub fn new(options: &Options) -> Result<ControlCenter> {
        let (config, state) = match &options.state {
            Some(path) => {
                let loaded = modified(path);
                (
                    load_state(path)?,
                    Some(StateFile {
                        path: path.clone(),
                        loaded,
                    }),
                )
            }
            None => (flatmesh_xds::bootstrap::empty_config(), None),
        };
        let placed = options.placement.as_ref().map(Placed::new).transpose()?;
        let placements = Placements::default();
        let pods = Placements::default();
        let ca = options
            .ca
            .as_ref()
            .map(|o| {
                let tokens = NodeTokens::load(&o.node_tokens)?;
                if let Some(placed) = &placed {
                    let origin = o.node_tokens.display().to_string();
                    if let Some(stranger) = tokens
                        .nodes()
                        .find(|n| !placed.topo.nodes.iter().any(|t| &t.id == *n))
                    {
                        tracing::warn!(node = %stranger, file = %origin, "node tokens file names a node the cluster does not have; it can only get the identities granted to it there");
                    }
                }
                NodeCa::new(&o.dir, Arc::new(tokens), placements.clone(), o.ttl)
                    .map(|ca| {
                        Arc::new(
                            ca.with_tokens_file(&o.node_tokens)
                                .with_pod_identities(pods.clone()),
                        )
                    })
            })
            .transpose()?;
        let metrics = options
            .metrics
            .map(|at| {
                let io = |source| ControlError::Io {
                    what: format!(
                        "cannot serve metrics on {at}; pick a free address with --metrics"
                    ),
                    source,
                };
                let listener = std::net::TcpListener::bind(at).map_err(io)?;
                listener.set_nonblocking(true).map_err(io)?;
                Ok::<_, ControlError>(listener)
            })
            .transpose()?;
        let ui = options
            .ui
            .map(|at| {
                let io = |source| ControlError::Io {
                    what: format!(
                        "cannot serve the console on {at}; pick a free address with --ui"
                    ),
                    source,
                };
                let listener = std::net::TcpListener::bind(at).map_err(io)?;
                listener.set_nonblocking(true).map_err(io)?;
                Ok::<_, ControlError>((listener, Console::default()))
            })
            .transpose()?;
        Ok(ControlCenter {
            ui,
            listen: options.listen,
            feed: Feed::new(Store::new(), config),
            state,
            placed,
            ca,
            placements,
            pods,
            metrics,
            placement_stats: Arc::default(),
            load_reports: None,
        })
    }

    /// Serves LRS beside ADS: the nodes report their endpoints' load every `period`, and each
    /// report is sent to the returned receiver (Kubernetes' orchestrator reads it). Reports
    /// are dropped while the receiver lags behind by more than a few.
    pub fn read_load_reports(
        &mut self,
        period: Duration,
    ) -> tokio::sync::mpsc::Receiver<flatmesh_xds::lrs::NodeLoad> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        self.load_reports = Some(flatmesh_xds::lrs::LoadReportServer::new(period, tx));
        rx
    }

    /// What is served. A clone follows every later change (state file, placement, moves).
    pub fn feed(&self) -> &Feed {
        &self.feed
    }

    /// Where the orchestrator receives heartbeats, if it runs.
    pub fn heartbeats_addr(&self) -> Option<SocketAddr> {
        let socket = &self.placed.as_ref()?.heartbeats.as_ref()?.socket;
        socket.local_addr().ok()
    }

    /// What the heartbeat receiver took and dropped, if the orchestrator runs.
    pub fn heartbeat_stats(&self) -> Option<std::sync::Arc<GateStats>> {
        Some(self.placed.as_ref()?.heartbeats.as_ref()?.gate.stats())
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref()?.local_addr().ok()
    }

    /// Where the console is served, if it is.
    pub fn ui_addr(&self) -> Option<SocketAddr> {
        self.ui.as_ref()?.0.local_addr().ok()
    }

    /// What the console shows, if it is served: the binary adds the nodes' live traffic.
    pub fn console(&self) -> Option<Console> {
        Some(self.ui.as_ref()?.1.clone())
    }

    /// Every node of the placed cluster with its IP from the addresses file.
    pub fn node_addresses(&self) -> Vec<(String, std::net::IpAddr)> {
        let Some(placed) = &self.placed else {
            return Vec::new();
        };
        placed
            .topo
            .nodes
            .iter()
            .filter_map(|n| Some((n.id.clone(), *placed.addresses.nodes.get(&n.id)?)))
            .collect()
    }

    /// Where the identities of each node's Kubernetes pods go (`flatmesh control --kubeconfig`
    /// replaces them on every translation): with a CA, a node may then hold, and is given over
    /// SDS, the identities of the pods scheduled on it, and loses one as soon as its pod moves
    /// or is deleted.
    pub fn pod_identities(&self) -> Placements {
        self.pods.clone()
    }

    /// The CA's trust domain, when the control center is a CA.
    pub fn trust_domain(&self) -> Option<String> {
        Some(self.ca.as_ref()?.trust_domain())
    }

    /// What the CA has issued and refused, when the control center is one.
    pub fn ca_stats(&self) -> Option<Arc<CaStats>> {
        Some(self.ca.as_ref()?.stats.clone())
    }

    /// Serves xDS (and runs the orchestrator) until `shutdown` resolves or either fails. `bound`
    /// receives the xDS address once the server listens.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send,
        bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
    ) -> Result<()> {
        let watcher = self
            .state
            .map(|state| tokio::spawn(watch(state, self.feed.clone())));
        let mut serve_options = ServeOptions::default();
        let mut fresh = None;
        let mut renewals = None;
        if let Some(ca) = &self.ca {
            let (config, renew_at) = ca.control_tls()?;
            let tls = ServerTls::new(config);
            fresh = Some(tokio::spawn(ca::keep_fresh(
                ca.clone(),
                tls.clone(),
                renew_at,
            )));
            let secrets = sds::NodeSecrets::new(ca.clone());
            renewals = Some(tokio::spawn(secrets.clone().keep_current()));
            serve_options = ServeOptions {
                tls: Some(tls),
                tokens: Some(ca.clone()),
                certificates: Some(CertificateServer::new(ca.clone())),
                secrets: Some(secrets),
                load_reports: None,
            };
        }
        serve_options.load_reports = self.load_reports.clone();
        let server = flatmesh_xds::server::serve_with(
            self.listen,
            self.feed.store().clone(),
            serve_options,
            bound,
            shutdown,
        );
        let scrapes = match self.metrics {
            Some(listener) => {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(|source| {
                    ControlError::Io {
                        what: "cannot use the metrics socket".into(),
                        source,
                    }
                })?;
                let sources = metrics::Sources {
                    ca: self.ca.clone(),
                    streams: self.feed.store().stream_stats(),
                    placement: self.placement_stats.clone(),
                };
                Some(tokio::spawn(metrics::serve(listener, sources)))
            }
            None => None,
        };
        let (console, console_tasks) = match self.ui {
            Some((listener, console)) => {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(|source| {
                    ControlError::Io {
                        what: "cannot use the console socket".into(),
                        source,
                    }
                })?;
                let server = tokio::spawn(crate::console::server::serve(listener, console.clone()));
                let expiries = self.ca.clone().map(|ca| {
                    let console = console.clone();
                    tokio::spawn(async move {
                        let mut tick = tokio::time::interval(CERTIFICATE_POLL);
                        loop {
                            tick.tick().await;
                            console.set_certificates(certificates(&ca));
                        }
                    })
                });
                (Some(console), [Some(server), expiries])
            }
            None => (None, [None, None]),
        };
        let grants = self
            .ca
            .as_ref()
            .map(|ca| (ca.trust_domain(), self.placements.clone()));
        let result = match self.placed {
            Some(placed) => {
                placed
                    .run(
                        self.feed.clone(),
                        grants,
                        server,
                        self.placement_stats,
                        console,
                    )
                    .await
            }
            None => server.await.map_err(ControlError::from),
        };
        for task in [watcher, fresh, renewals, scrapes]
            .into_iter()
            .chain(console_tasks)
            .flatten()
        {
            task.abort();
        }
        result
    }
}

/// How often the console re-reads the certificates' expiry (they change when renewed).
const CERTIFICATE_POLL: Duration = Duration::from_secs(10);

/// The certificates the console lists: the CA's root and the control channel's own.
fn certificates(ca: &NodeCa) -> Vec<Certificate> {
    let (root, control) = ca.expiries();
    let unix = metrics::unix_seconds;
    let mut list = vec![Certificate {
        name: "signing root".into(),
        expires_unix: unix(root),
    }];
    if let Some(control) = control {
        list.push(Certificate {
            name: "control center (xDS TLS)".into(),
            expires_unix: unix(control),
        });
    }
    list
}

/// Serves every change of the state file (checked each [`STATE_POLL`]); a file that does not
/// validate is logged and the previous state stays.
async fn watch(mut state: StateFile, feed: Feed) {
    let mut tick = tokio::time::interval(STATE_POLL);
    loop {
        tick.tick().await;
        let now = modified(&state.path);
        if now == state.loaded {
            continue;
        }
        state.loaded = now;
        match load_state(&state.path) {
            Ok(config) => feed.set_config(config),
            Err(e) => {
                tracing::error!(error = %e, "state file refused; still serving the previous state")
            }
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Reads and validates the state file.
fn load_state(path: &Path) -> Result<flatmesh_config::Config> {
    let config = flatmesh_xds::load_base(path)?;
    tracing::info!(
        state = %path.display(),
        listeners = config.listeners.len(),
        clusters = config.clusters.len(),
        "serving state"
    );
    Ok(config)
}

/// The placed applications: the cluster and workload models, where the algorithm put every
/// instance, where each instance serves, and the orchestrator's inputs if it runs.
struct Placed {
    topo: Topology,
    wl: Workload,
    assign: Vec<usize>,
    addresses: Addresses,
    heartbeats: Option<HeartbeatInput>,
    step_command: Option<PathBuf>,
}

/// The bound heartbeat socket and the gate its datagrams pass.
struct HeartbeatInput {
    socket: std::net::UdpSocket,
    gate: Gate,
}

impl Placed {
    fn new(options: &PlacementOptions) -> Result<Placed> {
        let topo = Topology::build(&load_cluster(&options.cluster)?)?;
        let apps = options
            .apps
            .iter()
            .map(|a| load_app(a))
            .collect::<Result<Vec<_>>>()?;
        let wl = Workload::from_apps(&apps)?;
        let addresses = Addresses::load(&options.addresses)?;
        addresses.check(&topo, &wl, &options.addresses.display().to_string())?;
        let p = place(&topo, &wl, options.algorithm, options.seed)?;
        tracing::info!(
            cluster = %topo.name,
            instances = wl.instances.len(),
            algorithm = options.algorithm.name(),
            "placed"
        );
        let heartbeats = options
            .orchestrator
            .as_ref()
            .map(|o| {
                let at = o.heartbeats;
                let io = |source| ControlError::Io {
                    what: format!(
                        "cannot receive heartbeats on {at}; pick a free address with --heartbeats"
                    ),
                    source,
                };
                let keys = HeartbeatKeys::load(&o.heartbeat_keys)?;
                keys.check(&topo, &o.heartbeat_keys.display().to_string())?;
                let gate = keys.gate(&topo, &addresses, GateConfig::default());
                let socket = std::net::UdpSocket::bind(at).map_err(io)?;
                socket.set_nonblocking(true).map_err(io)?;
                Ok::<_, ControlError>(HeartbeatInput { socket, gate })
            })
            .transpose()?;
        Ok(Placed {
            topo,
            wl,
            assign: p.assign,
            addresses,
            heartbeats,
            step_command: options
                .orchestrator
                .as_ref()
                .and_then(|o| o.step_command.clone()),
        })
    }

    /// Publishes the placement's endpoints and serves; with heartbeats, runs the orchestrator
    /// alongside the server until either stops.
    async fn run(
        self,
        feed: Feed,
        grants: Option<(String, Placements)>,
        server: impl std::future::Future<Output = flatmesh_xds::Result<()>>,
        stats: Arc<metrics::PlacementStats>,
        console: Option<Console>,
    ) -> Result<()> {
        let mut state = State::new(&self.topo, &self.wl);
        for (i, &n) in self.assign.iter().enumerate() {
            state.place(i, n);
        }
        let node_ids: Vec<String> = self.topo.nodes.iter().map(|n| n.id.clone()).collect();
        let instance_ids: Vec<String> = self.wl.instances.iter().map(|i| i.id.clone()).collect();
        if let Some(console) = &console {
            console.set_model(
                instance_ids.iter().map(|i| service_of(i).to_string()),
                callers_of(&self.wl),
            );
            console.set_nodes(
                self.topo
                    .nodes
                    .iter()
                    .map(|n| NodeInfo {
                        id: n.id.clone(),
                        kind: match n.kind {
                            NodeKind::Smartnic => "smartnic",
                            NodeKind::Host => "host",
                        }
                        .into(),
                        admin: None,
                    })
                    .collect(),
            );
            console.set_placement(
                state
                    .assign
                    .iter()
                    .enumerate()
                    .filter_map(|(i, n)| {
                        Some((instance_ids[i].clone(), node_ids.get((*n)?)?.clone()))
                    })
                    .collect(),
            );
        }
        stats.placed_instances.store(
            state.assign.iter().filter(|a| a.is_some()).count() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        for (i, inst) in self.wl.instances.iter().enumerate() {
            if let Some(n) = state.assign[i] {
                tracing::info!(instance = %inst.id, node = %self.topo.nodes[n].id, "placement");
            }
        }
        let mut sink = XdsSink {
            feed,
            addresses: self.addresses.clone(),
            grants,
        };
        let Some(HeartbeatInput { socket, gate }) = self.heartbeats else {
            sink.publish(&snapshot(&state, 1))?;
            return server.await.map_err(ControlError::from);
        };
        let socket =
            tokio::net::UdpSocket::from_std(socket).map_err(|source| ControlError::Io {
                what: "cannot use the heartbeat socket".into(),
                source,
            })?;
        tracing::info!(address = ?socket.local_addr().ok(), nodes = self.topo.nodes.len(), "orchestrator: receiving heartbeats (node index = position in `flatmesh place --json` nodes)");
        let runtime = StepCommand {
            program: self.step_command.clone(),
        };
        let mut controller = Controller::new(state, DetectorConfig::default(), runtime, sink)?;
        let (log_tx, mut log_rx) = tokio::sync::mpsc::unbounded_channel();
        controller.observer = Some(log_tx);
        let console_log = console.clone();
        let names = (node_ids.clone(), instance_ids);
        tokio::spawn(async move {
            while let Some(entry) = log_rx.recv().await {
                entry.log("endpoints pushed over EDS");
                if let Some(console) = &console_log {
                    let name = |list: &[String], i: usize| {
                        list.get(i).cloned().unwrap_or_else(|| i.to_string())
                    };
                    console.record(&entry, &|n| name(&names.0, n), &|i| name(&names.1, i));
                }
                let counter = match &entry {
                    LogEntry::Migrated { .. } => Some(&stats.migrations),
                    LogEntry::FailedOver { .. } => Some(&stats.failovers),
                    LogEntry::NotMigrated { .. } => Some(&stats.not_migrated),
                    _ => None,
                };
                if let Some(counter) = counter {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        let (beats_tx, beats_rx) = tokio::sync::mpsc::channel(1024);
        // With the console, each admitted heartbeat also marks its node alive there.
        let (admitted_tx, mut admitted_rx) =
            tokio::sync::mpsc::channel::<crate::heartbeat::Heartbeat>(1024);
        let tee = tokio::spawn(async move {
            while let Some(beat) = admitted_rx.recv().await {
                if let Some(console) = &console {
                    if let Some(id) = node_ids.get(beat.node as usize) {
                        console.heartbeat(id, std::time::Instant::now());
                    }
                }
                if beats_tx.send(beat).await.is_err() {
                    return;
                }
            }
        });
        let receiver = tokio::spawn(async move {
            if let Err(e) = crate::agent::receive(&socket, gate, admitted_tx).await {
                tracing::error!(error = %e, "heartbeat socket failed; the orchestrator stops");
            }
        });
        let result = tokio::select! {
            result = server => result.map_err(ControlError::from),
            result = controller.run(beats_rx) => result,
        };
        receiver.abort();
        tee.abort();
        result
    }
}
