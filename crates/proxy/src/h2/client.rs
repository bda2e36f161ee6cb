//! The HTTP/2 client of `protocol: http2` clusters, on `h2` directly: one multiplexed
//! connection per endpoint and worker, opened single-flight (`crate::upstream::dials`) under
//! the cluster's circuit breaker, and one try of a request on it as the retry driver asks
//! for it. A `tunnel: hbone` cluster's connection to an endpoint is one CONNECT stream
//! through the endpoint's node (`crate::upstream::transport`), on which every request of the
//! worker to it is multiplexed.
//!
//! Hand-written rather than hyper's client, for the reason the HTTP/1 pool is
//! (`crate::h1::pool`): per request, hyper's client hands the request over a channel to a
//! dispatch task, and runs a task that sends the body and one that waits for the answer; a
//! gRPC call then crossed five tasks in the node (BENCHMARKS.md, "Where the user tier's time
//! goes per request"). Here a try opens its stream from the request's own task and sends the
//! body from there while it waits for the answer; only a body still arriving when the answer
//! comes (a streaming call) gets a task of its own.

use std::collections::HashMap;
use std::future::{poll_fn, Future as _};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use h2::{Reason, SendStream};
use http::header::{HeaderValue, CONTENT_LENGTH};
use http::{HeaderMap, Method, Request, Response, Uri, Version};
use http_body::{Body as _, Frame, SizeHint};
use parking_lot::Mutex;

use super::received::Received;
use crate::body::{BoxError, UpstreamBody};
use crate::hbone::pool::TunnelPool;
use crate::l7::error::UpstreamError;
use crate::snapshot::ClusterPlan;
use crate::upstream::dials::{Dials, Turn};
use crate::upstream::transport;

/// How long a connection no request has used stays open: hyper-util's default for the pool
/// this replaces.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// One connection carries every stream of this worker to the endpoint, so its windows are
/// large. A fixed connection window also sizes h2's small-DATA-frame flood budget (half the
/// window); with an adaptive window it stays near 25 KiB, and gRPC streams of small messages
/// from many clients exhaust it: h2 then sends GOAWAY(ENHANCE_YOUR_CALM) upstream and every
/// stream on it is reset.
const CONNECTION_WINDOW: u32 = 8 << 20;
const STREAM_WINDOW: u32 = 1 << 20;

/// One worker's connections to the endpoints of one HTTP/2 cluster.
pub struct H2Pool {
    /// Per endpoint (an `original_dst` cluster's: per destination): its open connection.
    conns: Mutex<HashMap<SocketAddr, Pooled>>,
    dials: Dials<SocketAddr, UpstreamError>,
    /// A `tunnel: hbone` cluster's: this worker's tunnel connections, which new connections
    /// are opened through.
    tunnels: Option<Arc<TunnelPool>>,
    /// The most request bytes queued per stream (`limits.http2_stream_window`), so a slow
    /// endpoint holds little of the node's memory.
    send_buffer: u32,
    /// The largest response head taken (`limits.max_header_bytes`).
    max_header_list: u32,
}

/// An open connection as the pool hands it out.
#[derive(Clone)]
struct Pooled {
    send: SendRequest<Bytes>,
    state: Arc<ConnState>,
}

/// What the pool and the connection's task know of one connection.
struct ConnState {
    /// Streams using it, with [`CLOSED`] set once it may take no more.
    in_use: AtomicUsize,
    /// Tries started on it, ever: the idle check compares it across [`IDLE_TIMEOUT`].
    tries: AtomicU64,
}

const CLOSED: usize = 1 << (usize::BITS - 1);

