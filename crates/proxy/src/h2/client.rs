//! hyper's HTTP/2 client, for `protocol: http2` clusters: one multiplexed connection per
//! endpoint and worker, connections and connect failures counted per cluster, and one try of
//! a request on it as the retry driver asks for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use crate::body::UpstreamBody;
use crate::l7::error::UpstreamError;
use crate::metrics::ClusterStats;
use crate::snapshot::ClusterPlan;

pub type HttpClient = Client<CountingConnector, UpstreamBody>;

/// An HttpConnector that counts upstream connections and connect failures per cluster.
#[derive(Clone)]
pub struct CountingConnector {
    inner: HttpConnector,
    stats: Arc<ClusterStats>,
    worker: usize,
}

impl tower_service::Service<Uri> for CountingConnector {
    type Response = TokioIo<TcpStream>;
    type Error = <HttpConnector as tower_service::Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let connecting = self.inner.call(dst);
        let (stats, worker) = (self.stats.clone(), self.worker);
        Box::pin(async move {
            let result = connecting.await;
            match &result {
                // Connect outcomes are rare next to requests and can come from any task of
                // the worker; the shared add keeps them exact.
                Ok(_) => stats.connections.add_shared(worker, 1),
                Err(_) => stats.connect_failures.add_shared(worker, 1),
            }
            result
        })
    }
}

/// hyper's client for an HTTP/2 cluster.
pub fn build_client(plan: &ClusterPlan, worker: usize) -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(plan.connect_timeout));
    http.enforce_http(true);
    let connector = CountingConnector {
        inner: http,
        stats: plan.stats.clone(),
        worker,
    };
    let mut builder = Client::builder(TokioExecutor::new());
    // One connection carries every stream of this worker, so its windows are large.
    // A fixed connection window also sizes h2's small-DATA-frame flood budget (half the
    // window); with the adaptive window it stays near 25 KiB, and gRPC streams of small
    // messages from many clients exhaust it: h2 then sends GOAWAY(ENHANCE_YOUR_CALM)
    // upstream and every stream on it is reset.
    builder
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .http2_only(true)
        .http2_initial_connection_window_size(8 << 20)
        .http2_initial_stream_window_size(1 << 20);
    builder.build(connector)
}

/// One try of a request at endpoint `index` of the cluster, with `headers` (the request's,
/// already edited). `downstream_failed` is raised by the body when the client's framing
/// broke: the failure is then the client's.
pub(crate) async fn send(
    client: &HttpClient,
    parts: &http::request::Parts,
    headers: HeaderMap,
    plan: &ClusterPlan,
    index: usize,
    body: UpstreamBody,
    downstream_failed: &AtomicBool,
) -> Result<Response<Incoming>, UpstreamError> {
    let req =
        request(parts, headers, plan, index, body).map_err(UpstreamError::unusable_request)?;
    client.request(req).await.map_err(|err| {
        let detail = error_chain(&err);
        if downstream_failed.load(Ordering::Relaxed) {
            UpstreamError::request_body(detail)
        } else if err.is_connect() {
            UpstreamError::connect(detail)
        } else {
            UpstreamError::closed(detail, false, false)
        }
    })
}

/// The request as hyper's HTTP/2 client sends it to endpoint `index` of the cluster. A
/// target or head that cannot be built is the client's fault: the error names the part,
/// for the 400 to answer with.
fn request(
    parts: &http::request::Parts,
    headers: HeaderMap,
    plan: &ClusterPlan,
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

/// An error and its causes on one line: hyper's own message says little without them.
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
