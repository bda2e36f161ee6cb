//! A `tunnel: hbone` cluster: each connection a `tcp` listener relays to it becomes one
//! HTTP/2 CONNECT stream to `ENDPOINT_IP:tunnel_port`, `:authority` the endpoint's
//! `IP:PORT`. Tunnel connections (mutual TLS, the cluster's `tls`) are pooled per worker and
//! peer node, each carrying at most `limits.http2_max_concurrent_streams` streams; when all
//! are full, another is opened.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use http::{Method, Request, StatusCode, Uri};
use parking_lot::Mutex;
use tokio::net::TcpStream;

use super::stream::H2Stream;
use super::Refusal;
use crate::context::{ConnContext, WorkerView};
use crate::lb::hash_client;
use crate::snapshot::ClusterPlan;
use crate::tap::Tapped;
use crate::tcp::{copy_until_idle, reset_on_close, ByteCount, Relay, RelayEnd};
use crate::tls::Stream;

/// A tunnel cluster's peers' port and its pool of tunnel connections.
pub struct TunnelPlan {
    /// The port the endpoints' nodes accept tunnels on (`tunnel_port`).
    pub port: u16,
    /// Streams one tunnel connection carries at most.
    max_streams: usize,
    /// HTTP/2 windows the node grants the peer on a tunnel connection.
    stream_window: u32,
    connection_window: u32,
    /// Per (worker, peer node): its open tunnel connections. A connection's task runs on its
    /// worker's runtime, so each worker uses its own.
    pool: Mutex<HashMap<(usize, SocketAddr), Vec<Pooled>>>,
}

#[derive(Clone)]
struct Pooled {
    send: SendRequest<Bytes>,
    streams: Arc<AtomicUsize>,
    closed: Arc<AtomicBool>,
}

/// One stream's place on its tunnel connection, given back when the stream ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why opening a stream failed: the tunnel connection is gone (try a fresh one), or the peer
/// or the path refused this stream.
enum Failed {
    Connection,
    Refused(Refusal),
}

impl TunnelPlan {
    pub fn new(port: u16, limits: &flatmesh_config::Limits) -> TunnelPlan {
        TunnelPlan {
            port,
            max_streams: limits.http2_max_concurrent_streams.max(1) as usize,
            stream_window: limits.http2_stream_window,
            connection_window: limits.http2_connection_window,
            pool: Mutex::default(),
        }
    }

    /// A pooled connection to `peer` with room for one more stream, its room taken.
    fn pooled(&self, worker: usize, peer: SocketAddr) -> Option<(Pooled, Slot)> {
        let mut pool = self.pool.lock();
        let conns = pool.get_mut(&(worker, peer))?;
        conns.retain(|c| !c.closed.load(Ordering::Relaxed));
        let conn = conns
            .iter()
            .find(|c| c.streams.load(Ordering::Relaxed) < self.max_streams)?;
        conn.streams.fetch_add(1, Ordering::Relaxed);
        Some((conn.clone(), Slot(conn.streams.clone())))
    }

