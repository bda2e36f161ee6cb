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
use flatmesh_rules::{ClusterId, CompiledRoute, RouteAction};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::{BodyExt, Either, Empty, Full};
use hyper::body::Incoming;

use crate::access_log::AccessRecord;
use crate::lb::{hash64, hash_client};
use crate::upstream::UpstreamBody;
use crate::worker::ConnContext;

/// Body of a response sent downstream: the upstream's body streamed through, or our own.
pub type ResponseBody = Either<Incoming, Full<Bytes>>;

/// Where a failure came from (Pingora's idea): it decides the status and whether to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The client sent a malformed body (e.g. a bad chunk size): 400, close.
    Downstream,
    /// No connection to the endpoint could be made: 503, retryable.
    Connect,
    /// The endpoint reset or closed mid-request: 502.
    Reset,
    /// The route's timeout passed: 504.
    Timeout,
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

fn text_response(status: StatusCode, body: String, close: bool) -> Response<ResponseBody> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
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

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A reply made by the proxy itself. gRPC clients get a trailers-only response carrying
/// `grpc-status` / `grpc-message` (as Envoy does), everyone else plain text.
fn local_reply(
    status: StatusCode,
    message: String,
    close: bool,
    grpc: bool,
) -> Response<ResponseBody> {
    if !grpc {
        return text_response(status, message, close);
    }
    let mut resp = Response::new(Either::Right(Full::new(Bytes::new())));
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

/// Request smuggling shapes (RFC 9112 §6.3): refuse rather than guess which framing wins.
fn framing_error(headers: &HeaderMap, version: Version) -> Option<&'static str> {
    if version != Version::HTTP_11 && version != Version::HTTP_10 {
        return None;
    }
    let te = headers.contains_key(header::TRANSFER_ENCODING);
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    if te && headers.contains_key(header::CONTENT_LENGTH) {
        return Some("request has both Content-Length and Transfer-Encoding; send exactly one");
    }
    // RFC 9112 §3.2: an HTTP/1.1 request without Host must be answered with 400.
    if version == Version::HTTP_11 && !headers.contains_key(header::HOST) {
        return Some("HTTP/1.1 request has no Host header");
    }
    if let Some(first) = lengths.next() {
        let first_values: Vec<&[u8]> = first
            .as_bytes()
            .split(|b| *b == b',')
            .map(|v| v.trim_ascii())
            .collect();
        let all_same = first_values.windows(2).all(|w| w[0] == w[1])
            && lengths.all(|v| {
                v.as_bytes()
                    .split(|b| *b == b',')
                    .all(|x| x.trim_ascii() == first_values[0])
            });
        if !all_same {
            return Some("request has conflicting Content-Length values");
        }
    }
    None
}

/// Wraps the client's body so that a framing error inside it (a bad chunk size, say) is
/// recognised as the client's fault, not the upstream's.
struct DownstreamBody {
    inner: Incoming,
    failed: Arc<AtomicBool>,
}

impl http_body::Body for DownstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            self.failed.store(true, Ordering::Relaxed);
        }
        polled
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

