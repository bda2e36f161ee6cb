//! The match-action step both codecs share: run the listener's table of the rule program on
//! a request and say what to do with it.

use std::net::SocketAddr;

use flatmesh_rules::{ClusterId, CompiledRoute, ListenerId, RouteAction};
use http::header::{self, HeaderMap, HeaderName};
use http::{Response, StatusCode, Uri};
use http_body_util::Full;

use super::body::ResponseBody;
use super::headers::add_headers;
use super::reply::local_reply;
use crate::lb::{hash64, hash_client};
use crate::snapshot::Snapshot;

/// The host of a request held in `http` types: the target's authority, else Host.
pub(crate) fn authority<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
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

/// Runs the listener's match-action table on a request. `target` is the request target for
/// the 404's text, made only when no route matches.
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
