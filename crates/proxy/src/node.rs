//! The node: the control plane (slow path) of FlatProxy §IV-B. It owns the listening sockets,
//! builds and swaps config snapshots, tells workers what to listen on, and runs the admin
//! endpoint and the reload triggers (SIGHUP, file change) on a thread of its own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use flatmesh_config::{AdminAddress, Config};
use parking_lot::Mutex;

use crate::access_log::AccessLog;
use crate::context::WorkerView;
use crate::control::{kernel_plan, send_qnp, Bound, Shared, State};
pub use crate::control::{ConfigSource, ReloadStatus};
use crate::drain::{DrainSignal, Draining};
use crate::error::ProxyError;
use crate::listener::bind_group;
use crate::metrics::Metrics;
use crate::qnp::QnpGroup;
use crate::snapshot::Snapshot;
use crate::upstream::Upstreams;
use crate::worker::{self, Command};

/// A running node proxy.
pub struct Node {
    shared: Arc<Shared>,
    admin: AdminAddress,
    control: Option<std::thread::JoinHandle<()>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Node {
    /// Bind every listener and the admin endpoint, start the workers, and return once all of
    /// them accept connections.
    pub fn start(config: Config, source: ConfigSource) -> Result<Node, ProxyError> {
        let workers = config.worker_count();
        let fds = crate::limits::raise_fd_limit();
        tracing::info!(
            soft = fds.soft,
            started = fds.started,
            hard = fds.hard,
            "file descriptor limit"
        );
        let metrics = Metrics::new(workers);
        let snapshot = Arc::new(Snapshot::build(config, 1, &metrics)?);
        metrics.set_certificates(snapshot.presented_certificates());
        let access_log = match &snapshot.config.access_log {
            Some(a) => AccessLog::open(a).map_err(|e| {
                ProxyError::Config(format!(
                    "cannot open access log `{}`: {e}; check the path and permissions",
                    a.path
                ))
            })?,
            None => AccessLog::disabled(),
        };
        let tracer: crate::trace::NodeTracer = Arc::new(arc_swap::ArcSwap::from_pointee(
            crate::control::start_tracer(&snapshot.config, &metrics)?,
        ));
        let (admin_socket, admin) = crate::admin::bind(&snapshot.config.admin)?;
        let mut bound = HashMap::new();
        let mut sockets = Vec::new();
        for l in snapshot.listeners.iter().filter(|l| l.qnp.is_none()) {
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
        if let Some(k) = &kernel {
            // The SYN filter goes on before any worker accepts (and before the maps below
            // say which limits the kernel holds).
            for (key, group) in &sockets {
                if let Some(b) = bound.get(key) {
                    k.guard_listener(&snapshot.config, &b.name, b.actual, group);
                }
            }
            if k.conn_limit_on() {
                let k = k.clone();
                metrics
                    .rate_limits
                    .count_kernel_drops(Box::new(move || k.conn_limit_drops()));
            }
        }
        // qnp listeners: a UDP socket group each, dispatched by their own sk_reuseport program
        // when the config has a `kernel:` section (`crate::qnp`).
        let mut qnp = HashMap::new();
        let mut qnp_sockets = Vec::new();
        for l in &snapshot.listeners {
            let Some(plan) = &l.qnp else {
                continue;
            };
            let key = (l.address, l.protocol);
            let (group, sockets) = QnpGroup::bind(
                &l.name,
                l.address,
                plan,
                workers,
                snapshot.config.kernel.is_some(),
            )?;
            bound.insert(
                key,
                Bound {
                    name: l.name.clone(),
                    actual: group.actual,
                },
            );
            qnp.insert(key, group);
            qnp_sockets.push((key, sockets));
        }
        let drain = DrainSignal::new();
        let mut handles = Vec::with_capacity(workers);
        for id in 0..workers {
            let view = WorkerView {
                snapshot: snapshot.clone(),
                upstreams: Upstreams::build(&snapshot, id, None),
            };
            handles.push(worker::spawn(
                id,
                view,
                access_log.clone(),
                tracer.clone(),
                kernel.clone(),
                metrics.budget.clone(),
                drain.subscribe(),
            )?);
        }
        let state = State {
            snapshot,
            bound,
            qnp,
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
        for (key, sockets) in qnp_sockets {
            send_qnp(&handles, key, sockets);
        }
        let shared = Arc::new(Shared {
            metrics,
            source,
            ready: AtomicBool::new(false),
            workers: handles,
            state: Mutex::new(state),
            kernel,
            kernel_off,
            drain,
            tracer,
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
        tracing::info!(admin = %admin, workers, "node proxy started");
        Ok(Node {
            shared,
            admin,
            control: Some(control),
            stop: Some(stop_tx),
        })
    }

    /// Where the admin endpoint listens (with the actual port when the config said 0).
    pub fn admin_addr(&self) -> &AdminAddress {
        &self.admin
    }

    /// The bound address of listener `name` (useful with port 0).
    pub fn listener_addr(&self, name: &str) -> Option<SocketAddr> {
        self.shared
            .listener_addresses()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
    }

    /// Each endpoint's load since the last call, for the control plane's load reports (the
    /// xDS client's LRS stream, `flatmesh_xds::lrs`). One caller: each call starts a period.
    pub fn take_load_reports(&self) -> Vec<crate::EndpointReport> {
        self.shared.metrics.loads.take()
    }

    /// Apply a new config with a zero-drop swap.
    pub fn reload(&self, config: Config) -> Result<(), ProxyError> {
        let result = self.shared.apply(config);
        self.shared
            .record(&result.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        result
    }

    /// Applies the config in force again, re-reading the certificate and key files it names
    /// (renewed on disk). A zero-drop swap like any reload: new connections present the new
    /// certificates, open ones keep theirs.
    pub fn reload_files(&self) -> Result<(), ProxyError> {
        self.reload(self.shared.config_in_force())
    }

    /// Begins the drain without stopping the node: `/ready` answers 503, the workers stop
    /// accepting, and connections finish what they carry and close (`crate::drain`). What
    /// `POST /drain` does; [`shutdown`](Self::shutdown) then waits for the connections.
    pub fn drain(&self) {
        self.shared.begin_drain();
    }

    /// Resolves once the drain has begun, by [`drain`](Self::drain) or `POST /drain`: the
    /// node's owner then calls [`shutdown`](Self::shutdown).
    pub fn draining(&self) -> Draining {
        self.shared.drain.subscribe()
    }

    /// Drains the node: stop accepting, let in-flight requests and connections finish (up to
    /// the config's `drain_timeout`), close what is left, and stop every thread.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.shared.begin_drain();
        let drain_timeout = self.shared.snapshot().config.drain_timeout;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(control) = self.control.take() {
            let _ = control.join();
        }
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            for w in shared.workers.drain(..) {
                w.join(drain_timeout);
            }
        } else {
            for w in &self.shared.workers {
                w.send(Command::Shutdown {
                    drain: drain_timeout,
                });
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