/// Serve one request on a connection of an http listener.
pub async fn serve(
    ctx: Arc<ConnContext>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    let started = Instant::now();
    let view = ctx.view.load_full();
    let snap = &view.snapshot;
    let Some(lid) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        return Ok(text_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "this listener was removed by a config reload; reconnect\n".into(),
            true,
        ));
    };
    let listener = &snap.listeners[lid];
    let method = req.method().clone();
    // Cheap (shared bytes); kept for the 404 text and the access log after `req` moves on.
    let uri = req.uri().clone();
    let path_and_query = || uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();

    // The access log line is built only when logging is on: nothing is allocated otherwise.
    let finish = |route: Option<&CompiledRoute>,
                  cluster: &str,
                  upstream: Option<SocketAddr>,
                  resp: &Response<ResponseBody>| {
        ctx.access_log.write(|| AccessRecord {
            listener: listener.name.clone(),
            route: route.map(|r| r.name.clone()).unwrap_or_default(),
            cluster: cluster.to_owned(),
            method: method.to_string(),
            path: path_and_query(),
            status: resp.status().as_u16(),
            duration: started.elapsed(),
            upstream,
            peer: ctx.peer,
        });
    };

    let conflict = ctx
        .signals
        .framing_conflict
        .load(Ordering::Relaxed)
        .then_some("request has both Content-Length and Transfer-Encoding; send exactly one");
    if let Some(problem) = conflict.or_else(|| framing_error(req.headers(), req.version())) {
        listener
            .no_route_stats
            .record(ctx.worker, 400, started.elapsed());
        let resp = text_response(
            StatusCode::BAD_REQUEST,
            format!("bad request: {problem}\n"),
            true,
        );
        finish(None, "", None, &resp);
        return Ok(resp);
    }

    let decided = {
        let (path, query) = (req.uri().path(), req.uri().query());
        let host = authority(req.uri(), req.headers());
        let meta = flatmesh_rules::Request {
            method: &method,
            host,
            path,
            query,
            headers: req.headers(),
        };
        snap.program.route(lid, &meta)
    };
    let Some(route) = decided else {
        listener
            .no_route_stats
            .record(ctx.worker, 404, started.elapsed());
        let host = authority(req.uri(), req.headers()).unwrap_or("-");
        let resp = local_reply(
            StatusCode::NOT_FOUND,
            format!(
                "no route matched: listener `{}` has no route for {method} {host}{}\n",
                listener.name,
                path_and_query()
            ),
            false,
            is_grpc(req.headers()),
        );
        finish(None, "", None, &resp);
        return Ok(resp);
    };

    let cluster = match &route.action {
        RouteAction::DirectResponse { status, body } => {
            let mut resp = Response::new(Either::Right(Full::new(body.clone())));
            *resp.status_mut() = *status;
            add_headers(resp.headers_mut(), &route.response_headers_to_add);
            if let Some(s) = snap.request_stats(lid, route.id, None) {
                s.record(ctx.worker, status.as_u16(), started.elapsed());
            }
            finish(Some(route), "", None, &resp);
            return Ok(resp);
        }
        RouteAction::Forward(c) => *c,
        RouteAction::Split(split) => split.pick(rand::random::<u32>()),
    };

    let (resp, upstream) = forward(&ctx, &view, route, cluster, req).await;
    if let Some(s) = snap.request_stats(lid, route.id, Some(cluster)) {
        s.record(ctx.worker, resp.status().as_u16(), started.elapsed());
    }
    finish(Some(route), &snap.clusters[cluster].name, upstream, &resp);
    Ok(resp)
}

fn add_headers(headers: &mut HeaderMap, add: &[(HeaderName, HeaderValue)]) {
    for (name, value) in add {
        headers.insert(name.clone(), value.clone());
    }
}

/// The hash key for ring_hash / maglev: the configured header, else the client address.
fn hash_key(headers: &HeaderMap, hash_header: Option<&HeaderName>, peer: SocketAddr) -> u64 {
    match hash_header.and_then(|h| headers.get(h)) {
        Some(v) => hash64(v.as_bytes()),
        None => hash_client(peer.ip()),
    }
}

fn should_retry(failure: Failure, on: &[RetryOn]) -> bool {
    on.iter().any(|r| {
        matches!(
            (r, failure),
            (RetryOn::ConnectFailure, Failure::Connect)
                | (RetryOn::Reset, Failure::Reset)
                | (RetryOn::GatewayError, Failure::Connect | Failure::Reset)
        )
    })
}

fn should_retry_status(status: StatusCode, on: &[RetryOn]) -> bool {
    on.iter().any(|r| match r {
        RetryOn::Status5xx => status.is_server_error(),
        RetryOn::GatewayError => matches!(status.as_u16(), 502..=504),
        _ => false,
    })
}

