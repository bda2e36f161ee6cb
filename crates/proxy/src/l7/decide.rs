//! The match-action step both codecs share: check the request's target, run the listener's
//! table of the rule program on it and say what to do with it.
//!
//! Before any route is matched, the target must hold up: a Host or `:authority` that is not
//! `host[:port]` (RFC 3986 §3.2) gets 400, and the path is normalised as the listener asks
//! (`flatmesh_rules::normalize`: a refused path gets 400, an unescaped one under
//! `unescape_and_redirect` a 307). The normalised path is what the routes match and what the
//! upstream gets, as in Envoy.

use std::borrow::Cow;
use std::net::SocketAddr;

use flatmesh_rules::{ClusterId, CompiledRoute, ListenerId, Normalized, Peer, RouteAction};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode, Uri};
use http_body_util::Full;

use super::body::ResponseBody;
use super::fault::{self, Delayed, Drawn};
use super::headers::add_headers;
use super::reply::{local_reply, rate_limited};
use crate::lb::{hash64, hash_client};
use crate::resilience::rate_limit::{Key, RateLimiter, Scope};
use crate::snapshot::{LimitKey, Snapshot};

/// The host of a request held in `http` types: the target's authority, else Host.
pub(crate) fn authority<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    uri.authority()
        .map(|a| a.as_str())
        .or_else(|| headers.get(header::HOST).and_then(|h| h.to_str().ok()))
}

/// What the rule program decided for one request.
pub(crate) enum Decision<'v> {
    /// The proxy answers itself: a direct response, 404 when no route matched, or 400 / 307
    /// for a target that does not hold up.
    Reply(Option<&'v CompiledRoute>, Response<ResponseBody>),
    /// Forward to this cluster (a split has already picked it). The path is the normalised
    /// one when normalising changed it: the upstream gets that path, not the one received.
    /// A route's fault may first delay the request (and then abort it, `super::fault`).
    Forward(
        &'v CompiledRoute,
        ClusterId,
        Option<String>,
        Option<Delayed>,
    ),
}

/// Runs the listener's match-action table on a request. `target` is the request target for
/// the 404's text, made only when no route matches.
pub(crate) fn decide<'v>(
    snap: &'v Snapshot,
    listener: ListenerId,
    meta: &flatmesh_rules::Request<'_>,
    caller: (Peer<'_>, usize, SocketAddr),
    grpc: bool,
    target: impl FnOnce() -> String,
) -> Decision<'v> {
    let plan = &snap.listeners[listener];
    // The listener's rate limit, before anything else is looked at.
    if let Some(limiter) = &plan.rate_limit {
        let key = plan.limit_keys.first();
        if let Some(resp) = over_limit(
            limiter,
            key,
            &plan.name,
            meta,
            caller.2,
            Scope::Listener,
            grpc,
        ) {
            return Decision::Reply(None, resp);
        }
    }
    let refuse = |why: String| {
        Decision::Reply(
            None,
            local_reply(
                StatusCode::BAD_REQUEST,
                format!("bad request: {why}\n"),
                false,
                grpc,
            ),
        )
    };
    // The host routed by (`:authority` or Host), and every Host header, which may go on
    // upstream as it came.
    let hosts = meta.host.map(str::as_bytes).into_iter();
    for host in hosts.chain(meta.headers.values(&header::HOST)) {
        let valid =
            std::str::from_utf8(host).is_ok_and(|h| flatmesh_rules::is_valid_authority(h.trim()));
        if !valid {
            return refuse(format!(
                "the host `{}` is not a valid `host[:port]` (RFC 3986 §3.2)",
                String::from_utf8_lossy(host).escape_debug()
            ));
        }
    }
    let path = match snap.program.paths(listener).apply(meta.path) {
        // Unescaping can bring in a byte a request target may not carry (`%5C` is `\`):
        // refuse what could not be forwarded as it was matched.
        Ok(Normalized::Path(Cow::Owned(path)))
            if path.parse::<http::uri::PathAndQuery>().is_err() =>
        {
            return refuse(format!(
                "the path normalises to `{}`, which is not a valid request path",
                path.escape_debug()
            ));
        }
        Ok(Normalized::Path(path)) => path,
        Ok(Normalized::Redirect(path)) => {
            return Decision::Reply(None, redirect(&path, meta.query, grpc));
        }
        Err(why) => return refuse(why.describe().into()),
    };
    let meta = &flatmesh_rules::Request {
        path: &path,
        ..*meta
    };
    // Authorization, on the normalised path: no spelling of a path walks around a policy.
    if let Some(authz) = snap.program.authz(listener) {
        let (peer, worker, _) = caller;
        let d = authz.check_request(meta, peer);
        snap.listeners[listener].count_authz(worker, d);
        if !d.allowed {
            let why = match d.policy {
                Some(p) => format!("policy `{}` denies it", authz.policy_name(p)),
                None => "no policy allows it".to_string(),
            };
            tracing::debug!(listener = %snap.listeners[listener].name, principal = ?peer.principal, %why, "request denied");
            return Decision::Reply(
                None,
                local_reply(
                    StatusCode::FORBIDDEN,
                    format!("access denied: {why}\n"),
                    false,
                    grpc,
                ),
            );
        }
    }
    let Some(route) = snap.program.route(listener, meta) else {
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
    // The route's rate limit, once it matched.
    if let Some(Some(limiter)) = plan.route_limits.get(route.id) {
        let key = plan.limit_keys.get(1 + route.id);
        if let Some(resp) = over_limit(
            limiter,
            key,
            &route.name,
            meta,
            caller.2,
            Scope::Route,
            grpc,
        ) {
            return Decision::Reply(Some(route), resp);
        }
    }
    let cluster = match &route.action {
        RouteAction::DirectResponse { status, body } => {
            let mut resp = Response::new(ResponseBody::Local(Full::new(body.clone())));
            *resp.status_mut() = *status;
            add_headers(resp.headers_mut(), &route.response_headers_to_add);
            return Decision::Reply(Some(route), resp);
        }
        RouteAction::Forward(c) => *c,
        RouteAction::Split(split) => split.pick(rand::random::<u32>()),
    };
    let delayed = match route.fault.as_ref().map_or(Drawn::None, fault::roll) {
        Drawn::None => None,
        Drawn::Abort(status) => {
            snap.faults.aborts.add(caller.1, 1);
            let resp = fault::abort_reply(status, &route.name, grpc);
            return Decision::Reply(Some(route), resp);
        }
        Drawn::Delay(delayed) => {
            snap.faults.delays.add(caller.1, 1);
            Some(delayed)
        }
    };
    Decision::Forward(route, cluster, changed(path), delayed)
}

