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
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::mpsc;

use crate::access_log::AccessLog;
use crate::downstream::{ActivityTap, ConnSignals};
use crate::error::ProxyError;
use crate::kernel::{FirstRequest, KernelBinding};
use crate::snapshot::Snapshot;
use crate::sniff::{sniff, Protocol};
use crate::tap::{Rewind, Tapped};
use crate::upstream::Upstreams;

/// What one worker reads per request: the snapshot and its own upstream state for it.
pub struct WorkerView {
    pub snapshot: Arc<Snapshot>,
    pub upstreams: Upstreams,
}

/// Per-connection context handed to the L4 / L7 handlers.
pub struct ConnContext {
    pub worker: usize,
    /// The listener's address as written in the config (its identity across reloads).
    pub listener_address: SocketAddr,
    pub protocol: ListenerProtocol,
    pub peer: SocketAddr,
    /// The client's IP as a header value, for x-forwarded-for.
    pub peer_ip: http::HeaderValue,
    pub view: Arc<ArcSwap<WorkerView>>,
    pub access_log: AccessLog,
    pub signals: Arc<ConnSignals>,
    /// Tier K, when the node attached it.
    pub kernel: Option<Arc<KernelBinding>>,
}

/// The identity of a listener across reloads.
pub type ListenerKey = (SocketAddr, ListenerProtocol);

