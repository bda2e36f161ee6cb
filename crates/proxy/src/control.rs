//! The node's control-plane state (FlatProxy §IV-B): the snapshot in force, the bound
//! listeners, the workers, the outcome of the latest reload, and how a new config replaces
//! the running one (validate, compile, bind, swap) with nothing dropped. The node
//! (`crate::node`) owns it; the admin endpoint and the reload triggers (`crate::admin`) read
//! and drive it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use flatmesh_config::Config;
use parking_lot::Mutex;

use crate::context::WorkerView;
use crate::drain::DrainSignal;
use crate::error::ProxyError;
use crate::kernel::KernelBinding;
use crate::listener::bind_group;
use crate::metrics::{Metrics, RouteTiers};
use crate::qnp::{QnpGroup, QnpSocket};
use crate::snapshot::Snapshot;
use crate::upstream::Upstreams;
use crate::worker::{Command, ListenerKey, WorkerHandle};

/// Where the node's config comes from; a file enables SIGHUP and file-change reloads.
#[derive(Debug, Clone)]
pub enum ConfigSource {
    File(PathBuf),
    Inline,
}

/// A listener as bound: its name and its actual address (the configured port may be 0).
pub(crate) struct Bound {
    pub name: String,
    pub actual: SocketAddr,
}

/// The outcome of the latest reload, shown at /config.
#[derive(Default, Clone, serde::Serialize)]
pub struct ReloadStatus {
    pub last_reload_error: Option<String>,
    pub last_reload_ok_unix: Option<u64>,
}

pub(crate) struct State {
    pub snapshot: Arc<Snapshot>,
    pub bound: HashMap<ListenerKey, Bound>,
    /// The qnp listeners' socket groups and kernel dispatchers (`crate::qnp`).
    pub qnp: HashMap<ListenerKey, QnpGroup>,
    pub status: ReloadStatus,
}

pub(crate) struct Shared {
    pub metrics: Arc<Metrics>,
    pub source: ConfigSource,
    pub ready: AtomicBool,
    pub workers: Vec<WorkerHandle>,
    pub state: Mutex<State>,
    /// Tier K, attached at start when the config asks for it and the host can run it.
    pub kernel: Option<Arc<KernelBinding>>,
    /// Why tier K is not attached, when it is not.
    pub kernel_off: Option<String>,
    /// Set once the node drains (`crate::drain`).
    pub drain: DrainSignal,
    /// The span exporter of the config in force (`tracing`).
    pub tracer: crate::trace::NodeTracer,
}

/// The tracer `config.tracing` asks for (off when it has none).
pub(crate) fn start_tracer(
    config: &Config,
    metrics: &Metrics,
) -> Result<crate::trace::Tracer, ProxyError> {
    crate::trace::Tracer::start(config.tracing.as_ref(), metrics.tracing.clone())
        .map_err(|e| ProxyError::Config(format!("cannot start the span exporter: {e}")))
}

