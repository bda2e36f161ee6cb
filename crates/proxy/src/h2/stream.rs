//! One stream of an HTTP/2 client connection: the request decided and forwarded by the L7
//! layer, then the answer sent within the connection's budgets (`super` says which).

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use flatmesh_config::Limits;
use h2::server::SendResponse;
use h2::{Reason, RecvStream, SendStream};
use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Response, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::received::Received;
use crate::body::BoxError;
use crate::context::ConnContext;
use crate::l7::body::ResponseBody;
use crate::l7::decide::{authority, decide, Decision};
use crate::l7::forward::forward;
use crate::l7::log::{finish, Outcome};
use crate::l7::reply::{is_grpc, listener_removed, local_reply};
use crate::limits::{ByteBudget, NodeBudget, Reservation};
use crate::upstream::Pool;

/// What one client connection may hold, shared by its streams.
pub(super) struct ConnBudget {
    pub(super) node: Arc<NodeBudget>,
    /// Response bytes queued in h2 for this connection's streams.
    queued: Arc<ByteBudget>,
    per_connection: usize,
    memory_budget: usize,
    stall: Duration,
    /// The most request bytes read and discarded after an answer that came before the
    /// request's end (`finish_request`): one stream window.
    drain_bytes: usize,
    /// Upstream connections this connection's streams may hold at once.
    upstreams: Arc<Semaphore>,
    max_upstreams: usize,
}

impl ConnBudget {
    pub fn new(ctx: &ConnContext, limits: &Limits) -> ConnBudget {
        ConnBudget {
            node: ctx.budget.clone(),
            queued: Arc::new(ByteBudget::default()),
            per_connection: limits.per_connection_buffer_bytes,
            memory_budget: limits.memory_budget_bytes,
            stall: limits.stream_stall_timeout,
            drain_bytes: limits.http2_stream_window as usize,
            upstreams: Arc::new(Semaphore::new(limits.max_upstream_per_downstream)),
            max_upstreams: limits.max_upstream_per_downstream,
        }
    }

    /// `n` bytes of the connection's budget and of the node's, if both have room now.
    fn try_reserve(&self, n: usize) -> Option<Queued> {
        Some(Queued {
            _own: self.queued.try_take(n, self.per_connection)?,
            _node: self.node.memory.try_take(n, self.memory_budget)?,
        })
    }

    /// `n` bytes of the connection's budget and of the node's, waiting for both.
    async fn reserve(&self, n: usize) -> Queued {
        let own = self.queued.take(n, self.per_connection).await;
        let node = self.node.memory.take(n, self.memory_budget).await;
        Queued {
            _own: own,
            _node: node,
        }
    }
}

/// Bytes of both budgets, held while h2 holds the data they were taken for.
struct Queued {
    _own: Reservation,
    _node: Reservation,
}

/// Response data handed to h2, with the budget it holds. h2 drops it once the bytes are
/// written to the socket, or when the stream is reset: the budget comes back exactly then.
pub(super) struct Metered {
    data: Bytes,
    _queued: Option<Queued>,
}

impl Metered {
    fn unmetered(data: Bytes) -> Metered {
        Metered {
            data,
            _queued: None,
        }
    }
}

impl Buf for Metered {
    fn remaining(&self) -> usize {
        self.data.remaining()
    }

    fn chunk(&self) -> &[u8] {
        self.data.chunk()
    }

    fn advance(&mut self, cnt: usize) {
        self.data.advance(cnt)
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        self.data.copy_to_bytes(len)
    }
}

/// Serves one stream: refused at once when the node's memory budget is spent; otherwise
/// decided, forwarded and answered, unless the client resets it first; then the rest of
/// the request, if the answer came before it, is read to its end (`finish_request`).
pub(super) async fn serve(
    ctx: Arc<ConnContext>,
    req: Request<RecvStream>,
    mut respond: SendResponse<Metered>,
    budget: Arc<ConnBudget>,
) {
    if budget.node.memory.used() >= budget.memory_budget {
        budget.node.count_stream_reset("memory_budget");
        respond.send_reset(Reason::REFUSED_STREAM);
        return;
    }
    let unread = Unread::default();
    let req = RequestBody::wrap(req, &unread);
    let (resp, upstream) = tokio::select! {
        answered = handle(&ctx, req, &budget) => answered,
        reset = poll_fn(|cx| respond.poll_reset(cx)) => {
            tracing::debug!(reason = ?reset, "client reset the stream before its answer");
            return;
        }
    };
    // `upstream` (the stream's place among the connection's upstream connections) is
    // held until the answer's body is sent or given up.
    let sent = respond_with(resp, &mut respond, &budget).await;
    drop(upstream);
    match sent {
        Ok(()) => {
            let rest = unread.0.lock().take();
            if let Some(rest) = rest {
                finish_request(rest, budget.drain_bytes, budget.stall).await;
            }
        }
        Err(why) => tracing::debug!(%why, "response not sent in full"),
    }
}

