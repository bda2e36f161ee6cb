//! Answers the proxy makes itself: direct responses' plain text, no route, a removed
//! listener, and every failure of an upstream exchange. gRPC clients get them
//! trailers-only, with `grpc-status` and `grpc-message` (as Envoy does).

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::Full;

use super::body::ResponseBody;
use super::error::{Kind, UpstreamError};

/// The status counted for a request whose client went away before its answer (nginx's).
pub(crate) const CLIENT_CLOSED_REQUEST: u16 = 499;

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

/// A reply made by the proxy itself: plain text, or trailers-only for a gRPC client.
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

/// The answer on a listener a reload has removed while the connection stayed open.
pub(crate) fn listener_removed() -> Response<ResponseBody> {
    text_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "this listener was removed by a config reload; reconnect\n".into(),
        true,
    )
}

/// The answer to a request whose upstream exchange failed with `err`, for cluster
/// `cluster` and the route's `timeout`: 400 for the client's own faults (and the connection
/// closes), 408 for an upload that stalled, 502 for a reset or an invalid answer, 503 when nothing could be reached, 504 on
/// the timeout; 499 (nginx's "client closed request", for the stats) when the client is gone.
pub(crate) fn upstream_failure(
    err: &UpstreamError,
    cluster: &str,
    timeout: Duration,
    grpc: bool,
) -> Response<ResponseBody> {
    let detail = err.located();
    match err.kind {
        Kind::ClientGone => text_response(
            StatusCode::from_u16(CLIENT_CLOSED_REQUEST).unwrap_or(StatusCode::BAD_REQUEST),
            "client closed request\n".into(),
            true,
        ),
        Kind::RequestBody => text_response(
            StatusCode::BAD_REQUEST,
            "bad request: the request body is malformed (bad chunked encoding)\n".into(),
            true,
        ),
        Kind::UploadStalled => text_response(
            StatusCode::REQUEST_TIMEOUT,
            format!("request timeout: {detail}\n"),
            true,
        ),
        Kind::UnusableRequest(what) => text_response(
            StatusCode::BAD_REQUEST,
            format!("bad request: unusable request {what}\n"),
            true,
        ),
        Kind::InvalidResponse => local_reply(
            StatusCode::BAD_GATEWAY,
            format!("upstream sent an invalid response: cluster `{cluster}`, {detail}\n"),
            false,
            grpc,
        ),
        Kind::ConnectFailed => local_reply(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("upstream connect error: cluster `{cluster}` is unreachable ({detail}); check that its endpoints are up\n"),
            false,
            grpc,
        ),
        Kind::Closed => local_reply(
            StatusCode::BAD_GATEWAY,
            format!("upstream reset: cluster `{cluster}` closed the connection before answering ({detail})\n"),
            false,
            grpc,
        ),
        Kind::Timeout => local_reply(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "upstream timeout: cluster `{cluster}` did not answer within {}; raise the route's `timeout` if this is expected\n",
                flatmesh_config::duration::format(&timeout)
            ),
            false,
            grpc,
        ),
        Kind::PerTryTimeout => local_reply(
            StatusCode::GATEWAY_TIMEOUT,
            format!("upstream timeout: cluster `{cluster}`, {detail}\n"),
            false,
            grpc,
        ),
        Kind::DestinationRefused(status) => local_reply(
            StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN),
            format!("destination refused: cluster `{cluster}`: {detail}\n"),
            false,
            grpc,
        ),
        Kind::NoEndpoint => local_reply(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no healthy upstream: cluster `{cluster}` has no endpoints\n"),
            false,
            grpc,
        ),
        Kind::Overflow(kind) => {
            let mut resp = local_reply(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "upstream overflow: cluster `{cluster}` is at its circuit breaker's {} ({}); retry later, or raise circuit_breaker.{}\n",
                    kind.key(),
                    kind.as_str(),
                    kind.key()
                ),
                false,
                grpc,
            );
            resp.headers_mut().insert(
                OVERFLOW_HEADER,
                HeaderValue::from_static(kind.as_str()),
            );
            resp
        }
    }
}

/// Names the circuit-breaker limit that refused a request (Envoy's `x-envoy-overloaded`).
pub(crate) const OVERFLOW_HEADER: &str = "x-flatmesh-overflow";

/// Names the rate limit that refused a request: `listener` or `route` (Envoy's
/// `x-envoy-ratelimited`).
pub(crate) const RATE_LIMITED_HEADER: &str = "x-flatmesh-ratelimited";

