//! One client connection speaking HTTP/1.x: read a request head, decide, forward, relay the
//! answer, and again for the next request (keep-alive and pipelining).
//!
//! This is the proxy's hot path, FlatProxy's PPM chain for HTTP/1: the parser is httparse
//! over the connection's read buffer; the match is the rule program run on borrowed header
//! lines (no header map is built); the deparser writes the upstream head straight from the
//! parsed lines with the route's edits. Bodies are streamed in their own framing. Requests
//! for an HTTP/2 cluster cross over to the HTTP/2 client (`crate::l7::forward`). Tries, retries
//! and failure replies are the L7 layer's (`crate::l7`); this file is the HTTP/1 adapter.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use flatmesh_config::Limits;
use flatmesh_rules::{ClusterId, CompiledRoute, ListenerId};
use http::{HeaderName, HeaderValue, Method, Response, StatusCode};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

use super::body::{self, ChannelSink, DiscardSink, Encode, Kept, RelayError, Watched, WriteSink};
use super::head::{self, Framing, Refusal, MAX_HEADERS};
use super::pool::{self, H1Pool, HeadState, UpstreamConn};
use crate::body::{empty, BoxError, UpstreamBody};
use crate::context::{ConnContext, WorkerView};
use crate::l7::body::ResponseBody;
use crate::l7::decide::{decide, hash_key, Decision};
use crate::l7::error::{Kind, Source, UpstreamError};
use crate::l7::fault::Delayed;
use crate::l7::log::Outcome;
use crate::l7::reply::{listener_removed, text_response, upstream_failure, CLIENT_CLOSED_REQUEST};
use crate::l7::retry::{replayable_body, Answer, Answered, Attempt, Retry, Try};
use crate::snapshot::ClusterPlan;
use crate::upstream::Pool;

/// Read buffer of a client connection; grows up to `limits.max_header_bytes` for a head.
const READ_BUFFER: usize = 16 * 1024;
/// What a client connection holds while it waits for its next request: a typical request
/// head fits in one read. A bigger head reads on into [`READ_BUFFER`], and the buffer shrinks
/// back between requests, so 10,000 idle keep-alive connections hold 20 MB of buffers, not
/// the 320 MB a kept 32 KiB buffer made (BENCHMARKS.md, `idle_connections`).
pub(crate) const IDLE_BUFFER: usize = 2 * 1024;
/// A request body the proxy answered without forwarding is read and dropped up to this
/// size, so the connection can carry the next request; beyond it the connection is closed.
const MAX_DRAIN: u64 = 1 << 20;

const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// The client side of the connection: its socket and the bytes read from it not yet used.
struct Client<S> {
    io: S,
    buf: BytesMut,
}

/// Everything about one request that outlives its parsed head.
struct Exchange<'v> {
    view: &'v WorkerView,
    listener: ListenerId,
    started: Instant,
    framing: Framing,
    http10: bool,
    keep_alive: bool,
    is_head: bool,
    expect_continue: bool,
    /// A protocol upgrade was asked for (and is forwarded: HTTP/1.1 clusters only).
    upgrade: bool,
    /// Method and target for the access log; only taken when logging is on.
    logged: Option<(String, String)>,
    /// The node's span of the request, when tracing is on (`crate::trace`).
    trace: Option<crate::trace::Started>,
}

enum Action<'v> {
    /// Refuse the request and close: the connection's framing can no longer be trusted.
    Refuse(Refusal),
    /// The proxy answers itself (direct response, no route, removed listener).
    Reply(Option<&'v CompiledRoute>, Response<ResponseBody>),
    /// Forward to an HTTP/1.1 cluster over its pool; `head` is the upstream request head.
    Forward {
        route: &'v CompiledRoute,
        cluster: ClusterId,
        pool: &'v H1Pool,
        head: Vec<u8>,
        key: u64,
    },
    /// Forward through the L7 layer's general path (`crate::l7::forward`): to an HTTP/2
    /// cluster through hyper's client, or for a route's fault delay or mirror.
    Bridge {
        route: &'v CompiledRoute,
        cluster: ClusterId,
        parts: http::request::Parts,
        delayed: Option<Delayed>,
    },
}

/// How one request ended, for the stats and the access log.
struct Done {
    status: u16,
    cluster: Option<ClusterId>,
    upstream: Option<SocketAddr>,
    /// The connection cannot carry another request.
    close: bool,
}

/// Serves HTTP/1.x on `io`, starting with the bytes already read into `buf`.
pub async fn serve<S>(ctx: Arc<ConnContext>, io: S, buf: BytesMut)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut client = Client { io, buf };
    let mut draining = ctx.draining.clone();
    loop {
        // The snapshot is read once the next request has begun to arrive, so a request
        // that comes after a reload, on a connection older than it, meets the new config.
        if client.buf.is_empty() {
            let idle = ctx.view.load().snapshot.config.limits.idle_timeout;
            if client.buf.capacity() > 2 * IDLE_BUFFER {
                // A big head or body grew it: let it go rather than hold it while idle.
                client.buf = BytesMut::new();
            }
            client.buf.reserve(IDLE_BUFFER);
            let read = tokio::io::AsyncReadExt::read_buf(&mut client.io, &mut client.buf);
            let next = tokio::select! {
                read = tokio::time::timeout(idle, read) => Some(read),
                // Between requests the connection carries nothing: a drain closes it now.
                () = draining.begun() => None,
            };
            match next {
                Some(Ok(Ok(1..))) => {}
                Some(_) => return,
                None => {
                    close_gracefully(&mut client.io).await;
                    return;
                }
            }
        }
        // One request, boxed: its state (reading the head, forwarding, retries, the answer) is
        // most of this future's size and lives only while the request does, so an idle
        // keep-alive connection holds just this loop's (BENCHMARKS.md, `idle_connections`).
        match Box::pin(one_request(&ctx, &mut client)).await {
            After::Next => {}
            After::Close => {
                close_gracefully(&mut client.io).await;
                return;
            }
            After::Stop => return,
        }
    }
}

/// What the connection does after a request.
enum After {
    /// Read the next request.
    Next,
    /// Close it gracefully ([`close_gracefully`]).
    Close,
    /// It is closed already, or was answered and closed by the request's own path.
    Stop,
}

