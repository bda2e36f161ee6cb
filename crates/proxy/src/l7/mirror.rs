//! Request mirroring, a route's `mirror:` (Envoy's `request_mirror_policies`): a share of the
//! route's requests is copied to another cluster, fire and forget.
//!
//! The copy is the request as the route sends it upstream (its header edits made for the
//! mirror cluster's protocol), with `-shadow` added to its host (`api:8080` becomes
//! `api-shadow:8080`, as Envoy does), and the body up to [`MAX_BODY`] bytes: the body is
//! copied as it streams to the route's cluster, and the copy leaves once the body is
//! complete. A bigger body is not mirrored at all (counted: `body_too_large`).
//!
//! The copy runs in a task of its own on the worker, through the one retry driver (one try,
//! the mirror cluster's load balancing, circuit breaker and the route's timeout); its answer
//! is read and dropped. Nothing of it reaches the caller: not its failures, not its latency,
//! not a mirror cluster that is down or hangs. Copies in flight are capped node-wide at
//! [`MAX_OUTSTANDING`]; a copy over the cap is not sent (counted: `overflow`), so a slow
//! mirror never queues requests without bound.

use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use flatmesh_rules::{ClusterId, CompiledRoute, ListenerId, MirrorAction, RouteId, TableKind};
use http::header::{self, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt as _, Full};
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::decide::hash_key;
use super::forward::MessageTry;
use super::headers::edit_request;
use super::retry::Retry;
use crate::body::{BoxError, UpstreamBody};
use crate::context::{ConnContext, WorkerView};
use crate::metrics::WorkerCounter;
use crate::snapshot::Snapshot;

/// Mirror copies in flight on the whole node, at most.
pub(crate) const MAX_OUTSTANDING: usize = 512;
/// The largest request body a copy carries; a request with a bigger one is not mirrored.
pub(crate) const MAX_BODY: usize = 64 * 1024;

/// The node's mirror copies: the cap on those in flight, and what became of them
/// (`/metrics`: `flatmesh_mirror_requests`, `flatmesh_mirror_dropped`).
pub(crate) struct MirrorGate {
    slots: Arc<Semaphore>,
    sent: WorkerCounter,
    failed: WorkerCounter,
    overflow: WorkerCounter,
    too_large: WorkerCounter,
}

impl MirrorGate {
    pub fn new(workers: usize) -> MirrorGate {
        MirrorGate::with_cap(workers, MAX_OUTSTANDING)
    }

    fn with_cap(workers: usize, cap: usize) -> MirrorGate {
        MirrorGate {
            slots: Arc::new(Semaphore::new(cap)),
            sent: WorkerCounter::new(workers),
            failed: WorkerCounter::new(workers),
            overflow: WorkerCounter::new(workers),
            too_large: WorkerCounter::new(workers),
        }
    }

    pub fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        crate::metrics::counter(
            enc,
            "flatmesh_mirror_requests",
            "Mirror copies sent to a route's mirror cluster, and those of them that got no answer (failed)",
            &[
                ([("result", "sent")], self.sent.sum()),
                ([("result", "failed")], self.failed.sum()),
            ],
        )?;
        crate::metrics::counter(
            enc,
            "flatmesh_mirror_dropped",
            "Requests a route's mirror drew but did not copy: over the node's cap of copies in flight, or a body too large",
            &[
                ([("reason", "overflow")], self.overflow.sum()),
                ([("reason", "body_too_large")], self.too_large.sum()),
            ],
        )
    }
}

/// Starts a copy of the request to the route's mirror cluster if the route mirrors and this
/// request is in its share. `parts` is the request as the client sent it (routed, path
/// normalised, not yet edited for the upstream); returns the body to send upstream, which
/// copies itself for the mirror as it streams. Never waits.
pub(crate) fn start(
    ctx: &ConnContext,
    view: &WorkerView,
    route: &CompiledRoute,
    parts: &http::request::Parts,
    body: UpstreamBody,
    replayable: bool,
) -> UpstreamBody {
    let Some(mirror) = route.mirror else {
        return body;
    };
    if !mirror.share.hit(rand::random()) {
        return body;
    }
    let snap = &view.snapshot;
    let gate = &snap.mirrors;
    let too_large = body
        .size_hint()
        .upper()
        .is_some_and(|n| n > MAX_BODY as u64);
    if too_large {
        gate.too_large.add(ctx.worker, 1);
        return body;
    }
    // The task holds the worker's view of the config it was routed with; after a reload
    // swapped it, the ids no longer name the same route and cluster, so no copy is made.
    let current = ctx.view.load_full();
    let Some(listener) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        return body;
    };
    if !std::ptr::eq(Arc::as_ptr(&current), view) {
        return body;
    }
    let Ok(permit) = gate.slots.clone().try_acquire_owned() else {
        gate.overflow.add(ctx.worker, 1);
        return body;
    };
    let copy = Copy {
        ctx: ctx.clone(),
        view: current,
        listener,
        route: route.id,
        mirror,
        parts: shadow_parts(parts),
        _permit: permit,
    };
    if replayable {
        tokio::spawn(copy.send(Bytes::new()));
        return body;
    }
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        match rx.await {
            Ok(Some(bytes)) => copy.send(bytes).await,
            Ok(None) => copy
                .view
                .snapshot
                .mirrors
                .too_large
                .add_shared(copy.ctx.worker, 1),
            // The client's body broke off, or its request ended before sending it all.
            Err(_) => {}
        }
    });
    Tee {
        inner: body,
        copied: BytesMut::new(),
        done: Some(tx),
    }
    .boxed_unsync()
}

