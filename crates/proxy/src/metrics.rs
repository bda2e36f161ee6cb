//! Telemetry counters that never sit on the request path's critical section.
//!
//! FlatProxy found Envoy's serial statistics to be a bottleneck. Here every counter has one
//! cache-line-padded slot per worker; a worker only ever writes its own slot (a plain load +
//! store, no locked instruction), and the slots are summed only when `/metrics` is scraped.
//! Counter families are keyed by their label set in a registry that outlives config
//! snapshots, so totals survive a reload.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flatmesh_rules::Tier;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Upper bounds (seconds) of the request duration histogram buckets.
pub const DURATION_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];
const BUCKETS: usize = DURATION_BUCKETS.len() + 1; // + the +Inf bucket

#[repr(align(64))]
#[derive(Default)]
struct Padded<T>(T);

/// A counter with one slot per worker. Only worker `w` writes slot `w`.
pub struct WorkerCounter {
    slots: Box<[Padded<AtomicU64>]>,
}

impl WorkerCounter {
    pub fn new(workers: usize) -> Self {
        WorkerCounter {
            slots: (0..workers.max(1)).map(|_| Padded::default()).collect(),
        }
    }

    /// Add `n` to worker `worker`'s slot. Single writer per slot, so load + store is
    /// exact and avoids a locked read-modify-write on the hot path.
    #[inline]
    pub fn add(&self, worker: usize, n: u64) {
        if let Some(slot) = self.slots.get(worker) {
            let v = slot.0.load(Ordering::Relaxed);
            slot.0.store(v.wrapping_add(n), Ordering::Relaxed);
        }
    }

