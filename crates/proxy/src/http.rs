//! The L7 path, FlatProxy's PPM chain in software:
//! parser (hyper reads the request head) → match (the rule program's user-tier executor)
//! → action (forward / split / direct response, header rewrites) → deparser (hyper writes
//! the request to the upstream pool and streams the answer back).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use flatmesh_config::RetryOn;
use flatmesh_rules::{ClusterId, CompiledRoute, ListenerId, RouteAction};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;

use crate::access_log::AccessRecord;
use crate::h1::client::{H1Body, SendError};
use crate::lb::{hash64, hash_client};
use crate::snapshot::Snapshot;
use crate::upstream::{BoxError, Pool, UpstreamBody};
use crate::worker::ConnContext;

/// Body of a response sent downstream: an upstream's body streamed through, or our own.
pub enum ResponseBody {
    /// From an HTTP/2 endpoint (hyper's client).
    Http2(Incoming),
    /// From an HTTP/1.1 endpoint (`crate::h1::client`).
    Http1(Box<H1Body>),
    /// Made by the proxy.
    Local(Full<Bytes>),
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ResponseBody::Http2(b) => Pin::new(b).poll_frame(cx).map_err(BoxError::from),
            ResponseBody::Http1(b) => Pin::new(b).poll_frame(cx),
            ResponseBody::Local(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Http2(b) => b.is_end_stream(),
            ResponseBody::Http1(b) => b.is_end_stream(),
            ResponseBody::Local(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Http2(b) => b.size_hint(),
            ResponseBody::Http1(b) => b.size_hint(),
            ResponseBody::Local(b) => b.size_hint(),
        }
    }
}

/// Where a failure came from (Pingora's idea): it decides the status and whether to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The client sent a malformed body (e.g. a bad chunk size): 400, close.
    Downstream,
    /// No connection to the endpoint could be made: 503, retryable.
    Connect,
    /// The endpoint reset or closed mid-request: 502.
    Reset,
    /// The route's timeout passed: 504.
    Timeout,
    /// The endpoint answered with something that is not valid HTTP: 502.
    Invalid,
}

/// hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded.
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name == header::TE
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Fast path: most requests carry none, and one pass over the names is far cheaper than
    // a hashed remove per hop-by-hop name.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    // Headers named in `Connection` are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::try_from(n.trim()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    // `te` may only carry "trailers" (gRPC needs it); anything else is hop-by-hop.
    if headers
        .get(header::TE)
        .is_some_and(|v| v.as_bytes() != b"trailers")
    {
        headers.remove(header::TE);
    }
}