/// Takes a token from `limiter` for the request (keyed as `key` says); without one, the 429
/// that names the listener or route `name`.
fn over_limit(
    limiter: &RateLimiter,
    key: Option<&LimitKey>,
    name: &str,
    meta: &flatmesh_rules::Request<'_>,
    client: SocketAddr,
    scope: Scope,
    grpc: bool,
) -> Option<Response<ResponseBody>> {
    let ip = match client.ip() {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    };
    let key = match key {
        Some(LimitKey::ClientAddress) => Key::Bytes(&ip),
        Some(LimitKey::Header(header)) => {
            Key::Bytes(meta.headers.first(header).unwrap_or_default())
        }
        Some(LimitKey::None) | None => Key::None,
    };
    limiter
        .admit(tokio::time::Instant::now(), key)
        .err()
        .map(|wait| rate_limited(scope, name, wait, grpc))
}

/// The normalised path, if normalising changed it.
fn changed(path: Cow<'_, str>) -> Option<String> {
    match path {
        Cow::Borrowed(_) => None,
        Cow::Owned(p) => Some(p),
    }
}

/// 307 to the unescaped path, query kept (`unescape_and_redirect`, as Envoy). A gRPC client
/// cannot follow a redirect: it gets INTERNAL, as from Envoy.
fn redirect(path: &str, query: Option<&str>, grpc: bool) -> Response<ResponseBody> {
    let location = match query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    if grpc {
        return local_reply(
            StatusCode::BAD_REQUEST,
            format!("the path holds escaped slashes; call {location}"),
            false,
            true,
        );
    }
    let mut resp = local_reply(
        StatusCode::TEMPORARY_REDIRECT,
        format!("the path holds escaped slashes: ask for {location}\n"),
        false,
        false,
    );
    if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    resp
}

/// Puts the normalised path (if it changed) into a request's target, query kept.
pub(crate) fn set_path(uri: &mut Uri, path: Option<String>) {
    let Some(path) = path else {
        return;
    };
    let target = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    // The path came out of a valid target and normalising only removed or decoded bytes,
    // so it parses; if it ever did not, the target stays as it was rather than failing.
    let Ok(pq) = target.parse() else {
        return;
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(pq);
    if let Ok(new) = Uri::from_parts(parts) {
        *uri = new;
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
