//! Load reporting (LRS, `envoy.service.load_stats.v3.LoadReportingService`): each node tells
//! the control plane, per period, how much it sent to every endpoint and how long the answers
//! took; the control plane sums that per endpoint. It is how E3's orchestrator on Kubernetes
//! learns each pod's execution time (`flatmesh_k8s::schedule::orchestrate`).
//!
//! The protocol, as Envoy speaks it: the node opens the stream with its identity; the server
//! answers with the period and the clusters it wants (flatmesh's server asks for all of them,
//! at endpoint granularity); from then on the node sends one report per period. Each endpoint's
//! time to the answer's head goes in `load_metric_stats` as [`ANSWER_TIME_METRIC`], in
//! microseconds, with the count of answered tries.
//!
//! What the server takes from a report is bounded ([`MAX_ENDPOINTS_PER_REPORT`]); a report is
//! attributed to the node its bootstrap token names when the server checks tokens, else to the
//! node id the stream claims (as ADS trusts it).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node as NodeId;
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterStats, EndpointLoadMetricStats, UpstreamEndpointStats, UpstreamLocalityStats,
};
use envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_client::LoadReportingServiceClient;
use envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_server::LoadReportingService;
use envoy_types::pb::envoy::service::load_stats::v3::{LoadStatsRequest, LoadStatsResponse};
use flatmesh_config::load_report::EndpointReport;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;

use crate::client::{Backoff, Options};
use crate::error::XdsError;

/// The metric carrying the time to each answer's head, in microseconds.
pub const ANSWER_TIME_METRIC: &str = "flatmesh.answer_time_us";
/// Endpoints the server takes from one report; the rest are dropped (and logged).
pub const MAX_ENDPOINTS_PER_REPORT: usize = 100_000;
/// Reports of at most this size are read.
pub(crate) const MAX_MESSAGE: usize = 16 * 1024 * 1024;
/// The periods a server may ask for are clamped to this range.
const MIN_PERIOD: Duration = Duration::from_millis(100);
const MAX_PERIOD: Duration = Duration::from_secs(300);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a node asks again a control plane that does not implement LRS.
const UNIMPLEMENTED_RETRY: Duration = Duration::from_secs(60);
/// Marks a stream refused because the server has no LRS service.
const UNIMPLEMENTED: &str = "(the server does not implement LRS)";

/// Where a node's load comes from: each call returns the load since the last call.
#[derive(Clone)]
pub struct LoadSource(pub Arc<dyn Fn() -> Vec<EndpointReport> + Send + Sync>);

impl std::fmt::Debug for LoadSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadSource(..)")
    }
}

/// One report as the server received it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeLoad {
    /// The reporting node: its token's node with tokens, else the id it claims.
    pub node: String,
    /// The period the report covers, as the node measured it.
    pub period: Duration,
    pub endpoints: Vec<EndpointReport>,
}

// ---------------------------------------------------------------------------------------------
// The node's side.

/// Reports `source` to the server of `options` until dropped, reconnecting with backoff.
pub(crate) async fn report(options: Options, source: LoadSource) {
    let mut backoff = Backoff::new(&options.node_id);
    let mut said_unimplemented = false;
    loop {
        let outcome = stream(&options, &source).await;
        if let Err((_, XdsError::Stream { why, .. })) = &outcome {
            if why.contains(UNIMPLEMENTED) {
                // A control plane without LRS (another one, or flatmesh's without a reader of
                // load reports): ask again now and then, quietly.
                if !said_unimplemented {
                    tracing::info!(
                        "the control plane takes no load reports; asking again every {:?}",
                        UNIMPLEMENTED_RETRY
                    );
                    said_unimplemented = true;
                }
                tokio::time::sleep(UNIMPLEMENTED_RETRY).await;
                continue;
            }
        }
        let progress = match &outcome {
            Ok(progress) | Err((progress, _)) => *progress,
        };
        if progress {
            backoff.reset();
        }
        let wait = backoff.next();
        match outcome {
            Ok(_) => tracing::info!(retry_in = ?wait, "load report stream closed by the server"),
            Err((_, e)) => {
                tracing::warn!(error = %e, retry_in = ?wait, "load report stream failed")
            }
        }
        tokio::time::sleep(wait).await;
    }
}

