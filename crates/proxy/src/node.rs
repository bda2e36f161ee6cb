//! The node: the control plane (slow path) of FlatProxy §IV-B. It owns the listening sockets,
//! builds and swaps config snapshots, tells workers what to listen on, and runs the admin
//! endpoint and the reload triggers (SIGHUP, file change) on a thread of its own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use flatmesh_config::Config;
use parking_lot::Mutex;

use crate::access_log::AccessLog;
use crate::error::ProxyError;
use crate::kernel::KernelBinding;
use crate::listener::{bind_admin, bind_group};
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;
use crate::upstream::Upstreams;
use crate::worker::{self, Command, ListenerKey, WorkerHandle, WorkerView};

/// Where the node's config comes from; a file enables SIGHUP and file-change reloads.
#[derive(Debug, Clone)]
pub enum ConfigSource {
    File(PathBuf),
    Inline,
}

/// How long in-flight connections get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);

struct Bound {
    name: String,
    actual: SocketAddr,
}

/// The outcome of the latest reload, shown at /config.
#[derive(Default, Clone, serde::Serialize)]
pub struct ReloadStatus {
    pub last_reload_error: Option<String>,
    pub last_reload_ok_unix: Option<u64>,
}

struct State {
    snapshot: Arc<Snapshot>,
    bound: HashMap<ListenerKey, Bound>,
    status: ReloadStatus,
}

pub(crate) struct Shared {
    pub metrics: Arc<Metrics>,
    pub source: ConfigSource,
    pub ready: AtomicBool,
    workers: Vec<WorkerHandle>,
    state: Mutex<State>,
    /// Tier K, attached at start when the config asks for it and the host can run it.
    kernel: Option<Arc<KernelBinding>>,
    /// Why tier K is not attached, when it is not.
    kernel_off: Option<String>,
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
        flatmesh_rules::NodeTiers { kernel }
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

    fn record(&self, result: &Result<(), String>) {
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

        // Bind new listeners first: if one fails, nothing has changed yet.
        let mut new_sockets = Vec::new();
        for (key, name) in &wanted {
            if !state.bound.contains_key(key) {
                let (actual, sockets) =
                    bind_group(&format!("listener `{name}`"), key.0, self.workers.len())?;
                new_sockets.push((*key, name.to_string(), actual, sockets));
            }
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
            for (w, socket) in self.workers.iter().zip(sockets) {
                w.send(Command::Listen { key, socket });
            }
            state.bound.insert(key, Bound { name, actual });
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
        }
        for (key, name) in &wanted {
            if let Some(b) = state.bound.get_mut(key) {
                b.name = name.to_string();
            }
        }
        if state.snapshot.config.kernel != snapshot.config.kernel {
            tracing::warn!("the `kernel:` section changed; which programs are attached changes at the next restart, the maps follow now");
        }
        state.snapshot = snapshot;
        if let Some(k) = &self.kernel {
            k.install(&kernel_plan(&state));
        }
        Ok(())
    }
}

/// What the current snapshot asks of tier K, with listeners at their bound addresses.
fn kernel_plan(state: &State) -> crate::kernel::KernelPlan {
    let actual = |name: &str| {
        state
            .bound
            .values()
            .find(|b| b.name == name)
            .map(|b| b.actual)
    };
    crate::kernel::plan(&state.snapshot, &actual)
}

/// A running node proxy.
pub struct Node {
    shared: Arc<Shared>,
    admin: SocketAddr,
    control: Option<std::thread::JoinHandle<()>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Node {
    /// Bind every listener and the admin endpoint, start the workers, and return once all of
    /// them accept connections.
    pub fn start(config: Config, source: ConfigSource) -> Result<Node, ProxyError> {
        let workers = config.worker_count();
        let metrics = Metrics::new(workers);
        let snapshot = Arc::new(Snapshot::build(config, 1, &metrics)?);
        let access_log = match &snapshot.config.access_log {
            Some(a) => AccessLog::open(&a.path).map_err(|e| {
                ProxyError::Config(format!(
                    "cannot open access log `{}`: {e}; check the path and permissions",
                    a.path
                ))
            })?,
            None => AccessLog::disabled(),
        };
        let admin_socket = bind_admin(snapshot.config.admin)?;
        let admin = admin_socket
            .local_addr()
            .map_err(|source| ProxyError::Bind {
                what: "the admin endpoint".into(),
                address: snapshot.config.admin,
                source,
            })?;
        let mut bound = HashMap::new();
        let mut sockets = Vec::new();
        for l in &snapshot.listeners {
            let (actual, group) =
                bind_group(&format!("listener `{}`", l.name), l.address, workers)?;
            bound.insert(
                (l.address, l.protocol),
                Bound {
                    name: l.name.clone(),
                    actual,
                },
            );
            sockets.push(((l.address, l.protocol), group));
        }
        let (kernel, kernel_off) = match crate::kernel::attach(&snapshot.config) {
            Ok(k) => (Some(Arc::new(k)), None),
            Err(why) => (None, Some(why)),
        };
        let mut handles = Vec::with_capacity(workers);
        for id in 0..workers {
            let view = WorkerView {
                snapshot: snapshot.clone(),
                upstreams: Upstreams::build(&snapshot, id, None),
            };
            handles.push(worker::spawn(id, view, access_log.clone(), kernel.clone())?);
        }
        let state = State {
            snapshot,
            bound,
            status: ReloadStatus::default(),
        };
        // Maps before listening: the first connection already finds its routes and ports.
        if let Some(k) = &kernel {
            k.install(&kernel_plan(&state));
        }
        for (key, group) in sockets {
            for (w, socket) in handles.iter().zip(group) {
                w.send(Command::Listen { key, socket });
            }
        }
        let shared = Arc::new(Shared {
            metrics,
            source,
            ready: AtomicBool::new(false),
            workers: handles,
            state: Mutex::new(state),
            kernel,
            kernel_off,
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let control_shared = shared.clone();
        let control = std::thread::Builder::new()
            .name("flatmesh-control".into())
            .spawn(move || crate::admin::run(control_shared, admin_socket, stop_rx))
            .map_err(|source| ProxyError::Thread {
                worker: usize::MAX,
                source,
            })?;
        shared.ready.store(true, Ordering::Release);
        tracing::info!(%admin, workers, "node proxy started");
        Ok(Node {
            shared,
            admin,
            control: Some(control),
            stop: Some(stop_tx),
        })
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// The bound address of listener `name` (useful with port 0).
    pub fn listener_addr(&self, name: &str) -> Option<SocketAddr> {
        self.shared
            .listener_addresses()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
    }

    /// Apply a new config with a zero-drop swap.
    pub fn reload(&self, config: Config) -> Result<(), ProxyError> {
        let result = self.shared.apply(config);
        self.shared
            .record(&result.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        result
    }

    /// Stop accepting, let in-flight connections finish (up to 5 s), and stop every thread.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.shared.ready.store(false, Ordering::Release);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(control) = self.control.take() {
            let _ = control.join();
        }
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            for w in shared.workers.drain(..) {
                w.join(DRAIN);
            }
        } else {
            for w in &self.shared.workers {
                w.send(Command::Shutdown { drain: DRAIN });
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.stop_all();
        }
    }
}