/// Where a request body the node stopped reading before its end goes when it is dropped
/// (the answer came first: a local reply, or an upstream that answered before taking the
/// whole body), so that `serve` can finish it after the answer instead of resetting it.
#[derive(Default, Clone)]
struct Unread(Arc<parking_lot::Mutex<Option<RecvStream>>>);

/// Reads and discards what the client still sends of a request that was answered before
/// it ended, as long as the stream stays open on the node's side. Until its request ends the
/// stream is the client's as much as the node's: h2 checks every frame of it as it would
/// have for a request read to the end, so a rest that is malformed (more or less DATA than
/// `content-length` said, a pseudo-header in its trailers, a second HEADERS without
/// END_STREAM, a window raised past 2^31-1) is answered with the error RFC 9113 asks for
/// (§8.1.1: RST_STREAM PROTOCOL_ERROR), which a stream reset at once after its answer could
/// not do: h2 ignores whatever arrives on a stream it has reset. A client that ends its request
/// within `max_bytes` and `stall` closes the stream cleanly; one that sends more, or takes
/// longer, is told to stop without an error (RST_STREAM NO_ERROR, §8.1).
async fn finish_request(mut rest: RecvStream, max_bytes: usize, stall: Duration) {
    let drained = async {
        let mut taken = 0;
        while let Some(data) = rest.data().await {
            // An error: the client reset the stream, or h2 did (a malformed request).
            let Ok(data) = data else { return };
            taken += data.len();
            if taken > max_bytes {
                return;
            }
            let _ = rest.flow_control().release_capacity(data.len());
        }
        let _ = rest.trailers().await;
    };
    if tokio::time::timeout(stall, drained).await.is_err() {
        tracing::debug!(
            ?stall,
            "the client did not end a request answered early: stream reset"
        );
    }
}

/// Why an answer was not sent in full.
#[derive(Debug, thiserror::Error)]
enum Cut {
    #[error("the client took no data for {0:?}: stream reset")]
    Stalled(Duration),
    #[error("the upstream body failed: {0}")]
    Upstream(BoxError),
    #[error("{0}")]
    H2(#[from] h2::Error),
    #[error("the stream ended before its answer did")]
    Gone,
}

/// Sends `resp` on the stream: its head, then its body within the budgets.
async fn respond_with(
    resp: Response<ResponseBody>,
    respond: &mut SendResponse<Metered>,
    budget: &ConnBudget,
) -> Result<(), Cut> {
    let (mut parts, mut body) = resp.into_parts();
    strip_connection_headers(&mut parts.headers);
    let end = body.is_end_stream();
    if !end {
        if let Some(len) = body.size_hint().exact() {
            parts
                .headers
                .entry(header::CONTENT_LENGTH)
                .or_insert_with(|| len.into());
        }
    }
    let mut tx = respond.send_response(Response::from_parts(parts, ()), end)?;
    if end {
        return Ok(());
    }
    let sent = send_body(&mut body, &mut tx, budget).await;
    match &sent {
        Err(Cut::Stalled(_)) => {
            budget.node.count_stream_reset("stalled");
            tx.send_reset(Reason::CANCEL);
        }
        Err(Cut::Upstream(_)) => tx.send_reset(Reason::INTERNAL_ERROR),
        _ => {}
    }
    sent
}

/// Streams the body: each piece waits for the stream's flow-control capacity and for room
/// in both budgets, at most `stream_stall_timeout`; pieces never exceed what h2 may buffer.
async fn send_body(
    body: &mut ResponseBody,
    tx: &mut SendStream<Metered>,
    budget: &ConnBudget,
) -> Result<(), Cut> {
    loop {
        // The next piece of the body first, then capacity for it: capacity reserved ahead
        // of data would sit on the connection's window (hyper#4003).
        let frame = poll_fn(|cx| match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(Ok(frame)),
            Poll::Pending => tx.poll_reset(cx).map(Err),
        })
        .await;
        let frame = match frame {
            Ok(frame) => frame,
            Err(reset) => {
                tracing::debug!(reason = ?reset, "client reset the stream mid-answer");
                return Err(Cut::Gone);
            }
        };
        let frame = match frame {
            None => {
                tx.send_data(Metered::unmetered(Bytes::new()), true)?;
                return Ok(());
            }
            Some(Err(err)) => return Err(Cut::Upstream(err)),
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(mut data) => {
                let end = body.is_end_stream();
                if data.is_empty() && !end {
                    continue;
                }
                loop {
                    let n = room(tx, data.len(), budget).await?;
                    let piece = data.split_to(n.min(data.len()));
                    // Usually both budgets have room: no timer for that.
                    let queued = match piece.len() {
                        0 => None,
                        len => match budget.try_reserve(len) {
                            Some(q) => Some(q),
                            None => Some(stalled_after(budget.stall, budget.reserve(len)).await?),
                        },
                    };
                    tx.send_data(
                        Metered {
                            data: piece,
                            _queued: queued,
                        },
                        end && data.is_empty(),
                    )?;
                    if data.is_empty() {
                        break;
                    }
                }
                if end {
                    return Ok(());
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    tx.send_trailers(trailers)?;
                    return Ok(());
                }
            }
        }
    }
}