/// Reads one request from `client` and serves it.
async fn one_request<S>(ctx: &ConnContext, client: &mut Client<S>) -> After
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let view = ctx.view.load_full();
    let limits = &view.snapshot.config.limits;
    let Some((exchange, action)) = next_request(ctx, &view, client, limits).await else {
        return After::Stop;
    };
    let done = match action {
        Action::Refuse(refusal) => {
            let resp = text_response(
                StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::BAD_REQUEST),
                format!("bad request: {}\n", refusal.reason),
                true,
            );
            let _ = respond(&mut client.io, resp, false, exchange.http10, true).await;
            finish(ctx, &exchange, None, refusal.status, None, None);
            return After::Close;
        }
        Action::Reply(route, resp) => {
            // An unread body must go before the next request can be read.
            let drained = drain(client, &exchange, limits).await;
            let close = !drained || !exchange.keep_alive;
            let (status, close) = answer(&mut client.io, &exchange, resp, close).await;
            finish(ctx, &exchange, route, status, None, None);
            Done {
                status,
                cluster: None,
                upstream: None,
                close,
            }
        }
        Action::Forward {
            route,
            cluster,
            pool,
            head,
            key,
        } => {
            let target = Target {
                route,
                cluster,
                pool,
            };
            let done = forward(ctx, client, &exchange, target, head, key, limits).await;
            finish_forwarded(ctx, &exchange, route, done)
        }
        Action::Bridge {
            route,
            cluster,
            parts,
            delayed,
        } => {
            let target = (route, cluster, delayed);
            let done = bridge(ctx, client, &exchange, target, parts, limits).await;
            finish_forwarded(ctx, &exchange, route, done)
        }
    };
    if done.close || !exchange.keep_alive {
        return After::Close;
    }
    After::Next
}

/// Closes a connection the proxy is done with without losing its last answer: close()
/// with unread bytes in the socket makes the kernel send a reset, which can destroy a
/// response the client has not read yet. So: FIN first, then read and drop what the client
/// still sends until it closes too (bounded in time and bytes), as nginx and HAProxy do.
async fn close_gracefully<S: AsyncRead + AsyncWrite + Unpin + Send>(io: &mut S) {
    if io.shutdown().await.is_err() {
        return;
    }
    // On the heap: this runs once per connection, and an array here would be in every
    // connection's future for its whole life.
    let mut scratch = vec![0u8; 4096];
    let mut left = 256 * 1024usize;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Ok(n @ 1..) = tokio::io::AsyncReadExt::read(io, &mut scratch).await {
            left = left.saturating_sub(n);
            if left == 0 {
                break;
            }
        }
    })
    .await;
}

/// [`finish`] for a request a route forwarded; hands `done` back.
fn finish_forwarded(
    ctx: &ConnContext,
    exchange: &Exchange<'_>,
    route: &CompiledRoute,
    done: Done,
) -> Done {
    finish(
        ctx,
        exchange,
        Some(route),
        done.status,
        done.cluster,
        done.upstream,
    );
    done
}

fn finish(
    ctx: &ConnContext,
    exchange: &Exchange<'_>,
    route: Option<&CompiledRoute>,
    status: u16,
    cluster: Option<ClusterId>,
    upstream: Option<SocketAddr>,
) {
    let outcome = Outcome {
        route,
        cluster,
        upstream,
        status,
        trace: exchange.trace.as_ref(),
    };
    crate::l7::log::finish(
        ctx,
        &exchange.view.snapshot,
        exchange.listener,
        exchange.started,
        &outcome,
        || exchange.logged.clone(),
    );
}

/// Reads the rest of the request head that has begun to arrive and decides what to do with
/// it. `None` when the connection is over: the client closed it, or sent a head that is too
/// large, malformed or too slow (answered here with 431, 400 or 408).
async fn next_request<'v, S>(
    ctx: &ConnContext,
    view: &'v WorkerView,
    client: &mut Client<S>,
    limits: &Limits,
) -> Option<(Exchange<'v>, Action<'v>)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let listener = view
        .snapshot
        .listener_at(ctx.listener_address, ctx.protocol);
    let mut head_deadline = None;
    loop {
        if !client.buf.is_empty() {
            // Only the limit's worth is parsed: a head that ends past it is refused however
            // the reads fell (one read can bring a whole 70 KiB head).
            let within = &client.buf[..client.buf.len().min(limits.max_header_bytes)];
            match prepare(ctx, view, listener, within) {
                Ok(Some((head_len, exchange, action))) => {
                    client.buf.advance(head_len);
                    return Some((exchange, action));
                }
                Ok(None) if client.buf.len() < limits.max_header_bytes => {}
                Ok(None) | Err(httparse::Error::TooManyHeaders) => {
                    let resp = text_response(
                        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                        format!(
                            "request header fields too large: the head must fit in {} bytes and {MAX_HEADERS} lines\n",
                            limits.max_header_bytes
                        ),
                        true,
                    );
                    let _ = respond(&mut client.io, resp, false, false, true).await;
                    close_gracefully(&mut client.io).await;
                    return None;
                }
                Err(err) => {
                    let resp = text_response(
                        StatusCode::BAD_REQUEST,
                        format!("bad request: malformed request head ({err})\n"),
                        true,
                    );
                    let _ = respond(&mut client.io, resp, false, false, true).await;
                    if let Some(l) = listener {
                        view.snapshot.listeners[l].no_route_stats.record(
                            ctx.worker,
                            400,
                            Duration::ZERO,
                        );
                    }
                    close_gracefully(&mut client.io).await;
                    return None;
                }
            }
        }
        // The whole head must arrive within header_read_timeout.
        let wait = *head_deadline
            .get_or_insert_with(|| tokio::time::Instant::now() + limits.header_read_timeout);
        client.buf.reserve(READ_BUFFER.min(limits.max_header_bytes));
        match tokio::time::timeout_at(
            wait,
            tokio::io::AsyncReadExt::read_buf(&mut client.io, &mut client.buf),
        )
        .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => return None,
            Ok(Ok(_)) => {}
            Err(_) => {
                let resp = text_response(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "request timeout: the request head did not arrive within {}\n",
                        flatmesh_config::duration::format(&limits.header_read_timeout)
                    ),
                    true,
                );
                let _ = respond(&mut client.io, resp, false, false, true).await;
                return None;
            }
        }
    }
}

/// What `prepare` found: the head's length, the request, and what to do with it.
type Prepared<'v> = (usize, Exchange<'v>, Action<'v>);