    /// Opens a tunnel connection to `peer` (TCP, the cluster's TLS, HTTP/2), pools it with
    /// one stream's room taken, and spawns its task on this worker.
    async fn connect(
        &self,
        ctx: &ConnContext,
        cluster: &ClusterPlan,
        peer: SocketAddr,
    ) -> Result<(Pooled, Slot), Refusal> {
        let Some(tls) = &cluster.tls else {
            // Validation refuses a tunnel without `tls`; never tunnel in the clear.
            return Err("no_tls");
        };
        let socket_slot = crate::limits::upstream_socket().map_err(|err| {
            tracing::warn!(cluster = %cluster.name, %peer, error = %err, "HBONE tunnel connection refused");
            "fd_limit"
        })?;
        let tcp = match tokio::time::timeout(cluster.connect_timeout, TcpStream::connect(peer))
            .await
        {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(err)) => {
                cluster.stats.connect_failures.add_shared(ctx.worker, 1);
                tracing::warn!(cluster = %cluster.name, %peer, error = %err,
                    "HBONE tunnel connect failed; check that the peer node has an hbone listener on its tunnel_port");
                return Err("connect_failed");
            }
            Err(_) => {
                cluster.stats.connect_failures.add_shared(ctx.worker, 1);
                tracing::warn!(cluster = %cluster.name, %peer,
                    "HBONE tunnel connect timed out; check the peer node or raise connect_timeout");
                return Err("connect_timeout");
            }
        };
        cluster.stats.connections.add_shared(ctx.worker, 1);
        let _ = tcp.set_nodelay(true);
        let stream: Stream = tls
            .originate(tcp, &cluster.stats, ctx.worker)
            .await
            .map_err(|_| "tls")?;
        let mut builder = h2::client::Builder::new();
        builder
            .initial_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window);
        let (send, connection) = match tokio::time::timeout(
            cluster.connect_timeout,
            builder.handshake(stream),
        )
        .await
        {
            Ok(Ok(handshake)) => handshake,
            Ok(Err(err)) => {
                tracing::warn!(cluster = %cluster.name, %peer, error = %err, "HBONE tunnel: HTTP/2 handshake failed");
                return Err("h2_handshake");
            }
            Err(_) => {
                tracing::warn!(cluster = %cluster.name, %peer, "HBONE tunnel: HTTP/2 handshake timed out");
                return Err("h2_handshake");
            }
        };
        let closed = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(AtomicUsize::new(1));
        let conn = Pooled {
            send,
            streams: streams.clone(),
            closed: closed.clone(),
        };
        let name = cluster.name.clone();
        tokio::spawn(async move {
            // The connection holds its socket's place in the fd budget while it runs.
            let _socket = socket_slot;
            if let Err(err) = connection.await {
                tracing::debug!(cluster = %name, %peer, error = %err, "HBONE tunnel connection ended with an error");
            }
            closed.store(true, Ordering::Relaxed);
        });
        self.pool
            .lock()
            .entry((ctx.worker, peer))
            .or_default()
            .push(conn.clone());
        Ok((conn, Slot(streams)))
    }

    /// A CONNECT stream to `endpoint` through its node: on a pooled connection with room,
    /// else on a new one (also when the pooled one turns out to be gone).
    async fn open(
        &self,
        ctx: &ConnContext,
        cluster: &ClusterPlan,
        endpoint: SocketAddr,
    ) -> Result<(H2Stream, Slot), Refusal> {
        let peer = SocketAddr::new(endpoint.ip(), self.port);
        if let Some((conn, slot)) = self.pooled(ctx.worker, peer) {
            match connect_stream(conn.send.clone(), endpoint, cluster.connect_timeout).await {
                Ok(stream) => return Ok((stream, slot)),
                Err(Failed::Refused(reason)) => return Err(reason),
                Err(Failed::Connection) => conn.closed.store(true, Ordering::Relaxed),
            }
        }
        let (conn, slot) = self.connect(ctx, cluster, peer).await?;
        match connect_stream(conn.send.clone(), endpoint, cluster.connect_timeout).await {
            Ok(stream) => Ok((stream, slot)),
            Err(Failed::Refused(reason)) => Err(reason),
            Err(Failed::Connection) => {
                conn.closed.store(true, Ordering::Relaxed);
                Err("tunnel_closed")
            }
        }
    }
}