pub enum Command {
    Listen {
        key: ListenerKey,
        socket: std::net::TcpListener,
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
    kernel: Option<Arc<KernelBinding>>,
) -> Result<WorkerHandle, ProxyError> {
    let view = Arc::new(ArcSwap::from_pointee(view));
    let (tx, rx) = mpsc::unbounded_channel();
    let worker_view = view.clone();
    let thread = std::thread::Builder::new()
        .name(format!("flatmesh-worker-{id}"))
        .spawn(move || run(id, worker_view, access_log, kernel, rx))
        .map_err(|source| ProxyError::Thread { worker: id, source })?;
    Ok(WorkerHandle {
        id,
        view,
        commands: tx,
        thread: Some(thread),
    })
}

fn run(
    id: usize,
    view: Arc<ArcSwap<WorkerView>>,
    access_log: AccessLog,
    kernel: Option<Arc<KernelBinding>>,
    mut rx: mpsc::UnboundedReceiver<Command>,
) {
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
        let active = Arc::new(AtomicUsize::new(0));
        let mut accepting: HashMap<ListenerKey, tokio::task::JoinHandle<()>> = HashMap::new();
        let mut drain = Duration::ZERO;
        while let Some(command) = rx.recv().await {
            match command {
                Command::Listen { key, socket } => match tokio::net::TcpListener::from_std(socket) {
                    Ok(listener) => {
                        let task = tokio::spawn(accept_loop(
                            id,
                            key,
                            listener,
                            view.clone(),
                            access_log.clone(),
                            kernel.clone(),
                            active.clone(),
                        ));
                        if let Some(old) = accepting.insert(key, task) {
                            old.abort();
                        }
                    }
                    Err(err) => tracing::error!(worker = id, address = %key.0, error = %err, "cannot use listening socket"),
                },
                Command::Unlisten { key } => {
                    if let Some(task) = accepting.remove(&key) {
                        task.abort();
                    }
                }
                Command::Shutdown { drain: d } => {
                    drain = d;
                    break;
                }
            }
        }
        for (_, task) in accepting.drain() {
            task.abort();
        }
        // Let in-flight connections finish, up to the drain time.
        let deadline = tokio::time::Instant::now() + drain;
        while active.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
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

async fn accept_loop(
    worker: usize,
    key: ListenerKey,
    listener: tokio::net::TcpListener,
    view: Arc<ArcSwap<WorkerView>>,
    access_log: AccessLog,
    kernel: Option<Arc<KernelBinding>>,
    active: Arc<AtomicUsize>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // EMFILE / ENFILE / ECONNABORTED: back off briefly instead of spinning.
                tracing::warn!(worker, address = %key.0, error = %err, "accept failed; if this is 'too many open files', raise `ulimit -n`");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        active.fetch_add(1, Ordering::Relaxed);
        let guard = ActiveGuard(active.clone());
        let ctx = Arc::new(ConnContext {
            worker,
            listener_address: key.0,
            protocol: key.1,
            peer,
            peer_ip: http::HeaderValue::from_str(&peer.ip().to_string())
                .unwrap_or(http::HeaderValue::from_static("unknown")),
            view: view.clone(),
            access_log: access_log.clone(),
            signals: Arc::new(ConnSignals::default()),
            kernel: kernel.clone(),
        });
        tokio::spawn(async move {
            let _guard = guard;
            let current = ctx.view.load_full();
            let plan = current
                .snapshot
                .listener_at(key.0, key.1)
                .map(|l| &current.snapshot.listeners[l]);
            let stats = plan.map(|l| l.stats.clone());
            if let Some(s) = &stats {
                s.connections_opened.add_shared(worker, 1);
            }
            match key.1 {
                ListenerProtocol::Tcp => crate::tcp::relay(ctx, stream).await,
                ListenerProtocol::Http => match &ctx.kernel {
                    Some(k) if plan.is_some_and(|l| l.kernel_l7) => {
                        let k = k.clone();
                        serve_http_with_kernel(ctx, &k, stream, &current).await
                    }
                    _ => {
                        let _ = stream.set_nodelay(true);
                        serve_http(ctx, stream, &current.snapshot).await
                    }
                },
            }
            if let Some(s) = &stats {
                s.connections_closed.add_shared(worker, 1);
            }
        });
    }
}

/// The L7 listener with tier K: the kernel decides the first request; a decided connection is
/// spliced to an endpoint of its cluster, anything else runs the user L7 path over the bytes
/// read so far.
async fn serve_http_with_kernel(
    ctx: Arc<ConnContext>,
    kernel: &KernelBinding,
    stream: tokio::net::TcpStream,
    view: &WorkerView,
) {
    let snapshot = &view.snapshot;
    let _ = stream.set_nodelay(true);
    let buffered = match kernel
        .first_request(&stream, snapshot.config.limits.header_read_timeout)
        .await
    {
        FirstRequest::Closed => return,
        FirstRequest::UserTier {
            buffered,
            strip_settings_ack: true,
        } => {
            // The proxy sent the client an HTTP/2 SETTINGS frame while the kernel decided;
            // the user tier must not see the client's ACK of it.
            let stream = crate::kernel::StripSettingsAck::new(Rewind::new(buffered, stream));
            return serve_http(ctx, stream, snapshot).await;
        }
        FirstRequest::UserTier { buffered, .. } => buffered,
        FirstRequest::Decided {
            cluster,
            cookie,
            buffered,
            consumed,
        } => {
            let listener = snapshot
                .listener_at(ctx.listener_address, ctx.protocol)
                .map(|l| &snapshot.listeners[l]);
            let name = listener.map(|l| l.name.as_str()).unwrap_or("");
            let connected = match snapshot.clusters.get(cluster) {
                Some(_) => crate::tcp::connect_upstream(&ctx, view, name, cluster).await,
                None => None,
            };
            match connected {
                Some((mut up, _in_flight)) => {
                    match kernel
                        .take_decided(cookie, &stream, &mut up, &buffered, consumed)
                        .await
                    {
                        Ok(path) => {
                            let (_, _, in_kernel) =
                                crate::tcp::pump_path(Some(kernel), stream, up, path).await;
                            if let (Some(l), true) = (listener, in_kernel) {
                                l.stats.kernel_spliced.add_shared(ctx.worker, 1);
                            }
                        }
                        Err(err) => {
                            tracing::debug!(error = %err, "upstream closed before the first request was written");
                        }
                    }
                    kernel.forget(&[cookie]);
                    return;
                }
                // No endpoint answered: the user tier gives the client its 503.
                None => {
                    kernel.forget(&[cookie]);
                    buffered
                }
            }
        }
    };
    serve_http(ctx, Rewind::new(buffered, stream), snapshot).await
}

/// An http listener's connection: the first bytes tell the protocol. The HTTP/2 preface goes
/// to hyper's HTTP/2 server, anything else to flatmesh's own HTTP/1 path.
async fn serve_http<S>(ctx: Arc<ConnContext>, mut stream: S, snapshot: &Snapshot)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let limits = &snapshot.config.limits;
    let mut first = bytes::BytesMut::with_capacity(16 * 1024);
    let mut deadline = tokio::time::Instant::now() + limits.idle_timeout;
    let protocol = loop {
        if let Some(protocol) = sniff(&first) {
            break protocol;
        }
        let read = tokio::io::AsyncReadExt::read_buf(&mut stream, &mut first);
        match tokio::time::timeout_at(deadline, read).await {
            Ok(Ok(n)) if n > 0 => {}
            // Closed, failed, or silent: nothing to answer.
            _ => return,
        }
        deadline = deadline.min(tokio::time::Instant::now() + limits.header_read_timeout);
    };
    match protocol {
        Protocol::Http2 => serve_h2(ctx, Rewind::new(first.to_vec(), stream), snapshot).await,
        Protocol::Http1 => crate::h1::serve(ctx, stream, first).await,
    }
}

async fn serve_h2<S>(ctx: Arc<ConnContext>, stream: S, snapshot: &Snapshot)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let limits = &snapshot.config.limits;
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(1024);
    let signals = ctx.signals.clone();
    let io = TokioIo::new(Tapped {
        inner: stream,
        tap: ActivityTap(signals.clone()),
    });
    let service = service_fn(move |req| crate::http::serve(ctx.clone(), req));
    let connection = builder.serve_connection(io, service);
    tokio::select! {
        result = connection => {
            if let Err(err) = result {
                tracing::debug!(error = %err, "downstream connection ended with an error");
            }
        }
        // Dropping the connection future closes the socket.
        _ = crate::downstream::idle(&signals, limits.idle_timeout) => {
            tracing::debug!("closing idle downstream connection");
        }
    }
}
