//! hyper's HTTP/2 client, for `protocol: http2` clusters: one multiplexed connection per
//! endpoint and worker, connections and connect failures counted per cluster, and one try of
//! a request on it as the retry driver asks for it. A `tunnel: hbone` cluster's connection to
//! an endpoint is one CONNECT stream through the endpoint's node
//! (`crate::upstream::transport`), on which every request of the worker to it is multiplexed.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::body::{BoxError, UpstreamBody};
use crate::hbone::pool::TunnelPool;
use crate::l7::error::UpstreamError;
use crate::limits::upstream_socket;
use crate::metrics::ClusterStats;
use crate::resilience::{Breaker, Overflow, Overflowed, Permit};
use crate::snapshot::{ClusterPlan, Snapshot};
use crate::tls::{ClusterTlsPlan, Stream};
use crate::upstream::transport::{self, Transport};

pub type HttpClient = Client<CountingConnector, UpstreamBody>;

/// An HttpConnector that counts upstream connections and connect failures per cluster, and
/// holds each connection's place in the node's fd budget.
#[derive(Clone)]
pub struct CountingConnector {
    inner: HttpConnector,
    stats: Arc<ClusterStats>,
    worker: usize,
    /// The cluster's TLS, made on each new connection.
    tls: Option<Arc<ClusterTlsPlan>>,
    /// The cluster's circuit breaker: a connection takes a place under `max_connections`
    /// (and under `max_pending` while it opens).
    breaker: Arc<Breaker>,
    /// A `tunnel: hbone` cluster's way to its endpoints: connections open through it.
    tunnels: Option<Tunnels>,
}

/// A tunnel cluster's tunnel connections on one worker, and the snapshot whose cluster they
/// serve (a connect may outlive the request that started it, so it holds its own).
#[derive(Clone)]
pub struct Tunnels {
    pub pool: Arc<TunnelPool>,
    pub snapshot: Arc<Snapshot>,
    pub cluster: usize,
}

/// An upstream connection of hyper's client, holding its place under the cluster's
/// `max_connections` (and its socket or tunnel stream slot) while it is open.
pub struct CountedStream {
    inner: Transport,
    _counted: Permit,
}

impl tower_service::Service<Uri> for CountingConnector {
    type Response = TokioIo<CountedStream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(BoxError::from)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let (stats, worker, tls) = (self.stats.clone(), self.worker, self.tls.clone());
        let permits = self
            .breaker
            .acquire(Overflow::Pending)
            .and_then(|pending| Ok((pending, self.breaker.acquire(Overflow::Connections)?)));
        if let Some(tunnels) = self.tunnels.clone() {
            return Box::pin(async move {
                let (pending, counted) =
                    permits.map_err(|kind| BoxError::from(Overflowed(kind)))?;
                // The target is built from the endpoint's `IP:PORT` (`request` below).
                let endpoint = dst
                    .authority()
                    .ok_or_else(|| "upstream request without an authority".to_string())
                    .and_then(|a| crate::hbone::authority::parse(a.as_str()))?;
                let plan = &tunnels.snapshot.clusters[tunnels.cluster];
                let inner = transport::tunnel(&tunnels.pool, plan, worker, endpoint).await?;
                drop(pending);
                Ok(TokioIo::new(CountedStream {
                    inner,
                    _counted: counted,
                }))
            });
        }
        let slot = upstream_socket();
        let connecting = self.inner.call(dst);
        Box::pin(async move {
            let (pending, counted) = permits.map_err(|kind| BoxError::from(Overflowed(kind)))?;
            // Connect outcomes are rare next to requests and can come from any task of
            // the worker; the shared add keeps them exact.
            let slot = slot.inspect_err(|_| stats.connect_failures.add_shared(worker, 1))?;
            match connecting.await {
                Ok(io) => {
                    stats.connections.add_shared(worker, 1);
                    let tcp = io.into_inner();
                    let inner = match tls {
                        None => Stream::Plain(tcp),
                        Some(tls) => tls.originate(tcp, &stats, worker).await.map_err(|e| {
                            BoxError::from(format!("TLS handshake with the endpoint failed: {e}"))
                        })?,
                    };
                    drop(pending);
                    Ok(TokioIo::new(CountedStream {
                        inner: Transport::direct(inner, slot),
                        _counted: counted,
                    }))
                }
                Err(err) => {
                    stats.connect_failures.add_shared(worker, 1);
                    Err(err.into())
                }
            }
        })
    }
}