impl ConnState {
    /// A place on the connection for one stream, unless it is closed.
    fn take(self: &Arc<Self>) -> Option<InUse> {
        self.in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n & CLOSED == 0).then_some(n + 1)
            })
            .ok()?;
        self.tries.fetch_add(1, Ordering::Relaxed);
        Some(InUse(self.clone()))
    }

    fn close(&self) {
        self.in_use.fetch_or(CLOSED, Ordering::AcqRel);
    }

    /// Closes the connection if no stream uses it; true if it did.
    fn close_if_unused(&self) -> bool {
        self.in_use
            .compare_exchange(0, CLOSED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// One stream's place on its connection, held until its answer's body is dropped (and its
/// request's body is sent).
struct InUse(Arc<ConnState>);

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

impl H2Pool {
    /// A pool whose new connections are opened directly, or through `tunnels`.
    pub fn new(
        tunnels: Option<Arc<TunnelPool>>,
        send_buffer: u32,
        max_header_bytes: usize,
    ) -> H2Pool {
        H2Pool {
            conns: Mutex::default(),
            dials: Dials::default(),
            tunnels,
            send_buffer,
            max_header_list: u32::try_from(max_header_bytes).unwrap_or(u32::MAX),
        }
    }

    /// The open connection to `endpoint`, with a stream's place on it taken, if there is one.
    fn pooled(&self, endpoint: SocketAddr) -> Option<(Pooled, InUse)> {
        let mut conns = self.conns.lock();
        let conn = conns.get(&endpoint)?;
        match conn.state.take() {
            Some(in_use) => Some((conn.clone(), in_use)),
            None => {
                conns.remove(&endpoint);
                None
            }
        }
    }

    /// A connection to `endpoint` with a stream's place taken: the open one, else the one a
    /// dial in progress opens (waiting for it), else one this call opens. `fresh`: the
    /// connection was opened for this try.
    async fn connection(
        &self,
        plan: &ClusterPlan,
        worker: usize,
        endpoint: SocketAddr,
    ) -> Result<(Pooled, InUse, bool), UpstreamError> {
        loop {
            if let Some((conn, in_use)) = self.pooled(endpoint) {
                return Ok((conn, in_use, false));
            }
            match self.dials.turn(endpoint).await {
                Turn::Waited(Ok(())) => {}
                Turn::Waited(Err(err)) => return Err(err),
                Turn::Lead(mut dial) => {
                    // Boxed: opening (TLS handshake and all) is a large future, and every
                    // request's task would otherwise carry room for it.
                    let opened = Box::pin(self.open(plan, worker, endpoint)).await;
                    dial.finish(opened.as_ref().map(|_| ()).map_err(UpstreamError::clone));
                    return opened.map(|(conn, in_use)| (conn, in_use, true));
                }
            }
        }
    }

    /// Opens a connection to `endpoint` (a socket, TLS if the cluster has it, or a tunnel
    /// stream; then HTTP/2), pools it with one stream's place taken, and spawns its task.
    async fn open(
        &self,
        plan: &ClusterPlan,
        worker: usize,
        endpoint: SocketAddr,
    ) -> Result<(Pooled, InUse), UpstreamError> {
        let (io, counted) =
            transport::open(plan, worker, endpoint, self.tunnels.as_deref(), || {}).await?;
        let mut builder = h2::client::Builder::new();
        builder
            .enable_push(false)
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_send_buffer_size(self.send_buffer as usize)
            .max_header_list_size(self.max_header_list);
        // h2 writes its preface and returns: nothing here waits on the endpoint.
        let (send, connection) = builder.handshake::<_, Bytes>(io).await.map_err(|err| {
            UpstreamError::connect(format!("HTTP/2 handshake with the endpoint failed: {err}"))
        })?;
        // Born with the opening try's stream on it.
        let state = Arc::new(ConnState {
            in_use: AtomicUsize::new(1),
            tries: AtomicU64::new(1),
        });
        let in_use = InUse(state.clone());
        let conn = Pooled {
            send,
            state: state.clone(),
        };
        let cluster = plan.name.clone();
        tokio::spawn(async move {
            // The connection holds its place under `max_connections` while it runs (the
            // transport holds its socket's place in the fd budget).
            let _counted = counted;
            let mut connection = std::pin::pin!(connection);
            let mut seen = state.tries.load(Ordering::Relaxed);
            loop {
                tokio::select! {
                    // The connection first: it is what wakes the task, for every frame.
                    biased;
                    ended = &mut connection => {
                        if let Err(err) = ended {
                            tracing::debug!(%cluster, %endpoint, error = %err,
                                "upstream HTTP/2 connection ended with an error");
                        }
                        break;
                    }
                    () = tokio::time::sleep(IDLE_TIMEOUT) => {
                        let tries = state.tries.load(Ordering::Relaxed);
                        if tries == seen && state.close_if_unused() {
                            break;
                        }
                        seen = tries;
                    }
                }
            }
            state.close();
        });
        self.conns.lock().insert(endpoint, conn.clone());
        Ok((conn, in_use))
    }
}

/// One try of a request at `endpoint` (index `index` of the cluster), with `headers` (the
/// request's, already edited). `downstream_failed` is raised by the body when the client's
/// framing broke: the failure is then the client's.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn send(
    pool: &H2Pool,
    parts: &http::request::Parts,
    headers: HeaderMap,
    plan: &ClusterPlan,
    worker: usize,
    index: usize,
    endpoint: SocketAddr,
    body: UpstreamBody,
    downstream_failed: &AtomicBool,
) -> Result<Response<H2Body>, UpstreamError> {
    let authority = match plan.authorities.get(index) {
        Some(authority) => authority.clone(),
        None => http::uri::Authority::try_from(endpoint.to_string())
            .map_err(|_| UpstreamError::unusable_request("target"))?,
    };
    let head = head(parts, headers, authority, &body).map_err(UpstreamError::unusable_request)?;
    let end_of_stream = body.is_end_stream();
    // A pooled connection the endpoint has closed meanwhile fails before the request goes
    // out (h2 says so when asked for room): then once more, on a fresh one.
    let (mut response, stream, in_use) = loop {
        let (conn, in_use, fresh) = pool.connection(plan, worker, endpoint).await?;
        // The connection failed before it took the request, so sending it again is safe: a
        // fresh one failed as a connect does; a pooled one was closed while it sat idle.
        let gone = |err: h2::Error| {
            conn.state.close();
            let detail = error_chain(&err);
            if fresh {
                UpstreamError::connect(format!(
                    "the HTTP/2 connection failed before it took the request: {detail}"
                ))
            } else {
                UpstreamError::closed(detail, true, false)
            }
        };
        let mut send = match conn.send.clone().ready().await {
            Ok(send) => send,
            Err(err) if !fresh => {
                gone(err);
                continue;
            }
            Err(err) => return Err(gone(err)),
        };
        match send.send_request(head, end_of_stream) {
            Ok((response, stream)) => break (response, stream, in_use),
            // Not a connection's failure: h2 will not send this head.
            Err(err) if err.reason().is_none() && !err.is_io() => {
                tracing::debug!(error = %err, "request head refused by the HTTP/2 codec");
                return Err(UpstreamError::unusable_request("head"));
            }
            Err(err) => return Err(gone(err)),
        }
    };
    let mut upload = (!end_of_stream).then(|| RequestPipe { body, stream });
    let answer = poll_fn(|cx| {
        if let Some(pipe) = upload.as_mut() {
            match pipe.poll_send(cx) {
                Poll::Ready(Err(Piped::Downstream(err))) => {
                    return Poll::Ready(Err(UpstreamError::request_body(err)))
                }
                // Reset by the endpoint: its answer, or the reset, comes on `response`.
                Poll::Ready(Ok(()) | Err(Piped::Upstream(_))) => upload = None,
                Poll::Pending => {}
            }
        }
        Pin::new(&mut response).poll(cx).map(|answer| {
            answer.map_err(|err| {
                let detail = error_chain(&err);
                if downstream_failed.load(Ordering::Relaxed) {
                    UpstreamError::request_body(detail)
                } else {
                    // A refused stream was not processed (RFC 9113 §8.7): safe to send again.
                    let refused = err.reason() == Some(Reason::REFUSED_STREAM);
                    UpstreamError::closed(detail, refused, false)
                }
            })
        })
    })
    .await?;
    // The body still arriving (a streaming call): sent from a task of its own from now on,
    // holding the connection in use.
    if let Some(mut pipe) = upload {
        let held = in_use.0.take();
        tokio::spawn(async move {
            let _held = held;
            if let Err(Piped::Downstream(err) | Piped::Upstream(err)) =
                poll_fn(|cx| pipe.poll_send(cx)).await
            {
                tracing::debug!(error = %err, "request body to the HTTP/2 endpoint broke off");
            }
        });
    }
    let (parts, recv) = answer.into_parts();
    let received = Received::new(recv, &parts.headers);
    Ok(Response::from_parts(
        parts,
        H2Body {
            received,
            _in_use: in_use,
        },
    ))
}

/// The request's head as it goes to the endpoint: `authority` and the client's path, and a
/// `content-length` for a body of known length (hyper's rule, kept: unless it is empty on a
/// method that gives a body no meaning). A target that cannot be built is the client's
/// fault: the error names the part, for the 400 to answer with.
fn head(
    parts: &http::request::Parts,
    headers: HeaderMap,
    authority: http::uri::Authority,
    body: &UpstreamBody,
) -> Result<Request<()>, &'static str> {
    let uri = Uri::builder()
        .scheme(http::uri::Scheme::HTTP)
        .authority(authority)
        .path_and_query(
            parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
        )
        .build()
        .map_err(|_| "target")?;
    let mut req = Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_2;
    *req.headers_mut() = headers;
    if let Some(length) = body.size_hint().exact() {
        let defined = !matches!(
            parts.method,
            Method::GET | Method::HEAD | Method::DELETE | Method::CONNECT
        );
        if length != 0 || defined {
            req.headers_mut()
                .entry(CONTENT_LENGTH)
                .or_insert_with(|| HeaderValue::from(length));
        }
    }
    Ok(req)
}