/// The request's head for the mirror: the same, with `-shadow` added to its host.
fn shadow_parts(parts: &http::request::Parts) -> http::request::Parts {
    let (mut copy, ()) = http::Request::new(()).into_parts();
    copy.method = parts.method.clone();
    copy.version = parts.version;
    copy.headers = parts.headers.clone();
    copy.uri = parts.uri.clone();
    if let Some(authority) = parts.uri.authority() {
        let shadow = shadow_host(authority.as_str());
        let mut uri = parts.uri.clone().into_parts();
        uri.authority = shadow.parse().ok();
        if let Ok(u) = http::Uri::from_parts(uri) {
            copy.uri = u;
        }
    }
    if let Some(host) = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
    {
        if let Ok(v) = HeaderValue::from_str(&shadow_host(host)) {
            copy.headers.insert(header::HOST, v);
        }
    }
    copy
}

/// `api:8080` → `api-shadow:8080`, `api` → `api-shadow` (an IPv6 literal's port too).
fn shadow_host(host: &str) -> String {
    let port_at = match host.rfind(':') {
        Some(i)
            if !host[i..].contains(']') && host[i + 1..].bytes().all(|b| b.is_ascii_digit()) =>
        {
            i
        }
        _ => host.len(),
    };
    format!("{}-shadow{}", &host[..port_at], &host[port_at..])
}

/// One copy, until it is sent.
struct Copy {
    ctx: ConnContext,
    view: Arc<WorkerView>,
    listener: ListenerId,
    route: RouteId,
    mirror: MirrorAction,
    parts: http::request::Parts,
    /// Its place under the node's cap, held until its answer is read.
    _permit: OwnedSemaphorePermit,
}

impl Copy {
    /// Sends the copy with `body` and reads its answer to the end, dropping it.
    async fn send(mut self, body: Bytes) {
        let snap = &self.view.snapshot;
        let Some(route) = route_of(snap, self.listener, self.route) else {
            return;
        };
        let cluster: ClusterId = self.mirror.cluster;
        let plan = &snap.clusters[cluster];
        let upstream = &self.view.upstreams.by_cluster[cluster];
        let limits = &snap.config.limits;
        edit_request(&mut self.parts, route, plan.protocol, &self.ctx.peer_ip);
        let key = hash_key(
            (&self.parts.headers).into(),
            plan.hash_header.as_ref(),
            self.ctx.peer,
        );
        // One try: a body goes once, and a copy is not worth a retry.
        let retry = Retry::new(
            route,
            plan,
            upstream,
            self.ctx.worker,
            key,
            false,
            limits.request_timeout,
        )
        .toward(self.ctx.dialled);
        let failed = AtomicBool::new(false);
        let body = Full::new(body)
            .map_err(|never| match never {})
            .boxed_unsync();
        let mut codec = MessageTry {
            ctx: &self.ctx,
            plan,
            pool: &upstream.pool,
            parts: &mut self.parts,
            body: Some(body),
            kept: None,
            replayable: false,
            limits,
            downstream_failed: &failed,
        };
        snap.mirrors.sent.add_shared(self.ctx.worker, 1);
        match retry.drive(&mut codec).await {
            Ok(answered) => {
                let mut body = answered.answer.into_body();
                let drained = tokio::time::timeout(retry.timeout, async {
                    while let Some(Ok(_)) = body.frame().await {}
                });
                let _ = drained.await;
            }
            Err(err) => {
                tracing::debug!(cluster = %plan.name, error = %err.located(), "mirror copy failed");
                snap.mirrors.failed.add_shared(self.ctx.worker, 1);
            }
        }
    }
}

/// Route `id` of http listener `listener`.
fn route_of(snap: &Snapshot, listener: ListenerId, id: RouteId) -> Option<&CompiledRoute> {
    match &snap.program.listeners().get(listener)?.kind {
        TableKind::Http(table) => table.routes.get(id),
        TableKind::Tcp(_) | TableKind::Hbone(_) | TableKind::Qnp(_) => None,
    }
}

/// The client's body on its way upstream, copied for the mirror up to [`MAX_BODY`] bytes:
/// the copy goes to the mirror's task once the body is complete (`None` when it grew too
/// large). A body that fails or is dropped unfinished sends nothing.
struct Tee {
    inner: UpstreamBody,
    copied: BytesMut,
    done: Option<oneshot::Sender<Option<Bytes>>>,
}

