//! The HTTP/2 codec, on hyper: its server for HTTP/2 clients (h2c with prior knowledge,
//! gRPC) and, in [`client`], its client for `protocol: http2` clusters. Both are thin
//! adapters over the L7 layer (`crate::l7`): a request is decided there, forwarded through
//! its retry driver, and answered with its replies.

pub(crate) mod client;
mod idle;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use flatmesh_config::Limits;
use http::{Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::body::BoxError;
use crate::context::ConnContext;
use crate::l7::body::ResponseBody;
use crate::l7::decide::{authority, decide, Decision};
use crate::l7::forward::forward;
use crate::l7::log::{finish, Outcome};
use crate::l7::reply::{is_grpc, listener_removed};
use crate::tap::Tapped;
use idle::{ActivityTap, ConnSignals};

/// Serves an HTTP/2 client connection until it ends or stays idle for `idle_timeout`.
pub(crate) async fn serve<S>(ctx: Arc<ConnContext>, stream: S, limits: &Limits)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(1024);
    let signals = Arc::new(ConnSignals::default());
    let io = TokioIo::new(Tapped {
        inner: stream,
        tap: ActivityTap(signals.clone()),
    });
    let service = service_fn(move |req| handle(ctx.clone(), req));
    let connection = builder.serve_connection(io, service);
    tokio::select! {
        result = connection => {
            if let Err(err) = result {
                tracing::debug!(error = %err, "downstream connection ended with an error");
            }
        }
        // Dropping the connection future closes the socket.
        _ = idle::idle(&signals, limits.idle_timeout) => {
            tracing::debug!("closing idle downstream connection");
        }
    }
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

/// Serves one request of an HTTP/2 connection.
async fn handle(
    ctx: Arc<ConnContext>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    let started = Instant::now();
    let view = ctx.view.load_full();
    let snap = &view.snapshot;
    let Some(lid) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        return Ok(listener_removed());
    };
    let method = req.method().clone();
    // Cheap (shared bytes); kept for the 404 text and the access log after `req` moves on.
    let uri = req.uri().clone();
    let path_and_query = || uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let logged = || Some((method.to_string(), path_and_query()));

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
    let (resp, outcome) = match decision {
        Decision::Reply(route, resp) => {
            let outcome = Outcome {
                route,
                cluster: None,
                upstream: None,
                status: resp.status().as_u16(),
            };
            (resp, outcome)
        }
        Decision::Forward(route, cluster, path) => {
            let (mut parts, body) = req.into_parts();
            crate::l7::decide::set_path(&mut parts.uri, path);
            let failed = Arc::new(AtomicBool::new(false));
            let replayable = body.is_end_stream();
            let body = DownstreamBody {
                inner: body,
                failed: failed.clone(),
            }
            .boxed_unsync();
            let (resp, upstream) = forward(
                &ctx, &view, route, cluster, parts, body, replayable, &failed,
            )
            .await;
            let outcome = Outcome {
                route: Some(route),
                cluster: Some(cluster),
                upstream,
                status: resp.status().as_u16(),
            };
            (resp, outcome)
        }
    };
    finish(&ctx, snap, lid, started, &outcome, logged);
    Ok(resp)
}

#[cfg(test)]
mod tests {
    //! The HTTP/2 adapter end to end on the test's runtime, on the paused clock: an HTTP/2
    //! client over an in-memory pipe, HTTP/1.1 endpoints on loopback.
    #![allow(clippy::unwrap_used)]
    use std::net::SocketAddr;
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full};
    use tokio::time::Instant;

    use crate::testing::{self, dead_endpoint, ok, Endpoint, Script};

    fn config(endpoints: &[SocketAddr], retries: &str) -> String {
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
        format!(
            r#"
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
        timeout: 1s
{retries}
clusters:
  - name: app
    endpoints: [ {} ]
"#,
            endpoints.join(", ")
        )
    }

    async fn get(
        yaml: &str,
        grpc: bool,
    ) -> (
        http::Response<Bytes>,
        std::sync::Arc<arc_swap::ArcSwap<crate::context::WorkerView>>,
    ) {
        let view = testing::view(yaml);
        let mut h2 = testing::h2_client(testing::context(&view)).await;
        let mut req = http::Request::post("http://t.local/svc/Method");
        if grpc {
            req = req.header("content-type", "application/grpc");
        }
        let resp = h2
            .send_request(req.body(Full::new(Bytes::new())).unwrap())
            .await
            .unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (http::Response::from_parts(parts, body), view)
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_http1_cluster_gets_504_at_the_route_timeout() {
        let app =
            Endpoint::start(|_, _, _| Script::Answer(Duration::from_secs(30), ok("late"))).await;
        let started = Instant::now();
        let (resp, _) = get(&config(&[app.addr], ""), false).await;
        assert_eq!(resp.status(), 504);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_endpoint_is_retried_and_the_answer_comes_from_the_live_one() {
        let app = Endpoint::start(|_, _, head| {
            assert!(head.starts_with("POST /svc/Method HTTP/1.1"), "{head}");
            assert!(
                head.contains("host: t.local"),
                "the authority becomes Host: {head}"
            );
            Script::Answer(Duration::ZERO, ok("live"))
        })
        .await;
        let yaml = config(
            &[dead_endpoint(), app.addr],
            "        retries: { attempts: 1, on: [ connect-failure ] }",
        );
        let (resp, view) = get(&yaml, false).await;
        assert_eq!(
            (resp.status(), &resp.body()[..]),
            (http::StatusCode::OK, &b"live"[..])
        );
        assert_eq!(view.load().snapshot.clusters[0].stats.retries.sum(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_client_gets_a_grpc_status_when_the_cluster_is_unreachable() {
        let (resp, _) = get(&config(&[dead_endpoint()], ""), true).await;
        assert_eq!(
            resp.status(),
            200,
            "gRPC errors travel as trailers-only answers"
        );
        assert_eq!(resp.headers()["grpc-status"], "14");
        let message = resp.headers()["grpc-message"].to_str().unwrap();
        assert!(
            message.starts_with("upstream connect error: cluster `app`"),
            "{message}"
        );
    }
}
