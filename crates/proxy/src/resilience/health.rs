//! Active health checks (Envoy's `health_checks`): one checker per node, a task on the
//! node's control runtime, probes every endpoint of every cluster that has a `health_check`
//! each `interval` (plus up to 10% jitter, so clusters and nodes do not probe in lockstep).
//! At most [`MAX_PROBES_IN_FLIGHT`] probes are under way at once on the node, and each is
//! bounded by the check's `timeout`.
//!
//! An endpoint starts healthy, so a new cluster (or a node that just started) takes traffic
//! at once, as it did before it had a health check; Envoy starts endpoints unhealthy until
//! their first pass instead. It turns unhealthy after `unhealthy_threshold` consecutive
//! failed probes and healthy again after `healthy_threshold` consecutive passes; while
//! unhealthy it is out of every LB policy ([`super::Out`], shared with outlier detection).
//!
//! The state lives in a [`ClusterHealth`] that the resilience registry keeps across reloads
//! that leave the cluster's check and endpoints alone; a replaced one is retired and its
//! probing stops.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use flatmesh_config::{GrpcHealthCheck, HealthCheck, HealthCheckKind, HttpHealthCheck};
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};

/// Probes under way at once on the node, over every cluster: a node with thousands of
/// endpoints spreads its rounds out instead of opening thousands of connections at once.
pub const MAX_PROBES_IN_FLIGHT: usize = 64;

/// What one probe came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeResult {
    Pass = 0,
    Fail = 1,
    /// No answer within the check's `timeout`; counts as a failure.
    Timeout = 2,
}

impl ProbeResult {
    pub const ALL: [ProbeResult; 3] = [ProbeResult::Pass, ProbeResult::Fail, ProbeResult::Timeout];

    pub fn as_str(self) -> &'static str {
        match self {
            ProbeResult::Pass => "pass",
            ProbeResult::Fail => "fail",
            ProbeResult::Timeout => "timeout",
        }
    }
}

/// Probes of one cluster by result; kept by cluster name across reloads.
#[derive(Default)]
pub struct ProbeCounts([AtomicU64; 3]);

impl ProbeCounts {
    pub fn get(&self, result: ProbeResult) -> u64 {
        self.0[result as usize].load(Ordering::Relaxed)
    }
}

/// The threshold state machine of one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracker {
    healthy: bool,
    /// Consecutive probes that disagree with `healthy`.
    streak: u32,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            healthy: true,
            streak: 0,
        }
    }
}

impl Tracker {
    /// Counts a probe; returns the new state when it changes.
    pub fn record(
        &mut self,
        passed: bool,
        unhealthy_threshold: u32,
        healthy_threshold: u32,
    ) -> Option<bool> {
        if passed == self.healthy {
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let needed = if self.healthy {
            unhealthy_threshold
        } else {
            healthy_threshold
        };
        if self.streak < needed.max(1) {
            return None;
        }
        self.healthy = passed;
        self.streak = 0;
        Some(passed)
    }
}

/// One cluster's health check and what it found.
pub struct ClusterHealth {
    cluster: String,
    check: HealthCheck,
    endpoints: Box<[SocketAddr]>,
    trackers: Mutex<Vec<Tracker>>,
    /// By endpoint: failed its check (out of load balancing).
    down: Box<[AtomicBool]>,
    down_count: AtomicU32,
    counts: Arc<ProbeCounts>,
    /// Replaced by a reload or removed: its probing stops.
    retired: AtomicBool,
}

impl ClusterHealth {
    pub fn new(
        cluster: &str,
        check: &HealthCheck,
        endpoints: &[SocketAddr],
        counts: Arc<ProbeCounts>,
    ) -> Arc<ClusterHealth> {
        Arc::new(ClusterHealth {
            cluster: cluster.to_owned(),
            check: check.clone(),
            endpoints: endpoints.into(),
            trackers: Mutex::new(vec![Tracker::default(); endpoints.len()]),
            down: endpoints.iter().map(|_| AtomicBool::new(false)).collect(),
            down_count: AtomicU32::new(0),
            counts,
            retired: AtomicBool::new(false),
        })
    }

    /// Whether some endpoint is down: the pick's fast path looks no further.
    #[inline]
    pub fn any_down(&self) -> bool {
        self.down_count.load(Ordering::Relaxed) > 0
    }

    pub fn is_down(&self, index: usize) -> bool {
        self.down
            .get(index)
            .is_some_and(|d| d.load(Ordering::Relaxed))
    }