    /// Like `add`, for counters that several threads may touch (admin, reload).
    pub fn add_shared(&self, worker: usize, n: u64) {
        if let Some(slot) = self.slots.get(worker) {
            slot.0.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn sum(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// Per-worker block of request counters for one (listener, route, cluster).
#[derive(Default)]
struct RequestSlot {
    by_class: [AtomicU64; 5],
    buckets: [AtomicU64; BUCKETS],
    duration_micros: AtomicU64,
}

/// Requests of one (listener, route, cluster): status classes and a duration histogram.
pub struct RequestStats {
    slots: Box<[Padded<RequestSlot>]>,
}

impl RequestStats {
    fn new(workers: usize) -> Self {
        RequestStats {
            slots: (0..workers.max(1)).map(|_| Padded::default()).collect(),
        }
    }

    #[inline]
    pub fn record(&self, worker: usize, status: u16, elapsed: Duration) {
        let Some(slot) = self.slots.get(worker) else {
            return;
        };
        let slot = &slot.0;
        let class = usize::from((status / 100).clamp(1, 5)) - 1;
        bump(&slot.by_class[class], 1);
        let secs = elapsed.as_secs_f64();
        let bucket = DURATION_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS - 1);
        bump(&slot.buckets[bucket], 1);
        bump(&slot.duration_micros, elapsed.as_micros() as u64);
    }

    fn class_totals(&self) -> [u64; 5] {
        let mut out = [0u64; 5];
        for slot in self.slots.iter() {
            for (o, c) in out.iter_mut().zip(&slot.0.by_class) {
                *o += c.load(Ordering::Relaxed);
            }
        }
        out
    }

    fn histogram(&self) -> ([u64; BUCKETS], u64) {
        let mut buckets = [0u64; BUCKETS];
        let mut micros = 0;
        for slot in self.slots.iter() {
            for (o, c) in buckets.iter_mut().zip(&slot.0.buckets) {
                *o += c.load(Ordering::Relaxed);
            }
            micros += slot.0.duration_micros.load(Ordering::Relaxed);
        }
        (buckets, micros)
    }
}

/// The counters of `map` that have counted anything, with their totals, sorted by key: the
/// rows of a labelled counter family whose label set is the map's keys.
fn nonzero_sorted<K: Clone + Ord>(map: &Mutex<HashMap<K, Arc<WorkerCounter>>>) -> Vec<(K, u64)> {
    let mut rows: Vec<_> = map
        .lock()
        .iter()
        .map(|(k, v)| (k.clone(), v.sum()))
        .filter(|(_, n)| *n > 0)
        .collect();
    rows.sort();
    rows
}

#[inline]
fn bump(cell: &AtomicU64, n: u64) {
    // Single writer per worker slot: see WorkerCounter::add.
    cell.store(
        cell.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// Counters of one listener.
pub struct ListenerStats {
    pub connections_opened: WorkerCounter,
    pub connections_closed: WorkerCounter,
    /// TCP listeners: bytes client → upstream.
    pub bytes_in: WorkerCounter,
    /// TCP listeners: bytes upstream → client.
    pub bytes_out: WorkerCounter,
    /// Connections whose bytes tier K moves (tcp splice, or an http connection whose first
    /// request the kernel decided). Their bytes are counted by `flatmesh kernel status`.
    pub kernel_spliced: WorkerCounter,
    /// TLS listeners: handshakes with clients.
    pub tls: TlsCounts,
    /// hbone listeners: CONNECT streams relayed, and refused by reason.
    pub hbone: StreamCounts,
    /// qnp listeners: requests dispatched and packets dropped (created by the first
    /// snapshot that has the listener as a qnp listener).
    pub qnp: std::sync::OnceLock<QnpCounts>,
}

/// Why a qnp listener dropped a packet: the `reason` label of
/// `flatmesh_qnp_packets_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QnpDrop {
    /// Not a QNP packet (shorter than the header).
    Malformed = 0,
    /// No rule and no default for its app and type, or a follow-on packet whose first
    /// packet this socket did not see.
    NoRule,
    /// Its queue names no worker of the config in force (a reload removed it).
    NoWorker,
    /// It would open one more client session than `qnp.max_sessions`.
    SessionsFull,
    /// Sending it to the worker failed (the worker's socket is closed, say).
    SendFailed,
}

impl QnpDrop {
    const ALL: [QnpDrop; 5] = [
        QnpDrop::Malformed,
        QnpDrop::NoRule,
        QnpDrop::NoWorker,
        QnpDrop::SessionsFull,
        QnpDrop::SendFailed,
    ];

    fn label(self) -> &'static str {
        match self {
            QnpDrop::Malformed => "malformed",
            QnpDrop::NoRule => "no_rule",
            QnpDrop::NoWorker => "no_worker",
            QnpDrop::SessionsFull => "sessions_full",
            QnpDrop::SendFailed => "send_failed",
        }
    }
}

/// A qnp listener's counters. The worker label is bounded by
/// `flatmesh_config::QNP_MAX_WORKERS`, the tier label by two values.
pub struct QnpCounts {
    /// Requests (first packets) sent to each worker: user-space decisions, then the
    /// kernel's, `QNP_MAX_WORKERS` each.
    requests: Box<[WorkerCounter]>,
    dropped: [WorkerCounter; 5],
    /// Client sessions opened towards the workers.
    pub sessions: WorkerCounter,
}

impl QnpCounts {
    fn new(workers: usize) -> QnpCounts {
        QnpCounts {
            requests: (0..2 * flatmesh_config::QNP_MAX_WORKERS)
                .map(|_| WorkerCounter::new(workers))
                .collect(),
            dropped: std::array::from_fn(|_| WorkerCounter::new(workers)),
            sessions: WorkerCounter::new(workers),
        }
    }

    /// Counts a request that `worker` (a thread of the node) sent to queue `queue`, decided in
    /// the kernel or in user space.
    #[inline]
    pub fn request(&self, worker: usize, queue: u8, kernel: bool) {
        let i = usize::from(kernel) * flatmesh_config::QNP_MAX_WORKERS + usize::from(queue);
        if let Some(c) = self.requests.get(i) {
            c.add(worker, 1);
        }
    }

    #[inline]
    pub fn dropped(&self, worker: usize, why: QnpDrop) {
        self.dropped[why as usize].add(worker, 1);
    }

    /// Requests sent so far, per (queue, tier), for tests and `/metrics`.
    pub fn requests(&self) -> Vec<(u8, &'static str, u64)> {
        let per = flatmesh_config::QNP_MAX_WORKERS;
        self.requests
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    (i % per) as u8,
                    if i < per { "user" } else { "kernel" },
                    c.sum(),
                )
            })
            .filter(|(_, _, n)| *n > 0)
            .collect()
    }
}

/// HBONE CONNECT streams on one side, a listener's (tunnels in) or a cluster's (tunnels
/// out): opened, and refused by reason (a short bounded label).
pub struct StreamCounts {
    pub opened: WorkerCounter,
    refused: Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl StreamCounts {
    fn new(workers: usize) -> StreamCounts {
        StreamCounts {
            opened: WorkerCounter::new(workers),
            refused: Mutex::default(),
        }
    }

    pub fn refused(&self, reason: &'static str) {
        *self.refused.lock().entry(reason).or_default() += 1;
    }
}

/// The two stream families of one side: `{prefix}streams` and `{prefix}streams_refused`.
fn stream_families<'a>(
    enc: &mut DescriptorEncoder,
    prefix: &str,
    label: &str,
    rows: impl Iterator<Item = (&'a str, &'a StreamCounts)> + Clone,
) -> Result<(), std::fmt::Error> {
    let opened: Vec<_> = rows
        .clone()
        .map(|(n, s)| ([(label, n)], s.opened.sum()))
        .filter(|(_, v)| *v > 0)
        .collect();
    counter(
        enc,
        &format!("{prefix}streams"),
        "HBONE CONNECT streams opened",
        &opened,
    )?;
    let mut refused = Vec::new();
    for (n, s) in rows {
        for (reason, v) in s.refused.lock().iter() {
            refused.push(([(label, n), ("reason", *reason)], *v));
        }
    }
    counter(
        enc,
        &format!("{prefix}streams_refused"),
        "HBONE CONNECT streams refused, by reason",
        &refused,
    )
}