impl Connection for CountedStream {
    fn connected(&self) -> Connected {
        match self.inner.tcp() {
            Some(tcp) => tcp.connected(),
            None => Connected::new(),
        }
    }
}

impl AsyncRead for CountedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// hyper's client for an HTTP/2 cluster, connecting directly or through `tunnels`.
/// `send_buffer`: the most request bytes it queues per stream (`limits.http2_stream_window`),
/// so a slow endpoint holds little of the node's memory.
pub fn build_client(
    plan: &ClusterPlan,
    worker: usize,
    send_buffer: u32,
    tunnels: Option<Tunnels>,
) -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(plan.connect_timeout));
    http.enforce_http(true);
    let connector = CountingConnector {
        inner: http,
        stats: plan.stats.clone(),
        worker,
        tls: plan.tls.clone(),
        breaker: plan.guard.breaker.clone(),
        tunnels,
    };
    let mut builder = Client::builder(TokioExecutor::new());
    // One connection carries every stream of this worker, so its windows are large.
    // A fixed connection window also sizes h2's small-DATA-frame flood budget (half the
    // window); with the adaptive window it stays near 25 KiB, and gRPC streams of small
    // messages from many clients exhaust it: h2 then sends GOAWAY(ENHANCE_YOUR_CALM)
    // upstream and every stream on it is reset.
    builder
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .http2_only(true)
        .http2_initial_connection_window_size(8 << 20)
        .http2_initial_stream_window_size(1 << 20)
        .http2_max_send_buf_size(send_buffer as usize);
    builder.build(connector)
}

/// One try of a request at endpoint `index` of the cluster, with `headers` (the request's,
/// already edited). `downstream_failed` is raised by the body when the client's framing
/// broke: the failure is then the client's.
pub(crate) async fn send(
    client: &HttpClient,
    parts: &http::request::Parts,
    headers: HeaderMap,
    plan: &ClusterPlan,
    index: usize,
    body: UpstreamBody,
    downstream_failed: &AtomicBool,
) -> Result<Response<Incoming>, UpstreamError> {
    let req =
        request(parts, headers, plan, index, body).map_err(UpstreamError::unusable_request)?;
    client.request(req).await.map_err(|err| {
        let detail = error_chain(&err);
        if downstream_failed.load(Ordering::Relaxed) {
            UpstreamError::request_body(detail)
        } else if let Some(kind) = Overflowed::find(&err) {
            UpstreamError::overflow(kind)
        } else if err.is_connect() {
            UpstreamError::connect(detail)
        } else {
            UpstreamError::closed(detail, false, false)
        }
    })
}

/// The request as hyper's HTTP/2 client sends it to endpoint `index` of the cluster. A
/// target or head that cannot be built is the client's fault: the error names the part,
/// for the 400 to answer with.
fn request(
    parts: &http::request::Parts,
    headers: HeaderMap,
    plan: &ClusterPlan,
    index: usize,
    body: UpstreamBody,
) -> Result<Request<UpstreamBody>, &'static str> {
    let uri = Uri::builder()
        .scheme(http::uri::Scheme::HTTP)
        .authority(plan.authorities[index].clone())
        .path_and_query(
            parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        )
        .build()
        .map_err(|_| "target")?;
    let mut builder = Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .version(Version::HTTP_2);
    if let Some(h) = builder.headers_mut() {
        *h = headers;
    }
    builder.body(body).map_err(|_| "head")
}

/// An error and its causes on one line: hyper's own message says little without them.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
