//! The web console (`flatmesh control --ui HOST:PORT`, `flatmesh control demo --ui HOST:PORT`;
//! docs/console.md): a service graph built from live traffic, each route's tier, E3's placement
//! map with migrations on a timeline, node health and certificate expiry.
//!
//! A [`Console`] is the shared state its sources feed: the placement and the orchestrator's log
//! (the control center or the demo), heartbeats, and the node proxies' per-route windows (a
//! poller reading each node's `GET /stats/routes`, in the `flatmesh` binary, which owns the
//! admin client). [`Console::snapshot`] turns it into one bounded JSON document; [`server`]
//! serves it at `/ui/state` and once a second at `/ui/events`, with the page at `/ui`.
//!
//! Who called whom: a node proxy's route counters say which cluster (the callee) a request
//! went to, not which service sent it. The caller of an edge is therefore the callee's caller
//! in the application model ([`callers_of`]: the DAG of the placed applications, or the demo's
//! own call graph), and `ingress` for a service nothing calls. The rates, success rates and
//! latencies on the edges are live; the caller is the model's.

pub mod server;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use serde::Serialize;

use crate::endpoints::service_of;
use crate::orchestrator::{LogEntry, Signal};
use crate::workload::Workload;

/// Services drawn in the graph at most: the busiest, then by name.
pub const MAX_SERVICES: usize = 500;
/// Edges drawn at most: the busiest.
pub const MAX_EDGES: usize = 2000;
/// Route rows sent at most: the busiest.
pub const MAX_ROUTES: usize = 1000;
/// Instances in the placement map at most.
pub const MAX_INSTANCES: usize = 2000;
/// Nodes reported at most.
pub const MAX_NODES: usize = 512;
/// Timeline entries kept: the newest.
pub const MAX_TIMELINE: usize = 200;
/// A node whose last heartbeat is older than this is shown down.
pub const DOWN_AFTER: Duration = Duration::from_secs(2);
/// The caller of a service nothing in the model calls.
pub const INGRESS: &str = "ingress";

/// One route's traffic on one node over the last poll window (`flatmesh top`'s row).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouteWindow {
    pub node: String,
    pub listener: String,
    pub route: String,
    pub cluster: String,
    /// The tier the route runs in (`K`, `U4`, `U7`, ... from the node's `/rules`), `-` if unknown.
    pub tier: String,
    pub rps: f64,
    /// Share of answers that were not 5xx; `None` without requests.
    pub success: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// A node of the cluster.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeInfo {
    pub id: String,
    /// `host` or `smartnic`.
    pub kind: String,
    /// Where its admin endpoint is polled, if it is.
    pub admin: Option<String>,
}

/// Something the orchestrator did (or one step of it).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineEntry {
    pub at_unix_ms: u64,
    /// `detected`, `migrated`, `failed_over`, `not_migrated`, `step`, `error`.
    pub kind: String,
    pub text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

impl TimelineEntry {
    pub fn now(kind: &str, text: String) -> TimelineEntry {
        TimelineEntry {
            at_unix_ms: unix_ms(SystemTime::now()),
            kind: kind.into(),
            text,
            instance: None,
            from: None,
            to: None,
        }
    }
}

/// A certificate and when it expires.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Certificate {
    pub name: String,
    pub expires_unix: u64,
}

/// The console's shared state; clones share it.
#[derive(Clone, Default)]
pub struct Console {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    services: BTreeSet<String>,
    /// callee service -> caller service, from the model.
    callers: HashMap<String, String>,
    nodes: Vec<NodeInfo>,
    /// instance -> node.
    placement: BTreeMap<String, String>,
    heartbeats: HashMap<String, Instant>,
    /// node -> its latest route windows, or why it could not be read.
    routes: BTreeMap<String, Result<Vec<RouteWindow>, String>>,
    timeline: VecDeque<TimelineEntry>,
    certificates: Vec<Certificate>,
}

impl Console {
    /// The model: every service (`APP/STAGE`) and who calls it ([`callers_of`]).
    pub fn set_model(
        &self,
        services: impl IntoIterator<Item = String>,
        callers: HashMap<String, String>,
    ) {
        let mut inner = self.inner.lock();
        inner.services = services.into_iter().collect();
        inner.callers = callers;
    }

    pub fn set_nodes(&self, nodes: Vec<NodeInfo>) {
        self.inner.lock().nodes = nodes;
    }