    /// Endpoints down right now (the gauge).
    pub fn down(&self) -> usize {
        self.down_count.load(Ordering::Relaxed) as usize
    }

    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    fn retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Counts a probe of endpoint `index` and moves it in or out at a threshold.
    pub fn record(&self, index: usize, result: ProbeResult) {
        self.counts.0[result as usize].fetch_add(1, Ordering::Relaxed);
        let change = {
            let mut trackers = self.trackers.lock();
            let Some(t) = trackers.get_mut(index) else {
                return;
            };
            t.record(
                result == ProbeResult::Pass,
                self.check.unhealthy_threshold,
                self.check.healthy_threshold,
            )
        };
        let Some(healthy) = change else {
            return;
        };
        self.down[index].store(!healthy, Ordering::Relaxed);
        let endpoint = self.endpoints[index];
        if healthy {
            self.down_count.fetch_sub(1, Ordering::Relaxed);
            tracing::info!(cluster = %self.cluster, %endpoint, "endpoint passed its health check: back in");
        } else {
            self.down_count.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(cluster = %self.cluster, %endpoint, last = result.as_str(), "endpoint failed its health check: out of load balancing");
        }
    }
}

/// The node's checker: probes each cluster it is handed until that cluster is retired.
/// Runs as long as the control runtime does.
pub async fn run(mut clusters: mpsc::UnboundedReceiver<Arc<ClusterHealth>>) {
    let limit = Arc::new(Semaphore::new(MAX_PROBES_IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(cluster) = clusters.recv().await {
        let probe = {
            let kind = cluster.check.kind();
            let host: Arc<str> = cluster.cluster.as_str().into();
            let endpoints = cluster.endpoints.clone();
            move |index: usize| probe(kind.clone(), endpoints[index], host.clone())
        };
        tasks.spawn(check_cluster(
            Arc::downgrade(&cluster),
            limit.clone(),
            probe,
        ));
        while tasks.try_join_next().is_some() {}
    }
}

/// Up to a tenth of `interval`, at random.
fn jitter(interval: Duration) -> Duration {
    let tenth = u64::try_from(interval.as_millis() / 10).unwrap_or(u64::MAX);
    Duration::from_millis(rand::random_range(0..=tenth))
}

/// Probes every endpoint of `cluster` each interval, `probe(index)` telling whether endpoint
/// `index` passed, until the cluster is retired or dropped.
pub async fn check_cluster<P, F>(cluster: Weak<ClusterHealth>, limit: Arc<Semaphore>, probe: P)
where
    P: Fn(usize) -> F + Clone + Send + 'static,
    F: Future<Output = bool> + Send,
{
    let mut first = true;
    loop {
        let Some(interval) = cluster
            .upgrade()
            .filter(|c| !c.retired())
            .map(|c| c.check.interval)
        else {
            return;
        };
        // The first round soon after the cluster appears; then one interval apart.
        let wait = if first {
            jitter(interval)
        } else {
            interval + jitter(interval)
        };
        first = false;
        tokio::time::sleep(wait).await;
        let Some(c) = cluster.upgrade().filter(|c| !c.retired()) else {
            return;
        };
        let timeout = c.check.timeout;
        let mut round = tokio::task::JoinSet::new();
        for index in 0..c.endpoints.len() {
            let (probe, limit) = (probe.clone(), limit.clone());
            round.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let result = match tokio::time::timeout(timeout, probe(index)).await {
                    Ok(true) => ProbeResult::Pass,
                    Ok(false) => ProbeResult::Fail,
                    Err(_) => ProbeResult::Timeout,
                };
                (index, result)
            });
        }
        while let Some(done) = round.join_next().await {
            if let Ok((index, result)) = done {
                c.record(index, result);
            }
        }
    }
}

/// One probe of `endpoint`; `host` (the cluster's name) is the HTTP `Host`, as Envoy sends.
async fn probe(kind: HealthCheckKind, endpoint: SocketAddr, host: Arc<str>) -> bool {
    let Ok(stream) = TcpStream::connect(endpoint).await else {
        return false;
    };
    match kind {
        HealthCheckKind::Tcp => true,
        HealthCheckKind::Http(http) => probe_http(stream, &http, &host).await,
        HealthCheckKind::Grpc(grpc) => probe_grpc(stream, &grpc, &host).await,
    }
}

/// `GET path` over HTTP/1.1: passes when the status is one of `expect`.
async fn probe_http(stream: TcpStream, check: &HttpHealthCheck, host: &str) -> bool {
    let Ok((mut sender, conn)) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await
    else {
        return false;
    };
    let Ok(request) = http::Request::get(check.path.as_str())
        .header(http::header::HOST, host)
        .header(http::header::USER_AGENT, "flatmesh-health-check")
        .header(http::header::CONNECTION, "close")
        .body(http_body_util::Empty::<Bytes>::new())
    else {
        return false;
    };
    let response = sender.send_request(request);
    let status = drive(conn, response)
        .await
        .ok()
        .map(|r| r.status().as_u16());
    status.is_some_and(|s| check.expect.accepts(s))
}

/// `grpc.health.v1.Health/Check` over cleartext HTTP/2: passes when the answer is SERVING.
async fn probe_grpc(stream: TcpStream, check: &GrpcHealthCheck, host: &str) -> bool {
    let Ok((client, conn)) = h2::client::handshake(stream).await else {
        return false;
    };
    let call = async move {
        let mut client = client.ready().await.ok()?;
        let request = http::Request::post(format!("http://{host}/grpc.health.v1.Health/Check"))
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .body(())
            .ok()?;
        let (response, mut send) = client.send_request(request, false).ok()?;
        send.send_data(grpc_frame(&health_check_request(&check.service)), true)
            .ok()?;
        let response = response.await.ok()?;
        if response.status() != http::StatusCode::OK
            || response.headers().contains_key("grpc-status")
        {
            // Not gRPC, or a trailers-only answer: an error status (NOT_FOUND, UNIMPLEMENTED).
            return None;
        }
        let mut body = response.into_body();
        let mut bytes = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.ok()?;
            let _ = body.flow_control().release_capacity(chunk.len());
            bytes.extend_from_slice(&chunk);
            if bytes.len() > 64 * 1024 {
                return None;
            }
        }
        let trailers = body.trailers().await.ok()??;
        if trailers.get("grpc-status").map(|v| v.as_bytes()) != Some(b"0") {
            return None;
        }
        serving_status(&bytes)
    };
    drive(conn, call).await == Some(SERVING)
}