/// Send the request to `cluster`, with the route's timeout and retry policy.
async fn forward(
    ctx: &ConnContext,
    view: &crate::worker::WorkerView,
    route: &CompiledRoute,
    cluster: ClusterId,
    req: Request<Incoming>,
) -> (Response<ResponseBody>, Option<SocketAddr>) {
    let snap = &view.snapshot;
    let plan = &snap.clusters[cluster];
    let upstream = &view.upstreams.by_cluster[cluster];
    let mut picked = None;
    let timeout = route.timeout.unwrap_or(snap.config.limits.request_timeout);
    let (mut parts, body) = req.into_parts();
    let grpc = is_grpc(&parts.headers);
    let key = hash_key(&parts.headers, plan.hash_header.as_ref(), ctx.peer);

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
    let version = match plan.protocol {
        flatmesh_config::UpstreamProtocol::Http1 => Version::HTTP_11,
        flatmesh_config::UpstreamProtocol::Http2 => Version::HTTP_2,
    };
    let path_and_query = parts.uri.path_and_query().cloned();

    // A body can be sent only once; requests without one may be retried.
    let replayable = body.is_end_stream();
    let attempts = if replayable {
        1 + route.retries.as_ref().map_or(0, |r| r.attempts)
    } else {
        1
    };
    let retry_on: &[RetryOn] = route.retries.as_ref().map_or(&[], |r| &r.on);
    let downstream_failed = Arc::new(AtomicBool::new(false));
    let mut body = Some(body);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = String::new();
    let mut last_failure = Failure::Connect;

    for attempt in 0..attempts as usize {
        if attempt > 0 {
            plan.stats.retries.add(ctx.worker, 1);
        }
        let Some((index, _in_flight)) = upstream.balancer.pick(key, attempt) else {
            let msg = format!(
                "no healthy upstream: cluster `{}` has no endpoints\n",
                plan.name
            );
            return (
                text_response(StatusCode::SERVICE_UNAVAILABLE, msg, false),
                None,
            );
        };
        let endpoint = plan.endpoints[index];
        picked = Some(endpoint);
        let uri = Uri::builder()
            .scheme(http::uri::Scheme::HTTP)
            .authority(plan.authorities[index].clone())
            .path_and_query(
                path_and_query
                    .clone()
                    .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
            )
            .build();
        let Ok(uri) = uri else {
            return (
                text_response(
                    StatusCode::BAD_REQUEST,
                    "bad request: unusable request target\n".into(),
                    true,
                ),
                picked,
            );
        };
        let upstream_body: UpstreamBody = match body.take() {
            Some(b) if !replayable => DownstreamBody {
                inner: b,
                failed: downstream_failed.clone(),
            }
            .boxed_unsync(),
            _ => Empty::<Bytes>::new()
                .map_err(|never| match never {})
                .boxed_unsync(),
        };
        let mut builder = Request::builder()
            .method(parts.method.clone())
            .uri(uri)
            .version(version);
        if let Some(h) = builder.headers_mut() {
            *h = if attempt + 1 < attempts as usize {
                parts.headers.clone()
            } else {
                std::mem::take(&mut parts.headers)
            };
        }
        let Ok(up_req) = builder.body(upstream_body) else {
            return (
                text_response(
                    StatusCode::BAD_REQUEST,
                    "bad request: unusable request head\n".into(),
                    true,
                ),
                picked,
            );
        };

        let outcome = tokio::time::timeout_at(deadline, upstream.client.request(up_req)).await;
        let failure = match outcome {
            Ok(Ok(resp)) => {
                if attempt + 1 < attempts as usize && should_retry_status(resp.status(), retry_on) {
                    last_error = format!("endpoint {endpoint} answered {}", resp.status());
                    continue;
                }
                return (downstream_response(resp, route), picked);
            }
            Ok(Err(err)) => {
                last_error = format!("endpoint {endpoint}: {}", error_chain(&err));
                if downstream_failed.load(Ordering::Relaxed) {
                    Failure::Downstream
                } else if err.is_connect() {
                    Failure::Connect
                } else {
                    Failure::Reset
                }
            }
            Err(_) => Failure::Timeout,
        };
        last_failure = failure;
        if failure == Failure::Timeout
            || failure == Failure::Downstream
            || !should_retry(failure, retry_on)
        {
            break;
        }
    }
    (
        failure_response(last_failure, &plan.name, &last_error, timeout, grpc),
        picked,
    )
}

fn failure_response(
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

fn downstream_response(resp: Response<Incoming>, route: &CompiledRoute) -> Response<ResponseBody> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    add_headers(&mut parts.headers, &route.response_headers_to_add);
    Response::from_parts(parts, Either::Left(body))
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
    fn smuggling_shapes_are_refused() {
        let both = headers(&[("content-length", "5"), ("transfer-encoding", "chunked")]);
        assert!(framing_error(&both, Version::HTTP_11).is_some());
        let conflict = headers(&[("content-length", "5"), ("content-length", "6")]);
        assert!(framing_error(&conflict, Version::HTTP_11).is_some());
        let list = headers(&[("content-length", "5, 6")]);
        assert!(framing_error(&list, Version::HTTP_11).is_some());
        let same = headers(&[
            ("host", "a"),
            ("content-length", "5"),
            ("content-length", "5"),
        ]);
        assert!(framing_error(&same, Version::HTTP_11).is_none());
        assert!(framing_error(
            &headers(&[("host", "a"), ("content-length", "5")]),
            Version::HTTP_11
        )
        .is_none());
        assert!(
            framing_error(&headers(&[("content-length", "5")]), Version::HTTP_11).is_some(),
            "no Host"
        );
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