impl Tee {
    fn finish(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(Some(std::mem::take(&mut self.copied).freeze()));
        }
    }
}

impl Body for Tee {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(_)) = (frame.data_ref(), &this.done) {
                    if this.copied.len() + data.len() > MAX_BODY {
                        this.copied = BytesMut::new();
                        if let Some(done) = this.done.take() {
                            let _ = done.send(None);
                        }
                    } else {
                        this.copied.extend_from_slice(data);
                    }
                }
                if this.inner.is_end_stream() {
                    this.finish();
                }
            }
            Poll::Ready(None) => this.finish(),
            // A failed body: the copy would be cut short, so none is sent.
            Poll::Ready(Some(Err(_))) => this.done = None,
            Poll::Pending => {}
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

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use parking_lot::Mutex;
    use tokio::io::AsyncWriteExt as _;
    use tokio::time::Instant;

    use super::*;
    use crate::testing::{self, ok, read_reply, Endpoint, Script};

    #[test]
    fn shadow_hosts_keep_the_port() {
        assert_eq!(shadow_host("api"), "api-shadow");
        assert_eq!(shadow_host("api.local:8080"), "api.local-shadow:8080");
        assert_eq!(shadow_host("[::1]:80"), "[::1]-shadow:80");
        assert_eq!(shadow_host("[::1]"), "[::1]-shadow");
    }

    /// A node of one worker on this runtime: a route to `app` mirrored to `shadow`, with a
    /// cap of `cap` copies in flight. Returns the client connection and the gate.
    fn node(
        app: SocketAddr,
        shadow: SocketAddr,
        cap: usize,
    ) -> (tokio::io::DuplexStream, Arc<MirrorGate>) {
        let yaml = format!(
            "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    routes:\n      - cluster: app\n        timeout: 1h\n        mirror: {{ cluster: shadow }}\nclusters:\n  - name: app\n    endpoints: [ {app} ]\n  - name: shadow\n    endpoints: [ {shadow} ]\n"
        );
        let config = flatmesh_config::parse(&yaml, "test.yaml").unwrap();
        let mut metrics = crate::metrics::Metrics::new(1);
        let gate = Arc::new(MirrorGate::with_cap(1, cap));
        Arc::get_mut(&mut metrics).unwrap().mirrors = gate.clone();
        let snapshot = Arc::new(Snapshot::build(config, 1, &metrics).unwrap());
        let upstreams = crate::upstream::Upstreams::build(&snapshot, 0, None);
        let view = Arc::new(arc_swap::ArcSwap::from_pointee(WorkerView {
            snapshot,
            upstreams,
        }));
        (testing::h1_client(testing::context(&view)), gate)
    }

    /// An endpoint that records each request head and answers only after an hour.
    async fn hanging() -> (Endpoint, Arc<Mutex<Vec<String>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let heads = seen.clone();
        let endpoint = Endpoint::start(move |_, _, head| {
            heads.lock().push(head.to_owned());
            Script::Answer(Duration::from_secs(3600), ok("late"))
        })
        .await;
        (endpoint, seen)
    }

    #[tokio::test(start_paused = true)]
    async fn the_caller_does_not_wait_for_a_mirror_that_hangs() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("app"))).await;
        let (shadow, seen) = hanging().await;
        let (mut client, gate) = node(app.addr, shadow.addr, 8);
        let started = Instant::now();
        client
            .write_all(b"GET /x HTTP/1.1\r\nhost: api.local:8080\r\n\r\n")
            .await
            .unwrap();
        let reply = read_reply(&mut client, &mut Vec::new()).await.unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (200, "app"));
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "the mirror's hour is not the caller's"
        );
        // The copy arrives, its host marked as a shadow's.
        for _ in 0..100 {
            if !seen.lock().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let heads = seen.lock().clone();
        assert_eq!(heads.len(), 1, "{heads:?}");
        assert!(heads[0].starts_with("GET /x HTTP/1.1\r\n"), "{}", heads[0]);
        assert!(
            heads[0].contains("host: api.local-shadow:8080\r\n"),
            "{}",
            heads[0]
        );
        assert_eq!((gate.sent.sum(), gate.failed.sum()), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn copies_over_the_node_cap_are_dropped_and_counted() {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("app"))).await;
        let (shadow, seen) = hanging().await;
        let (mut client, gate) = node(app.addr, shadow.addr, 3);
        let mut buf = Vec::new();
        for _ in 0..5 {
            client
                .write_all(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
                .await
                .unwrap();
            let reply = read_reply(&mut client, &mut buf).await.unwrap();
            assert_eq!(reply.status, 200);
            // Let the copy reach the mirror before the next request.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(seen.lock().len(), 3, "three copies hang at the mirror");
        assert_eq!((gate.sent.sum(), gate.overflow.sum()), (3, 2));
        // An hour later the copies are answered (or time out) and their places are free.
        tokio::time::sleep(Duration::from_secs(3601)).await;
        assert_eq!(gate.slots.available_permits(), 3);
    }
}