    /// Where every instance runs now.
    pub fn set_placement(&self, placement: BTreeMap<String, String>) {
        self.inner.lock().placement = placement;
    }

    /// One instance moved (a migration, a failover).
    pub fn moved(&self, instance: &str, to: &str) {
        self.inner
            .lock()
            .placement
            .insert(instance.to_string(), to.to_string());
    }

    /// A heartbeat of `node` arrived at `at`.
    pub fn heartbeat(&self, node: &str, at: Instant) {
        self.inner.lock().heartbeats.insert(node.to_string(), at);
    }

    /// The latest window of `node`'s routes, or why its admin endpoint could not be read.
    pub fn set_routes(&self, node: &str, routes: Result<Vec<RouteWindow>, String>) {
        self.inner.lock().routes.insert(node.to_string(), routes);
    }

    pub fn push(&self, entry: TimelineEntry) {
        let mut inner = self.inner.lock();
        if inner.timeline.len() == MAX_TIMELINE {
            inner.timeline.pop_front();
        }
        inner.timeline.push_back(entry);
    }

    /// Puts an orchestrator log entry on the timeline and applies the moves it made. `node`
    /// and `instance` name the indices its signals and failovers carry.
    pub fn record(
        &self,
        entry: &LogEntry,
        node: &dyn Fn(usize) -> String,
        instance: &dyn Fn(usize) -> String,
    ) {
        let mut moves = Vec::new();
        let timeline = match entry {
            LogEntry::Detected(signal) => {
                let text = match signal {
                    Signal::Overload {
                        node: n,
                        slot,
                        exec_us,
                        ema_us,
                    } => format!(
                        "overload on {}: slot {slot} took {exec_us} µs, EMA {ema_us:.0} µs",
                        node(*n)
                    ),
                    Signal::HostStarvation {
                        node: n,
                        queue_len,
                        bw_util_pct,
                    } => format!(
                        "host starvation on {}: standing queue {queue_len}, links {bw_util_pct}% used",
                        node(*n)
                    ),
                    Signal::NodeDead { node: n } => format!("{} silent: dead", node(*n)),
                };
                TimelineEntry::now("detected", text)
            }
            LogEntry::Migrated {
                instance: i,
                from,
                to,
                ..
            } => {
                moves.push((i.clone(), to.clone()));
                TimelineEntry {
                    instance: Some(i.clone()),
                    from: Some(from.clone()),
                    to: Some(to.clone()),
                    ..TimelineEntry::now("migrated", format!("migrated {i}: {from} → {to}"))
                }
            }
            LogEntry::NotMigrated { node: n, reason } => {
                TimelineEntry::now("not_migrated", format!("not migrated off {n}: {reason}"))
            }
            LogEntry::FailedOver { node: n, moved, .. } => {
                moves.extend(moved.iter().map(|m| (instance(m.instance), node(m.to))));
                TimelineEntry {
                    from: Some(n.clone()),
                    ..TimelineEntry::now(
                        "failed_over",
                        format!("failed over {n}: {} instances re-placed", moved.len()),
                    )
                }
            }
            LogEntry::Error(e) => TimelineEntry::now("error", e.clone()),
        };
        for (i, to) in moves {
            self.moved(&i, &to);
        }
        self.push(timeline);
    }

    pub fn set_certificates(&self, certificates: Vec<Certificate>) {
        self.inner.lock().certificates = certificates;
    }