impl Shared {
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.state.lock().snapshot.clone()
    }

    /// The tiers this node runs, for `/rules`.
    pub fn tiers(&self) -> flatmesh_rules::NodeTiers {
        let kernel = match (&self.kernel, &self.kernel_off) {
            (Some(k), _) => k.runtime(),
            (None, why) => flatmesh_rules::KernelRuntime::Off(why.clone().unwrap_or_default()),
        };
        flatmesh_rules::NodeTiers {
            kernel,
            kernel_conn_limits: self
                .kernel
                .as_ref()
                .map(|k| k.conn_limited_listeners())
                .unwrap_or_default(),
        }
    }

    /// Where each http route runs on this node now, for the request metrics' `tier` label.
    pub fn route_tiers(&self) -> RouteTiers {
        RouteTiers::new(self.snapshot().program.route_tiers_on(&self.tiers()))
    }

    pub fn status(&self) -> ReloadStatus {
        self.state.lock().status.clone()
    }

    pub fn listener_addresses(&self) -> Vec<(String, SocketAddr)> {
        let mut out: Vec<_> = self
            .state
            .lock()
            .bound
            .values()
            .map(|b| (b.name.clone(), b.actual))
            .collect();
        out.sort();
        out
    }

    /// Re-read the config file and apply it. Errors are recorded for /config and metrics.
    pub fn reload_from_source(&self) -> Result<(), String> {
        let ConfigSource::File(path) = &self.source else {
            return Err(ProxyError::NoConfigFile.to_string());
        };
        let result = flatmesh_config::load(path)
            .map_err(|e| e.to_string())
            .and_then(|config| self.apply(config).map_err(|e| e.to_string()));
        self.record(&result);
        result
    }

    pub fn record(&self, result: &Result<(), String>) {
        let mut state = self.state.lock();
        match result {
            Ok(()) => {
                self.metrics.reloads_ok.add_shared(0, 1);
                state.status.last_reload_error = None;
                state.status.last_reload_ok_unix = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs());
                tracing::info!(generation = state.snapshot.generation, "config reloaded");
            }
            Err(err) => {
                self.metrics.reloads_failed.add_shared(0, 1);
                state.status.last_reload_error = Some(err.clone());
                tracing::error!(error = %err, "config reload refused; the previous config stays in force");
            }
        }
    }

    /// Begins the node's drain (`crate::drain`); a second call changes nothing.
    pub fn begin_drain(&self) {
        self.ready.store(false, Ordering::Release);
        self.metrics.draining.store(true, Ordering::Relaxed);
        if self.drain.start() {
            let open = self.metrics.budget.open_connections();
            tracing::info!(
                open,
                "draining: no new connections; open ones finish and close"
            );
        }
    }

    /// The config in force.
    pub fn config_in_force(&self) -> flatmesh_config::Config {
        (*self.state.lock().snapshot.config).clone()
    }

    /// Validate, compile and swap in `config`. Nothing changes unless all of it succeeds.
    pub fn apply(&self, config: Config) -> Result<(), ProxyError> {
        let mut state = self.state.lock();
        if config.worker_count() != self.workers.len() {
            tracing::warn!(
                running = self.workers.len(),
                configured = config.worker_count(),
                "`workers` changed; the new count takes effect at the next restart"
            );
        }
        let snapshot = Arc::new(Snapshot::build(
            config,
            state.snapshot.generation + 1,
            &self.metrics,
        )?);
        let wanted: HashMap<ListenerKey, &str> = snapshot
            .listeners
            .iter()
            .map(|l| ((l.address, l.protocol), l.name.as_str()))
            .collect();

        // A changed `tracing` section gets a new exporter (the old one sends what it has queued
        // and stops once the last connection holding it closes); started before anything
        // changes, so a failure refuses the reload.
        let tracer = if state.snapshot.config.tracing != snapshot.config.tracing {
            Some(start_tracer(&snapshot.config, &self.metrics)?)
        } else {
            None
        };
        // Bind new listeners first: if one fails, nothing has changed yet.
        let mut new_sockets = Vec::new();
        let mut new_qnp = Vec::new();
        for (key, name) in &wanted {
            if state.bound.contains_key(key) {
                continue;
            }
            match qnp_plan(&snapshot, *key) {
                Some(plan) => {
                    let (group, sockets) = QnpGroup::bind(
                        name,
                        key.0,
                        &plan,
                        self.workers.len(),
                        // Its dispatcher is a program of its own, which the config's
                        // `kernel:` section asks for, whatever else of tier K is attached.
                        snapshot.config.kernel.is_some(),
                    )?;
                    new_qnp.push((*key, name.to_string(), group, sockets));
                }
                None => {
                    let (actual, sockets) =
                        bind_group(&format!("listener `{name}`"), key.0, self.workers.len())?;
                    new_sockets.push((*key, name.to_string(), actual, sockets));
                }
            }
        }
        // qnp listeners that tier K dispatches get a socket for each worker the reload adds.
        let mut grown: Vec<(ListenerKey, Vec<QnpSocket>)> = Vec::new();
        for (key, group) in state.qnp.iter_mut() {
            if let Some(plan) = qnp_plan(&snapshot, *key) {
                grown.push((*key, group.grow(&plan)?));
            }
        }
        if let Some(tracer) = tracer {
            self.tracer.store(Arc::new(tracer));
        }
        // Swap every worker's view; in-flight requests keep the view they loaded.
        for w in &self.workers {
            let previous = w.view.load_full();
            let upstreams = Upstreams::build(&snapshot, w.id, Some(&previous.upstreams));
            w.view.store(Arc::new(WorkerView {
                snapshot: snapshot.clone(),
                upstreams,
            }));
        }
        for (key, name, actual, sockets) in new_sockets {
            if let Some(k) = &self.kernel {
                k.guard_listener(&snapshot.config, &name, actual, &sockets);
            }
            for (w, socket) in self.workers.iter().zip(sockets) {
                w.send(Command::Listen { key, socket });
            }
            state.bound.insert(key, Bound { name, actual });
        }
        for (key, name, group, sockets) in new_qnp {
            send_qnp(&self.workers, key, sockets);
            let actual = group.actual;
            state.qnp.insert(key, group);
            state.bound.insert(key, Bound { name, actual });
        }
        for (key, sockets) in grown {
            send_qnp(&self.workers, key, sockets);
        }
        // The kernel dispatchers take the new rules once the user-space side has them.
        for (key, group) in state.qnp.iter_mut() {
            if let Some(plan) = qnp_plan(&snapshot, *key) {
                group.install(&plan);
            }
        }
        let removed: Vec<ListenerKey> = state
            .bound
            .keys()
            .filter(|k| !wanted.contains_key(k))
            .copied()
            .collect();
        for key in removed {
            for w in &self.workers {
                w.send(Command::Unlisten { key });
            }
            state.bound.remove(&key);
            // Its sockets close as the workers drop them, which detaches the program.
            state.qnp.remove(&key);
        }
        for (key, name) in &wanted {
            if let Some(b) = state.bound.get_mut(key) {
                b.name = name.to_string();
            }
        }
        if state.snapshot.config.kernel != snapshot.config.kernel {
            tracing::warn!("the `kernel:` section changed; which programs are attached changes at the next restart, the maps follow now");
        }
        if state.snapshot.config.admin.address != snapshot.config.admin.address {
            tracing::warn!(
                running = %state.snapshot.config.admin.address,
                configured = %snapshot.config.admin.address,
                "`admin.address` changed; the admin endpoint moves at the next restart (its other settings apply now)"
            );
        }
        warn_if_everything_goes(&state.snapshot, &snapshot);
        self.metrics.retain(&snapshot.series);
        self.metrics
            .set_certificates(snapshot.presented_certificates());
        self.metrics.rate_limits.retain(&snapshot.config);
        state.snapshot = snapshot;
        if let Some(k) = &self.kernel {
            k.install(&kernel_plan(&state));
        }
        Ok(())
    }
}