/// Counters of one cluster.
pub struct ClusterStats {
    pub connections: WorkerCounter,
    pub connect_failures: WorkerCounter,
    pub retries: WorkerCounter,
    /// Retries the policy asked for and the cluster's retry budget refused.
    pub retries_over_budget: WorkerCounter,
    /// Tries cut short by the route's `retries.per_try_timeout`.
    pub per_try_timeouts: WorkerCounter,
    /// TLS clusters: handshakes with endpoints.
    pub tls: TlsCounts,
    /// Tunnel clusters: CONNECT streams opened to the peers, and refused by reason.
    pub tunnel: StreamCounts,
}

/// TLS handshakes on one side, a listener's or a cluster's: finished, and failed by reason
/// (a short bounded label, `crate::tls::HandshakeError::reason`).
pub struct TlsCounts {
    pub handshakes: WorkerCounter,
    failures: Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl TlsCounts {
    fn new(workers: usize) -> TlsCounts {
        TlsCounts {
            handshakes: WorkerCounter::new(workers),
            failures: Mutex::default(),
        }
    }

    pub fn failed(&self, reason: &'static str) {
        *self.failures.lock().entry(reason).or_default() += 1;
    }

    fn failures(&self) -> Vec<(&'static str, u64)> {
        self.failures.lock().iter().map(|(r, n)| (*r, *n)).collect()
    }
}

/// The two TLS families of one side: `{prefix}handshakes` and `{prefix}handshake_failures`.
fn tls_families<'a>(
    enc: &mut DescriptorEncoder,
    prefix: &str,
    side: &str,
    label: &str,
    rows: impl Iterator<Item = (&'a str, &'a TlsCounts)> + Clone,
) -> Result<(), std::fmt::Error> {
    let done: Vec<_> = rows
        .clone()
        .map(|(n, t)| ([(label, n)], t.handshakes.sum()))
        .filter(|(_, v)| *v > 0)
        .collect();
    counter(
        enc,
        &format!("{prefix}handshakes"),
        &format!("TLS handshakes finished with {side}"),
        &done,
    )?;
    let mut failed = Vec::new();
    for (n, t) in rows {
        for (reason, v) in t.failures() {
            failed.push(([(label, n), ("reason", reason)], v));
        }
    }
    counter(
        enc,
        &format!("{prefix}handshake_failures"),
        &format!("TLS handshakes with {side} that failed, by reason"),
        &failed,
    )
}

/// The qnp listeners' families: requests per worker and tier, drops per reason, sessions.
fn qnp_families(
    enc: &mut DescriptorEncoder,
    listeners: &[(String, Arc<ListenerStats>)],
) -> Result<(), std::fmt::Error> {
    let qnp: Vec<(&str, &QnpCounts)> = listeners
        .iter()
        .filter_map(|(n, s)| Some((n.as_str(), s.qnp.get()?)))
        .collect();
    let mut requests = Vec::new();
    for (n, q) in &qnp {
        for (queue, tier, v) in q.requests() {
            requests.push((
                [
                    ("listener", (*n).to_owned()),
                    ("worker", queue.to_string()),
                    ("tier", tier.to_owned()),
                ],
                v,
            ));
        }
    }
    counter(
        enc,
        "flatmesh_qnp_requests",
        "QNP requests a qnp listener sent to each of its workers (by index), by the tier that decided",
        &requests,
    )?;
    let mut dropped = Vec::new();
    for (n, q) in &qnp {
        for why in QnpDrop::ALL {
            let v = q.dropped[why as usize].sum();
            if v > 0 {
                dropped.push(([("listener", *n), ("reason", why.label())], v));
            }
        }
    }
    counter(
        enc,
        "flatmesh_qnp_packets_dropped",
        "Packets a qnp listener dropped in user space, by reason (the kernel dispatcher's drops are not counted)",
        &dropped,
    )?;
    let sessions: Vec<_> = qnp
        .iter()
        .map(|(n, q)| ([("listener", *n)], q.sessions.sum()))
        .filter(|(_, v)| *v > 0)
        .collect();
    counter(
        enc,
        "flatmesh_qnp_sessions",
        "Client sessions a qnp listener opened towards its workers",
        &sessions,
    )
}

/// Clients the admin endpoint turned away, by reason.
pub struct AdminRefused {
    /// The `Host` header named something else (DNS rebinding).
    pub host: WorkerCounter,
    /// The token was needed and missing or wrong.
    pub token: WorkerCounter,
    /// `admin.max_connections` were open already.
    pub busy: WorkerCounter,
}

