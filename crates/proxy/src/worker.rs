//! Shared-nothing workers: one thread per core, each with its own single-threaded tokio
//! runtime, its own SO_REUSEPORT listening sockets, upstream pools and counter slots.
//! The only thing a worker shares is the pointer to the config snapshot it reads.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use flatmesh_config::ListenerProtocol;
use tokio::sync::mpsc;

use crate::access_log::AccessLog;
use crate::context::{ConnContext, WorkerView};
use crate::drain::Draining;
use crate::error::ProxyError;
use crate::kernel::KernelBinding;
use crate::limits::NodeBudget;
use crate::trace::{NodeTracer, Tracer};

/// The identity of a listener across reloads.
pub type ListenerKey = (SocketAddr, ListenerProtocol);

pub enum Command {
    Listen {
        key: ListenerKey,
        socket: std::net::TcpListener,
    },
    /// One more socket of a qnp listener to serve (a worker may serve several).
    ListenQnp {
        key: ListenerKey,
        socket: crate::qnp::QnpSocket,
    },
    Unlisten {
        key: ListenerKey,
    },
    Shutdown {
        drain: Duration,
    },
}

pub struct WorkerHandle {
    pub id: usize,
    pub view: Arc<ArcSwap<WorkerView>>,
    commands: mpsc::UnboundedSender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WorkerHandle {
    pub fn send(&self, command: Command) {
        // A worker that is gone has nothing left to listen on; ignoring is correct.
        let _ = self.commands.send(command);
    }

    pub fn join(mut self, drain: Duration) {
        self.send(Command::Shutdown { drain });
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn spawn(
    id: usize,
    view: WorkerView,
    access_log: AccessLog,
    tracer: NodeTracer,
    kernel: Option<Arc<KernelBinding>>,
    budget: Arc<NodeBudget>,
    draining: Draining,
) -> Result<WorkerHandle, ProxyError> {
    let view = Arc::new(ArcSwap::from_pointee(view));
    let (tx, rx) = mpsc::unbounded_channel();
    let worker_view = view.clone();
    let services = Accepting {
        worker: id,
        view: worker_view,
        access_log,
        tracer,
        kernel,
        budget,
        active: Arc::new(AtomicUsize::new(0)),
        draining,
    };
    let thread = std::thread::Builder::new()
        .name(format!("flatmesh-worker-{id}"))
        .spawn(move || run(services, rx))
        .map_err(|source| ProxyError::Thread { worker: id, source })?;
    Ok(WorkerHandle {
        id,
        view,
        commands: tx,
        thread: Some(thread),
    })
}

/// What every accept loop of a worker shares: the worker's view and services, the node's
/// budgets, and the count of the worker's open connections (for the drain at shutdown).
struct Accepting {
    worker: usize,
    view: Arc<ArcSwap<WorkerView>>,
    access_log: AccessLog,
    tracer: NodeTracer,
    kernel: Option<Arc<KernelBinding>>,
    budget: Arc<NodeBudget>,
    active: Arc<AtomicUsize>,
    draining: Draining,
}

fn run(services: Accepting, mut rx: mpsc::UnboundedReceiver<Command>) {
    let id = services.worker;
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            tracing::error!(worker = id, error = %err, "cannot build the worker runtime; this worker serves nothing");
            return;
        }
    };
    rt.block_on(async move {
        let active = services.active.clone();
        let mut draining = services.draining.clone();
        let shared = Arc::new(services);
        // One worker hands the heap a burst of connections freed back to the kernel.
        let trimming = (id == 0).then(|| {
            tokio::spawn(crate::limits::trim_after_bursts(shared.budget.clone()))
        });
        let mut accepting: HashMap<ListenerKey, Vec<tokio::task::JoinHandle<()>>> = HashMap::new();
        let mut drain = Duration::ZERO;
        let mut stopped_accepting = false;
        loop {
            let command = tokio::select! {
                command = rx.recv() => match command {
                    Some(command) => command,
                    None => break,
                },
                // The drain stops accepting at once: the listening sockets close.
                _ = draining.begun(), if !stopped_accepting => {
                    stopped_accepting = true;
                    for task in accepting.drain().flat_map(|(_, tasks)| tasks) {
                        task.abort();
                    }
                    continue;
                }
            };
            match command {
                // A listener that a reload adds during the drain is not opened.
                Command::Listen { .. } | Command::ListenQnp { .. } if stopped_accepting => {}
                Command::Listen { key, socket } => match tokio::net::TcpListener::from_std(socket) {
                    Ok(listener) => {
                        let task = tokio::spawn(accept_loop(key, listener, shared.clone()));
                        for old in accepting.insert(key, vec![task]).into_iter().flatten() {
                            old.abort();
                        }
                    }
                    Err(err) => tracing::error!(worker = id, address = %key.0, error = %err, "cannot use listening socket"),
                },
                Command::ListenQnp { key, socket } => {
                    let task = tokio::spawn(crate::qnp::serve(key, socket, id, shared.view.clone()));
                    accepting.entry(key).or_default().push(task);
                }
                Command::Unlisten { key } => {
                    for task in accepting.remove(&key).into_iter().flatten() {
                        task.abort();
                    }
                }
                Command::Shutdown { drain: d } => {
                    drain = d;
                    break;
                }
            }
        }
        for task in accepting.into_values().flatten().chain(trimming) {
            task.abort();
        }
        // Let in-flight connections finish, up to the drain time.
        let deadline = tokio::time::Instant::now() + drain;
        while active.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cut = active.load(Ordering::Relaxed);
        if cut > 0 {
            tracing::warn!(worker = id, connections = cut, "drain timeout reached: closing the connections still open");
        }
    });
}

/// Decrements the worker's active-connection count when the connection task ends, however it ends.
struct ActiveGuard(Arc<AtomicUsize>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(key: ListenerKey, listener: tokio::net::TcpListener, shared: Arc<Accepting>) {
    let worker = shared.worker;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // EMFILE / ENFILE / ECONNABORTED: back off briefly instead of spinning.
                tracing::warn!(worker, address = %key.0, error = %err, "accept failed; if this is 'too many open files', raise `ulimit -n` or lower limits.max_connections");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Budgets are checked before anything is spent on the connection; over one, it is
        // closed at once (and counted), and the loop goes on accepting.
        let mut dialled = None;
        let admitted = {
            let current = shared.view.load();
            let snapshot = &current.snapshot;
            if snapshot.original_dst {
                dialled = crate::original_dst::lookup(&stream, shared.kernel.as_deref());
            }
            match snapshot.listener_at(key.0, key.1) {
                Some(lid) => {
                    let config = &snapshot.config.listeners[lid];
                    let open = shared.budget.listener(&config.name);
                    match shared.budget.admit(config, &open, &snapshot.config.limits) {
                        Ok(admitted) => Some(admitted),
                        Err(reason) => {
                            tracing::debug!(worker, listener = %config.name, ?reason, %peer, "connection refused at accept");
                            continue;
                        }
                    }
                }
                // Removed by a reload: dispatch closes it.
                None => None,
            }
        };
        shared.active.fetch_add(1, Ordering::Relaxed);
        let guard = ActiveGuard(shared.active.clone());
        let ctx = Arc::new(ConnContext {
            worker,
            listener_address: key.0,
            protocol: key.1,
            peer,
            peer_ip: http::HeaderValue::from_str(&peer.ip().to_string())
                .unwrap_or(http::HeaderValue::from_static("unknown")),
            view: shared.view.clone(),
            access_log: shared.access_log.clone(),
            tracer: Tracer::clone(&shared.tracer.load()),
            kernel: shared.kernel.clone(),
            budget: shared.budget.clone(),
            principal: None,
            draining: shared.draining.clone(),
            dialled,
        });
        tokio::spawn(async move {
            let _guard = guard;
            let _admitted = admitted;
            crate::dispatch::serve(ctx, stream).await;
        });
    }
}