/// The answer to a request over a rate limit: 429 with `retry-after` (the wait in seconds,
/// rounded up), or for a gRPC client `grpc-status: 8` (RESOURCE_EXHAUSTED), as Envoy's
/// local rate limit answers.
pub(crate) fn rate_limited(
    scope: crate::resilience::rate_limit::Scope,
    name: &str,
    wait: Duration,
    grpc: bool,
) -> Response<ResponseBody> {
    let secs = crate::resilience::rate_limit::retry_after_secs(wait);
    let mut resp = local_reply(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            "too many requests: {} `{name}` is at its rate_limit; retry after {secs}s\n",
            scope.as_str()
        ),
        false,
        grpc,
    );
    let h = resp.headers_mut();
    if grpc {
        h.insert("grpc-status", HeaderValue::from_static("8"));
    }
    h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    h.insert(
        RATE_LIMITED_HEADER,
        HeaderValue::from_static(scope.as_str()),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn status_of(err: UpstreamError) -> u16 {
        upstream_failure(&err, "c", Duration::from_secs(1), false)
            .status()
            .as_u16()
    }

    #[test]
    fn every_failure_has_its_status() {
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(status_of(UpstreamError::connect("refused")), 503);
        assert_eq!(status_of(UpstreamError::closed("reset", false, false)), 502);
        assert_eq!(status_of(UpstreamError::invalid("bad head")), 502);
        assert_eq!(status_of(UpstreamError::timeout()), 504);
        assert_eq!(status_of(UpstreamError::no_endpoint()), 503);
        assert_eq!(status_of(UpstreamError::request_body("bad chunk")), 400);
        assert_eq!(status_of(UpstreamError::unusable_request("target")), 400);
        assert_eq!(status_of(UpstreamError::client_gone(io())), 499);
        assert_eq!(
            status_of(UpstreamError::upload_stalled(Duration::from_secs(1))),
            408
        );
    }

    #[test]
    fn an_overflow_says_which_limit_to_plain_and_grpc_clients() {
        use crate::resilience::Overflow;
        let err = UpstreamError::overflow(Overflow::Pending);
        let plain = upstream_failure(&err, "api", Duration::from_secs(1), false);
        assert_eq!(plain.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(plain.headers()[OVERFLOW_HEADER], "pending");
        let grpc = upstream_failure(&err, "api", Duration::from_secs(1), true);
        assert_eq!(grpc.headers()["grpc-status"], "14", "UNAVAILABLE");
        assert_eq!(grpc.headers()[OVERFLOW_HEADER], "pending");
        let message = grpc.headers()["grpc-message"].to_str().unwrap();
        assert!(message.contains("max_pending"), "{message}");
    }

    #[test]
    fn a_rate_limited_request_gets_429_or_resource_exhausted() {
        use crate::resilience::rate_limit::Scope;
        let wait = Duration::from_millis(1500);
        let plain = rate_limited(Scope::Route, "web/0", wait, false);
        assert_eq!(plain.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(plain.headers()[header::RETRY_AFTER], "2");
        assert_eq!(plain.headers()[RATE_LIMITED_HEADER], "route");
        let grpc = rate_limited(Scope::Listener, "web", wait, true);
        assert_eq!(grpc.status(), StatusCode::OK);
        assert_eq!(grpc.headers()["grpc-status"], "8", "RESOURCE_EXHAUSTED");
        assert_eq!(grpc.headers()[RATE_LIMITED_HEADER], "listener");
        let message = grpc.headers()["grpc-message"].to_str().unwrap();
        assert!(message.contains("rate_limit"), "{message}");
    }

    #[test]
    fn the_reply_names_the_cluster_and_the_endpoint() {
        let mut err = UpstreamError::connect("connection refused");
        err.endpoint = Some(([127, 0, 0, 1], 9).into());
        let resp = upstream_failure(&err, "api", Duration::from_secs(1), false);
        let ResponseBody::Local(body) = resp.into_body() else {
            panic!("a local reply");
        };
        let text = futures_text(body);
        assert!(
            text.contains("cluster `api`")
                && text.contains("endpoint 127.0.0.1:9: connection refused"),
            "{text}"
        );
    }

    fn futures_text(body: Full<Bytes>) -> String {
        use http_body_util::BodyExt as _;
        let bytes = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(body.collect())
            .expect("a full body")
            .to_bytes();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