type RequestKey = (String, String, String);

/// Where each http route runs on the node now, by (listener, route): the `tier` label of the
/// request families and of `/stats/routes`. Filled from the one place that places a route
/// on a node (`RuleProgram::route_tiers_on`, what `/rules` shows), at each scrape, so it
/// follows the kernel tier's state as `/rules` does.
#[derive(Debug, Default, Clone)]
pub struct RouteTiers(HashMap<(String, String), &'static str>);

impl RouteTiers {
    pub fn new<'a>(routes: impl IntoIterator<Item = (&'a str, &'a str, Tier)>) -> RouteTiers {
        RouteTiers(
            routes
                .into_iter()
                .map(|(l, r, t)| ((l.to_owned(), r.to_owned()), t.as_str()))
                .collect(),
        )
    }

    /// The tier of `route` on `listener`. Requests no route took (`route="none"`) are
    /// answered by the user L7 tier, the only one that counts requests one by one.
    pub fn of(&self, listener: &str, route: &str) -> &'static str {
        self.0
            .get(&(listener.to_owned(), route.to_owned()))
            .copied()
            .unwrap_or(Tier::UserL7.as_str())
    }
}

/// The series one config snapshot uses. When it takes over, [`Metrics::retain`] drops every
/// other one, so the routes, clusters and listeners that reloads removed leave `/metrics`
/// (their cardinality stays that of the config in force).
#[derive(Default)]
pub struct Series {
    requests: HashSet<RequestKey>,
    listeners: HashSet<String>,
    clusters: HashSet<String>,
    authz: HashSet<AuthzKey>,
    workloads: HashSet<WorkloadKey>,
}

/// (listener, workload): connections or streams of one workload on one listener.
type WorkloadKey = (String, String);