/// What the server asked for.
struct Asked {
    period: Duration,
    /// `None`: every cluster.
    clusters: Option<Vec<String>>,
}

/// One stream, until it ends. The bool says whether the server answered (resets backoff).
async fn stream(
    options: &Options,
    source: &LoadSource,
) -> std::result::Result<bool, (bool, XdsError)> {
    let failed = |progress: bool, why: String| {
        (
            progress,
            XdsError::Stream {
                address: options.server.clone(),
                why: format!("load reporting: {why}"),
            },
        )
    };
    let channel = crate::secure::connect(&options.server, &options.security, CONNECT_TIMEOUT)
        .await
        .map_err(|why| {
            (
                false,
                XdsError::Connect {
                    address: options.server.clone(),
                    why,
                },
            )
        })?;
    let mut client = LoadReportingServiceClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let (tx, rx) = mpsc::channel::<LoadStatsRequest>(2);
    let node = NodeId {
        id: options.node_id.clone(),
        cluster: options.node_cluster.clone(),
        user_agent_name: "flatmesh".into(),
        client_features: vec!["envoy.lrs.supports_send_all_clusters".into()],
        ..Default::default()
    };
    let _ = tx
        .send(LoadStatsRequest {
            node: Some(node),
            cluster_stats: Vec::new(),
        })
        .await;
    let request = crate::secure::with_token(
        tonic::Request::new(ReceiverStream::new(rx)),
        &options.security,
    )
    .map_err(|why| failed(false, why))?;
    let mut responses = client
        .stream_load_stats(request)
        .await
        .map_err(|e| match e.code() {
            tonic::Code::Unimplemented => failed(false, format!("{} {UNIMPLEMENTED}", e.message())),
            _ => failed(false, e.to_string()),
        })?
        .into_inner();
    let mut asked: Option<Asked> = None;
    let mut progress = false;
    let mut since = tokio::time::Instant::now();
    let mut next = since;
    loop {
        let due = async {
            match &asked {
                Some(_) => tokio::time::sleep_until(next).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            response = responses.message() => match response {
                Ok(Some(response)) => {
                    progress = true;
                    let period = response
                        .load_reporting_interval
                        .and_then(|d| crate::to_model::duration(&d, "load_reporting_interval").ok())
                        .unwrap_or(Duration::from_secs(10))
                        .clamp(MIN_PERIOD, MAX_PERIOD);
                    let clusters = (!response.send_all_clusters).then_some(response.clusters);
                    tracing::info!(?period, all = clusters.is_none(), "reporting load");
                    if asked.is_none() {
                        // The counts so far are the first period's.
                        next = tokio::time::Instant::now() + period;
                    }
                    asked = Some(Asked { period, clusters });
                }
                Ok(None) => return Ok(progress),
                Err(e) => return Err(failed(progress, e.to_string())),
            },
            () = due => {
                let Some(asked) = &asked else { continue };
                let now = tokio::time::Instant::now();
                let reports = (source.0)();
                let request = LoadStatsRequest {
                    node: None,
                    cluster_stats: cluster_stats(&reports, asked.clusters.as_deref(), now - since),
                };
                since = now;
                next = now + asked.period;
                if tx.send(request).await.is_err() {
                    return Ok(progress);
                }
            }
        }
    }
}

/// The LRS form of `reports`: one `ClusterStats` per cluster (of `wanted`, or all), its
/// endpoints in one locality (the node's).
fn cluster_stats(
    reports: &[EndpointReport],
    wanted: Option<&[String]>,
    period: Duration,
) -> Vec<ClusterStats> {
    let mut out: Vec<ClusterStats> = Vec::new();
    for r in reports {
        if wanted.is_some_and(|w| !w.contains(&r.cluster)) {
            continue;
        }
        if out.last().is_none_or(|c| c.cluster_name != r.cluster) {
            out.push(ClusterStats {
                cluster_name: r.cluster.clone(),
                upstream_locality_stats: vec![UpstreamLocalityStats::default()],
                load_report_interval: Some(crate::from_model::duration(period)),
                ..Default::default()
            });
        }
        let Some(locality) = out
            .last_mut()
            .and_then(|c| c.upstream_locality_stats.last_mut())
        else {
            continue;
        };
        locality.total_successful_requests += r.succeeded;
        locality.total_error_requests += r.failed;
        locality.total_issued_requests += r.issued;
        locality.total_requests_in_progress += r.in_progress;
        locality
            .upstream_endpoint_stats
            .push(UpstreamEndpointStats {
                address: Some(crate::from_model::socket_address(r.endpoint)),
                total_successful_requests: r.succeeded,
                total_requests_in_progress: r.in_progress,
                total_error_requests: r.failed,
                total_issued_requests: r.issued,
                load_metric_stats: vec![EndpointLoadMetricStats {
                    metric_name: ANSWER_TIME_METRIC.into(),
                    num_requests_finished_with_metric: r.answered,
                    total_metric_value: r.answer_us as f64,
                }],
                ..Default::default()
            });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The server's side.

/// The LRS service: asks every node for all clusters every `period`, and hands each report
/// to `reports` (dropped, and counted in the log, when the receiver lags).
#[derive(Clone)]
pub struct LoadReportServer {
    pub period: Duration,
    pub reports: mpsc::Sender<NodeLoad>,
    /// Reports dropped because `reports` was full.
    pub dropped: Arc<AtomicU64>,
}

impl LoadReportServer {
    pub fn new(period: Duration, reports: mpsc::Sender<NodeLoad>) -> LoadReportServer {
        LoadReportServer {
            period,
            reports,
            dropped: Arc::default(),
        }
    }
}

/// What the xDS server gives the service: who a stream's token names, and the shutdown.
pub(crate) struct Served {
    pub server: LoadReportServer,
    pub tokens: Option<Arc<dyn crate::secure::Tokens>>,
    pub closing: watch::Receiver<bool>,
}

type Responses =
    Pin<Box<dyn Stream<Item = std::result::Result<LoadStatsResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl LoadReportingService for Served {
    type StreamLoadStatsStream = Responses;

    async fn stream_load_stats(
        &self,
        request: tonic::Request<tonic::Streaming<LoadStatsRequest>>,
    ) -> std::result::Result<tonic::Response<Responses>, tonic::Status> {
        let token_node = match (
            &self.tokens,
            crate::certificates::bearer_token(request.metadata()),
        ) {
            (Some(tokens), Some(token)) => tokens.node_of(token),
            _ => None,
        };
        let mut requests = request.into_inner();
        let (tx, rx) = mpsc::channel(1);
        let server = self.server.clone();
        let mut closing = self.closing.clone();
        let period = server.period.clamp(MIN_PERIOD, MAX_PERIOD);
        tokio::spawn(async move {
            let mut node: Option<String> = token_node;
            let mut answered = false;
            loop {
                let request = tokio::select! {
                    r = requests.message() => r,
                    _ = closing.wait_for(|c| *c) => return,
                };
                let request = match request {
                    Ok(Some(r)) => r,
                    Ok(None) | Err(_) => return,
                };
                if node.is_none() {
                    node = request
                        .node
                        .as_ref()
                        .map(|n| n.id.clone())
                        .filter(|id| !id.is_empty());
                }
                let Some(node) = &node else {
                    let _ = tx
                        .send(Err(tonic::Status::invalid_argument(
                            "the first load report names no node (node.id)",
                        )))
                        .await;
                    return;
                };
                if !answered {
                    answered = true;
                    let asked = LoadStatsResponse {
                        send_all_clusters: true,
                        load_reporting_interval: Some(crate::from_model::duration(period)),
                        report_endpoint_granularity: true,
                        ..Default::default()
                    };
                    if tx.send(Ok(asked)).await.is_err() {
                        return;
                    }
                }
                if request.cluster_stats.is_empty() {
                    continue;
                }
                let load = read_report(node, &request.cluster_stats);
                if server.reports.try_send(load).is_err() {
                    // Said at the 1st, 2nd, 4th, 8th ... drop: a lagging reader must not
                    // flood the log with one line per node per period.
                    let dropped = server.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                    if dropped.is_power_of_two() {
                        tracing::warn!(%node, dropped, "load reports dropped so far: their reader lags");
                    }
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// What the server takes from a report of `node`: the endpoints that name a usable address,
/// at most [`MAX_ENDPOINTS_PER_REPORT`] of them, with a non-negative, finite answer time.
pub fn read_report(node: &str, clusters: &[ClusterStats]) -> NodeLoad {
    let mut endpoints = Vec::new();
    let mut period = Duration::ZERO;
    let mut dropped = 0usize;
    for cluster in clusters {
        if let Some(d) = cluster
            .load_report_interval
            .and_then(|d| crate::to_model::duration(&d, "load_report_interval").ok())
        {
            period = period.max(d);
        }
        for e in cluster
            .upstream_locality_stats
            .iter()
            .flat_map(|l| &l.upstream_endpoint_stats)
        {
            let Ok(endpoint) = crate::to_model::socket_addr(e.address.as_ref(), "load report")
            else {
                dropped += 1;
                continue;
            };
            if endpoints.len() >= MAX_ENDPOINTS_PER_REPORT {
                dropped += 1;
                continue;
            }
            let (answered, answer_us) = e
                .load_metric_stats
                .iter()
                .find(|m| m.metric_name == ANSWER_TIME_METRIC)
                .filter(|m| m.total_metric_value.is_finite() && m.total_metric_value >= 0.0)
                .map_or((0, 0), |m| {
                    (
                        m.num_requests_finished_with_metric,
                        m.total_metric_value as u64,
                    )
                });
            endpoints.push(EndpointReport {
                cluster: cluster.cluster_name.clone(),
                endpoint,
                issued: e.total_issued_requests,
                succeeded: e.total_successful_requests,
                failed: e.total_error_requests,
                in_progress: e.total_requests_in_progress,
                answered,
                answer_us,
            });
        }
    }
    if dropped > 0 {
        tracing::warn!(%node, dropped, "load report: endpoints left out (no usable address, or past {MAX_ENDPOINTS_PER_REPORT})");
    }
    NodeLoad {
        node: node.to_string(),
        period,
        endpoints,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::net::SocketAddr;

    fn report(cluster: &str, last: u8, answered: u64, answer_us: u64) -> EndpointReport {
        EndpointReport {
            cluster: cluster.into(),
            endpoint: SocketAddr::from(([10, 0, 0, last], 80)),
            issued: answered + 1,
            succeeded: answered,
            failed: 1,
            in_progress: 2,
            answered,
            answer_us,
        }
    }

    #[test]
    fn a_report_reads_back_as_it_was_sent() {
        let sent = vec![
            report("a", 1, 10, 1000),
            report("a", 2, 5, 50),
            report("b", 3, 0, 0),
        ];
        let stats = cluster_stats(&sent, None, Duration::from_secs(1));
        assert_eq!(stats.len(), 2);
        assert_eq!(
            stats[0].upstream_locality_stats[0].total_issued_requests,
            17
        );
        let back = read_report("n1", &stats);
        assert_eq!(back.node, "n1");
        assert_eq!(back.period, Duration::from_secs(1));
        assert_eq!(back.endpoints, sent);
        let only_b = cluster_stats(&sent, Some(&["b".to_string()]), Duration::from_secs(1));
        assert_eq!(only_b.len(), 1);
        assert_eq!(only_b[0].cluster_name, "b");
    }

    #[test]
    fn hostile_numbers_and_addresses_are_left_out() {
        let mut stats = cluster_stats(&[report("a", 1, 3, 30)], None, Duration::from_secs(1));
        let endpoints = &mut stats[0].upstream_locality_stats[0].upstream_endpoint_stats;
        let mut bad = endpoints[0].clone();
        bad.address = None;
        endpoints.push(bad);
        let mut nan = endpoints[0].clone();
        nan.load_metric_stats[0].total_metric_value = f64::NAN;
        endpoints.push(nan);
        let back = read_report("n1", &stats);
        assert_eq!(
            back.endpoints.len(),
            2,
            "the one with no address is dropped"
        );
        assert_eq!(
            (back.endpoints[1].answered, back.endpoints[1].answer_us),
            (0, 0)
        );
    }
}