/// Why sending a request body stopped early.
enum Piped {
    /// The client's body failed: the stream is reset.
    Downstream(BoxError),
    /// The endpoint reset the stream, or the connection went.
    Upstream(BoxError),
}

/// A request body on its way to the endpoint: each piece sent once the stream has room.
struct RequestPipe {
    body: UpstreamBody,
    stream: SendStream<Bytes>,
}

impl RequestPipe {
    /// Sends what the body has, as far as the stream's window allows; Ready when all of it
    /// and its end are sent.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Piped>> {
        let upstream = |err: h2::Error| Piped::Upstream(err.into());
        loop {
            // Room for at least a byte before the next piece is read: h2 queues the rest of
            // a piece up to its send buffer, and window updates move it.
            self.stream.reserve_capacity(1);
            if self.stream.capacity() == 0 {
                loop {
                    match ready!(self.stream.poll_capacity(cx)) {
                        Some(Ok(0)) => {}
                        Some(Ok(_)) => break,
                        Some(Err(err)) => return Poll::Ready(Err(upstream(err))),
                        None => {
                            return Poll::Ready(Err(Piped::Upstream(
                                "the stream closed while its request body was being sent".into(),
                            )))
                        }
                    }
                }
            } else if let Poll::Ready(reason) = self.stream.poll_reset(cx) {
                let err = reason.map_or_else(upstream, |r| upstream(h2::Error::from(r)));
                return Poll::Ready(Err(err));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let end = self.body.is_end_stream();
                        self.stream.send_data(data, end).map_err(upstream)?;
                        if end {
                            return Poll::Ready(Ok(()));
                        }
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            self.stream.reserve_capacity(0);
                            self.stream.send_trailers(trailers).map_err(upstream)?;
                            return Poll::Ready(Ok(()));
                        }
                    }
                },
                Some(Err(err)) => {
                    self.stream.send_reset(Reason::CANCEL);
                    return Poll::Ready(Err(Piped::Downstream(err)));
                }
                None => {
                    self.stream
                        .send_data(Bytes::new(), true)
                        .map_err(upstream)?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

/// An HTTP/2 endpoint's answer body (`super::received`), holding its stream's place on the
/// connection.
pub struct H2Body {
    received: Received,
    _in_use: InUse,
}

impl http_body::Body for H2Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.get_mut()
            .received
            .poll_frame(cx)
            .map(|frame| match frame {
                // A reset with NO_ERROR or CANCEL stops the body without failing it (as hyper's
                // did); any other is a failure.
                Some(Err(err)) => match err.reason() {
                    Some(Reason::NO_ERROR | Reason::CANCEL) => None,
                    _ => Some(Err(err.into())),
                },
                frame => frame.map(|f| f.map_err(BoxError::from)),
            })
    }

    fn is_end_stream(&self) -> bool {
        self.received.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.received.left() {
            Some(left) => SizeHint::with_exact(left),
            None => SizeHint::default(),
        }
    }
}

