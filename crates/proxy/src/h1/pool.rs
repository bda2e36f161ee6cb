//! Keep-alive HTTP/1.1 connections to one cluster's endpoints, owned by one worker.
//!
//! Hand-written rather than hyper-util's pool: that pool keys every checkout by a hashed
//! scheme+authority, wraps each connection in a dispatcher task and hands requests over a
//! channel, which together cost more user-space CPU per request than the rest of the
//! proxy's HTTP/1 path. Here a request takes a socket out of a per-endpoint stack, uses it
//! directly from its own task, and puts it back.
//!
//! A `tunnel: hbone` cluster's connections are CONNECT streams through the endpoints' nodes
//! (`crate::upstream::transport`), pooled and reused the same way.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use parking_lot::Mutex;

use super::head::{self, Framing, MAX_HEADERS};
use crate::hbone::pool::TunnelPool;
use crate::l7::error::UpstreamError;
use crate::resilience::Permit;
use crate::snapshot::ClusterPlan;
use crate::upstream::transport::{self, Transport};

/// Idle connections kept per endpoint and how long one may stay idle. hyper-util's defaults
/// for the pool this replaces.
const MAX_IDLE_PER_ENDPOINT: usize = 1024;
const MAX_IDLE_TIME: Duration = Duration::from_secs(90);
/// Read buffer of an upstream connection; grows for a large response head.
const READ_BUFFER: usize = 16 * 1024;

/// One connection to an endpoint, with the bytes read from it and not yet used.
pub struct UpstreamConn {
    /// In the clear, inside the cluster's TLS, or through the endpoint's node's tunnel.
    pub stream: Transport,
    pub buf: BytesMut,
    /// Taken from the pool rather than freshly connected: the endpoint may have closed it
    /// while it was idle, so a request that fails on it before any answer is retried.
    pub reused: bool,
    idle_since: Instant,
    /// Its place under the cluster's `circuit_breaker.max_connections` while it is open.
    counted: Option<Permit>,
}

impl UpstreamConn {
    fn new(stream: Transport) -> UpstreamConn {
        UpstreamConn {
            stream,
            buf: BytesMut::with_capacity(READ_BUFFER),
            reused: false,
            idle_since: Instant::now(),
            counted: None,
        }
    }

    /// True if the idle socket is known to be unusable: the endpoint closed it (EOF or
    /// reset) or sent bytes nobody asked for. Costs no system call unless the reactor has
    /// seen the socket become readable.
    fn is_stale(&mut self) -> bool {
        self.stream.is_stale()
    }
}

/// The idle connections of one cluster, per endpoint (an `original_dst` cluster's: per
/// destination).
pub struct H1Pool {
    idle: Mutex<HashMap<SocketAddr, Vec<UpstreamConn>>>,
    /// A `tunnel: hbone` cluster's: this worker's tunnel connections, which new connections
    /// are opened through.
    tunnels: Option<Arc<TunnelPool>>,
    /// An `original_dst` cluster's `max_destinations`: the most destinations it keeps idle
    /// connections to (any other cluster's are bounded by its endpoints).
    max_destinations: Option<usize>,
}

impl H1Pool {
    /// A pool whose new connections are opened directly, or through `tunnels`, keeping idle
    /// connections to at most `max_destinations` endpoints when bounded.
    pub fn new(tunnels: Option<Arc<TunnelPool>>, max_destinations: Option<usize>) -> Arc<H1Pool> {
        Arc::new(H1Pool {
            idle: Mutex::default(),
            tunnels,
            max_destinations,
        })
    }

    /// The most recently used live connection to `endpoint`, if any.
    pub fn checkout(&self, endpoint: SocketAddr) -> Option<UpstreamConn> {
        let mut idle = self.idle.lock();
        let stack = idle.get_mut(&endpoint)?;
        let mut found = None;
        while let Some(mut conn) = stack.pop() {
            if conn.idle_since.elapsed() < MAX_IDLE_TIME && !conn.is_stale() {
                conn.reused = true;
                found = Some(conn);
                break;
            }
        }
        // An endpoint with nothing idle takes no place among the destinations.
        if stack.is_empty() {
            idle.remove(&endpoint);
        }
        found
    }

