//! The one upstream connection type of the HTTP pools: the bytes of an HTTP/1.1 pooled
//! connection or of an HTTP/2 cluster's connection, whichever way they travel. Either a socket
//! of the node's own to the endpoint (in the clear or inside the cluster's TLS), or, for a
//! `tunnel: hbone` cluster, one HBONE CONNECT stream to the endpoint through its node's tunnel
//! port ([`crate::hbone::pool`]). The HTTP/1 pool and the HTTP/2 client open it with
//! [`open`], and read, write, pool and judge a [`Transport`] without knowing which it is.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::hbone::pool::{Slot, TunnelPool};
use crate::hbone::stream::H2Stream;
use crate::l7::error::UpstreamError;
use crate::limits::{upstream_socket, SocketSlot};
use crate::metrics::ClusterStats;
use crate::resilience::{Overflow, Permit};
use crate::snapshot::ClusterPlan;
use crate::tls::Stream;

/// An upstream connection's byte stream, with the place it holds while it is open.
pub enum Transport {
    /// A socket to the endpoint, holding its place in the node's fd budget.
    Direct { stream: Stream, _slot: SocketSlot },
    /// A CONNECT stream on one of the worker's tunnel connections to the endpoint's node,
    /// holding its place among that connection's streams (the tunnel connection holds the
    /// socket).
    Tunnel { stream: H2Stream, _slot: Slot },
}

/// A new connection to `endpoint` of cluster `plan` for worker `worker`, if the cluster's
/// circuit breaker has room for it: the try counts as pending while it opens, and the
/// connection holds its place under `max_connections` (the permit returned) while it is open.
/// `make_room` is called first when the breaker is full, to close an idle connection of the
/// caller's. Through `tunnels` for a `tunnel: hbone` cluster, else a socket of the node's own,
/// in the cluster's TLS if it has one.
pub async fn open(
    plan: &ClusterPlan,
    worker: usize,
    endpoint: SocketAddr,
    tunnels: Option<&TunnelPool>,
    make_room: impl FnOnce(),
) -> Result<(Transport, Permit), UpstreamError> {
    let breaker = &plan.guard.breaker;
    let _pending = breaker
        .acquire(Overflow::Pending)
        .map_err(UpstreamError::overflow)?;
    if breaker.open(Overflow::Connections) >= breaker.limit(Overflow::Connections) {
        make_room();
    }
    let counted = breaker
        .acquire(Overflow::Connections)
        .map_err(UpstreamError::overflow)?;
    let transport = match tunnels {
        Some(tunnels) => tunnel(tunnels, plan, worker, endpoint)
            .await
            .map_err(UpstreamError::connect)?,
        None => {
            let (tcp, slot) = connect(endpoint, plan.connect_timeout, &plan.stats, worker)
                .await
                .map_err(UpstreamError::connect)?;
            let stream = match &plan.tls {
                None => Stream::Plain(tcp),
                Some(tls) => tls
                    .originate(tcp, &plan.stats, worker)
                    .await
                    .map_err(|err| {
                        UpstreamError::connect(format!(
                            "TLS handshake with the endpoint failed: {err}"
                        ))
                    })?,
            };
            Transport::direct(stream, slot)
        }
    };
    Ok((transport, counted))
}

/// Opens a socket to `endpoint` within `timeout`, holding its place in the node's fd budget,
/// and counts it (or its failure) for the cluster.
pub async fn connect(
    endpoint: SocketAddr,
    timeout: Duration,
    stats: &ClusterStats,
    worker: usize,
) -> io::Result<(TcpStream, SocketSlot)> {
    // Connect outcomes are rare next to requests and can come from any task of the worker;
    // the shared add keeps them exact.
    let slot = upstream_socket().inspect_err(|_| stats.connect_failures.add_shared(worker, 1))?;
    let connected = match tokio::time::timeout(timeout, TcpStream::connect(endpoint)).await {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "connect timed out after {}",
                flatmesh_config::duration::format(&timeout)
            ),
        )),
    };
    match connected {
        Ok(stream) => {
            stats.connections.add_shared(worker, 1);
            let _ = stream.set_nodelay(true);
            Ok((stream, slot))
        }
        Err(err) => {
            stats.connect_failures.add_shared(worker, 1);
            Err(err)
        }
    }
}

/// Opens a connection to `endpoint` of tunnel cluster `plan` on worker `worker`: one CONNECT
/// stream through the endpoint's node, on `tunnels` (this worker's tunnel connections of the
/// cluster). Counted as a tcp listener's tunnelled connections are: opened, or refused by
/// reason (`flatmesh_upstream_hbone_streams_refused_total`). Err: why, for the caller's
/// connect failure; a refusal is that endpoint's failure to connect, so a retry on
/// `connect-failure` goes to another endpoint.
pub async fn tunnel(
    tunnels: &TunnelPool,
    plan: &ClusterPlan,
    worker: usize,
    endpoint: SocketAddr,
) -> Result<Transport, String> {
    // The pooled connections of an http route are shared by every client, so they present
    // the cluster's own certificate, never one workload's.
    match tunnels.open(worker, plan, endpoint, None).await {
        Ok((stream, slot)) => {
            plan.stats.tunnel.opened.add_shared(worker, 1);
            Ok(Transport::Tunnel {
                stream,
                _slot: slot,
            })
        }
        Err(reason) => {
            plan.stats.tunnel.refused(reason);
            tracing::warn!(cluster = %plan.name, %endpoint, reason,
                "HBONE stream to the endpoint was not opened");
            Err(format!(
                "no HBONE stream through the endpoint's node ({reason}, counted in flatmesh_upstream_hbone_streams_refused_total)"
            ))
        }
    }
}

impl Transport {
    /// A socket opened for one endpoint.
    pub fn direct(stream: Stream, slot: SocketSlot) -> Transport {
        Transport::Direct {
            stream,
            _slot: slot,
        }
    }

    /// Reads what has arrived into `buf`; Ready(Ok(0)) at the end of the stream.
    pub fn poll_read_buf(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        match self {
            Transport::Direct { stream, .. } => stream.poll_read_buf(cx, buf),
            Transport::Tunnel { stream, .. } => stream.poll_read_buf(cx, buf),
        }
    }

    /// True if an idle connection is known to be unusable: closed, reset, or holding bytes
    /// nobody asked for. Never blocks.
    pub fn is_stale(&mut self) -> bool {
        match self {
            Transport::Direct { stream, .. } => stream.is_stale(),
            Transport::Tunnel { stream, .. } => stream.is_stale(),
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Direct { stream, .. } => Pin::new(stream).poll_read(cx, buf),
            Transport::Tunnel { stream, .. } => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Direct { stream, .. } => Pin::new(stream).poll_write(cx, buf),
            Transport::Tunnel { stream, .. } => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Direct { stream, .. } => Pin::new(stream).poll_write_vectored(cx, bufs),
            Transport::Tunnel { stream, .. } => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Direct { stream, .. } => stream.is_write_vectored(),
            Transport::Tunnel { stream, .. } => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Direct { stream, .. } => Pin::new(stream).poll_flush(cx),
            Transport::Tunnel { stream, .. } => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Direct { stream, .. } => Pin::new(stream).poll_shutdown(cx),
            Transport::Tunnel { stream, .. } => Pin::new(stream).poll_shutdown(cx),
        }
    }
}
