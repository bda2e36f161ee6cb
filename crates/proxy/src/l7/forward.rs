//! Forwarding a request held in `http` types — an HTTP/2 client's, or an HTTP/1 client's
//! bound for an HTTP/2 cluster — to either kind of cluster, through the retry driver: the
//! upstream request is edited once, and each try goes out on the cluster's pool (flatmesh's
//! HTTP/1 client, or its HTTP/2 client).

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use flatmesh_config::Limits;
use flatmesh_rules::{ClusterId, CompiledRoute};
use http::header::HeaderValue;
use http::Response;
use http_body_util::BodyExt as _;

use super::body::ResponseBody;
use super::decide::hash_key;
use super::error::UpstreamError;
use super::fault::{abort_reply, Delayed, FAULT_HEADER};
use super::headers::{edit_request, edit_response};
use super::reply::{is_grpc, upstream_failure};
use super::retry::{replayable_body, Answer, Attempt, Retry, Try};
use super::upload::Upload;
use crate::body::{empty, UpstreamBody};
use crate::context::{ConnContext, WorkerView};
use crate::snapshot::ClusterPlan;
use crate::upstream::Pool;

impl Answer for Response<ResponseBody> {
    fn status(&self) -> u16 {
        Response::status(self).as_u16()
    }

    fn grpc_status(&self) -> Option<u32> {
        self.headers()
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok())
    }
}

/// One request held in `http` types, tried on the cluster's pool (a mirror's copy too,
/// `super::mirror`).
pub(crate) struct MessageTry<'a> {
    pub ctx: &'a ConnContext,
    pub plan: &'a ClusterPlan,
    pub pool: &'a Pool,
    pub parts: &'a mut http::request::Parts,
    /// The client's body, until the one try that may send it takes it.
    pub body: Option<UpstreamBody>,
    /// The client's body read whole and kept for every try (`retries.max_replay_body`).
    pub kept: Option<Kept>,
    pub replayable: bool,
    pub limits: &'a Limits,
    pub downstream_failed: &'a AtomicBool,
}