/// Parses the head at the front of `buf` and decides the request: `Ok(None)` until the head
/// is complete. Consumes nothing: the caller advances past the head.
fn prepare<'v>(
    ctx: &ConnContext,
    view: &'v WorkerView,
    listener: Option<ListenerId>,
    buf: &[u8],
) -> Result<Option<Prepared<'v>>, httparse::Error> {
    let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut lines);
    let head_len = match req.parse(buf)? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    let snap = &view.snapshot;
    let method_text = req.method.unwrap_or("GET");
    let mut exchange = Exchange {
        view,
        listener: listener.unwrap_or(0),
        started: Instant::now(),
        framing: Framing::Empty,
        http10: req.version == Some(0),
        keep_alive: false,
        is_head: method_text == "HEAD",
        expect_continue: false,
        upgrade: false,
        logged: ctx
            .access_log
            .enabled()
            .then(|| (method_text.to_owned(), req.path.unwrap_or("").to_owned())),
        trace: None,
    };
    let mut info = match head::analyze_request(&req) {
        Ok(info) => info,
        Err(refusal) => return Ok(Some((head_len, exchange, Action::Refuse(refusal)))),
    };
    exchange.framing = info.framing;
    // A request that arrives once the node drains is the connection's last: its answer says
    // `Connection: close`.
    exchange.keep_alive = info.keep_alive && !ctx.draining.now();
    exchange.expect_continue = info.expect_continue;
    exchange.upgrade = info.upgrade.is_some();
    let Some(lid) = listener else {
        return Ok(Some((
            head_len,
            exchange,
            Action::Reply(None, listener_removed()),
        )));
    };
    let Ok(method) = Method::from_bytes(method_text.as_bytes()) else {
        let refusal = Refusal {
            status: 400,
            reason: "the method is not a valid token",
        };
        return Ok(Some((head_len, exchange, Action::Refuse(refusal))));
    };
    let headers = flatmesh_rules::Headers::Raw(req.headers);
    exchange.trace = ctx.tracer.begin(headers, &method);
    let meta = flatmesh_rules::Request {
        method: &method,
        host: info.host,
        path: &info.path,
        query: info.query,
        headers,
        // gRPC runs over HTTP/2 only: no HTTP/1 request has a first gRPC message.
        message: None,
    };
    let caller = (ctx.peer(), ctx.worker, ctx.peer);
    let action = match decide(snap, lid, &meta, caller, false, || info.target()) {
        Decision::Reply(route, resp) => Action::Reply(route, resp),
        Decision::Forward(route, ..)
            if info
                .upgrade
                .is_some_and(|p| !route.allows_upgrade(p.as_bytes())) =>
        {
            // Envoy's answer to an upgrade its route does not allow. The client may already
            // be sending the new protocol's bytes: the connection closes after the answer.
            exchange.keep_alive = false;
            exchange.upgrade = false;
            Action::Reply(Some(route), upgrade_refused(route, info.upgrade))
        }
        Decision::Forward(route, cluster, path, delayed) => {
            if let Some(path) = path {
                info.path = path.into();
            }
            let plan = &snap.clusters[cluster];
            // A fault's delay and a mirror's copy are made on the general path; an upgrade
            // stays on the byte path (it is neither delayed nor mirrored).
            let general = (delayed.is_some() || route.mirror.is_some()) && info.upgrade.is_none();
            match &view.upstreams.by_cluster[cluster].pool {
                Pool::Http1(pool) if !general => {
                    let mut out = Vec::with_capacity(head_len + 128);
                    let endpoint = plan.authorities.first().map_or("", |a| a.as_str());
                    let propagation = exchange
                        .trace
                        .as_ref()
                        .map(crate::trace::Started::propagation)
                        .unwrap_or_default();
                    head::write_request_head(
                        &mut out,
                        &req,
                        &info,
                        route,
                        ctx.peer_ip.as_bytes(),
                        endpoint,
                        &propagation,
                    );
                    Action::Forward {
                        route,
                        cluster,
                        pool,
                        head: out,
                        key: hash_key(headers, plan.hash_header.as_ref(), ctx.peer),
                    }
                }
                Pool::Http1(_) | Pool::Http2(_) => match bridge_parts(&req, &info) {
                    Ok(parts) => Action::Bridge {
                        route,
                        cluster,
                        parts,
                        delayed,
                    },
                    Err(refusal) => Action::Refuse(refusal),
                },
            }
        }
    };
    exchange.listener = lid;
    Ok(Some((head_len, exchange, action)))
}

/// 403 for an upgrade to `protocol` that `route` does not list in `upgrades`.
fn upgrade_refused(route: &CompiledRoute, protocol: Option<&str>) -> Response<ResponseBody> {
    text_response(
        StatusCode::FORBIDDEN,
        format!(
            "forbidden: route `{}` does not allow the upgrade to `{}`; list it in the route's `upgrades` to let it through\n",
            route.name,
            protocol.unwrap_or_default().escape_debug()
        ),
        true,
    )
}

/// The request as hyper's client wants it, for an HTTP/2 cluster.
fn bridge_parts(
    req: &httparse::Request<'_, '_>,
    info: &head::RequestInfo<'_>,
) -> Result<http::request::Parts, Refusal> {
    let bad = |reason| Refusal {
        status: 400,
        reason,
    };
    let mut builder = http::Request::builder()
        .method(req.method.unwrap_or("GET"))
        .uri(info.target())
        .version(http::Version::HTTP_11);
    let headers = builder.headers_mut().ok_or(bad("unusable request line"))?;
    for h in req.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| bad("bad header name"))?;
        let value = HeaderValue::from_bytes(h.value).map_err(|_| bad("bad header value"))?;
        headers.append(name, value);
    }
    if info.absolute_form {
        if let Some(host) = info.host.and_then(|h| HeaderValue::from_str(h).ok()) {
            headers.insert(http::header::HOST, host);
        }
    }
    // The body is re-framed by hyper; the client's own framing headers do not go on.
    headers.remove(http::header::CONTENT_LENGTH);
    headers.remove(http::header::TRANSFER_ENCODING);
    headers.remove(http::header::EXPECT);
    builder
        .body(())
        .map(|r| r.into_parts().0)
        .map_err(|_| bad("unusable request target"))
}