pub(crate) fn text_response(
    status: StatusCode,
    body: String,
    close: bool,
) -> Response<ResponseBody> {
    let mut resp = Response::new(ResponseBody::Local(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if close {
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// The gRPC status for an HTTP status, per gRPC's "HTTP to gRPC status code mapping".
fn grpc_status(status: StatusCode) -> u8 {
    match status.as_u16() {
        400 => 13,             // INTERNAL
        401 => 16,             // UNAUTHENTICATED
        403 => 7,              // PERMISSION_DENIED
        404 => 12,             // UNIMPLEMENTED
        429 | 502..=504 => 14, // UNAVAILABLE
        _ => 2,                // UNKNOWN
    }
}

pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A reply made by the proxy itself. gRPC clients get a trailers-only response carrying
/// `grpc-status` / `grpc-message` (as Envoy does), everyone else plain text.
pub(crate) fn local_reply(
    status: StatusCode,
    message: String,
    close: bool,
    grpc: bool,
) -> Response<ResponseBody> {
    if !grpc {
        return text_response(status, message, close);
    }
    let mut resp = Response::new(ResponseBody::Local(Full::new(Bytes::new())));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert(
        "grpc-status",
        HeaderValue::from(u16::from(grpc_status(status))),
    );
    // grpc-message is percent-encoded; keep it to safe visible ASCII.
    let encoded: String = message
        .trim_end()
        .bytes()
        .map(|b| {
            if b.is_ascii_graphic() && b != b'%' || b == b' ' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    if let Ok(v) = HeaderValue::from_str(&encoded) {
        h.insert("grpc-message", v);
    }
    resp
}

/// Wraps the client's body so that a framing error inside it (a bad chunk size, say) is
/// recognised as the client's fault, not the upstream's.
struct DownstreamBody {
    inner: Incoming,
    failed: Arc<AtomicBool>,
}

impl http_body::Body for DownstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            self.failed.store(true, Ordering::Relaxed);
        }
        polled.map_err(BoxError::from)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request as the rule program sees it.
fn authority<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    uri.authority()
        .map(|a| a.as_str())
        .or_else(|| headers.get(header::HOST).and_then(|h| h.to_str().ok()))
}

/// What the rule program decided for one request.
pub(crate) enum Decision<'v> {
    /// The proxy answers itself: a direct response, or 404 when no route matched.
    Reply(Option<&'v CompiledRoute>, Response<ResponseBody>),
    /// Forward to this cluster (a split has already picked it).
    Forward(&'v CompiledRoute, ClusterId),
}

/// Runs the listener's match-action table on a request: the part of the L7 path both HTTP
/// codecs share.
pub(crate) fn decide<'v>(
    snap: &'v Snapshot,
    listener: ListenerId,
    meta: &flatmesh_rules::Request<'_>,
    grpc: bool,
    target: impl FnOnce() -> String,
) -> Decision<'v> {
    let Some(route) = snap.program.route(listener, meta) else {
        let plan = &snap.listeners[listener];
        return Decision::Reply(
            None,
            local_reply(
                StatusCode::NOT_FOUND,
                format!(
                    "no route matched: listener `{}` has no route for {} {}{}\n",
                    plan.name,
                    meta.method,
                    meta.host.unwrap_or("-"),
                    target()
                ),
                false,
                grpc,
            ),
        );
    };
    match &route.action {
        RouteAction::DirectResponse { status, body } => {
            let mut resp = Response::new(ResponseBody::Local(Full::new(body.clone())));
            *resp.status_mut() = *status;
            add_headers(resp.headers_mut(), &route.response_headers_to_add);
            Decision::Reply(Some(route), resp)
        }
        RouteAction::Forward(c) => Decision::Forward(route, *c),
        RouteAction::Split(split) => Decision::Forward(route, split.pick(rand::random::<u32>())),
    }
}

/// Counts a finished request: by route and cluster, or as unrouted.
pub(crate) fn record(
    ctx: &ConnContext,
    snap: &Snapshot,
    listener: ListenerId,
    route: Option<&CompiledRoute>,
    cluster: Option<ClusterId>,
    status: u16,
    elapsed: Duration,
) {
    let stats = match route {
        Some(r) => snap.request_stats(listener, r.id, cluster),
        None => snap.listeners.get(listener).map(|l| &l.no_route_stats),
    };
    if let Some(s) = stats {
        s.record(ctx.worker, status, elapsed);
    }
}

/// The answer on a listener a reload has removed while the connection stayed open.
pub(crate) fn listener_removed() -> Response<ResponseBody> {
    text_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "this listener was removed by a config reload; reconnect\n".into(),
        true,
    )
}

/// Serve one request of an HTTP/2 connection (hyper's server).
pub async fn serve(
    ctx: Arc<ConnContext>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    let started = Instant::now();
    let view = ctx.view.load_full();
    let snap = &view.snapshot;
    let Some(lid) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        return Ok(listener_removed());
    };
    let listener = &snap.listeners[lid];
    let method = req.method().clone();
    // Cheap (shared bytes); kept for the 404 text and the access log after `req` moves on.
    let uri = req.uri().clone();
    let path_and_query = || uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();

    // The access log line is built only when logging is on: nothing is allocated otherwise.
    let finish = |route: Option<&CompiledRoute>,
                  cluster: Option<ClusterId>,
                  upstream: Option<SocketAddr>,
                  resp: &Response<ResponseBody>| {
        record(
            &ctx,
            snap,
            lid,
            route,
            cluster,
            resp.status().as_u16(),
            started.elapsed(),
        );
        ctx.access_log.write(|| AccessRecord {
            listener: listener.name.clone(),
            route: route.map(|r| r.name.clone()).unwrap_or_default(),
            cluster: cluster
                .map(|c| snap.clusters[c].name.clone())
                .unwrap_or_default(),
            method: method.to_string(),
            path: path_and_query(),
            status: resp.status().as_u16(),
            duration: started.elapsed(),
            upstream,
            peer: ctx.peer,
        });
    };

    let grpc = is_grpc(req.headers());
    let decision = {
        let meta = flatmesh_rules::Request {
            method: &method,
            host: authority(req.uri(), req.headers()),
            path: req.uri().path(),
            query: req.uri().query(),
            headers: req.headers().into(),
        };
        decide(snap, lid, &meta, grpc, path_and_query)
    };
    match decision {
        Decision::Reply(route, resp) => {
            finish(route, None, None, &resp);
            Ok(resp)
        }
        Decision::Forward(route, cluster) => {
            let (parts, body) = req.into_parts();
            let failed = Arc::new(AtomicBool::new(false));
            let replayable = body.is_end_stream();
            let body = DownstreamBody {
                inner: body,
                failed: failed.clone(),
            }
            .boxed_unsync();
            let (resp, upstream) =
                forward(&ctx, &view, route, cluster, parts, body, replayable, failed).await;
            finish(Some(route), Some(cluster), upstream, &resp);
            Ok(resp)
        }
    }
}

fn add_headers(headers: &mut HeaderMap, add: &[(HeaderName, HeaderValue)]) {
    for (name, value) in add {
        headers.insert(name.clone(), value.clone());
    }
}

/// The hash key for ring_hash / maglev: the configured header, else the client address.
pub(crate) fn hash_key(
    headers: flatmesh_rules::Headers<'_>,
    hash_header: Option<&HeaderName>,
    peer: SocketAddr,
) -> u64 {
    match hash_header.and_then(|h| headers.first(h)) {
        Some(v) => hash64(v),
        None => hash_client(peer.ip()),
    }
}

pub(crate) fn should_retry(failure: Failure, on: &[RetryOn]) -> bool {
    on.iter().any(|r| {
        matches!(
            (r, failure),
            (RetryOn::ConnectFailure, Failure::Connect)
                | (RetryOn::Reset, Failure::Reset)
                | (RetryOn::GatewayError, Failure::Connect | Failure::Reset)
        )
    })
}

pub(crate) fn should_retry_status(status: StatusCode, on: &[RetryOn]) -> bool {
    on.iter().any(|r| match r {
        RetryOn::Status5xx => status.is_server_error(),
        RetryOn::GatewayError => matches!(status.as_u16(), 502..=504),
        _ => false,
    })
}

/// Send a request to `cluster` through hyper's client (HTTP/2 clusters, and HTTP/2 clients),
/// with the route's timeout and retry policy. `replayable` says the body is empty, so the
/// request may be sent again; `downstream_failed` is raised by the body when the client's
/// framing broke, which makes the answer a 400 rather than an upstream error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn forward(
    ctx: &ConnContext,
    view: &crate::worker::WorkerView,
    route: &CompiledRoute,
    cluster: ClusterId,
    mut parts: http::request::Parts,
    body: UpstreamBody,
    replayable: bool,
    downstream_failed: Arc<AtomicBool>,
) -> (Response<ResponseBody>, Option<SocketAddr>) {
    let snap = &view.snapshot;
    let plan = &snap.clusters[cluster];
    let upstream = &view.upstreams.by_cluster[cluster];
    let mut picked;
    let timeout = route.timeout.unwrap_or(snap.config.limits.request_timeout);
    let grpc = is_grpc(&parts.headers);
    let key = hash_key((&parts.headers).into(), plan.hash_header.as_ref(), ctx.peer);

    // Deparser work that is the same for every attempt.
    // An HTTP/1 upstream needs Host: from :authority for an h2 client (it wins over any
    // Host header), from an absolute-form target for an h1 client that sent none.
    let needs_host = match parts.version {
        Version::HTTP_2 => plan.protocol == flatmesh_config::UpstreamProtocol::Http1,
        _ => !parts.headers.contains_key(header::HOST),
    };
    if needs_host {
        if let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        {
            parts.headers.insert(header::HOST, v);
        }
    }
    strip_hop_by_hop(&mut parts.headers);
    for name in &route.request_headers_to_remove {
        parts.headers.remove(name);
    }
    add_headers(&mut parts.headers, &route.request_headers_to_add);
    append_forwarded_for(&mut parts.headers, &ctx.peer_ip);
    // A body can be sent only once; requests without one may be retried.
    let attempts = if replayable {
        1 + route.retries.as_ref().map_or(0, |r| r.attempts as usize)
    } else {
        1
    };
    let retry_on: &[RetryOn] = route.retries.as_ref().map_or(&[], |r| &r.on);
    let limits = &snap.config.limits;
    let mut body = Some(body);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error;
    let mut last_failure;
    let mut attempt = 0;
    let mut stale_retried = false;
    loop {
        let Some((index, _in_flight)) = upstream.balancer.pick(key, attempt) else {
            return (no_endpoints(&plan.name, grpc), None);
        };
        let endpoint = plan.endpoints[index];
        picked = Some(endpoint);
        let upstream_body: UpstreamBody = match body.take() {
            Some(b) if !replayable => b,
            _ => Empty::<Bytes>::new()
                .map_err(|never| match never {})
                .boxed_unsync(),
        };
        let last = attempt + 1 >= attempts;
        let outcome = match &upstream.pool {
            Pool::Http1(pool) => {
                let sent = crate::h1::client::send(
                    pool,
                    plan,
                    ctx.worker,
                    endpoint,
                    &parts,
                    upstream_body,
                    limits.max_header_bytes,
                    limits.idle_timeout,
                );
                match tokio::time::timeout_at(deadline, sent).await {
                    Ok(Ok(resp)) => Ok(resp.map(|body| ResponseBody::Http1(Box::new(body)))),
                    Ok(Err(SendError::Upstream { error, stale: true }))
                        if replayable && !stale_retried =>
                    {
                        // The endpoint closed an idle keep-alive connection as we used it:
                        // not a failure of the endpoint, so try again on a fresh one.
                        tracing::debug!(%endpoint, %error, "pooled connection was closed; retrying on a new one");
                        stale_retried = true;
                        continue;
                    }
                    Ok(Err(err)) => Err(match err {
                        SendError::Connect(e) => (Failure::Connect, e.to_string()),
                        SendError::Upstream { error, .. } => (Failure::Reset, error.to_string()),
                        SendError::Invalid(why) => (Failure::Invalid, why),
                        SendError::Downstream(e) => (Failure::Downstream, e.to_string()),
                    }),
                    Err(_) => Err((Failure::Timeout, String::new())),
                }
            }
            Pool::Http2(client) => {
                let headers = if last {
                    std::mem::take(&mut parts.headers)
                } else {
                    parts.headers.clone()
                };
                let up_req = match http2_request(&parts, headers, plan, index, upstream_body) {
                    Ok(req) => req,
                    Err(what) => {
                        let resp = text_response(
                            StatusCode::BAD_REQUEST,
                            format!("bad request: unusable request {what}\n"),
                            true,
                        );
                        return (resp, picked);
                    }
                };
                match tokio::time::timeout_at(deadline, client.request(up_req)).await {
                    Ok(Ok(resp)) => Ok(resp.map(ResponseBody::Http2)),
                    Ok(Err(err)) => Err((
                        if downstream_failed.load(Ordering::Relaxed) {
                            Failure::Downstream
                        } else if err.is_connect() {
                            Failure::Connect
                        } else {
                            Failure::Reset
                        },
                        error_chain(&err),
                    )),
                    Err(_) => Err((Failure::Timeout, String::new())),
                }
            }
        };
        let failure = match outcome {
            Ok(resp) => {
                if !last && should_retry_status(resp.status(), retry_on) {
                    attempt += 1;
                    plan.stats.retries.add(ctx.worker, 1);
                    continue;
                }
                return (downstream_response(resp, route), picked);
            }
            Err((failure, detail)) => {
                last_error = format!("endpoint {endpoint}: {detail}");
                failure
            }
        };
        last_failure = failure;
        if last || !should_retry(failure, retry_on) {
            break;
        }
        attempt += 1;
        plan.stats.retries.add(ctx.worker, 1);
    }
    (
        failure_response(last_failure, &plan.name, &last_error, timeout, grpc),
        picked,
    )
}