/// Sends the CONNECT for `endpoint` and waits (within `timeout`) for the peer's answer.
async fn connect_stream(
    send: SendRequest<Bytes>,
    endpoint: SocketAddr,
    timeout: Duration,
) -> Result<H2Stream, Failed> {
    let answered = async {
        let mut send = send.ready().await.map_err(|_| Failed::Connection)?;
        let mut request = Request::new(());
        *request.method_mut() = Method::CONNECT;
        *request.uri_mut() =
            Uri::try_from(endpoint.to_string()).map_err(|_| Failed::Refused("bad_authority"))?;
        let (response, stream) = send
            .send_request(request, false)
            .map_err(|_| Failed::Connection)?;
        let response = response.await.map_err(|err| {
            // A stream the peer refused before reading it, or a connection going away: a
            // fresh connection may do. Anything else is the peer's answer to this stream.
            if err.is_go_away() || err.reason() == Some(h2::Reason::REFUSED_STREAM) || err.is_io() {
                Failed::Connection
            } else {
                Failed::Refused("peer_reset")
            }
        })?;
        match response.status() {
            StatusCode::OK => Ok(H2Stream::new(stream, response.into_body())),
            StatusCode::BAD_REQUEST => Err(Failed::Refused("peer_400")),
            StatusCode::FORBIDDEN => Err(Failed::Refused("peer_403")),
            StatusCode::SERVICE_UNAVAILABLE => Err(Failed::Refused("peer_503")),
            _ => Err(Failed::Refused("peer_status")),
        }
    };
    tokio::time::timeout(timeout, answered)
        .await
        .unwrap_or(Err(Failed::Refused("peer_timeout")))
}

/// Relays a tcp listener's connection through a tunnel to an endpoint of cluster `cid`,
/// trying up to 3 endpoints as the plain relay does. The listener counts the bytes.
pub async fn relay(
    ctx: &ConnContext,
    view: &WorkerView,
    listener: usize,
    cid: flatmesh_rules::ClusterId,
    downstream: Stream,
) {
    let snap = &view.snapshot;
    let plan = &snap.listeners[listener];
    let cluster = &snap.clusters[cid];
    let Some(tunnel) = &cluster.tunnel else {
        return;
    };
    let balancer = &view.upstreams.by_cluster[cid].balancer;
    let key = hash_client(ctx.peer.ip());
    let mut opened = None;
    for attempt in 0..cluster.endpoints.len().clamp(1, 3) {
        let Some((index, in_flight)) = balancer.pick(key, attempt) else {
            break;
        };
        let endpoint = cluster.endpoints[index];
        match tunnel.open(ctx, cluster, endpoint).await {
            Ok((stream, slot)) => {
                opened = Some((stream, slot, in_flight));
                break;
            }
            Err(reason) => {
                cluster.stats.tunnel.refused(reason);
                tracing::warn!(listener = %plan.name, cluster = %cluster.name, %endpoint, reason,
                    "HBONE stream to the endpoint was not opened");
            }
        }
    }
    let Some((stream, _slot, _in_flight)) = opened else {
        reset_on_close(downstream.tcp());
        return;
    };
    cluster.stats.tunnel.opened.add_shared(ctx.worker, 1);
    let relay = Relay::of(
        &snap
            .config
            .limits
            .for_listener(&snap.config.listeners[listener]),
    );
    let Some(_buffers) = ctx
        .budget
        .memory
        .try_take(2 * relay.buffer, snap.config.limits.memory_budget_bytes)
    else {
        tracing::debug!(listener = %plan.name, "memory budget spent; closing the relay");
        reset_on_close(downstream.tcp());
        return;
    };
    let _ = downstream.tcp().set_nodelay(true);
    let mut client = Tapped {
        inner: downstream,
        tap: ByteCount::default(),
    };
    let mut up = Tapped {
        inner: stream,
        tap: ByteCount::default(),
    };
    if let RelayEnd::Failed(err) = copy_until_idle(&mut client, &mut up, relay).await {
        tracing::debug!(listener = %plan.name, error = %err, "tunnelled relay ended with an error; resetting both sides");
        reset_on_close(client.inner.tcp());
        up.inner.reset();
    }
    plan.stats.bytes_in.add_shared(ctx.worker, client.tap.0);
    plan.stats.bytes_out.add_shared(ctx.worker, up.tap.0);
}