/// An error and its causes on one line.
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

#[cfg(test)]
mod tests {
    //! The pool against an h2c endpoint on loopback, on the paused clock.
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::AtomicUsize;

    use http_body_util::BodyExt as _;
    use tokio::net::TcpListener;

    use super::*;
    use crate::testing;

    /// An h2c endpoint that answers every request `200 ok`, counting the connections it took
    /// and the ones that ended; with `one_request`, it closes each connection after its first
    /// answer.
    struct H2Endpoint {
        addr: SocketAddr,
        opened: Arc<AtomicUsize>,
        ended: Arc<AtomicUsize>,
    }

    impl H2Endpoint {
        async fn start(one_request: bool) -> H2Endpoint {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (opened, ended) = (Arc::default(), Arc::default());
            let (o, e): (Arc<AtomicUsize>, Arc<AtomicUsize>) =
                (Arc::clone(&opened), Arc::clone(&ended));
            tokio::spawn(async move {
                loop {
                    let (tcp, _) = listener.accept().await.unwrap();
                    o.fetch_add(1, Ordering::SeqCst);
                    let e = e.clone();
                    tokio::spawn(async move {
                        if let Ok(mut conn) = h2::server::handshake(tcp).await {
                            while let Some(Ok((_, mut respond))) = conn.accept().await {
                                let resp = Response::builder().status(200).body(()).unwrap();
                                let mut tx = respond.send_response(resp, false).unwrap();
                                tx.send_data(Bytes::from_static(b"ok"), true).unwrap();
                                if one_request {
                                    // GOAWAY, the answer out, then the connection closed.
                                    conn.graceful_shutdown();
                                    while conn.accept().await.is_some() {}
                                    break;
                                }
                            }
                        }
                        e.fetch_add(1, Ordering::SeqCst);
                    });
                }
            });
            H2Endpoint {
                addr,
                opened,
                ended,
            }
        }
    }