    /// Keeps `conn` for the next request to `endpoint`. Call only after a complete
    /// response with nothing left over. A bounded pool full of other destinations first
    /// drops those whose connections have all been idle too long, then, if it is still
    /// full, the destination idle the longest.
    pub fn checkin(&self, endpoint: SocketAddr, mut conn: UpstreamConn) {
        conn.idle_since = Instant::now();
        let mut idle = self.idle.lock();
        if let Some(max) = self.max_destinations {
            if !idle.contains_key(&endpoint) && idle.len() >= max {
                idle.retain(|_, stack| {
                    stack.iter().any(|c| c.idle_since.elapsed() < MAX_IDLE_TIME)
                });
            }
            if !idle.contains_key(&endpoint) && idle.len() >= max {
                let longest_idle = idle
                    .iter()
                    .min_by_key(|(_, stack)| stack.last().map(|c| c.idle_since))
                    .map(|(at, _)| *at);
                if let Some(at) = longest_idle {
                    idle.remove(&at);
                }
            }
        }
        let stack = idle.entry(endpoint).or_default();
        if stack.len() >= MAX_IDLE_PER_ENDPOINT {
            // Drop the oldest: it is the likeliest to have been closed by the endpoint.
            stack.remove(0);
        }
        stack.push(conn);
    }

    /// Closes one idle connection, the oldest of some endpoint, to make room under the
    /// cluster's `max_connections`, if there is one.
    fn evict_one(&self) {
        let mut idle = self.idle.lock();
        if let Some(stack) = idle.values_mut().find(|stack| !stack.is_empty()) {
            stack.remove(0);
        }
    }

    /// Destinations with idle connections right now.
    #[cfg(test)]
    pub fn destination_count(&self) -> usize {
        self.idle.lock().len()
    }

    /// Idle connections right now.
    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.idle.lock().values().map(Vec::len).sum()
    }
}

/// What the bytes buffered from an upstream connection hold, while a response is awaited.
pub enum HeadState {
    /// Not a whole head yet: read more.
    Incomplete,
    /// A final response head is at the front of the buffer.
    Final,
    /// An informational (1xx) head of `len` bytes, rewritten for the client as `head`.
    Informational { len: usize, head: Vec<u8> },
    /// Not an acceptable response: the endpoint answers 502.
    Invalid(String),
}

impl UpstreamConn {
    /// Looks at the buffered bytes for the head of the answer to a request. `upgrade`: the
    /// request asked to switch protocols, so a 101 is its final answer.
    pub fn response_head(&self, max_head: usize, upgrade: bool) -> HeadState {
        if self.buf.is_empty() {
            return HeadState::Incomplete;
        }
        let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut lines);
        match resp.parse(&self.buf) {
            Ok(httparse::Status::Complete(len)) => match resp.code {
                Some(101) if upgrade => HeadState::Final,
                Some(101) => HeadState::Invalid(
                    "101 Switching Protocols to a request that asked for no upgrade".into(),
                ),
                Some(code) if (100..200).contains(&code) => {
                    match head::analyze_response(&resp, false) {
                        Ok(info) => {
                            let mut out = Vec::new();
                            head::write_response_head(
                                &mut out,
                                &resp,
                                &info,
                                &[],
                                Framing::Empty,
                                false,
                                false,
                            );
                            HeadState::Informational { len, head: out }
                        }
                        Err(why) => HeadState::Invalid(why.into()),
                    }
                }
                _ => HeadState::Final,
            },
            Ok(httparse::Status::Partial) if self.buf.len() < max_head => HeadState::Incomplete,
            Ok(httparse::Status::Partial) => HeadState::Invalid("response head too large".into()),
            Err(e) => HeadState::Invalid(format!("malformed response head ({e})")),
        }
    }

    /// Reads more of the answer. The end of the connection is an error here: the caller
    /// still expects bytes.
    pub async fn read_more(&mut self) -> Result<(), UpstreamError> {
        self.buf.reserve(4096);
        match tokio::io::AsyncReadExt::read_buf(&mut self.stream, &mut self.buf).await {
            Ok(1..) => Ok(()),
            Ok(0) => Err(self.failed(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before a complete response",
            ))),
            Err(err) => Err(self.failed(err)),
        }
    }

    /// The error for `err` on this connection before a complete answer. A pooled connection
    /// that failed before any byte of an answer was probably closed by the endpoint while
    /// idle: the error says so, and a request without a body may go again on a fresh one.
    pub fn failed(&self, err: io::Error) -> UpstreamError {
        UpstreamError::closed(err, self.reused, !self.buf.is_empty())
    }
}