/// A reload may replace every listener at once (a valid config that means it, say a node
/// repurposed): it is applied, but said loudly, since a config file cut short by a writer
/// looks the same. (A file cut so short that it has no listener, or an http listener with
/// no route, is refused by validation.)
fn warn_if_everything_goes(old: &Snapshot, new: &Snapshot) {
    let kept = old
        .listeners
        .iter()
        .filter(|l| new.listeners.iter().any(|n| n.name == l.name))
        .count();
    if kept == 0 && !old.listeners.is_empty() {
        let names = |s: &Snapshot| {
            s.listeners
                .iter()
                .map(|l| l.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        tracing::warn!(
            removed = %names(old),
            now = %names(new),
            "this reload removes every listener the node had; if that was not meant, restore the config file (write it to a temporary file and rename it over the old one)"
        );
    }
    let routes = |s: &Snapshot| {
        s.listeners
            .iter()
            .map(|l| l.route_stats.len())
            .sum::<usize>()
    };
    let (before, after) = (routes(old), routes(new));
    if before >= 4 && after * 2 < before {
        tracing::warn!(
            before,
            after,
            "this reload removes more than half of the node's routes"
        );
    }
}

/// The plan of the qnp listener at `key` in `snapshot`, if it is one.
fn qnp_plan(snapshot: &Snapshot, key: ListenerKey) -> Option<Arc<crate::qnp::QnpPlan>> {
    let lid = snapshot.listener_at(key.0, key.1)?;
    snapshot.listeners[lid].qnp.clone()
}

/// Hands a qnp listener's sockets to the workers, round robin.
pub(crate) fn send_qnp(workers: &[WorkerHandle], key: ListenerKey, sockets: Vec<QnpSocket>) {
    for (w, socket) in workers.iter().cycle().zip(sockets) {
        w.send(Command::ListenQnp { key, socket });
    }
}

/// What the current snapshot asks of tier K, with listeners at their bound addresses.
pub(crate) fn kernel_plan(state: &State) -> crate::kernel::KernelPlan {
    let actual = |name: &str| {
        state
            .bound
            .values()
            .find(|b| b.name == name)
            .map(|b| b.actual)
    };
    crate::kernel::plan(&state.snapshot, &actual)
}
