//! A `tunnel: hbone` cluster's tunnel connections on one worker: HTTP/2 over the cluster's
//! mutual TLS to `ENDPOINT_IP:tunnel_port`, pooled per peer node and presented identity
//! (the cluster's own or a workload's: streams of two workloads never share a connection,
//! so the peer sees each workload's own identity), each carrying at most
//! `limits.http2_max_concurrent_streams` CONNECT streams; when all are full, another is
//! opened. [`TunnelPool::open`] gives one stream to an endpoint, `:authority` its `IP:PORT`.
//!
//! Dials are single-flight: streams that find no room while a connection to the same peer
//! and identity is being dialled wait for that dial instead of each opening its own (a burst
//! of new streams would otherwise cost a TCP and TLS handshake apiece), and share its failure.

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
use crate::snapshot::ClusterPlan;
use crate::tls::{ClusterTlsPlan, Stream};
use crate::upstream::dials::{Dials, Turn};

/// One worker's tunnel connections of one tunnel cluster.
pub struct TunnelPool {
    /// The port the endpoints' nodes accept tunnels on (`tunnel_port`).
    port: u16,
    /// Streams one tunnel connection carries at most.
    max_streams: usize,
    /// HTTP/2 windows the node grants the peer on a tunnel connection.
    stream_window: u32,
    connection_window: u32,
    /// Per peer node and presented identity: its open tunnel connections (whose tasks run
    /// on this worker).
    pool: Mutex<HashMap<PoolKey, Vec<Pooled>>>,
    /// The dials in progress, per peer node and presented identity.
    dials: Dials<PoolKey, Refusal>,
}

type PoolKey = (SocketAddr, Presenting);

/// Whose identity a tunnel connection presents: the cluster's own certificate (`None`) or a
/// workload's.
pub type Presenting = Option<crate::workload::WorkloadId>;

#[derive(Clone)]
struct Pooled {
    send: SendRequest<Bytes>,
    streams: Arc<AtomicUsize>,
    closed: Arc<AtomicBool>,
}

/// One stream's place on its tunnel connection, given back when the stream ends.
pub struct Slot(Arc<AtomicUsize>);

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

impl TunnelPool {
    pub fn new(port: u16, limits: &flatmesh_config::Limits) -> TunnelPool {
        TunnelPool {
            port,
            max_streams: limits.http2_max_concurrent_streams.max(1) as usize,
            stream_window: limits.http2_stream_window,
            connection_window: limits.http2_connection_window,
            pool: Mutex::default(),
            dials: Dials::default(),
        }
    }

    /// Room for one stream to `peer` presenting `who`: on a pooled connection, else on the
    /// connection a dial in progress opens (waiting for it), else on one this call dials.
    async fn room(
        &self,
        worker: usize,
        cluster: &ClusterPlan,
        tls: &ClusterTlsPlan,
        peer: SocketAddr,
        who: Presenting,
    ) -> Result<(Pooled, Slot), Refusal> {
        loop {
            if let Some(found) = self.pooled(peer, who) {
                return Ok(found);
            }
            match self.dials.turn((peer, who)).await {
                Turn::Waited(Ok(())) => {}
                Turn::Waited(Err(reason)) => return Err(reason),
                Turn::Lead(mut dial) => {
                    let dialled = self.connect(worker, cluster, tls, peer, who).await;
                    dial.finish(dialled.as_ref().map(|_| ()).map_err(|reason| *reason));
                    return dialled;
                }
            }
        }
    }

    /// A pooled connection to `peer` presenting `who`, with room for one more stream, its
    /// room taken.
    fn pooled(&self, peer: SocketAddr, who: Presenting) -> Option<(Pooled, Slot)> {
        let mut pool = self.pool.lock();
        let conns = pool.get_mut(&(peer, who))?;
        conns.retain(|c| !c.closed.load(Ordering::Relaxed));
        let conn = conns
            .iter()
            .find(|c| c.streams.load(Ordering::Relaxed) < self.max_streams)?;
        conn.streams.fetch_add(1, Ordering::Relaxed);
        Some((conn.clone(), Slot(conn.streams.clone())))
    }

    /// Opens a tunnel connection to `peer` (TCP, `tls`: the cluster's, presenting `who`,
    /// HTTP/2), pools it with one stream's room taken, and spawns its task on this worker.
    async fn connect(
        &self,
        worker: usize,
        cluster: &ClusterPlan,
        tls: &ClusterTlsPlan,
        peer: SocketAddr,
        who: Presenting,
    ) -> Result<(Pooled, Slot), Refusal> {
        let socket_slot = crate::limits::upstream_socket().map_err(|err| {
            tracing::warn!(cluster = %cluster.name, %peer, error = %err, "HBONE tunnel connection refused");
            "fd_limit"
        })?;
        let tcp = match tokio::time::timeout(cluster.connect_timeout, TcpStream::connect(peer))
            .await
        {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(err)) => {
                cluster.stats.connect_failures.add_shared(worker, 1);
                tracing::warn!(cluster = %cluster.name, %peer, error = %err,
                    "HBONE tunnel connect failed; check that the peer node has an hbone listener on its tunnel_port");
                return Err("connect_failed");
            }
            Err(_) => {
                cluster.stats.connect_failures.add_shared(worker, 1);
                tracing::warn!(cluster = %cluster.name, %peer,
                    "HBONE tunnel connect timed out; check the peer node or raise connect_timeout");
                return Err("connect_timeout");
            }
        };
        cluster.stats.connections.add_shared(worker, 1);
        let _ = tcp.set_nodelay(true);
        let stream: Stream = tls
            .originate(tcp, &cluster.stats, worker)
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
            .entry((peer, who))
            .or_default()
            .push(conn.clone());
        Ok((conn, Slot(streams)))
    }

    /// A CONNECT stream to `endpoint` through its node, presenting `who`'s identity: on a
    /// pooled connection with room, else on a new one (also when the pooled one turns out
    /// to be gone). `worker` is the worker this pool belongs to, for the counters.
    pub async fn open(
        &self,
        worker: usize,
        cluster: &ClusterPlan,
        endpoint: SocketAddr,
        who: Presenting,
    ) -> Result<(H2Stream, Slot), Refusal> {
        let tls = match who {
            Some(w) => cluster.workload_tls.get(w).and_then(Option::as_ref),
            None => cluster.tls.as_ref().filter(|t| t.presents.is_some()),
        };
        let Some(tls) = tls else {
            // Validation refuses a tunnel without `tls`, so never in the clear; and a
            // connection of no declared workload has no identity when the cluster has no
            // certificate of its own.
            return Err("no_identity");
        };
        let peer = SocketAddr::new(endpoint.ip(), self.port);
        // A pooled connection can turn out to be gone when the stream is sent: then once
        // more, on another (the closed one is no longer pooled).
        for _ in 0..2 {
            let (conn, slot) = self.room(worker, cluster, tls, peer, who).await?;
            match connect_stream(conn.send.clone(), endpoint, cluster.connect_timeout).await {
                Ok(stream) => return Ok((stream, slot)),
                Err(Failed::Refused(reason)) => return Err(reason),
                Err(Failed::Connection) => conn.closed.store(true, Ordering::Relaxed),
            }
        }
        Err("tunnel_closed")
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