/// (listener, policy, decision): an authorization decision's series.
type AuthzKey = (String, String, &'static str);

impl Series {
    /// [`Metrics::requests`], remembered.
    pub fn requests(
        &mut self,
        m: &Metrics,
        listener: &str,
        route: &str,
        cluster: &str,
    ) -> Arc<RequestStats> {
        self.requests
            .insert((listener.to_owned(), route.to_owned(), cluster.to_owned()));
        m.requests(listener, route, cluster)
    }

    /// [`Metrics::listener`], remembered.
    pub fn listener(&mut self, m: &Metrics, name: &str) -> Arc<ListenerStats> {
        self.listeners.insert(name.to_owned());
        m.listener(name)
    }

    /// [`Metrics::cluster`], remembered.
    pub fn cluster(&mut self, m: &Metrics, name: &str) -> Arc<ClusterStats> {
        self.clusters.insert(name.to_owned());
        m.cluster(name)
    }

    /// The counters of `policy` on `listener`: [allowed, denied]. `policy` is `(none)` for
    /// the decisions no policy matched.
    pub fn authz(&mut self, m: &Metrics, listener: &str, policy: &str) -> [Arc<WorkerCounter>; 2] {
        ["allow", "deny"].map(|decision| {
            let key = (listener.to_owned(), policy.to_owned(), decision);
            self.authz.insert(key.clone());
            m.authz
                .lock()
                .entry(key)
                .or_insert_with(|| Arc::new(WorkerCounter::new(m.workers)))
                .clone()
        })
    }
}

impl Series {
    /// The counter of `workload`'s connections (or streams) on `listener`.
    pub fn workload(&mut self, m: &Metrics, listener: &str, workload: &str) -> Arc<WorkerCounter> {
        let key = (listener.to_owned(), workload.to_owned());
        self.workloads.insert(key.clone());
        m.workloads
            .lock()
            .entry(key)
            .or_insert_with(|| Arc::new(WorkerCounter::new(m.workers)))
            .clone()
    }
}

/// Every counter family of the node, keyed by label set; lives as long as the node.
pub struct Metrics {
    workers: usize,
    requests: Mutex<HashMap<RequestKey, Arc<RequestStats>>>,
    listeners: Mutex<HashMap<String, Arc<ListenerStats>>>,
    clusters: Mutex<HashMap<String, Arc<ClusterStats>>>,
    authz: Mutex<HashMap<AuthzKey, Arc<WorkerCounter>>>,
    workloads: Mutex<HashMap<WorkloadKey, Arc<WorkerCounter>>>,
    /// (`listener` or `cluster`, its name, the SPIFFE ID it presents, expiry in Unix seconds):
    /// the certificates of the snapshot in force.
    certificates: Mutex<Vec<([String; 3], i64)>>,
    pub reloads_ok: WorkerCounter,
    pub reloads_failed: WorkerCounter,
    /// Connection, fd and memory budgets, and their refusals (`crate::limits`).
    pub budget: Arc<crate::limits::NodeBudget>,
    pub admin_refused: AdminRefused,
    /// Circuit breakers and outlier detection of every cluster (`crate::resilience`).
    pub resilience: crate::resilience::Registry,
    /// The node drains (`crate::drain`).
    pub draining: std::sync::atomic::AtomicBool,
    /// Faults injected by routes (`crate::l7::fault`).
    pub faults: Arc<crate::l7::fault::FaultCounts>,
    /// Mirror copies: the node's cap on those in flight, and their counts (`crate::l7::mirror`).
    pub mirrors: Arc<crate::l7::mirror::MirrorGate>,
    /// Rate limits of every listener and route (`crate::resilience::rate_limit`).
    pub rate_limits: crate::resilience::rate_limit::Registry,
    /// Every cluster's load-balancing tables: priority levels and slow start (`crate::lb`).
    pub lb: crate::lb::Registry,
    /// Every endpoint's load, for the control plane's load reports (`crate::load_report`).
    pub loads: crate::load_report::LoadReports,
    /// Spans exported and dropped (`crate::trace`).
    pub tracing: Arc<crate::trace::TraceCounts>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new(workers: usize) -> Arc<Self> {
        Arc::new(Metrics {
            workers,
            requests: Mutex::default(),
            listeners: Mutex::default(),
            clusters: Mutex::default(),
            authz: Mutex::default(),
            workloads: Mutex::default(),
            certificates: Mutex::default(),
            reloads_ok: WorkerCounter::new(1),
            reloads_failed: WorkerCounter::new(1),
            draining: std::sync::atomic::AtomicBool::new(false),
            budget: crate::limits::NodeBudget::new(),
            admin_refused: AdminRefused {
                host: WorkerCounter::new(1),
                token: WorkerCounter::new(1),
                busy: WorkerCounter::new(1),
            },
            resilience: crate::resilience::Registry::default(),
            faults: Arc::new(crate::l7::fault::FaultCounts::new(workers)),
            mirrors: Arc::new(crate::l7::mirror::MirrorGate::new(workers)),
            tracing: Arc::default(),
            rate_limits: crate::resilience::rate_limit::Registry::default(),
            lb: crate::lb::Registry::default(),
            loads: crate::load_report::LoadReports::new(workers),
        })
    }

    /// The request counters of (listener, route, cluster); created on first use. Called when a
    /// snapshot is built, never per request. `cluster` is empty for direct responses / no route.
    pub fn requests(&self, listener: &str, route: &str, cluster: &str) -> Arc<RequestStats> {
        let key = (listener.to_owned(), route.to_owned(), cluster.to_owned());
        self.requests
            .lock()
            .entry(key)
            .or_insert_with(|| Arc::new(RequestStats::new(self.workers)))
            .clone()
    }

    pub fn listener(&self, name: &str) -> Arc<ListenerStats> {
        let w = self.workers;
        self.listeners
            .lock()
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(ListenerStats {
                    connections_opened: WorkerCounter::new(w),
                    connections_closed: WorkerCounter::new(w),
                    bytes_in: WorkerCounter::new(w),
                    bytes_out: WorkerCounter::new(w),
                    kernel_spliced: WorkerCounter::new(w),
                    tls: TlsCounts::new(w),
                    hbone: StreamCounts::new(w),
                    qnp: std::sync::OnceLock::new(),
                })
            })
            .clone()
    }

    pub fn cluster(&self, name: &str) -> Arc<ClusterStats> {
        let w = self.workers;
        self.clusters
            .lock()
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(ClusterStats {
                    connections: WorkerCounter::new(w),
                    connect_failures: WorkerCounter::new(w),
                    retries: WorkerCounter::new(w),
                    retries_over_budget: WorkerCounter::new(w),
                    per_try_timeouts: WorkerCounter::new(w),
                    tls: TlsCounts::new(w),
                    tunnel: StreamCounts::new(w),
                })
            })
            .clone()
    }

    /// The qnp counters of a listener, created on first use (a snapshot build, never a packet).
    pub fn qnp_counts<'a>(&self, stats: &'a ListenerStats) -> &'a QnpCounts {
        stats.qnp.get_or_init(|| QnpCounts::new(self.workers))
    }

    /// Keep only the series `keep` uses: a reload drops those of what it removed. Requests
    /// still in flight on an older snapshot count into their own (now unlisted) counters.
    pub fn retain(&self, keep: &Series) {
        self.requests
            .lock()
            .retain(|k, _| keep.requests.contains(k));
        self.listeners
            .lock()
            .retain(|k, _| keep.listeners.contains(k));
        self.clusters
            .lock()
            .retain(|k, _| keep.clusters.contains(k));
        self.resilience.retain(&keep.clusters);
        self.lb.retain(&keep.clusters);
        self.authz.lock().retain(|k, _| keep.authz.contains(k));
        self.workloads
            .lock()
            .retain(|k, _| keep.workloads.contains(k));
    }

    /// The certificates the node presents from now on (a snapshot came into force).
    pub fn set_certificates(&self, certificates: Vec<([String; 3], i64)>) {
        *self.certificates.lock() = certificates;
    }

    /// Prometheus text exposition of everything; `tiers` gives the requests' `tier` label.
    pub fn encode(self: &Arc<Self>, tiers: RouteTiers) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Scrape(self.clone(), tiers)));
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
            let _ = writeln!(out, "# metrics encoding failed");
        }
        out
    }

    /// The request counters of every (listener, route, cluster) as JSON, for `GET
    /// /stats/routes` and `flatmesh top`: the same numbers as `flatmesh_requests_total` and
    /// `flatmesh_request_duration_seconds`, cumulative, without a Prometheus parser on the
    /// reading side. `tiers` gives each route's `tier`, as in the metrics.
    pub fn route_stats(&self, tiers: &RouteTiers) -> serde_json::Value {
        let mut requests: Vec<_> = self
            .requests
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        requests.sort_by(|a, b| a.0.cmp(&b.0));
        let routes: Vec<serde_json::Value> = requests
            .iter()
            .map(|((listener, route, cluster), stats)| {
                let (buckets, micros) = stats.histogram();
                serde_json::json!({
                    "listener": listener,
                    "route": route,
                    "cluster": cluster,
                    "tier": tiers.of(listener, route),
                    "status_classes": stats.class_totals(),
                    "duration_buckets": buckets,
                    "duration_micros": micros,
                })
            })
            .collect();
        serde_json::json!({
            "status_classes": CLASSES,
            "bucket_bounds_seconds": DURATION_BUCKETS,
            "routes": routes,
        })
    }
}