    fn pool_for(endpoint: SocketAddr) -> (View, Arc<H2Pool>) {
        let view = testing::view(&format!(
            r#"
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - name: app
    protocol: http2
    endpoints: [ {endpoint} ]
"#
        ));
        let pool = match &view.load().upstreams.by_cluster[0].pool {
            crate::upstream::Pool::Http2(pool) => pool.clone(),
            crate::upstream::Pool::Http1(_) => unreachable!("an http2 cluster"),
        };
        (view, pool)
    }

    type View = Arc<arc_swap::ArcSwap<crate::context::WorkerView>>;

    /// A GET of / through the pool; its status and body.
    async fn get(
        view: View,
        pool: Arc<H2Pool>,
        endpoint: SocketAddr,
    ) -> Result<(u16, Bytes), UpstreamError> {
        let view = view.load();
        let (parts, ()) = Request::get("http://t/").body(()).unwrap().into_parts();
        let failed = AtomicBool::new(false);
        let resp = send(
            &pool,
            &parts,
            HeaderMap::new(),
            &view.snapshot.clusters[0],
            0,
            0,
            endpoint,
            crate::body::empty(),
            &failed,
        )
        .await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Ok((status, body))
    }

    /// `n` GETs at once, each on a task of its own; their outcomes.
    async fn burst(
        n: usize,
        view: &View,
        pool: &Arc<H2Pool>,
        endpoint: SocketAddr,
    ) -> Vec<Result<(u16, Bytes), UpstreamError>> {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..n {
            tasks.spawn(get(view.clone(), pool.clone(), endpoint));
        }
        tasks.join_all().await
    }

    #[tokio::test(start_paused = true)]
    async fn requests_share_one_connection_until_it_stays_unused_for_the_idle_timeout() {
        let app = H2Endpoint::start(false).await;
        let (view, pool) = pool_for(app.addr);
        // Eight at once: one dial, the others wait for it.
        for answer in burst(8, &view, &pool, app.addr).await {
            assert_eq!(answer.unwrap(), (200, Bytes::from_static(b"ok")));
        }
        assert_eq!(app.opened.load(Ordering::SeqCst), 1);
        // Used again within the idle timeout: still the same connection.
        tokio::time::sleep(IDLE_TIMEOUT / 2).await;
        get(view.clone(), pool.clone(), app.addr).await.unwrap();
        tokio::time::sleep(IDLE_TIMEOUT / 2).await;
        get(view.clone(), pool.clone(), app.addr).await.unwrap();
        assert_eq!(app.opened.load(Ordering::SeqCst), 1);
        assert_eq!(app.ended.load(Ordering::SeqCst), 0);
        // Unused for two idle timeouts: closed, and the next request opens another.
        tokio::time::sleep(IDLE_TIMEOUT * 2 + Duration::from_secs(1)).await;
        assert_eq!(app.ended.load(Ordering::SeqCst), 1);
        assert_eq!(
            get(view.clone(), pool.clone(), app.addr).await.unwrap().0,
            200
        );
        assert_eq!(app.opened.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_the_endpoint_closed_is_replaced_without_failing_a_request() {
        let app = H2Endpoint::start(true).await;
        let (view, pool) = pool_for(app.addr);
        for n in 1..=3 {
            assert_eq!(
                get(view.clone(), pool.clone(), app.addr).await.unwrap().0,
                200,
                "request {n}"
            );
            // The endpoint's close reaches the node before the next request.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(app.opened.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_endpoint_is_a_connect_failure_for_every_waiting_request() {
        let dead = testing::dead_endpoint();
        let (view, pool) = pool_for(dead);
        for answer in burst(4, &view, &pool, dead).await {
            let err = answer.unwrap_err();
            assert_eq!(err.kind, crate::l7::error::Kind::ConnectFailed, "{err:?}");
            assert!(err.retry_safe);
        }
    }
}