    /// Everything the page shows, bounded by the `MAX_*` limits.
    pub fn snapshot(&self) -> Snapshot {
        let inner = self.inner.lock();
        let now = Instant::now();
        let windows: Vec<&RouteWindow> = inner
            .routes
            .values()
            .filter_map(|r| r.as_ref().ok())
            .flatten()
            .collect();
        let graph = build_graph(&inner.services, &inner.callers, &windows);
        let mut routes: Vec<RouteRow> = windows
            .iter()
            .map(|w| RouteRow {
                service: service_of_cluster(&inner.services, &w.cluster),
                window: (*w).clone(),
            })
            .collect();
        let routes_total = routes.len();
        routes.sort_by(|a, b| {
            b.window
                .rps
                .total_cmp(&a.window.rps)
                .then_with(|| route_key(&a.window).cmp(&route_key(&b.window)))
        });
        routes.truncate(MAX_ROUTES);
        let nodes = inner
            .nodes
            .iter()
            .take(MAX_NODES)
            .map(|n| {
                let age = inner
                    .heartbeats
                    .get(&n.id)
                    .map(|at| now.saturating_duration_since(*at));
                NodeRow {
                    info: n.clone(),
                    up: age.is_some_and(|a| a <= DOWN_AFTER),
                    heartbeat_age_ms: age.map(|a| a.as_millis() as u64),
                    admin_error: match inner.routes.get(&n.id) {
                        Some(Err(e)) => Some(e.clone()),
                        _ => None,
                    },
                    instances: inner
                        .placement
                        .iter()
                        .filter(|(_, node)| **node == n.id)
                        .count(),
                }
            })
            .collect();
        let kind_of: HashMap<&str, &str> = inner
            .nodes
            .iter()
            .map(|n| (n.id.as_str(), n.kind.as_str()))
            .collect();
        let placement = inner
            .placement
            .iter()
            .take(MAX_INSTANCES)
            .map(|(instance, node)| PlacementRow {
                instance: instance.clone(),
                service: service_of(instance).to_string(),
                node: node.clone(),
                kind: kind_of.get(node.as_str()).unwrap_or(&"?").to_string(),
            })
            .collect();
        Snapshot {
            generated_unix_ms: unix_ms(SystemTime::now()),
            limits: Limits::default(),
            truncated: Truncated {
                services: graph.services_total.saturating_sub(graph.services.len()),
                edges: graph.edges_total.saturating_sub(graph.edges.len()),
                routes: routes_total.saturating_sub(MAX_ROUTES),
                instances: inner.placement.len().saturating_sub(MAX_INSTANCES),
                nodes: inner.nodes.len().saturating_sub(MAX_NODES),
            },
            services: graph.services,
            edges: graph.edges,
            routes,
            nodes,
            placement,
            timeline: inner.timeline.iter().cloned().collect(),
            certificates: inner.certificates.clone(),
        }
    }
}

fn route_key(w: &RouteWindow) -> (&str, &str, &str, &str) {
    (&w.node, &w.listener, &w.route, &w.cluster)
}

/// callee service -> its caller, from the placed applications' DAG (a stage's parent calls
/// it). A stage with several parents is shown called by the first.
pub fn callers_of(wl: &Workload) -> HashMap<String, String> {
    let mut callers = HashMap::new();
    for (parent, children) in wl.children.iter().enumerate() {
        let Some(caller) = wl.instances.get(parent) else {
            continue;
        };
        for &child in children {
            if let Some(callee) = wl.instances.get(child) {
                callers
                    .entry(service_of(&callee.id).to_string())
                    .or_insert_with(|| service_of(&caller.id).to_string());
            }
        }
    }
    callers
}

/// The service a cluster serves: a known service named like it (`APP/STAGE`, or `APP-STAGE`
/// as the demo's proxies name clusters), else the cluster's own name.
pub fn service_of_cluster(services: &BTreeSet<String>, cluster: &str) -> String {
    if services.contains(cluster) {
        return cluster.to_string();
    }
    if let Some((app, stage)) = cluster.split_once('-') {
        let slashed = format!("{app}/{stage}");
        if services.contains(&slashed) {
            return slashed;
        }
    }
    cluster.to_string()
}