const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[derive(Debug)]
struct Scrape(Arc<Metrics>, RouteTiers);

pub(crate) fn counter<L: prometheus_client::encoding::EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(L, u64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

pub(crate) fn gauge<L: prometheus_client::encoding::EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(L, i64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (m, tiers) = (&self.0, &self.1);
        let mut requests: Vec<_> = m
            .requests
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        requests.sort_by(|a, b| a.0.cmp(&b.0));
        let mut rows = Vec::new();
        for ((listener, route, cluster), stats) in &requests {
            for (class, n) in CLASSES.iter().zip(stats.class_totals()) {
                if n > 0 {
                    rows.push((
                        [
                            ("listener", listener.as_str()),
                            ("route", route.as_str()),
                            ("cluster", cluster.as_str()),
                            ("tier", tiers.of(listener, route)),
                            ("status_class", class),
                        ],
                        n,
                    ));
                }
            }
        }
        counter(
            &mut enc,
            "flatmesh_requests",
            "HTTP requests by listener, route, cluster, the route's tier and status class",
            &rows,
        )?;

        let mut hist = enc.encode_descriptor(
            "flatmesh_request_duration_seconds",
            "HTTP request duration, from the request head read until the node counts the request, by listener, route, cluster and the route's tier",
            None,
            MetricType::Histogram,
        )?;
        for ((listener, route, cluster), stats) in &requests {
            let (buckets, micros) = stats.histogram();
            let count: u64 = buckets.iter().sum();
            if count == 0 {
                continue;
            }
            let pairs: Vec<(f64, u64)> = DURATION_BUCKETS
                .iter()
                .copied()
                .chain([f64::INFINITY])
                .zip(buckets)
                .collect();
            let labels = [
                ("listener", listener.as_str()),
                ("route", route.as_str()),
                ("cluster", cluster.as_str()),
                ("tier", tiers.of(listener, route)),
            ];
            hist.encode_family(&labels)?
                .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    micros as f64 / 1e6,
                    count,
                    &pairs,
                    None,
                )?;
        }

        let mut listeners: Vec<_> = m
            .listeners
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        listeners.sort_by(|a, b| a.0.cmp(&b.0));
        let active: Vec<_> = listeners
            .iter()
            .map(|(n, s)| {
                (
                    [("listener", n.as_str())],
                    s.connections_opened.sum() as i64 - s.connections_closed.sum() as i64,
                )
            })
            .collect();
        gauge(
            &mut enc,
            "flatmesh_downstream_connections_active",
            "Open downstream connections",
            &active,
        )?;
        let total: Vec<_> = listeners
            .iter()
            .map(|(n, s)| ([("listener", n.as_str())], s.connections_opened.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_downstream_connections",
            "Accepted downstream connections",
            &total,
        )?;
        let spliced: Vec<_> = listeners
            .iter()
            .map(|(n, s)| ([("listener", n.as_str())], s.kernel_spliced.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_kernel_spliced_connections",
            "Downstream connections handed to the kernel tier (eBPF splice)",
            &spliced,
        )?;
        let mut bytes = Vec::new();
        for (n, s) in &listeners {
            bytes.push((
                [
                    ("listener", n.as_str()),
                    ("direction", "downstream_to_upstream"),
                ],
                s.bytes_in.sum(),
            ));
            bytes.push((
                [
                    ("listener", n.as_str()),
                    ("direction", "upstream_to_downstream"),
                ],
                s.bytes_out.sum(),
            ));
        }
        counter(
            &mut enc,
            "flatmesh_tcp_bytes",
            "Bytes relayed by tcp and hbone listeners, by direction",
            &bytes,
        )?;
        tls_families(
            &mut enc,
            "flatmesh_tls_",
            "clients",
            "listener",
            listeners.iter().map(|(n, s)| (n.as_str(), &s.tls)),
        )?;
        stream_families(
            &mut enc,
            "flatmesh_hbone_",
            "listener",
            listeners.iter().map(|(n, s)| (n.as_str(), &s.hbone)),
        )?;
        qnp_families(&mut enc, &listeners)?;

        let mut clusters: Vec<_> = m
            .clusters
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        clusters.sort_by(|a, b| a.0.cmp(&b.0));
        let conns: Vec<_> = clusters
            .iter()
            .map(|(n, s)| ([("cluster", n.as_str())], s.connections.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_upstream_connections",
            "Upstream connections opened",
            &conns,
        )?;
        let fails: Vec<_> = clusters
            .iter()
            .map(|(n, s)| ([("cluster", n.as_str())], s.connect_failures.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_upstream_connect_failures",
            "Upstream connect failures",
            &fails,
        )?;
        let retries: Vec<_> = clusters
            .iter()
            .map(|(n, s)| ([("cluster", n.as_str())], s.retries.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_upstream_retries",
            "Requests retried on another attempt",
            &retries,
        )?;
        let over_budget: Vec<_> = clusters
            .iter()
            .map(|(n, s)| ([("cluster", n.as_str())], s.retries_over_budget.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_upstream_retries_over_budget",
            "Retries the retry policy asked for and the cluster's retry budget refused",
            &over_budget,
        )?;
        let per_try: Vec<_> = clusters
            .iter()
            .map(|(n, s)| ([("cluster", n.as_str())], s.per_try_timeouts.sum()))
            .collect();
        counter(
            &mut enc,
            "flatmesh_upstream_per_try_timeouts",
            "Tries cut short by the route's per-try timeout",
            &per_try,
        )?;
        m.resilience.encode(&mut enc)?;
        m.faults.encode(&mut enc)?;
        m.mirrors.encode(&mut enc)?;
        m.rate_limits.encode(&mut enc)?;
        m.lb.encode(&mut enc)?;
        tls_families(
            &mut enc,
            "flatmesh_upstream_tls_",
            "endpoints",
            "cluster",
            clusters.iter().map(|(n, s)| (n.as_str(), &s.tls)),
        )?;
        stream_families(
            &mut enc,
            "flatmesh_upstream_hbone_",
            "cluster",
            clusters.iter().map(|(n, s)| (n.as_str(), &s.tunnel)),
        )?;

        let authz = nonzero_sorted(&m.authz);
        let rows: Vec<_> = authz
            .iter()
            .map(|((l, p, d), n)| {
                (
                    [
                        ("listener", l.as_str()),
                        ("policy", p.as_str()),
                        ("decision", *d),
                    ],
                    *n,
                )
            })
            .collect();
        counter(
            &mut enc,
            "flatmesh_authz_decisions",
            "Authorization decisions by listener, deciding policy (`(none)`: no policy matched) and decision",
            &rows,
        )?;

        let workloads = nonzero_sorted(&m.workloads);
        let rows: Vec<_> = workloads
            .iter()
            .map(|((l, w), n)| ([("listener", l.as_str()), ("workload", w.as_str())], *n))
            .collect();
        counter(
            &mut enc,
            "flatmesh_workload_connections",
            "Tunnelled connections by the workload that made them, and HBONE streams by the workload they were delivered to (`(none)`: no declared workload), by listener",
            &rows,
        )?;

        let certificates = m.certificates.lock().clone();
        let rows: Vec<_> = certificates
            .iter()
            .map(|([kind, name, id], at)| {
                (
                    [(kind.as_str(), name.as_str()), ("identity", id.as_str())],
                    *at,
                )
            })
            .collect();
        gauge(
            &mut enc,
            "flatmesh_tls_certificate_expiry_timestamp_seconds",
            "When each certificate the node presents expires (Unix time), by listener or cluster and SPIFFE ID",
            &rows,
        )?;

        let reloads = [
            ([("result", "ok")], m.reloads_ok.sum()),
            ([("result", "failed")], m.reloads_failed.sum()),
        ];
        counter(
            &mut enc,
            "flatmesh_config_reloads",
            "Config reloads by result",
            &reloads,
        )?;
        m.budget.encode(&mut enc)?;
        // No labels: written as the family itself, not as one member of it.
        ConstGauge::new(i64::from(m.draining.load(Ordering::Relaxed))).encode(
            enc.encode_descriptor(
                "flatmesh_draining",
                "1 once the node drains (SIGTERM, POST /drain): it accepts nothing new and closes connections as they finish",
                None,
                MetricType::Gauge,
            )?,
        )?;

        let refused = [
            ([("reason", "host")], m.admin_refused.host.sum()),
            ([("reason", "token")], m.admin_refused.token.sum()),
            ([("reason", "busy")], m.admin_refused.busy.sum()),
        ];
        counter(
            &mut enc,
            "flatmesh_admin_refused",
            "Admin requests or connections refused: a foreign Host, a missing or wrong token, or too many open",
            &refused,
        )?;

        let spans = &m.tracing;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        counter(
            &mut enc,
            "flatmesh_tracing_spans_exported",
            "Spans the OTLP collector accepted",
            &[(Vec::<(&str, &str)>::new(), load(&spans.exported))],
        )?;
        counter(
            &mut enc,
            "flatmesh_tracing_spans_dropped",
            "Spans left out: the export queue was full (queue_full) or their export call failed (export_failed)",
            &[
                ([("reason", "queue_full")], load(&spans.queue_full)),
                ([("reason", "export_failed")], load(&spans.export_failed)),
            ],
        )?;

        let dropped: Vec<_> = crate::logging::dropped()
            .into_iter()
            .map(|d| ([("log", d.log), ("reason", d.reason)], d.lines))
            .collect();
        counter(
            &mut enc,
            "flatmesh_log_lines_dropped",
            "Log lines left out: the log's reader lagged (queue_full) or a warning repeated (repeated)",
            &dropped,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_across_workers_and_encode() {
        let m = Metrics::new(2);
        let r = m.requests("web", "web/0", "api");
        r.record(0, 200, Duration::from_micros(300));
        r.record(1, 503, Duration::from_millis(2));
        m.listener("web").connections_opened.add(1, 3);
        m.cluster("api").connect_failures.add(0, 1);
        let tiers = RouteTiers::new([("web", "web/0", Tier::Kernel)]);
        let text = m.encode(tiers.clone());
        assert!(text.contains(
            r#"flatmesh_requests_total{listener="web",route="web/0",cluster="api",tier="K",status_class="2xx"} 1"#
        ), "{text}");
        assert!(text.contains(r#"status_class="5xx"} 1"#), "{text}");
        assert!(
            text.contains(r#"flatmesh_downstream_connections_active{listener="web"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"flatmesh_upstream_connect_failures_total{cluster="api"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"flatmesh_request_duration_seconds_count{listener="web",route="web/0",cluster="api",tier="K"} 2"#
            ),
            "{text}"
        );
        assert_eq!(m.route_stats(&tiers)["routes"][0]["tier"], "K");
    }

    #[test]
    fn requests_no_route_took_are_the_user_tier_s() {
        let m = Metrics::new(1);
        m.requests("web", "none", "").record(0, 404, Duration::ZERO);
        let text = m.encode(RouteTiers::default());
        assert!(
            text.contains(r#"route="none",cluster="",tier="U7",status_class="4xx"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn retain_drops_the_series_a_snapshot_no_longer_uses() {
        let m = Metrics::new(1);
        let mut old = Series::default();
        old.requests(&m, "web", "gone", "api")
            .record(0, 200, Duration::ZERO);
        old.requests(&m, "web", "kept", "api")
            .record(0, 200, Duration::ZERO);
        old.listener(&m, "old").connections_opened.add(0, 1);
        old.cluster(&m, "old-cluster").connections.add(0, 1);
        let mut new = Series::default();
        new.requests(&m, "web", "kept", "api")
            .record(0, 200, Duration::ZERO);
        new.cluster(&m, "api");
        m.retain(&new);
        let text = m.encode(RouteTiers::default());
        assert!(!text.contains("gone") && !text.contains("old"), "{text}");
        // A kept series keeps its total across the swap.
        assert!(
            text.contains(r#"route="kept",cluster="api",tier="U7",status_class="2xx"} 2"#),
            "{text}"
        );
    }

    #[test]
    fn every_family_is_documented() {
        // docs/observability.md, "Metrics": every family a node exports has a row there.
        let docs = include_str!("../../../docs/observability.md");
        let text = Metrics::new(1).encode(RouteTiers::default());
        let missing: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|family| !docs.contains(&format!("`{family}")))
            .collect();
        assert!(
            missing.is_empty(),
            "docs/observability.md does not document {missing:?}"
        );
    }

    #[test]
    fn out_of_range_worker_is_ignored() {
        let c = WorkerCounter::new(1);
        c.add(5, 1);
        assert_eq!(c.sum(), 0);
    }
}