/// Waits for `what`, at most the stall timeout.
async fn stalled_after<T>(
    stall: Duration,
    what: impl std::future::Future<Output = T>,
) -> Result<T, Cut> {
    tokio::time::timeout(stall, what)
        .await
        .map_err(|_| Cut::Stalled(stall))
}

/// Waits until the stream may send some of `want` bytes; returns how many (at most `want`,
/// at most the connection's budget). An empty piece (the end of the stream) needs none.
async fn room(
    tx: &mut SendStream<Metered>,
    want: usize,
    budget: &ConnBudget,
) -> Result<usize, Cut> {
    if want == 0 {
        return Ok(0);
    }
    let want = want.min(budget.per_connection);
    tx.reserve_capacity(want);
    // Usually the window has room already: no timer for that.
    let now = tx.capacity();
    if now > 0 {
        return Ok(now.min(want));
    }
    let capacity = stalled_after(budget.stall, async {
        loop {
            let now = tx.capacity();
            if now > 0 {
                return Ok(now);
            }
            match poll_fn(|cx| tx.poll_capacity(cx)).await {
                Some(Ok(_)) => {}
                Some(Err(err)) => return Err(Cut::H2(err)),
                None => return Err(Cut::Gone),
            }
        }
    })
    .await??;
    Ok(capacity.min(want))
}