/// Reads and drops the body of a request the proxy answered itself. False if the
/// connection cannot be reused (body too large, malformed or cut off).
async fn drain<S: AsyncRead + AsyncWrite + Unpin + Send>(
    client: &mut Client<S>,
    exchange: &Exchange<'_>,
    limits: &Limits,
) -> bool {
    if exchange.framing == Framing::Empty {
        return true;
    }
    if exchange.expect_continue {
        // The client waits for a go-ahead that a final answer makes moot; it will not send the body.
        return false;
    }
    body::relay(
        &mut client.io,
        &mut client.buf,
        &mut DiscardSink { left: MAX_DRAIN },
        Vec::new(),
        exchange.framing,
        Encode::Dechunk,
        limits.header_read_timeout,
    )
    .await
    .is_ok()
}

/// Writes a response the proxy made (or hyper's client returned) to an HTTP/1 client, with
/// `Connection: close` if `close`. False if the client is gone or the body broke off.
/// Sends a whole response to this exchange's client. Returns its status and whether the
/// connection must close afterwards: because `close` asked for it, or because the write failed.
async fn answer<W: AsyncWrite + Unpin>(
    io: &mut W,
    exchange: &Exchange<'_>,
    resp: Response<ResponseBody>,
    close: bool,
) -> (u16, bool) {
    let status = resp.status().as_u16();
    let ok = respond(io, resp, exchange.is_head, exchange.http10, close).await;
    (status, close || !ok)
}

async fn respond<W: AsyncWrite + Unpin>(
    io: &mut W,
    resp: Response<ResponseBody>,
    is_head: bool,
    http10: bool,
    close: bool,
) -> bool {
    let (parts, mut body) = resp.into_parts();
    let status = parts.status.as_u16();
    let no_body = is_head || (100..200).contains(&status) || status == 204 || status == 304;
    let length = body.size_hint().exact().or_else(|| {
        parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok())
    });
    let (framing, close) = match (no_body, length) {
        (true, _) => (Framing::Empty, close),
        (false, Some(n)) => (Framing::Length(n), close),
        // Unknown length: chunked to HTTP/1.1, to the end of the connection for HTTP/1.0.
        (false, None) if http10 => (Framing::UntilClose, true),
        (false, None) => (Framing::Chunked, close),
    };
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(parts.status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == http::header::CONTENT_LENGTH && framing != Framing::Empty
            || name == http::header::TRANSFER_ENCODING
            || name == http::header::CONNECTION
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        Framing::Length(n) => out.extend_from_slice(format!("content-length: {n}\r\n").as_bytes()),
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        Framing::Empty if !no_body => out.extend_from_slice(b"content-length: 0\r\n"),
        _ => {}
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if http10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if framing == Framing::Empty {
        return io.write_all(&out).await.is_ok();
    }
    // Stream the body frames; data goes out behind the head where it can.
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            // The upstream broke mid-body: the client can only learn it from the close.
            let _ = io.write_all(&out).await;
            return false;
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers have no HTTP/1 form worth sending
        };
        if data.is_empty() {
            continue;
        }
        if framing == Framing::Chunked {
            super::chunked::chunk_header(&mut out, data.len());
            out.extend_from_slice(&data);
            out.extend_from_slice(b"\r\n");
        } else {
            out.extend_from_slice(&data);
        }
        if io.write_all(&out).await.is_err() {
            return false;
        }
        out.clear();
    }
    if framing == Framing::Chunked {
        out.extend_from_slice(super::chunked::LAST_CHUNK);
    }
    io.write_all(&out).await.is_ok()
}

/// Answers `Expect: 100-continue` once the request is on its way, unless the client has
/// started sending its body anyway.
async fn go_ahead<S: AsyncRead + AsyncWrite + Unpin + Send>(
    client: &mut Client<S>,
    exchange: &Exchange<'_>,
) -> std::io::Result<()> {
    if exchange.expect_continue && client.buf.is_empty() && !exchange.http10 {
        client.io.write_all(CONTINUE).await?;
    }
    Ok(())
}

/// Where a request goes: its route, the cluster the route picked, and that cluster's pool.
struct Target<'v> {
    route: &'v CompiledRoute,
    cluster: ClusterId,
    pool: &'v H1Pool,
}

/// An HTTP/1.1 endpoint's answer to one try: the connection with the final response head at
/// the front of its buffer, and what the client gets of that head.
struct H1Answer {
    conn: UpstreamConn,
    status: u16,
    head_len: usize,
    /// The body's framing as the endpoint sends it, and how it leaves for the client.
    framing: Framing,
    encode: Encode,
    /// The endpoint's connection can carry another request after this answer.
    reusable: bool,
    /// The client's connection closes after this answer.
    close: bool,
    /// The response head for the client, rewritten.
    out: Vec<u8>,
}

impl Answer for H1Answer {
    fn status(&self) -> u16 {
        self.status
    }
}

/// Forwards a request to an HTTP/1.1 cluster over the worker's keep-alive pool, through the
/// retry driver.
#[allow(clippy::too_many_arguments)]
async fn forward<S: AsyncRead + AsyncWrite + Unpin + Send>(
    ctx: &ConnContext,
    client: &mut Client<S>,
    exchange: &Exchange<'_>,
    target: Target<'_>,
    head: Vec<u8>,
    key: u64,
    limits: &Limits,
) -> Done {
    let Target {
        route,
        cluster,
        pool,
    } = target;
    let view = exchange.view;
    let plan = &view.snapshot.clusters[cluster];
    let upstream = &view.upstreams.by_cluster[cluster];
    // A body is kept for a retry when its declared length fits the route's
    // `retries.max_replay_body`; any other can be sent only once.
    let kept = match exchange.framing {
        Framing::Length(n) if replayable_body(route, Some(n)) => {
            Some(Vec::with_capacity(head.len() + n as usize))
        }
        _ => None,
    };
    let has_body = exchange.framing != Framing::Empty;
    let replayable = !has_body || kept.is_some();
    let mut retry = Retry::new(
        route,
        plan,
        upstream,
        ctx.worker,
        key,
        replayable,
        limits.request_timeout,
    )
    .toward(ctx.dialled);
    // A body still to relay: the route's timeout starts once it is through.
    let mut uploaded = None;
    if has_body {
        let (sender, watched) = watch::channel(false);
        retry = retry.timed_from_upload(watched, limits.idle_timeout);
        uploaded = Some(sender);
    }
    let mut codec = H1Try {
        ctx,
        client: &mut *client,
        exchange,
        route,
        pool,
        plan,
        head: &head,
        limits,
        uploaded: uploaded.as_ref(),
        kept,
        body_sent: BodySent::Nothing,
    };
    let sent = retry.drive(&mut codec).await;
    // The client's body is read whole (its framing is intact) once a try sent all of it.
    let body_read = !has_body || codec.body_sent == BodySent::Whole;
    drop(codec);
    let done = |status: u16, upstream, close| Done {
        status,
        cluster: Some(cluster),
        upstream,
        close,
    };
    match sent {
        Ok(Answered {
            mut answer,
            endpoint,
            in_flight: _in_flight,
        }) => {
            let (reusable, client_ok) = relay_response(client, &mut answer, limits).await;
            if reusable {
                pool.checkin(endpoint, answer.conn);
            }
            done(answer.status, Some(endpoint), !client_ok)
        }
        Err(err) if err.kind == Kind::ClientGone => done(CLIENT_CLOSED_REQUEST, err.endpoint, true),
        Err(err) => {
            let resp = upstream_failure(&err, &plan.name, retry.timeout, false);
            // After a failure mid-body the client's framing is unknown: close.
            let close = !body_read || err.source == Source::Downstream;
            let (status, close) = answer(&mut client.io, exchange, resp, close).await;
            done(status, err.endpoint, close)
        }
    }
}