/// A connection to `endpoint`: an idle pooled one, else a new one if the cluster's circuit
/// breaker has room for it (an idle connection of this worker to another endpoint is closed
/// to make room under `max_connections`); the request counts as pending while it opens.
pub async fn acquire(
    pool: &H1Pool,
    endpoint: SocketAddr,
    plan: &ClusterPlan,
    worker: usize,
) -> Result<UpstreamConn, UpstreamError> {
    if let Some(conn) = pool.checkout(endpoint) {
        return Ok(conn);
    }
    // Boxed: opening (TLS handshake and all) is a large future, and every request's task
    // would otherwise carry room for it.
    let (stream, counted) = Box::pin(transport::open(
        plan,
        worker,
        endpoint,
        pool.tunnels.as_deref(),
        || pool.evict_one(),
    ))
    .await?;
    let mut conn = UpstreamConn::new(stream);
    conn.counted = Some(counted);
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A new connection to `addr`, as the pool would open it.
    async fn connect(
        addr: SocketAddr,
        timeout: Duration,
        stats: &crate::metrics::ClusterStats,
        worker: usize,
    ) -> io::Result<UpstreamConn> {
        let (tcp, slot) = transport::connect(addr, timeout, stats, worker).await?;
        Ok(UpstreamConn::new(Transport::direct(
            crate::tls::Stream::Plain(tcp),
            slot,
        )))
    }

    #[tokio::test]
    async fn closed_and_chatty_idle_connections_are_not_handed_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = crate::metrics::Metrics::new(1).cluster("c");
        let pool = H1Pool::new(None, None);

        let quiet = connect(addr, Duration::from_secs(1), &stats, 0)
            .await
            .unwrap();
        let (_quiet_peer, _) = listener.accept().await.unwrap();
        pool.checkin(addr, quiet);
        let conn = pool.checkout(addr).expect("a live idle connection");
        assert!(conn.reused);
        pool.checkin(addr, conn);

        let closed = connect(addr, Duration::from_secs(1), &stats, 0)
            .await
            .unwrap();
        let (closed_peer, _) = listener.accept().await.unwrap();
        let chatty = connect(addr, Duration::from_secs(1), &stats, 0)
            .await
            .unwrap();
        let (mut chatty_peer, _) = listener.accept().await.unwrap();
        pool.checkin(addr, closed);
        pool.checkin(addr, chatty);
        drop(closed_peer);
        chatty_peer.write_all(b"unasked").await.unwrap();
        // Let the reactor see both sockets become readable.
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let conn = pool
            .checkout(addr)
            .expect("the quiet connection is still there");
        assert_eq!(
            pool.idle_count(),
            0,
            "the closed and chatty ones were dropped"
        );
        drop(conn);
        assert_eq!(stats.connections.sum(), 3);
    }

    #[tokio::test]
    async fn a_bounded_pool_keeps_the_destinations_used_last() {
        let stats = crate::metrics::Metrics::new(1).cluster("c");
        let pool = H1Pool::new(None, Some(2));
        let mut listeners = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..3 {
            listeners.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
        }
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        for (l, addr) in listeners.iter().zip(&addrs) {
            let conn = connect(*addr, Duration::from_secs(1), &stats, 0)
                .await
                .unwrap();
            peers.push(l.accept().await.unwrap());
            pool.checkin(*addr, conn);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(pool.destination_count(), 2, "bounded to max_destinations");
        assert!(
            pool.checkout(addrs[0]).is_none(),
            "the destination idle the longest was evicted"
        );
        assert!(pool.checkout(addrs[1]).is_some());
        assert!(pool.checkout(addrs[2]).is_some());
        assert_eq!(
            pool.destination_count(),
            0,
            "a destination with nothing idle takes no place"
        );
    }
}