/// Headers that have no place in HTTP/2 (RFC 9113 §8.2.2); h2 refuses a response with them.
fn strip_connection_headers(headers: &mut HeaderMap) {
    if let Some(connection) = headers.remove(header::CONNECTION) {
        // The headers it names are this hop's too.
        if let Ok(names) = connection.to_str() {
            for name in names.split(',') {
                if let Ok(name) = HeaderName::from_bytes(name.trim().as_bytes()) {
                    headers.remove(name);
                }
            }
        }
    }
    for name in [
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::TE,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

/// The client's request body: h2's stream, whose window is opened as the upstream takes
/// its bytes, so a client can be ahead by one window and no more. Dropped before its end,
/// it leaves the stream in its [`Unread`].
struct RequestBody {
    /// `None` once dropped.
    recv: Option<Received>,
    unread: Unread,
    /// Raised when the client's side of the body breaks (a reset, a length that does not
    /// add up): the failure is then the client's, not the upstream's.
    failed: Arc<AtomicBool>,
    /// Frames already read to decide the request (its first gRPC message, for a
    /// `grpc_field` route), handed on first.
    peeked: VecDeque<Frame<Bytes>>,
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(frame) = this.peeked.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let Some(recv) = this.recv.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = ready!(recv.poll_frame(cx));
        if let Some(Err(_)) = &frame {
            this.failed.store(true, Ordering::Relaxed);
        }
        Poll::Ready(frame.map(|f| f.map_err(BoxError::from)))
    }

    fn is_end_stream(&self) -> bool {
        self.peeked.is_empty() && self.recv.as_ref().is_none_or(Received::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let peeked: u64 = self
            .peeked
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        match self.recv.as_ref().map_or(Some(0), Received::left) {
            Some(left) => SizeHint::with_exact(left.saturating_add(peeked)),
            None => SizeHint::default(),
        }
    }
}

impl RequestBody {
    /// The request with its body read through a `RequestBody` that leaves its rest in
    /// `unread` when dropped early.
    fn wrap(req: Request<RecvStream>, unread: &Unread) -> Request<RequestBody> {
        let (parts, recv) = req.into_parts();
        let body = RequestBody {
            recv: Some(Received::new(recv, &parts.headers)),
            unread: unread.clone(),
            failed: Arc::new(AtomicBool::new(false)),
            peeked: VecDeque::new(),
        };
        Request::from_parts(parts, body)
    }

    /// Reads the start of the body until it holds what a `grpc_field` route looks at (the
    /// 5-byte prefix and up to `protobuf::MESSAGE_PREFIX_MAX` bytes of the first message) or
    /// the body ends, and keeps what it read to hand on. Returns those bytes.
    async fn read_first_message(&mut self) -> Result<Bytes, BoxError> {
        let mut start = bytes::BytesMut::new();
        let mut frames = VecDeque::new();
        while flatmesh_rules::protobuf::wanted_prefix(&start).is_none_or(|want| start.len() < want)
        {
            let Some(frame) = self.frame().await.transpose()? else {
                break;
            };
            if let Some(data) = frame.data_ref() {
                start.extend_from_slice(data);
            }
            frames.push_back(frame);
        }
        self.peeked = frames;
        Ok(start.freeze())
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let Some(recv) = self.recv.take() {
            if !recv.is_end_stream() {
                *self.unread.0.lock() = Some(recv.into_inner());
            }
        }
    }
}

/// Decides and forwards one request. Returns the answer and, for a request sent to an
/// HTTP/1.1 cluster, its place among the connection's upstream connections.
async fn handle(
    ctx: &Arc<ConnContext>,
    mut req: Request<RequestBody>,
    budget: &ConnBudget,
) -> (Response<ResponseBody>, Option<OwnedSemaphorePermit>) {
    let started = Instant::now();
    let view = ctx.view.load_full();
    let snap = &view.snapshot;
    let Some(lid) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        return (listener_removed(), None);
    };
    let method = req.method().clone();
    // Cheap (shared bytes); kept for the 404 text and the access log after `req` moves on.
    let uri = req.uri().clone();
    let path_and_query = || uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let logged = || Some((method.to_string(), path_and_query()));

    let grpc = is_grpc(req.headers());
    let trace = ctx.tracer.begin(req.headers().into(), &method);
    // A `grpc_field` route needs the first message before anything is decided.
    let first = if grpc && snap.program.reads_message(lid) {
        let limit = snap.config.limits.request_timeout;
        let refused = match tokio::time::timeout(limit, req.body_mut().read_first_message()).await
        {
            Ok(Ok(first)) => Ok(first),
            Err(_) => Err((
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the first gRPC message did not arrive within {} (limits.request_timeout), and a route of this listener matches on it",
                    flatmesh_config::duration::format(&limit)
                ),
            )),
            Ok(Err(e)) => Err((
                StatusCode::BAD_REQUEST,
                format!("the request body broke before its first gRPC message was read: {e}"),
            )),
        };
        match refused {
            Ok(first) => Some(first),
            Err((status, why)) => {
                let resp = local_reply(status, why, false, grpc);
                let outcome = Outcome {
                    route: None,
                    cluster: None,
                    upstream: None,
                    status: resp.status().as_u16(),
                    trace: trace.as_ref(),
                };
                finish(ctx, snap, lid, started, &outcome, logged);
                return (resp, None);
            }
        }
    } else {
        None
    };
    let decision = {
        let meta = flatmesh_rules::Request {
            method: &method,
            host: authority(req.uri(), req.headers()),
            path: req.uri().path(),
            query: req.uri().query(),
            headers: req.headers().into(),
            message: first
                .as_deref()
                .and_then(flatmesh_rules::protobuf::first_message),
        };
        decide(
            snap,
            lid,
            &meta,
            (ctx.peer(), ctx.worker, ctx.peer),
            grpc,
            path_and_query,
        )
    };
    let (resp, outcome, held) = match decision {
        Decision::Reply(route, resp) => {
            let outcome = Outcome {
                route,
                cluster: None,
                upstream: None,
                status: resp.status().as_u16(),
                trace: trace.as_ref(),
            };
            (resp, outcome, None)
        }
        Decision::Forward(route, cluster, path, delayed) => {
            let limits = &snap.config.limits;
            let timeout = route.timeout.unwrap_or(limits.request_timeout);
            // An HTTP/1.1 cluster gives each stream a connection of its own; an HTTP/2
            // cluster carries them all on one.
            let held = match &view.upstreams.by_cluster[cluster].pool {
                Pool::Http1(_) => {
                    let waited =
                        tokio::time::timeout(timeout, budget.upstreams.clone().acquire_owned())
                            .await;
                    match waited {
                        Ok(Ok(permit)) => Some(permit),
                        _ => {
                            let resp = local_reply(
                                StatusCode::SERVICE_UNAVAILABLE,
                                format!(
                                    "this client connection already holds {} upstream connections (limits.max_upstream_per_downstream), none freed within {}; spread the requests over more connections\n",
                                    budget.max_upstreams,
                                    flatmesh_config::duration::format(&timeout)
                                ),
                                false,
                                grpc,
                            );
                            let outcome = Outcome {
                                route: Some(route),
                                cluster: Some(cluster),
                                upstream: None,
                                status: resp.status().as_u16(),
                                trace: trace.as_ref(),
                            };
                            finish(ctx, snap, lid, started, &outcome, logged);
                            return (resp, None);
                        }
                    }
                }
                Pool::Http2(_) => None,
            };
            let (mut parts, body) = req.into_parts();
            crate::l7::decide::set_path(&mut parts.uri, path);
            let failed = body.failed.clone();
            let replayable = body.is_end_stream();
            let body = body.boxed_unsync();
            let (resp, upstream) = forward(
                ctx,
                &view,
                route,
                cluster,
                parts,
                body,
                replayable,
                &failed,
                delayed,
                trace.as_ref(),
            )
            .await;
            let outcome = Outcome {
                route: Some(route),
                cluster: Some(cluster),
                upstream,
                status: resp.status().as_u16(),
                trace: trace.as_ref(),
            };
            (resp, outcome, held)
        }
    };
    finish(ctx, snap, lid, started, &outcome, logged);
    (resp, held)
}