/// One request from an HTTP/1 client, tried on an HTTP/1.1 cluster's pool.
struct H1Try<'a, 'v, S> {
    ctx: &'a ConnContext,
    client: &'a mut Client<S>,
    exchange: &'a Exchange<'v>,
    route: &'v CompiledRoute,
    pool: &'v H1Pool,
    plan: &'v ClusterPlan,
    /// The upstream request head, written once for every try.
    head: &'a [u8],
    limits: &'a Limits,
    /// Where the relay of the request body reports its progress (`l7::retry`).
    uploaded: Option<&'a watch::Sender<bool>>,
    /// The request as the first try that relays it sends it (head and body), kept for the
    /// tries after it: `Some` when the body fits `retries.max_replay_body`. Freed with the
    /// request.
    kept: Option<Vec<u8>>,
    /// How much of the client's body a try has sent.
    body_sent: BodySent,
}

/// How much of the client's request body the tries have read and sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodySent {
    Nothing,
    /// A try failed partway: the rest of the body is lost, no other try can send it.
    Part,
    Whole,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> Attempt for H1Try<'_, '_, S> {
    type Answer = H1Answer;

    async fn attempt(&mut self, to: Try) -> Result<H1Answer, UpstreamError> {
        let conn = self.exchange_with(to.endpoint).await?;
        read_answer(conn, self.exchange, self.route)
    }

    fn can_resend(&self) -> bool {
        self.body_sent != BodySent::Part
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> H1Try<'_, '_, S> {
    /// Sends the request to `endpoint` on a pooled or new connection and reads until a
    /// complete final response head is buffered. Informational (1xx) answers are passed to
    /// the client on the way.
    async fn exchange_with(&mut self, endpoint: SocketAddr) -> Result<UpstreamConn, UpstreamError> {
        let (exchange, limits) = (self.exchange, self.limits);
        let mut conn = pool::acquire(self.pool, endpoint, self.plan, self.ctx.worker).await?;
        match (&self.kept, self.body_sent) {
            // A retry: the request as the first try sent it, head and body.
            (Some(kept), BodySent::Whole) => {
                conn.stream
                    .write_all(kept)
                    .await
                    .map_err(|e| conn.failed(e))?;
            }
            _ => self.relay_request(&mut conn).await?,
        }
        loop {
            match conn.response_head(limits.max_header_bytes, exchange.upgrade) {
                HeadState::Final => return Ok(conn),
                HeadState::Invalid(why) => return Err(UpstreamError::invalid(why)),
                // Pass an informational answer on (HTTP/1.1 clients only); the final one
                // follows.
                HeadState::Informational { len, head } => {
                    conn.buf.advance(len);
                    if !exchange.http10 {
                        self.client
                            .io
                            .write_all(&head)
                            .await
                            .map_err(UpstreamError::client_gone)?;
                    }
                }
                HeadState::Incomplete => conn.read_more().await?,
            }
        }
    }

    /// Sends the request head and relays the client's body to `conn`, keeping what it sends
    /// when the body is kept for a retry.
    async fn relay_request(&mut self, conn: &mut UpstreamConn) -> Result<(), UpstreamError> {
        let (client, exchange, limits) = (&mut *self.client, self.exchange, self.limits);
        go_ahead(client, exchange)
            .await
            .map_err(UpstreamError::client_gone)?;
        if exchange.framing != Framing::Empty {
            self.body_sent = BodySent::Part;
        }
        let mut sink = Watched {
            sink: Kept {
                sink: WriteSink(&mut conn.stream),
                kept: self.kept.as_mut(),
            },
            progress: self.uploaded,
        };
        let relayed = body::relay(
            &mut client.io,
            &mut client.buf,
            &mut sink,
            self.head.to_vec(),
            exchange.framing,
            Encode::AsIs,
            limits.idle_timeout,
        )
        .await;
        match relayed {
            Ok(()) => {}
            Err(RelayError::Sink(e)) => {
                let err = conn.failed(e);
                self.keep_the_rest().await;
                return Err(err);
            }
            Err(RelayError::Framing(e)) => return Err(UpstreamError::request_body(e.describe())),
            Err(RelayError::Source(e)) => return Err(UpstreamError::client_gone(e)),
        }
        self.body_sent = BodySent::Whole;
        if let Some(uploaded) = self.uploaded {
            uploaded.send_replace(true);
        }
        Ok(())
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> H1Try<'_, '_, S> {
    /// After the endpoint stopped taking a kept body partway: reads the rest of it from the
    /// client into the keep, so that another try can send it whole.
    async fn keep_the_rest(&mut self) {
        let (Some(kept), Framing::Length(length)) = (self.kept.as_mut(), self.exchange.framing)
        else {
            return;
        };
        // The keep holds the head, then the body as far as it was taken from the client.
        let taken = kept.len().saturating_sub(self.head.len()) as u64;
        let mut sink = Kept {
            sink: DiscardSink { left: u64::MAX },
            kept: Some(kept),
        };
        let rest = body::relay(
            &mut self.client.io,
            &mut self.client.buf,
            &mut sink,
            Vec::new(),
            Framing::Length(length.saturating_sub(taken)),
            Encode::AsIs,
            self.limits.idle_timeout,
        )
        .await;
        if rest.is_ok() {
            self.body_sent = BodySent::Whole;
            if let Some(uploaded) = self.uploaded {
                uploaded.send_replace(true);
            }
        }
    }
}

/// Reads the final response head buffered in `conn` and writes, for the client, the head it
/// gets: hop-by-hop fields out, the route's response headers in, the body framed for it.
fn read_answer(
    conn: UpstreamConn,
    exchange: &Exchange<'_>,
    route: &CompiledRoute,
) -> Result<H1Answer, UpstreamError> {
    // The head borrows the connection's buffer until the answer takes the connection.
    let (status, head_len, framing, encode, reusable, close, out) = {
        let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut lines);
        let Ok(httparse::Status::Complete(head_len)) = resp.parse(&conn.buf) else {
            return Err(UpstreamError::invalid("malformed response head"));
        };
        let info =
            head::analyze_response(&resp, exchange.is_head).map_err(UpstreamError::invalid)?;
        if exchange.http10 && info.has_codings() {
            return Err(UpstreamError::invalid(head::CODINGS_NEED_HTTP11));
        }
        let (out_framing, encode, until_close) = match (info.framing, exchange.http10) {
            (Framing::Chunked, true) => (Framing::UntilClose, Encode::Dechunk, true),
            (Framing::UntilClose, true) => (Framing::UntilClose, Encode::AsIs, true),
            (Framing::UntilClose, false) => (Framing::Chunked, Encode::Rechunk, false),
            (f, _) => (f, Encode::AsIs, false),
        };
        let close = !exchange.keep_alive || until_close;
        let mut out = Vec::with_capacity(head_len + 64);
        head::write_response_head(
            &mut out,
            &resp,
            &info,
            &route.response_headers_to_add,
            out_framing,
            close,
            exchange.http10 && !close,
        );
        let status = info.status;
        (
            status,
            head_len,
            info.framing,
            encode,
            info.reusable,
            close,
            out,
        )
    };
    Ok(H1Answer {
        conn,
        status,
        head_len,
        framing,
        encode,
        reusable,
        close,
        out,
    })
}

/// Sends the answer's rewritten head and streams its body to the client. Returns whether the
/// upstream connection can go back to the pool and whether the client's connection is
/// still good for another request.
async fn relay_response<S: AsyncRead + AsyncWrite + Unpin + Send>(
    client: &mut Client<S>,
    answer: &mut H1Answer,
    limits: &Limits,
) -> (bool, bool) {
    let conn = &mut answer.conn;
    conn.buf.advance(answer.head_len);
    let out = std::mem::take(&mut answer.out);
    if answer.status == 101 {
        tunnel(client, conn, out, crate::tcp::Relay::of(limits)).await;
        return (false, false);
    }
    let relayed = body::relay(
        &mut conn.stream,
        &mut conn.buf,
        &mut WriteSink(&mut client.io),
        out,
        answer.framing,
        answer.encode,
        limits.idle_timeout,
    )
    .await;
    match relayed {
        Ok(()) => (answer.reusable && conn.buf.is_empty(), !answer.close),
        Err(err) => {
            tracing::debug!(?err, "response body cut short");
            (false, false)
        }
    }
}

/// After a 101 answer: the connection is the new protocol's, both ways, until either side
/// closes. Bytes already read on either side go first. The upstream connection is used up.
async fn tunnel<S: AsyncRead + AsyncWrite + Unpin + Send>(
    client: &mut Client<S>,
    conn: &mut UpstreamConn,
    mut head: Vec<u8>,
    relay: crate::tcp::Relay,
) {
    head.extend_from_slice(&conn.buf);
    conn.buf.clear();
    let early = std::mem::take(&mut client.buf);
    let ready =
        client.io.write_all(&head).await.is_ok() && conn.stream.write_all(&early).await.is_ok();
    if ready {
        let ended = crate::tcp::copy_until_idle(&mut client.io, &mut conn.stream, relay).await;
        tracing::debug!(?ended, "upgraded connection ended");
    }
}

/// A request body handed to hyper's client through a channel.
struct ChannelBody(mpsc::Receiver<Result<Bytes, BoxError>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|next| next.map(|item| item.map(http_body::Frame::data)))
    }
}

/// Forwards a request through the L7 layer's general path (an HTTP/2 cluster, or a route's
/// fault delay or mirror): the request in `http` types, the body pumped from the client
/// connection into it, and the answer written back as HTTP/1.
async fn bridge<S: AsyncRead + AsyncWrite + Unpin + Send>(
    ctx: &ConnContext,
    client: &mut Client<S>,
    exchange: &Exchange<'_>,
    (route, cluster, delayed): (&CompiledRoute, ClusterId, Option<Delayed>),
    parts: http::request::Parts,
    limits: &Limits,
) -> Done {
    let failed = AtomicBool::new(false);
    let replayable = exchange.framing == Framing::Empty;
    let (body, pump) = if replayable {
        (empty(), None)
    } else {
        let (tx, rx) = mpsc::channel(4);
        (ChannelBody(rx).boxed_unsync() as UpstreamBody, Some(tx))
    };
    let pumped = async {
        let Some(tx) = pump else {
            return true;
        };
        if go_ahead(client, exchange).await.is_err() {
            return false;
        }
        let mut sink = ChannelSink(tx);
        match body::relay(
            &mut client.io,
            &mut client.buf,
            &mut sink,
            Vec::new(),
            exchange.framing,
            Encode::Dechunk,
            limits.idle_timeout,
        )
        .await
        {
            Ok(()) => true,
            Err(RelayError::Framing(e)) => {
                failed.store(true, Ordering::Relaxed);
                let _ = sink.0.send(Err(e.describe().into())).await;
                false
            }
            Err(RelayError::Source(e)) => {
                let _ = sink.0.send(Err(Box::new(e))).await;
                false
            }
            Err(RelayError::Sink(_)) => false,
        }
    };
    let view = exchange.view;
    let forwarded = crate::l7::forward::forward(
        ctx,
        view,
        route,
        cluster,
        parts,
        body,
        replayable,
        &failed,
        delayed,
        exchange.trace.as_ref(),
    );
    let ((resp, upstream), body_complete) = tokio::join!(forwarded, pumped);
    let close = !body_complete || !exchange.keep_alive;
    let (status, close) = answer(&mut client.io, exchange, resp, close).await;
    Done {
        status,
        cluster: Some(cluster),
        upstream,
        close,
    }
}

#[cfg(test)]
mod tests {
    //! The HTTP/1 adapter end to end on the test's runtime: a client connection over an
    //! in-memory pipe, endpoints on loopback, and tokio's paused clock for every timeout.
    #![allow(clippy::unwrap_used)]
    use std::net::SocketAddr;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::time::Instant;

    use crate::testing::{self, dead_endpoint, ok, read_reply, Endpoint, Reply, Script};

    fn config(endpoints: &[SocketAddr], retries: &str) -> String {
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
        format!(
            r#"
limits:
  header_read_timeout: 2s
  idle_timeout: 5s
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /slow }} }}
        cluster: app
        timeout: 1s
      - match: {{ path: {{ exact: /direct }} }}
        direct_response: {{ status: 200, body: "direct" }}
      - match: {{ path: {{ prefix: /app }} }}
        cluster: app
{retries}
clusters:
  - name: app
    endpoints: [ {} ]
