//! Forwarding a request held in `http` types — an HTTP/2 client's, or an HTTP/1 client's
//! bound for an HTTP/2 cluster — to either kind of cluster, through the retry driver: the
//! upstream request is edited once, and each try goes out on the cluster's pool (flatmesh's
//! HTTP/1 client, or hyper's HTTP/2 client).

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;

use flatmesh_config::Limits;
use flatmesh_rules::{ClusterId, CompiledRoute};
use http::Response;

use super::body::ResponseBody;
use super::decide::hash_key;
use super::error::UpstreamError;
use super::headers::{edit_request, edit_response};
use super::reply::{is_grpc, upstream_failure};
use super::retry::{Answer, Attempt, Retry, Try};
use crate::body::{empty, UpstreamBody};
use crate::context::{ConnContext, WorkerView};
use crate::snapshot::ClusterPlan;
use crate::upstream::Pool;

impl Answer for Response<ResponseBody> {
    fn status(&self) -> u16 {
        Response::status(self).as_u16()
    }
}

/// One request held in `http` types, tried on the cluster's pool.
struct MessageTry<'a> {
    ctx: &'a ConnContext,
    plan: &'a ClusterPlan,
    pool: &'a Pool,
    parts: &'a mut http::request::Parts,
    /// The client's body, until the one try that may send it takes it.
    body: Option<UpstreamBody>,
    replayable: bool,
    limits: &'a Limits,
    downstream_failed: &'a AtomicBool,
}

impl Attempt for MessageTry<'_> {
    type Answer = Response<ResponseBody>;

    async fn attempt(&mut self, to: Try) -> Result<Response<ResponseBody>, UpstreamError> {
        // A body can be sent only once; the driver sends a request twice only without one.
        let body = match self.body.take() {
            Some(b) if !self.replayable => b,
            _ => empty(),
        };
        match self.pool {
            Pool::Http1(pool) => crate::h1::client::send(
                pool,
                self.plan,
                self.ctx.worker,
                to.endpoint,
                self.parts,
                body,
                self.limits.max_header_bytes,
                self.limits.idle_timeout,
            )
            .await
            .map(|resp| resp.map(|body| ResponseBody::Http1(Box::new(body)))),
            Pool::Http2(client) => {
                let headers = if to.last {
                    std::mem::take(&mut self.parts.headers)
                } else {
                    self.parts.headers.clone()
                };
                crate::h2::client::send(
                    client,
                    self.parts,
                    headers,
                    self.plan,
                    to.index,
                    body,
                    self.downstream_failed,
                )
                .await
                .map(|resp| resp.map(ResponseBody::Http2))
            }
        }
    }
}

/// Sends a request to `cluster` with the route's timeout and retry policy, and returns the
/// answer for the client (the upstream's, or the proxy's own on failure) and the endpoint
/// that gave it. `replayable` says the body is empty, so the request may be sent again;
/// `downstream_failed` is raised by the body when the client's framing broke, which makes
/// the answer a 400 rather than an upstream error.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn forward(
    ctx: &ConnContext,
    view: &WorkerView,
    route: &CompiledRoute,
    cluster: ClusterId,
    mut parts: http::request::Parts,
    body: UpstreamBody,
    replayable: bool,
    downstream_failed: &AtomicBool,
) -> (Response<ResponseBody>, Option<SocketAddr>) {
    let snap = &view.snapshot;
    let plan = &snap.clusters[cluster];
    let upstream = &view.upstreams.by_cluster[cluster];
    let limits = &snap.config.limits;
    let grpc = is_grpc(&parts.headers);
    let key = hash_key((&parts.headers).into(), plan.hash_header.as_ref(), ctx.peer);
    edit_request(&mut parts, route, plan.protocol, &ctx.peer_ip);
    let retry = Retry::new(
        route,
        plan,
        upstream,
        ctx.worker,
        key,
        replayable,
        limits.request_timeout,
    );
    let mut codec = MessageTry {
        ctx,
        plan,
        pool: &upstream.pool,
        parts: &mut parts,
        body: Some(body),
        replayable,
        limits,
        downstream_failed,
    };
    let sent = retry.drive(&mut codec).await;
    match sent {
        Ok(answered) => (
            edit_response(answered.answer, route),
            Some(answered.endpoint),
        ),
        Err(err) => (
            upstream_failure(&err, &plan.name, retry.timeout, grpc),
            err.endpoint,
        ),
    }
}