#[cfg(test)]
mod tests {
    //! What a stream's task costs to start. Spawning moves the whole future: its size (the
    //! largest state it can reach) is copied for every stream.
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use super::*;
    use crate::testing;

    /// A request's future is about 6.5 KiB (release build) since opening a connection was
    /// boxed; it was 13 KiB before, with the TLS handshake's future inline (BENCHMARKS.md).
    const MAX_FUTURE: usize = 8 * 1024;

    #[test]
    fn a_request_s_future_stays_small_with_connection_opening_boxed() {
        let view = testing::view(
            "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    routes:\n      - match: { path: { prefix: / } }\n        cluster: app\nclusters:\n  - name: app\n    endpoints: [ 127.0.0.1:9 ]\n",
        );
        let ctx = testing::context(&view);
        let budget = Arc::new(ConnBudget::new(&ctx, &Limits::default()));
        let req = Request::new(RequestBody {
            recv: None,
            unread: Unread::default(),
            failed: Arc::default(),
            peeked: VecDeque::default(),
        });
        let handled = handle(&ctx, req, &budget);
        let size = std::mem::size_of_val(&handled);
        assert!(
            size <= MAX_FUTURE,
            "a stream's request future is {size} bytes"
        );
        let (parts, ()) = Request::new(()).into_parts();
        let pool = crate::h2::client::H2Pool::new(None, 1, 1);
        let failed = AtomicBool::new(false);
        let snap = &view.load().snapshot;
        let sent = crate::h2::client::send(
            &pool,
            &parts,
            HeaderMap::new(),
            &snap.clusters[0],
            0,
            0,
            "127.0.0.1:9".parse().unwrap(),
            crate::body::empty(),
            &failed,
        );
        let size = std::mem::size_of_val(&sent);
        assert!(size <= 2048, "an HTTP/2 try's future is {size} bytes");
    }
}