"#,
            endpoints.join(", ")
        )
    }

    /// A client connection to a node running `yaml`, and the view it reads (for the stats).
    fn connect(
        yaml: &str,
    ) -> (
        tokio::io::DuplexStream,
        std::sync::Arc<arc_swap::ArcSwap<crate::context::WorkerView>>,
    ) {
        let view = testing::view(yaml);
        let client = testing::h1_client(testing::context(&view));
        (client, view)
    }

    async fn exchange(client: &mut tokio::io::DuplexStream, request: &str) -> Option<Reply> {
        client.write_all(request.as_bytes()).await.unwrap();
        read_reply(client, &mut Vec::new()).await
    }

    fn retries(view: &arc_swap::ArcSwap<crate::context::WorkerView>) -> u64 {
        view.load().snapshot.clusters[0].stats.retries.sum()
    }

    /// Reads until the proxy closes the connection; true if it did (rather than erroring).
    async fn closed(client: &mut tokio::io::DuplexStream) -> bool {
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.is_ok()
    }

    const GET: &str = "GET /app/x HTTP/1.1\r\nhost: t\r\n\r\n";

    #[tokio::test(start_paused = true)]
    async fn requests_are_forwarded_and_the_upstream_connection_is_reused() {
        let app = Endpoint::start(|_, n, head| {
            assert!(head.contains("x-forwarded-for: 127.0.0.1"), "{head}");
            Script::Answer(Duration::ZERO, ok(&format!("answer {n}")))
        })
        .await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        for n in 0..3 {
            let reply = exchange(&mut client, GET).await.unwrap();
            assert_eq!(
                (reply.status, reply.body.as_str()),
                (200, format!("answer {n}").as_str())
            );
        }
        assert_eq!(app.connections(), 1, "one keep-alive connection upstream");
    }

    #[tokio::test(start_paused = true)]
    async fn an_endpoint_slower_than_the_route_timeout_gets_504_at_the_timeout() {
        let app =
            Endpoint::start(|_, _, _| Script::Answer(Duration::from_secs(10), ok("late"))).await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        let started = Instant::now();
        let reply = exchange(&mut client, "GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(reply.status, 504, "{reply:?}");
        assert!(reply.body.contains("did not answer within 1s"), "{reply:?}");
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        // The connection carries on.
        let reply = exchange(&mut client, "GET /direct HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(reply.body, "direct");
    }

    /// The head limit holds however the bytes arrived: here the whole 70 KiB head is in the
    /// connection's first read (the protocol sniff's), where a parse of everything read would
    /// have found it complete and taken it.
    #[tokio::test(start_paused = true)]
    async fn a_head_over_the_limit_in_one_read_gets_431() {
        let ctx = testing::context(&testing::view(&config(&[dead_endpoint()], "")));
        let mut head = String::from("GET /direct HTTP/1.1\r\nhost: t\r\n");
        for i in 0..10 {
            head.push_str(&format!("x-big-{i}: {}\r\n", "a".repeat(7 * 1024)));
        }
        head.push_str("\r\n");
        assert!(head.len() > 70 * 1024);
        let (mut client, server) = tokio::io::duplex(256 * 1024);
        tokio::spawn(super::serve(
            ctx,
            server,
            bytes::BytesMut::from(head.as_bytes()),
        ));
        let reply = read_reply(&mut client, &mut Vec::new()).await.unwrap();
        assert_eq!(reply.status, 431, "{reply:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_endpoint_is_retried_on_the_live_one() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("live"))).await;
        let yaml = config(
            &[dead_endpoint(), app.addr],
            "        retries: { attempts: 1, on: [ connect-failure ] }",
        );
        let (mut client, view) = connect(&yaml);
        let reply = exchange(&mut client, GET).await.unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (200, "live"));
        assert_eq!(retries(&view), 1);
        // Without a retry policy the dead endpoint's turn is a 503 that names the cluster.
        let (mut client, _view) = connect(&config(&[dead_endpoint()], ""));
        let reply = exchange(&mut client, GET).await.unwrap();
        assert_eq!(reply.status, 503);
        assert!(
            reply.body.contains("upstream connect error: cluster `app`"),
            "{reply:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_5xx_answer_is_tried_again_when_the_policy_names_it() {
        // The first connection answers 503; the retry's own connection answers 200.
        let app = Endpoint::start(|c, _, _| match c {
            0 => Script::Answer(
                Duration::ZERO,
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy".to_vec(),
            ),
            _ => Script::Answer(Duration::ZERO, ok("fine")),
        })
        .await;
        let yaml = config(&[app.addr], "        retries: { attempts: 2, on: [ 5xx ] }");
        let (mut client, view) = connect(&yaml);
        let reply = exchange(&mut client, GET).await.unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (200, "fine"));
        assert_eq!(retries(&view), 1);
        assert_eq!(
            app.connections(),
            2,
            "a retried answer's connection is not reused"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pooled_connection_the_endpoint_closed_is_replaced_without_a_retry() {
        // Each connection answers its first request, then closes on the second unanswered.
        let app = Endpoint::start(|_, n, _| match n {
            0 => Script::Answer(Duration::ZERO, ok("first")),
            _ => Script::Close,
        })
        .await;
        let (mut client, view) = connect(&config(&[app.addr], ""));
        for _ in 0..3 {
            let reply = exchange(&mut client, GET).await.unwrap();
            assert_eq!((reply.status, reply.body.as_str()), (200, "first"));
        }
        assert_eq!(app.connections(), 3);
        assert_eq!(retries(&view), 0, "not a retry by policy");
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_with_a_body_is_sent_once_and_its_failure_closes_the_connection() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("live"))).await;
        // A body over `max_replay_body` is not kept for a retry.
        let yaml = config(
            &[dead_endpoint(), app.addr],
            "        retries: { attempts: 1, on: [ connect-failure ], max_replay_body: 4 }",
        );
        let (mut client, view) = connect(&yaml);
        let reply = exchange(
            &mut client,
            "POST /app HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhello",
        )
        .await
        .unwrap();
        assert_eq!(reply.status, 503, "{reply:?}");
        assert_eq!(reply.header("connection"), Some("close"));
        assert!(closed(&mut client).await);
        assert_eq!(retries(&view), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_with_a_body_that_fits_max_replay_body_is_retried_whole() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("live"))).await;
        let yaml = config(
            &[dead_endpoint(), app.addr],
            "        retries: { attempts: 1, on: [ connect-failure ], max_replay_body: 5 }",
        );
        let (mut client, view) = connect(&yaml);
        let reply = exchange(
            &mut client,
            "POST /app HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhello",
        )
        .await
        .unwrap();
        assert_eq!(
            (reply.status, reply.body.as_str()),
            (200, "live"),
            "{reply:?}"
        );
        assert_eq!(reply.header("connection"), None, "the body was read whole");
        assert_eq!(retries(&view), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_invalid_answer_is_502_and_an_answerless_close_is_502() {
        let app = Endpoint::start(|c, _, _| match c {
            0 => Script::Answer(Duration::ZERO, b"NONSENSE\r\n\r\n".to_vec()),
            _ => Script::Close,
        })
        .await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        let reply = exchange(&mut client, GET).await.unwrap();
        assert_eq!(reply.status, 502);
        assert!(
            reply.body.contains("upstream sent an invalid response"),
            "{reply:?}"
        );
        let reply = exchange(&mut client, GET).await.unwrap();
        assert_eq!(reply.status, 502);
        assert!(
            reply.body.contains("upstream reset: cluster `app`"),
            "{reply:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_malformed_chunked_body_is_400_and_closes() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("never"))).await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        let reply = exchange(
            &mut client,
            "POST /app HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        )
        .await
        .unwrap();
        assert_eq!(reply.status, 400, "{reply:?}");
        assert!(reply.body.contains("malformed"), "{reply:?}");
        assert!(closed(&mut client).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_that_does_not_arrive_in_time_gets_408() {
        let (mut client, _view) = connect(&config(&[dead_endpoint()], ""));
        let started = Instant::now();
        client
            .write_all(b"GET /direct HTTP/1.1\r\nhost:")
            .await
            .unwrap();
        let reply = read_reply(&mut client, &mut Vec::new()).await.unwrap();
        assert_eq!(reply.status, 408);
        assert_eq!(
            started.elapsed(),
            Duration::from_secs(2),
            "header_read_timeout"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
        let (mut client, _view) = connect(&config(&[dead_endpoint()], ""));
        let reply = exchange(&mut client, "GET /direct HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(reply.body, "direct");
        let started = Instant::now();
        assert!(closed(&mut client).await);
        assert_eq!(started.elapsed(), Duration::from_secs(5), "idle_timeout");
    }

    #[tokio::test(start_paused = true)]
    async fn pipelined_requests_are_answered_in_order() {
        let app = Endpoint::start(|_, n, head| {
            let path = head.split(' ').nth(1).unwrap_or("").to_owned();
            // The first waits longest: order must still hold.
            Script::Answer(Duration::from_millis(300 - 100 * n as u64), ok(&path))
        })
        .await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        client
            .write_all(b"GET /app/1 HTTP/1.1\r\nhost: t\r\n\r\nGET /direct HTTP/1.1\r\nhost: t\r\n\r\nGET /app/3 HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let mut bodies = Vec::new();
        for _ in 0..3 {
            bodies.push(read_reply(&mut client, &mut buf).await.unwrap().body);
        }
        assert_eq!(bodies, ["/app/1", "direct", "/app/3"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_but_live_upload_is_not_cut_by_the_route_timeout() {
        // Issue 23 item 9: the route's timeout (1s on /slow) ran during the upload. It starts
        // once the request is complete, as Envoy's does: a 3 s upload gets its answer.
        let app = Endpoint::start(|_, _, head| {
            assert!(head.contains("content-length: 6"), "{head}");
            Script::Answer(Duration::ZERO, ok("stored"))
        })
        .await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        let started = Instant::now();
        client
            .write_all(b"POST /slow HTTP/1.1\r\nhost: t\r\ncontent-length: 6\r\n\r\n")
            .await
            .unwrap();
        for byte in b"abcdef" {
            tokio::time::sleep(Duration::from_millis(500)).await;
            client.write_all(&[*byte]).await.unwrap();
        }
        let reply = read_reply(&mut client, &mut Vec::new()).await.unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (200, "stored"));
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_upload_is_cut_by_the_idle_timeout() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("never"))).await;
        let (mut client, _view) = connect(&config(&[app.addr], ""));
        client
            .write_all(b"POST /slow HTTP/1.1\r\nhost: t\r\ncontent-length: 6\r\n\r\nab")
            .await
            .unwrap();
        let stalled = Instant::now();
        assert!(closed(&mut client).await);
        assert_eq!(stalled.elapsed(), Duration::from_secs(5), "idle_timeout");
    }

    #[tokio::test(start_paused = true)]
    async fn no_route_is_404_and_the_connection_stays_open() {
        let (mut client, _view) = connect(&config(&[dead_endpoint()], ""));
        let reply = exchange(&mut client, "GET /nowhere HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(reply.status, 404);
        assert!(
            reply.body.contains("no route matched: listener `web`"),
            "{reply:?}"
        );
        let reply = exchange(&mut client, "GET /direct HTTP/1.1\r\nhost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(reply.status, 200);
    }
}