/// The page's data.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub generated_unix_ms: u64,
    pub limits: Limits,
    /// What each list left out to stay within [`Limits`].
    pub truncated: Truncated,
    pub services: Vec<ServiceNode>,
    pub edges: Vec<Edge>,
    pub routes: Vec<RouteRow>,
    pub nodes: Vec<NodeRow>,
    pub placement: Vec<PlacementRow>,
    pub timeline: Vec<TimelineEntry>,
    pub certificates: Vec<Certificate>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub services: usize,
    pub edges: usize,
    pub routes: usize,
    pub instances: usize,
    pub nodes: usize,
    pub timeline: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            services: MAX_SERVICES,
            edges: MAX_EDGES,
            routes: MAX_ROUTES,
            instances: MAX_INSTANCES,
            nodes: MAX_NODES,
            timeline: MAX_TIMELINE,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Truncated {
    pub services: usize,
    pub edges: usize,
    pub routes: usize,
    pub instances: usize,
    pub nodes: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceNode {
    pub name: String,
    /// Requests/s into the service.
    pub rps_in: f64,
}

/// Calls from one service to another over the last window, summed over the nodes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub rps: f64,
    /// Share of answers that were not 5xx, weighted by each node's requests.
    pub success: Option<f64>,
    /// The highest of the nodes' p99s: an upper bound of the edge's p99 (the nodes' histograms
    /// are not merged).
    pub p99_ms: Option<f64>,
    /// The tiers of the routes that carried it.
    pub tiers: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RouteRow {
    pub service: String,
    #[serde(flatten)]
    pub window: RouteWindow,
}

#[derive(Debug, Clone, Serialize)]
pub struct NodeRow {
    #[serde(flatten)]
    pub info: NodeInfo,
    pub up: bool,
    pub heartbeat_age_ms: Option<u64>,
    pub admin_error: Option<String>,
    pub instances: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct PlacementRow {
    pub instance: String,
    pub service: String,
    pub node: String,
    pub kind: String,
}

struct Graph {
    services: Vec<ServiceNode>,
    services_total: usize,
    edges: Vec<Edge>,
    edges_total: usize,
}

/// Services and edges from the model and the route windows: O(routes + services log services).
fn build_graph(
    services: &BTreeSet<String>,
    callers: &HashMap<String, String>,
    windows: &[&RouteWindow],
) -> Graph {
    #[derive(Default)]
    struct Sum {
        rps: f64,
        ok_weighted: f64,
        answered_rps: f64,
        p99_ms: Option<f64>,
        tiers: BTreeSet<String>,
    }
    let mut sums: HashMap<(String, String), Sum> = HashMap::new();
    for w in windows {
        // Requests no route took (answered by the node itself) went to no service.
        if w.cluster.is_empty() {
            continue;
        }
        let to = service_of_cluster(services, &w.cluster);
        let from = callers
            .get(&to)
            .cloned()
            .unwrap_or_else(|| INGRESS.to_string());
        let sum = sums.entry((from, to)).or_default();
        sum.rps += w.rps;
        if let Some(s) = w.success {
            sum.ok_weighted += s * w.rps;
            sum.answered_rps += w.rps;
        }
        if let Some(p) = w.p99_ms {
            sum.p99_ms = Some(sum.p99_ms.map_or(p, |q: f64| q.max(p)));
        }
        if w.tier != "-" {
            sum.tiers.insert(w.tier.clone());
        }
    }
    // Every service of the model, those traffic reveals, and the callers.
    let mut rps_in: HashMap<String, f64> = services.iter().map(|s| (s.clone(), 0.0)).collect();
    for ((from, to), sum) in &sums {
        *rps_in.entry(to.clone()).or_default() += sum.rps;
        rps_in.entry(from.clone()).or_default();
    }
    if sums.keys().any(|(from, _)| from == INGRESS) || callers.values().any(|c| c == INGRESS) {
        rps_in.entry(INGRESS.to_string()).or_default();
    }
    let services_total = rps_in.len();
    let mut nodes: Vec<ServiceNode> = rps_in
        .into_iter()
        .map(|(name, rps_in)| ServiceNode { name, rps_in })
        .collect();
    nodes.sort_by(|a, b| {
        // Ingress first (it is where the graph starts), then the busiest.
        (b.name == INGRESS)
            .cmp(&(a.name == INGRESS))
            .then(b.rps_in.total_cmp(&a.rps_in))
            .then_with(|| a.name.cmp(&b.name))
    });
    nodes.truncate(MAX_SERVICES);
    let shown: BTreeSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    let edges_total = sums.len();
    let mut edges: Vec<Edge> = sums
        .into_iter()
        .filter(|((from, to), _)| shown.contains(from.as_str()) && shown.contains(to.as_str()))
        .map(|((from, to), sum)| Edge {
            from,
            to,
            rps: sum.rps,
            success: (sum.answered_rps > 0.0).then(|| sum.ok_weighted / sum.answered_rps),
            p99_ms: sum.p99_ms,
            tiers: sum.tiers.into_iter().collect(),
        })
        .collect();
    edges.sort_by(|a, b| {
        b.rps
            .total_cmp(&a.rps)
            .then_with(|| (&a.from, &a.to).cmp(&(&b.from, &b.to)))
    });
    edges.truncate(MAX_EDGES);
    Graph {
        services: nodes,
        services_total,
        edges,
        edges_total,
    }
}

pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn window(node: &str, cluster: &str, rps: f64, success: f64, p99: f64) -> RouteWindow {
        RouteWindow {
            node: node.into(),
            listener: "entrance".into(),
            route: cluster.into(),
            cluster: cluster.into(),
            tier: "U7".into(),
            rps,
            success: Some(success),
            p99_ms: Some(p99),
        }
    }

    #[test]
    fn edges_sum_the_nodes_and_take_the_callers_from_the_model() {
        let console = Console::default();
        console.set_model(
            ["gw/api".to_string(), "t/kvs".to_string()],
            HashMap::from([("t/kvs".to_string(), "gw/api".to_string())]),
        );
        console.set_routes(
            "n0",
            Ok(vec![
                window("n0", "gw-api", 30.0, 1.0, 2.0),
                window("n0", "t-kvs", 10.0, 1.0, 5.0),
            ]),
        );
        console.set_routes("n1", Ok(vec![window("n1", "t-kvs", 30.0, 0.9, 3.0)]));
        console.set_routes("n2", Err("connection refused".into()));
        let snap = console.snapshot();
        let names: Vec<&str> = snap.services.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["ingress", "t/kvs", "gw/api"]);
        let kvs = snap.edges.iter().find(|e| e.to == "t/kvs").unwrap();
        assert_eq!(kvs.from, "gw/api");
        assert!((kvs.rps - 40.0).abs() < 1e-9);
        // (10 x 1.0 + 30 x 0.9) / 40
        assert!((kvs.success.unwrap() - 0.925).abs() < 1e-9);
        assert_eq!(kvs.p99_ms, Some(5.0));
        assert_eq!(kvs.tiers, ["U7"]);
        let api = snap.edges.iter().find(|e| e.to == "gw/api").unwrap();
        assert_eq!(api.from, INGRESS);
        assert_eq!(snap.routes.len(), 3);
        assert_eq!(snap.routes[0].service, "gw/api");
    }

    #[test]
    fn a_500_service_mesh_stays_bounded_and_fast() {
        let console = Console::default();
        // 600 services in chains of 6, 4 nodes each carrying every route: 2400 windows.
        let services: Vec<String> = (0..600)
            .map(|i| format!("app{}/s{}", i / 6, i % 6))
            .collect();
        let callers: HashMap<String, String> = (0..600)
            .filter(|i| i % 6 != 0)
            .map(|i| (services[i].clone(), services[i - 1].clone()))
            .collect();
        console.set_model(services.clone(), callers);
        for n in 0..4 {
            let node = format!("node{n}");
            let windows = services
                .iter()
                .enumerate()
                .map(|(i, s)| window(&node, &s.replace('/', "-"), 1.0 + i as f64, 1.0, 1.0))
                .collect();
            console.set_routes(&node, Ok(windows));
        }
        let placement = (0..3000)
            .map(|i| {
                (
                    format!("app{}/s{}-{i}", i / 30, i % 6),
                    format!("node{}", i % 4),
                )
            })
            .collect();
        console.set_placement(placement);
        for i in 0..500 {
            console.push(TimelineEntry::now("step", format!("step {i}")));
        }
        let started = Instant::now();
        let snap = console.snapshot();
        let json = serde_json::to_string(&snap).unwrap();
        let took = started.elapsed();
        assert_eq!(snap.services.len(), MAX_SERVICES);
        // 600 services and ingress; the 101 quietest are left out and the page says so.
        assert_eq!(snap.truncated.services, 101);
        assert!(snap.edges.len() <= MAX_EDGES);
        assert!(snap
            .edges
            .iter()
            .all(|e| snap.services.iter().any(|s| s.name == e.from)
                && snap.services.iter().any(|s| s.name == e.to)));
        assert_eq!(snap.routes.len(), MAX_ROUTES);
        assert_eq!(snap.truncated.routes, 2400 - MAX_ROUTES);
        assert_eq!(snap.placement.len(), MAX_INSTANCES);
        assert_eq!(snap.truncated.instances, 1000);
        assert_eq!(snap.timeline.len(), MAX_TIMELINE);
        assert_eq!(snap.timeline.last().unwrap().text, "step 499");
        // One snapshot a second: it must cost far less than that (and stay well under 1 MiB).
        assert!(json.len() < 1 << 20, "{} bytes", json.len());
        assert!(took < Duration::from_millis(500), "{took:?}");
    }

    #[test]
    fn clusters_map_to_model_services() {
        let services: BTreeSet<String> = ["gateway/api".to_string()].into();
        assert_eq!(service_of_cluster(&services, "gateway-api"), "gateway/api");
        assert_eq!(service_of_cluster(&services, "gateway/api"), "gateway/api");
        assert_eq!(service_of_cluster(&services, "other"), "other");
    }
}