/// `call`'s outcome, driving `conn` (its connection) meanwhile. The connection is driven
/// here, not spawned, so a probe cut at its timeout leaves nothing behind. A connection
/// that ends (the server closed it after answering) may have handed `call` its answer in
/// the same turn: `call` then finishes with it, or with the error of the closed connection.
async fn drive<C: Future, F: Future>(conn: C, call: F) -> F::Output {
    tokio::pin!(call);
    tokio::select! {
        biased;
        out = &mut call => out,
        _ = conn => call.await,
    }
}

/// `HealthCheckResponse.ServingStatus.SERVING`.
const SERVING: u64 = 1;

/// A `HealthCheckRequest { service }` in protobuf (field 1, a string; omitted when empty).
pub fn health_check_request(service: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if !service.is_empty() {
        out.push(0x0a);
        put_varint(&mut out, service.len() as u64);
        out.extend_from_slice(service.as_bytes());
    }
    out
}

/// One gRPC message: uncompressed flag, 4-byte big-endian length, the message.
fn grpc_frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.extend_from_slice(&[0]);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out.freeze()
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.first()?;
        buf.advance(1);
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

/// The `status` (field 1) of the one `HealthCheckResponse` in a gRPC body; 0 (UNKNOWN) when
/// the field is absent, as protobuf decodes it; `None` when the body is not one message.
pub fn serving_status(body: &[u8]) -> Option<u64> {
    let (header, rest) = body.split_at_checked(5)?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if header[0] != 0 || rest.len() != len {
        return None;
    }
    let mut buf = rest;
    let mut status = 0;
    while !buf.is_empty() {
        let tag = get_varint(&mut buf)?;
        match (tag >> 3, tag & 7) {
            (1, 0) => status = get_varint(&mut buf)?,
            (_, 0) => {
                get_varint(&mut buf)?;
            }
            (_, 2) => {
                let n = usize::try_from(get_varint(&mut buf)?).ok()?;
                buf = buf.get(n..)?;
            }
            _ => return None,
        }
    }
    Some(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_count_consecutive_probes_only() {
        let mut t = Tracker::default();
        assert!(t.healthy, "an endpoint starts healthy");
        assert_eq!(t.record(false, 3, 2), None);
        assert_eq!(t.record(false, 3, 2), None);
        assert_eq!(t.record(true, 3, 2), None, "a pass breaks the streak");
        assert_eq!(t.record(false, 3, 2), None);
        assert_eq!(t.record(false, 3, 2), None);
        assert_eq!(t.record(false, 3, 2), Some(false));
        assert!(!t.healthy);
        assert_eq!(t.record(false, 3, 2), None, "already out");
        assert_eq!(t.record(true, 3, 2), None);
        assert_eq!(t.record(false, 3, 2), None, "a failure breaks the passes");
        assert_eq!(t.record(true, 3, 2), None);
        assert_eq!(t.record(true, 3, 2), Some(true));
        assert!(t.healthy);
        let mut once = Tracker::default();
        assert_eq!(once.record(false, 1, 1), Some(false));
        assert_eq!(once.record(true, 1, 1), Some(true));
    }

    #[test]
    fn grpc_messages_encode_and_decode() {
        assert_eq!(health_check_request(""), Vec::<u8>::new());
        assert_eq!(health_check_request("echo"), b"\x0a\x04echo".to_vec());
        assert_eq!(serving_status(b"\0\0\0\0\x02\x08\x01"), Some(SERVING));
        assert_eq!(
            serving_status(b"\0\0\0\0\x02\x08\x02"),
            Some(2),
            "NOT_SERVING"
        );
        assert_eq!(
            serving_status(b"\0\0\0\0\0"),
            Some(0),
            "UNKNOWN when absent"
        );
        assert_eq!(serving_status(b"\0\0\0\0\x03\x08\x01"), None, "cut short");
        assert_eq!(
            serving_status(b"\x01\0\0\0\x02\x08\x01"),
            None,
            "compressed"
        );
        assert_eq!(serving_status(b"\0\0\0"), None);
        // An unknown field before the status is skipped.
        assert_eq!(
            serving_status(b"\0\0\0\0\x06\x12\x02hi\x08\x01"),
            Some(SERVING)
        );
    }

    fn check(interval_ms: u64, timeout_ms: u64) -> HealthCheck {
        HealthCheck {
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_millis(timeout_ms),
            unhealthy_threshold: 2,
            healthy_threshold: 3,
            ..HealthCheck::new(HealthCheckKind::Tcp)
        }
    }

    fn addrs(n: u16) -> Vec<SocketAddr> {
        (0..n)
            .map(|i| SocketAddr::from(([127, 0, 0, 1], 9000 + i)))
            .collect()
    }

    /// The loop on the paused clock, with probes that answer as `passing` says (endpoint 2
    /// never answers at all): thresholds in rounds, timeouts counted, retirement stops it.
    #[tokio::test(start_paused = true)]
    async fn the_checker_moves_endpoints_out_and_in_by_rounds() {
        let counts = Arc::new(ProbeCounts::default());
        let c = ClusterHealth::new("c", &check(1000, 200), &addrs(3), counts.clone());
        let passing: Arc<[AtomicBool; 3]> = Arc::new([
            AtomicBool::new(true),
            AtomicBool::new(false),
            AtomicBool::new(true),
        ]);
        let probe = {
            let passing = passing.clone();
            move |i: usize| {
                let pass = passing[i].load(Ordering::Relaxed);
                async move {
                    if i == 2 {
                        std::future::pending::<()>().await;
                    }
                    pass
                }
            }
        };
        let task = tokio::spawn(check_cluster(
            Arc::downgrade(&c),
            Arc::new(Semaphore::new(MAX_PROBES_IN_FLIGHT)),
            probe,
        ));
        // Round 1 starts within 100 ms (jitter) and ends 200 ms later (the hung probe's
        // timeout); rounds are 1000–1100 ms + 200 ms apart.
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(counts.get(ProbeResult::Timeout), 1);
        assert!(!c.any_down(), "one failure of two: still in");
        tokio::time::sleep(Duration::from_millis(1400)).await;
        assert_eq!(counts.get(ProbeResult::Fail), 2);
        assert!(c.is_down(1) && c.is_down(2) && !c.is_down(0));
        assert_eq!(c.down(), 2);
        // Endpoint 1 recovers: out until its third pass.
        passing[1].store(true, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(2600)).await;
        assert!(c.is_down(1), "two passes of three");
        tokio::time::sleep(Duration::from_millis(1300)).await;
        assert!(!c.is_down(1) && c.is_down(2));
        assert_eq!(c.down(), 1);
        c.retire();
        tokio::time::sleep(Duration::from_millis(2600)).await;
        assert!(task.is_finished(), "a retired cluster is no longer probed");
    }
}