/// The request as hyper's HTTP/2 client sends it to endpoint `index` of the cluster. A
/// target or head that cannot be built is the client's fault: the error names the part,
/// for the 400 to answer with.
fn http2_request(
    parts: &http::request::Parts,
    headers: HeaderMap,
    plan: &crate::snapshot::ClusterPlan,
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

/// The answer when a cluster has no endpoint to send to.
pub(crate) fn no_endpoints(cluster: &str, grpc: bool) -> Response<ResponseBody> {
    local_reply(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("no healthy upstream: cluster `{cluster}` has no endpoints\n"),
        false,
        grpc,
    )
}

pub(crate) fn failure_response(
    failure: Failure,
    cluster: &str,
    detail: &str,
    timeout: Duration,
    grpc: bool,
) -> Response<ResponseBody> {
    match failure {
        Failure::Downstream => text_response(
            StatusCode::BAD_REQUEST,
            "bad request: the request body is malformed (bad chunked encoding)\n".into(),
            true,
        ),
        Failure::Invalid => local_reply(
            StatusCode::BAD_GATEWAY,
            format!("upstream sent an invalid response: cluster `{cluster}`, {detail}\n"),
            false,
            grpc,
        ),
        Failure::Connect => local_reply(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("upstream connect error: cluster `{cluster}` is unreachable ({detail}); check that its endpoints are up\n"),
            false,
            grpc,
        ),
        Failure::Reset => local_reply(
            StatusCode::BAD_GATEWAY,
            format!("upstream reset: cluster `{cluster}` closed the connection before answering ({detail})\n"),
            false,
            grpc,
        ),
        Failure::Timeout => local_reply(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "upstream timeout: cluster `{cluster}` did not answer within {}; raise the route's `timeout` if this is expected\n",
                flatmesh_config::duration::format(&timeout)
            ),
            false,
            grpc,
        ),
    }
}

pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// `peer_ip` is the client's address as a header value, made once per connection.
fn append_forwarded_for(headers: &mut HeaderMap, peer_ip: &HeaderValue) {
    match headers.entry(X_FORWARDED_FOR) {
        header::Entry::Vacant(e) => {
            e.insert(peer_ip.clone());
        }
        header::Entry::Occupied(mut e) => {
            let mut joined = e.get().as_bytes().to_vec();
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(peer_ip.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&joined) {
                e.insert(v);
            }
        }
    }
}

fn downstream_response(
    resp: Response<ResponseBody>,
    route: &CompiledRoute,
) -> Response<ResponseBody> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    add_headers(&mut parts.headers, &route.response_headers_to_add);
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::try_from(*k).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = headers(&[
            ("connection", "x-secret, close"),
            ("x-secret", "1"),
            ("te", "gzip"),
            ("x-keep", "1"),
        ]);
        strip_hop_by_hop(&mut h);
        assert!(
            h.get("x-secret").is_none() && h.get("te").is_none() && h.get("connection").is_none()
        );
        assert!(h.get("x-keep").is_some());
        let mut grpc = headers(&[("te", "trailers")]);
        strip_hop_by_hop(&mut grpc);
        assert!(grpc.get("te").is_some(), "gRPC's te: trailers must pass");
    }

    #[test]
    fn grpc_clients_get_grpc_shaped_local_replies() {
        let resp = local_reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "cluster `x` down: 100%\n".into(),
            false,
            true,
        );
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["grpc-status"], "14");
        assert_eq!(resp.headers()["grpc-message"], "cluster `x` down: 100%25");
        let plain = local_reply(StatusCode::NOT_FOUND, "no route\n".into(), false, false);
        assert_eq!(plain.status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn forwarded_for_appends() {
        let mut h = headers(&[("x-forwarded-for", "10.0.0.1")]);
        append_forwarded_for(&mut h, &HeaderValue::from_static("127.0.0.1"));
        assert_eq!(
            h.get("x-forwarded-for").and_then(|v| v.to_str().ok()),
            Some("10.0.0.1, 127.0.0.1")
        );
    }
}
