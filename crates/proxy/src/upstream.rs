//! Upstream side of a worker: per-cluster balancers and connection pools.
//!
//! HTTP/1.1 clusters get a keep-alive pool; `protocol: http2` clusters get one multiplexed
//! HTTP/2 connection per endpoint. Pools belong to one worker (shared-nothing) and survive
//! config reloads when the cluster's connection settings did not change.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use flatmesh_config::UpstreamProtocol;
use http::Uri;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use crate::h1::pool::H1Pool;
use crate::lb::Balancer;
use crate::metrics::ClusterStats;
use crate::snapshot::{ClusterPlan, Snapshot};

/// Why a request body stopped early: the client's framing, or the client went away.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Body of a request sent upstream: the client's body streamed through, or empty.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;
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

/// What makes two pools interchangeable across a reload.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    cluster: String,
    protocol: UpstreamProtocol,
    connect_timeout: Duration,
}

/// hyper's client for an HTTP/2 cluster.
fn build_client(plan: &ClusterPlan, worker: usize) -> HttpClient {
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

/// One cluster as seen by one worker.
pub struct Upstream {
    pub balancer: Balancer,
    pub pool: Pool,
}

/// The connections of one cluster, kept across reloads that leave its settings alone.
#[derive(Clone)]
pub enum Pool {
    /// Keep-alive HTTP/1.1 connections per endpoint (`crate::h1`), for every client.
    Http1(Arc<H1Pool>),
    /// hyper's client: one multiplexed HTTP/2 connection per endpoint.
    Http2(Box<HttpClient>),
}

/// A worker's upstream state for one snapshot.
pub struct Upstreams {
    pub by_cluster: Vec<Upstream>,
    pub pools: HashMap<PoolKey, Pool>,
}

impl Upstreams {
    /// Build this worker's balancers and pools for `snapshot`, reusing the pools of `previous`
    /// whose settings are unchanged (so keep-alive connections survive a reload).
    pub fn build(snapshot: &Snapshot, worker: usize, previous: Option<&Upstreams>) -> Upstreams {
        let mut pools = HashMap::new();
        let by_cluster = snapshot
            .clusters
            .iter()
            .map(|plan| {
                let key = PoolKey {
                    cluster: plan.name.clone(),
                    protocol: plan.protocol,
                    connect_timeout: plan.connect_timeout,
                };
                let pool = previous
                    .and_then(|p| p.pools.get(&key).cloned())
                    .unwrap_or_else(|| match plan.protocol {
                        UpstreamProtocol::Http1 => Pool::Http1(H1Pool::new()),
                        UpstreamProtocol::Http2 => {
                            Pool::Http2(Box::new(build_client(plan, worker)))
                        }
                    });
                pools.insert(key, pool.clone());
                Upstream {
                    balancer: Balancer::new(
                        plan.policy,
                        plan.endpoints.clone(),
                        &plan.table,
                        worker,
                    ),
                    pool,
                }
            })
            .collect();
        Upstreams { by_cluster, pools }
    }
}