impl Attempt for MessageTry<'_> {
    type Answer = Response<ResponseBody>;

    async fn attempt(&mut self, to: Try) -> Result<Response<ResponseBody>, UpstreamError> {
        // A body can be sent only once; the driver sends a request twice only without one.
        let body = match (&self.kept, self.body.take()) {
            (Some(kept), _) => kept.body(),
            (None, Some(b)) if !self.replayable => b,
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
            Pool::Http2(pool) => {
                let headers = if to.last {
                    std::mem::take(&mut self.parts.headers)
                } else {
                    self.parts.headers.clone()
                };
                crate::h2::client::send(
                    pool,
                    self.parts,
                    headers,
                    self.plan,
                    self.ctx.worker,
                    to.index,
                    to.endpoint,
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
/// the answer a 400 rather than an upstream error. `delayed`: the route's fault holds the
/// request first (`super::fault`), within the route's timeout. The route's mirror, if it
/// draws the request, gets its copy on the way (`super::mirror`). `trace`: the node's span,
/// whose context the upstream request carries (`crate::trace`).
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
    delayed: Option<Delayed>,
    trace: Option<&crate::trace::Started>,
) -> (Response<ResponseBody>, Option<SocketAddr>) {
    let snap = &view.snapshot;
    let plan = &snap.clusters[cluster];
    let upstream = &view.upstreams.by_cluster[cluster];
    let limits = &snap.config.limits;
    let grpc = is_grpc(&parts.headers);
    let timeout = route.timeout.unwrap_or(limits.request_timeout);
    let mut waited = Duration::ZERO;
    if let Some(delayed) = delayed {
        if delayed.duration >= timeout {
            tokio::time::sleep(timeout).await;
            let mut resp = upstream_failure(&UpstreamError::timeout(), &plan.name, timeout, grpc);
            resp.headers_mut()
                .insert(FAULT_HEADER, HeaderValue::from_static("delay"));
            return (resp, None);
        }
        tokio::time::sleep(delayed.duration).await;
        if let Some(status) = delayed.abort {
            snap.faults.aborts.add(ctx.worker, 1);
            return (abort_reply(status, &route.name, grpc), None);
        }
        waited = delayed.duration;
    }
    let body = super::mirror::start(ctx, view, route, &parts, body, replayable);
    let key = hash_key((&parts.headers).into(), plan.hash_header.as_ref(), ctx.peer);
    edit_request(&mut parts, route, plan.protocol, &ctx.peer_ip);
    if let Some(trace) = trace {
        trace.propagate(&mut parts.headers, &route.request_headers_to_add);
    }
    // A body of a declared length that fits the route's `retries.max_replay_body` is read
    // whole first and kept for every try; any other is streamed, and sent once.
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let (body, kept) = match (replayable, declared) {
        (false, Some(length)) if replayable_body(route, Some(length)) => {
            match Kept::read(body, length, limits.idle_timeout).await {
                Ok(kept) => (empty(), Some(kept)),
                Err(err) => {
                    let timeout = route.timeout.unwrap_or(limits.request_timeout);
                    return (upstream_failure(&err, &plan.name, timeout, grpc), None);
                }
            }
        }
        _ => (body, None),
    };
    let replayable = replayable || kept.is_some();
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
    retry.timeout -= waited;
    // A body still arriving: the route's timeout starts once it is complete.
    let body = if replayable {
        body
    } else {
        let (upload, watched) = Upload::new(body);
        retry = retry.timed_from_upload(watched, limits.idle_timeout);
        upload.boxed_unsync()
    };
    let mut codec = MessageTry {
        ctx,
        plan,
        pool: &upstream.pool,
        parts: &mut parts,
        body: Some(body),
        kept,
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

/// A request body read whole, kept for every try of the request; freed with it.
pub(crate) struct Kept {
    data: Bytes,
    trailers: Option<http::HeaderMap>,
}

impl Kept {
    /// Reads `body`, declared `length` bytes long: a body that moves nothing for `idle`
    /// stalled (408), one that breaks off or runs past its length is the client's fault (400).
    async fn read(
        mut body: UpstreamBody,
        length: u64,
        idle: Duration,
    ) -> Result<Kept, UpstreamError> {
        let mut data = BytesMut::with_capacity(length as usize);
        let mut trailers = None;
        loop {
            let frame = match tokio::time::timeout(idle, body.frame()).await {
                Err(_) => return Err(UpstreamError::upload_stalled(idle)),
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(UpstreamError::request_body(e)),
                Ok(Some(Ok(frame))) => crate::trailers::filter_frame(frame),
            };
            match frame.into_data() {
                Ok(piece) if data.len() as u64 + piece.len() as u64 > length => {
                    return Err(UpstreamError::request_body(
                        "the body is longer than its content-length",
                    ))
                }
                Ok(piece) => data.extend_from_slice(&piece),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        Ok(Kept {
            data: data.freeze(),
            trailers,
        })
    }

    /// The body for one try: the kept bytes (shared, not copied) and trailers.
    fn body(&self) -> UpstreamBody {
        KeptBody {
            data: Some(self.data.clone()).filter(|d| !d.is_empty()),
            trailers: self.trailers.clone(),
        }
        .boxed_unsync()
    }
}

/// A [`Kept`] body as one try sends it: the data in one frame, then the trailers.
struct KeptBody {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for KeptBody {
    type Data = Bytes;
    type Error = crate::body::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let frame = match self.data.take() {
            Some(data) => http_body::Frame::data(data),
            None => match self.trailers.take() {
                Some(trailers) => http_body::Frame::trailers(trailers),
                None => return std::task::Poll::Ready(None),
            },
        };
        std::task::Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    //! Requests held in `http` types with a body still arriving, on the paused clock: an
    //! HTTP/2 client whose body trickles in, to an HTTP/1.1 endpoint.
    #![allow(clippy::unwrap_used)]
    use std::convert::Infallible;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::BodyExt as _;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    use crate::testing::{self, ok, Endpoint, Script};

    /// A request body fed by the test, one piece at a time, of a stated length.
    struct Trickle(mpsc::Receiver<Bytes>, u64);

    impl http_body::Body for Trickle {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.1)
        }
    }

    /// POSTs 6 bytes to /up over HTTP/2, one every `every` for `sent` of them (the body ends
    /// after the sixth, and stays open after fewer); returns the answer's status and when it
    /// came.
    async fn trickle(sent: usize, every: Duration) -> (u16, Duration) {
        let app = Endpoint::start(|_, _, _| Script::Answer(Duration::ZERO, ok("stored"))).await;
        let yaml = format!(
            r#"
limits: {{ idle_timeout: 5s }}
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /up }} }}
        cluster: app
        timeout: 1s
clusters:
  - name: app
    endpoints: [ {} ]
"#,
            app.addr
        );
        let view = testing::view(&yaml);
        let io = TokioIo::new(testing::http_client(testing::context(&view)));
        let (mut h2, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        let (tx, rx) = mpsc::channel(8);
        let req = http::Request::post("http://t/up")
            .body(Trickle(rx, 6))
            .unwrap();
        let started = Instant::now();
        let feeder = tokio::spawn(async move {
            for byte in b"abcdef".iter().take(sent) {
                tokio::time::sleep(every).await;
                let _ = tx.send(Bytes::copy_from_slice(&[*byte])).await;
            }
            if sent < 6 {
                // Hold the body open (unfinished) until the test is over.
                std::future::pending::<()>().await;
            }
            drop(tx);
        });
        let resp = h2.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let _ = resp.into_body().collect().await;
        feeder.abort();
        drop(app);
        (status, started.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_but_live_http2_upload_is_not_cut_by_the_route_timeout() {
        // Issue 23 item 9: six bytes over 3 s, the route's timeout is 1 s.
        let (status, took) = trickle(6, Duration::from_millis(500)).await;
        assert_eq!((status, took), (200, Duration::from_secs(3)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_http2_upload_is_408_after_the_idle_timeout() {
        // Two bytes, then nothing: the idle timeout (5 s) after the last one.
        let (status, took) = trickle(2, Duration::from_millis(500)).await;
        assert_eq!((status, took), (408, Duration::from_secs(6)));
    }
}
