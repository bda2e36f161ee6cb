//! A small closed-loop load generator: N HTTP/1.1 keep-alive connections, each
//! with one request in flight, walking the targets round robin, plus optional
//! paced TCP echo round trips. Every task keeps its own statistics and they are
//! merged once at the end, so nothing shared sits on the request path except two
//! relaxed counters for live progress.
//!
//! Reusable by benchmarks and tests: [`run`] needs only addresses and a [`Plan`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), flatmesh_lab::LabError> {
//! use std::{sync::Arc, time::Duration};
//! use flatmesh_lab::demo::load::{self, HttpTarget, Live, Plan};
//! let plan = Plan {
//!     http_addr: Some("127.0.0.1:8080".parse().expect("literal address")),
//!     targets: vec![HttpTarget {
//!         name: "api".into(),
//!         method: http::Method::GET,
//!         path: "/api/users".into(),
//!         expect_status: http::StatusCode::OK,
//!     }],
//!     connections: 8,
//!     tcp: None,
//!     duration: Duration::from_secs(5),
//! };
//! let results = load::run(&plan, Arc::new(Live::default())).await?;
//! println!("{} answers", results.http[0].ok());
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::demo::services::BACKEND_HEADER;
use crate::LabError;

/// Backend label for answers without an `x-backend` header (the proxy answered itself).
pub const NO_BACKEND: &str = "(proxy)";

/// Longest a single request or round trip may take before it counts as an error.
/// Bounds how long [`run`] can overrun its duration.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause after a failed connect, so a refused port does not become a busy loop.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(20);

/// Distinct error messages kept per route, for the report.
const ERROR_SAMPLES: usize = 3;

/// Latencies are recorded in microseconds, from 1 µs to one minute, 3 significant digits.
const HISTOGRAM_MAX_US: u64 = 60_000_000;

/// One kind of HTTP request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpTarget {
    /// Name used in results (usually the route name).
    pub name: String,
    pub method: Method,
    /// Path and query, e.g. `/api/users`.
    pub path: String,
    /// Any other status counts as an error.
    pub expect_status: StatusCode,
}

/// Paced TCP echo round trips on one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpPlan {
    pub addr: SocketAddr,
    /// Bytes per round trip (at least 1).
    pub payload: usize,
    /// Pause between round trips.
    pub interval: Duration,
}

/// What to send, where, for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Where HTTP requests go; `None` sends no HTTP.
    pub http_addr: Option<SocketAddr>,
    pub targets: Vec<HttpTarget>,
    /// Concurrent keep-alive connections (one request in flight each).
    pub connections: usize,
    pub tcp: Option<TcpPlan>,
    pub duration: Duration,
}

/// Live counters, read by a progress display while [`run`] works.
#[derive(Debug, Default)]
pub struct Live {
    completed: AtomicU64,
    errors: AtomicU64,
}

impl Live {
    /// Requests and round trips finished so far, including failed ones.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Failed requests and round trips so far.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    fn record(&self, ok: bool) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Outcome of one target (or of the TCP round trips).
#[derive(Debug, Clone)]
pub struct TargetResult {
    pub name: String,
    /// Latency of successful attempts, in microseconds.
    pub latency_us: Histogram<u64>,
    pub errors: u64,
    /// Successful answers per backend (`x-backend` value, or [`NO_BACKEND`]).
    pub backends: BTreeMap<String, u64>,
    /// The first few distinct error messages.
    pub error_samples: Vec<String>,
}

impl TargetResult {
    pub(crate) fn new(name: &str) -> Result<TargetResult, LabError> {
        Ok(TargetResult {
            name: name.to_string(),
            latency_us: new_histogram()?,
            errors: 0,
            backends: BTreeMap::new(),
            error_samples: Vec::new(),
        })
    }

    /// Successful attempts.
    pub fn ok(&self) -> u64 {
        self.latency_us.len()
    }

    /// All attempts, successful or not.
    pub fn attempts(&self) -> u64 {
        self.ok() + self.errors
    }

    fn success(&mut self, latency: Duration, backend: &str) {
        // Values beyond the histogram's range are clamped rather than lost.
        let us = (latency.as_micros() as u64).clamp(1, HISTOGRAM_MAX_US);
        self.latency_us.saturating_record(us);
        *self.backends.entry(backend.to_string()).or_default() += 1;
    }

    fn failure(&mut self, message: String) {
        self.errors += 1;
        if self.error_samples.len() < ERROR_SAMPLES && !self.error_samples.contains(&message) {
            self.error_samples.push(message);
        }
    }

    fn merge(&mut self, other: TargetResult) -> Result<(), LabError> {
        self.latency_us
            .add(&other.latency_us)
            .map_err(|e| LabError::Internal(format!("merging latency histograms: {e:?}")))?;
        self.errors += other.errors;
        for (backend, count) in other.backends {
            *self.backends.entry(backend).or_default() += count;
        }
        for message in other.error_samples {
            if self.error_samples.len() < ERROR_SAMPLES && !self.error_samples.contains(&message) {
                self.error_samples.push(message);
            }
        }
        Ok(())
    }
}

fn new_histogram() -> Result<Histogram<u64>, LabError> {
    Histogram::new_with_bounds(1, HISTOGRAM_MAX_US, 3)
        .map_err(|e| LabError::Internal(format!("creating a latency histogram: {e:?}")))
}

/// Everything [`run`] measured.
#[derive(Debug, Clone)]
pub struct Results {
    /// Wall time from the first request to the last answer.
    pub elapsed: Duration,
    /// One entry per target, in plan order.
    pub http: Vec<TargetResult>,
    pub tcp: Option<TargetResult>,
}

impl Plan {
    fn validate(&self) -> Result<(), LabError> {
        let bad = |why: &str| Err(LabError::InvalidPlan(why.to_string()));
        if self.duration.is_zero() {
            return bad("the duration is zero: give a duration of at least 1 second");
        }
        if self.http_addr.is_some() && self.targets.is_empty() {
            return bad("an HTTP address is set but there are no targets: add at least one target");
        }
        if self.http_addr.is_some() && !(1..=4096).contains(&self.connections) {
            return bad("connections must be between 1 and 4096");
        }
        if self.tcp.as_ref().is_some_and(|t| t.payload == 0) {
            return bad("the TCP payload is empty: give at least 1 byte");
        }
        if self.http_addr.is_none() && self.tcp.is_none() {
            return bad("the plan sends nothing: set an HTTP address or a TCP plan");
        }
        Ok(())
    }
}

/// Drive the plan's load until its duration is over, then return what was measured.
/// Finishes within `duration + ATTEMPT_TIMEOUT`.
pub async fn run(plan: &Plan, live: Arc<Live>) -> Result<Results, LabError> {
    plan.validate()?;
    let start = Instant::now();
    let deadline = start + plan.duration;
    let targets: Arc<[HttpTarget]> = plan.targets.clone().into();

    let mut http_tasks = Vec::new();
    if let Some(addr) = plan.http_addr {
        for id in 0..plan.connections {
            let worker = HttpWorker {
                addr,
                targets: Arc::clone(&targets),
                // Stagger the starting target so all targets get traffic from the start.
                next: id % targets.len(),
                deadline,
                live: Arc::clone(&live),
            };
            http_tasks.push(tokio::spawn(worker.run()));
        }
    }
    let tcp_task = plan
        .tcp
        .clone()
        .map(|tcp| tokio::spawn(tcp_worker(tcp, deadline, Arc::clone(&live))));

    let mut http = targets
        .iter()
        .map(|t| TargetResult::new(&t.name))
        .collect::<Result<Vec<_>, _>>()?;
    for task in http_tasks {
        let partial = task.await.map_err(join_error)??;
        for (total, part) in http.iter_mut().zip(partial) {
            total.merge(part)?;
        }
    }
    let tcp = match tcp_task {
        Some(task) => Some(task.await.map_err(join_error)??),
        None => None,
    };
    Ok(Results {
        elapsed: start.elapsed(),
        http,
        tcp,
    })
}

fn join_error(e: tokio::task::JoinError) -> LabError {
    LabError::Internal(format!("a load task stopped unexpectedly: {e}"))
}

struct HttpWorker {
    addr: SocketAddr,
    targets: Arc<[HttpTarget]>,
    next: usize,
    deadline: Instant,
    live: Arc<Live>,
}

impl HttpWorker {
    async fn run(mut self) -> Result<Vec<TargetResult>, LabError> {
        let mut results = self
            .targets
            .iter()
            .map(|t| TargetResult::new(&t.name))
            .collect::<Result<Vec<_>, _>>()?;
        let mut conn: Option<SendRequest<Empty<Bytes>>> = None;
        while Instant::now() < self.deadline {
            let index = self.next;
            self.next = (self.next + 1) % self.targets.len();
            let target = &self.targets[index];

            let sender = match conn.take() {
                Some(sender) => sender,
                None => match connect_http(self.addr).await {
                    Ok(sender) => sender,
                    Err(message) => {
                        results[index].failure(message);
                        self.live.record(false);
                        tokio::time::sleep(RECONNECT_BACKOFF).await;
                        continue;
                    }
                },
            };
            let started = Instant::now();
            let outcome = tokio::time::timeout(ATTEMPT_TIMEOUT, send(sender, target)).await;
            let outcome = outcome.unwrap_or_else(|_| {
                Err(format!(
                    "no answer within {ATTEMPT_TIMEOUT:?}: the proxy or backend is stuck"
                ))
            });
            match outcome {
                Ok(Answer {
                    sender,
                    backend,
                    closing,
                }) => {
                    results[index].success(started.elapsed(), &backend);
                    self.live.record(true);
                    // Reuse the connection only if the server keeps it open; sending
                    // on one it is closing would count a spurious error.
                    if !closing && !sender.is_closed() {
                        conn = Some(sender);
                    }
                }
                Err(message) => {
                    results[index].failure(message);
                    self.live.record(false);
                }
            }
        }
        Ok(results)
    }
}

async fn connect_http(addr: SocketAddr) -> Result<SendRequest<Empty<Bytes>>, String> {
    let connect = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect to {addr} failed: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP/1.1 handshake with {addr} failed: {e}"))?;
        // The connection task ends when the sender is dropped or the peer closes.
        tokio::spawn(connection);
        Ok(sender)
    };
    tokio::time::timeout(ATTEMPT_TIMEOUT, connect)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "connect to {addr} timed out after {ATTEMPT_TIMEOUT:?}"
            ))
        })
}

/// A complete, expected answer.
struct Answer {
    /// The connection, for reuse.
    sender: SendRequest<Empty<Bytes>>,
    /// Who answered: the `x-backend` value or [`NO_BACKEND`].
    backend: String,
    /// The server said `Connection: close`.
    closing: bool,
}

/// Send one request and read the whole answer.
async fn send(
    mut sender: SendRequest<Empty<Bytes>>,
    target: &HttpTarget,
) -> Result<Answer, String> {
    sender
        .ready()
        .await
        .map_err(|e| format!("connection closed before the request: {e}"))?;
    let request = Request::builder()
        .method(target.method.clone())
        .uri(target.path.as_str())
        .header(http::header::HOST, "demo.flatmesh.local")
        .body(Empty::new())
        .map_err(|e| format!("cannot build a request for `{}`: {e}", target.path))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    let status = response.status();
    let backend = response
        .headers()
        .get(BACKEND_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_else(|| NO_BACKEND.to_string());
    let closing = response
        .headers()
        .get_all(http::header::CONNECTION)
        .iter()
        .any(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading the response body failed: {e}"))?
        .to_bytes();
    if status != target.expect_status {
        let snippet = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        return Err(format!(
            "status {} (expected {}): {}",
            status.as_u16(),
            target.expect_status.as_u16(),
            snippet.trim()
        ));
    }
    Ok(Answer {
        sender,
        backend,
        closing,
    })
}

async fn tcp_worker(
    plan: TcpPlan,
    deadline: Instant,
    live: Arc<Live>,
) -> Result<TargetResult, LabError> {
    let mut result = TargetResult::new("tcp echo")?;
    let mut stream: Option<TcpStream> = None;
    let mut payload = vec![0u8; plan.payload];
    let mut echoed = vec![0u8; plan.payload];
    let mut round: u64 = 0;
    while Instant::now() < deadline {
        round += 1;
        // A different pattern each round, so a stale or misrouted echo is caught.
        for (i, byte) in payload.iter_mut().enumerate() {
            *byte = (round as usize).wrapping_add(i) as u8;
        }
        let mut current = match stream.take() {
            Some(s) => s,
            None => {
                match tokio::time::timeout(ATTEMPT_TIMEOUT, TcpStream::connect(plan.addr)).await {
                    Ok(Ok(s)) => {
                        let _ = s.set_nodelay(true);
                        s
                    }
                    Ok(Err(e)) => {
                        result.failure(format!("connect to {} failed: {e}", plan.addr));
                        live.record(false);
                        tokio::time::sleep(RECONNECT_BACKOFF).await;
                        continue;
                    }
                    Err(_) => {
                        result.failure(format!("connect to {} timed out", plan.addr));
                        live.record(false);
                        continue;
                    }
                }
            }
        };
        let started = Instant::now();
        let trip = async {
            current.write_all(&payload).await?;
            current.read_exact(&mut echoed).await?;
            Ok::<_, std::io::Error>(())
        };
        match tokio::time::timeout(ATTEMPT_TIMEOUT, trip).await {
            Ok(Ok(())) if echoed == payload => {
                result.success(started.elapsed(), "echo");
                live.record(true);
                stream = Some(current);
            }
            Ok(Ok(())) => {
                result.failure("the echo came back different from what was sent".into());
                live.record(false);
            }
            Ok(Err(e)) => {
                result.failure(format!("round trip failed: {e}"));
                live.record(false);
            }
            Err(_) => {
                result.failure(format!("no echo within {ATTEMPT_TIMEOUT:?}"));
                live.record(false);
            }
        }
        tokio::time::sleep(plan.interval).await;
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::demo::services::{spawn_echo, spawn_http, HttpVersions};
    use std::net::Ipv4Addr;

    fn target(name: &str, path: &str, status: StatusCode) -> HttpTarget {
        HttpTarget {
            name: name.into(),
            method: Method::GET,
            path: path.into(),
            expect_status: status,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn drives_a_local_backend_round_robin() -> Result<(), Box<dyn std::error::Error>> {
        let (addr, backend) = spawn_http("api-1", HttpVersions::Http1).await?;
        let (echo, echo_task) = spawn_echo().await?;
        let plan = Plan {
            http_addr: Some(addr),
            targets: vec![
                target("a", "/a", StatusCode::OK),
                target("b", "/b", StatusCode::OK),
            ],
            connections: 3,
            tcp: Some(TcpPlan {
                addr: echo,
                payload: 64,
                interval: Duration::from_millis(5),
            }),
            duration: Duration::from_millis(300),
        };
        let live = Arc::new(Live::default());
        let results = run(&plan, Arc::clone(&live)).await?;
        backend.abort();
        echo_task.abort();

        assert_eq!(results.http.len(), 2);
        let total: u64 = results.http.iter().map(|r| r.attempts()).sum();
        let tcp = results.tcp.ok_or("no tcp result")?;
        assert_eq!(live.completed(), total + tcp.attempts());
        assert_eq!(live.errors(), 0);
        for r in &results.http {
            assert!(r.ok() > 10, "{} got only {} answers", r.name, r.ok());
            assert_eq!(r.errors, 0, "{:?}", r.error_samples);
            assert_eq!(r.backends.get("api-1"), Some(&r.ok()));
        }
        // Round robin per connection: the two targets differ by at most one per connection.
        let (a, b) = (results.http[0].attempts(), results.http[1].attempts());
        assert!(a.abs_diff(b) <= plan.connections as u64, "{a} vs {b}");
        assert!(tcp.ok() > 5 && tcp.errors == 0, "{tcp:?}");
        assert!(results.elapsed >= plan.duration);
        assert!(results.elapsed < plan.duration + ATTEMPT_TIMEOUT);
        Ok(())
    }

    #[tokio::test]
    async fn unexpected_status_is_an_error_with_the_body() -> Result<(), Box<dyn std::error::Error>>
    {
        let (addr, backend) = spawn_http("api-1", HttpVersions::Http1).await?;
        let plan = Plan {
            http_addr: Some(addr),
            targets: vec![target("x", "/x", StatusCode::NOT_FOUND)],
            connections: 1,
            tcp: None,
            duration: Duration::from_millis(50),
        };
        let results = run(&plan, Arc::new(Live::default())).await?;
        backend.abort();
        let r = &results.http[0];
        assert_eq!(r.ok(), 0);
        assert!(r.errors > 0);
        assert_eq!(
            r.error_samples,
            vec!["status 200 (expected 404): hello from api-1".to_string()]
        );
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn server_closing_each_connection_costs_no_errors(
    ) -> Result<(), Box<dyn std::error::Error>> {
        // A backend that answers one request per connection, then closes it.
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(Bytes::from_static(b"bye")),
                        ))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let plan = Plan {
            http_addr: Some(addr),
            targets: vec![target("x", "/x", StatusCode::OK)],
            connections: 2,
            tcp: None,
            duration: Duration::from_millis(200),
        };
        let results = run(&plan, Arc::new(Live::default())).await?;
        server.abort();
        let r = &results.http[0];
        assert!(r.ok() > 5, "{r:?}");
        assert_eq!(r.errors, 0, "{:?}", r.error_samples);
        assert_eq!(r.backends.get(NO_BACKEND), Some(&r.ok()));
        Ok(())
    }

    #[tokio::test]
    async fn a_silent_server_times_out_and_bounds_the_run() -> Result<(), Box<dyn std::error::Error>>
    {
        // Accepts connections and never answers.
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let plan = Plan {
            http_addr: Some(addr),
            targets: vec![target("x", "/x", StatusCode::OK)],
            connections: 1,
            tcp: None,
            duration: Duration::from_millis(100),
        };
        let results = run(&plan, Arc::new(Live::default())).await?;
        server.abort();
        let r = &results.http[0];
        assert_eq!((r.ok(), r.errors), (0, 1));
        assert!(
            r.error_samples[0].starts_with("no answer within 2s"),
            "{r:?}"
        );
        assert!(results.elapsed >= ATTEMPT_TIMEOUT);
        assert!(results.elapsed < plan.duration + ATTEMPT_TIMEOUT + Duration::from_millis(500));
        Ok(())
    }

    #[tokio::test]
    async fn a_wrong_echo_is_an_error() -> Result<(), Box<dyn std::error::Error>> {
        // Answers every read with the same number of zero bytes.
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            if let Ok((mut stream, _)) = listener.accept().await {
                let mut buf = [0u8; 256];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    if stream.write_all(&vec![0u8; n]).await.is_err() {
                        break;
                    }
                }
            }
        });
        let plan = Plan {
            http_addr: None,
            targets: vec![],
            connections: 0,
            tcp: Some(TcpPlan {
                addr,
                payload: 16,
                interval: Duration::from_millis(10),
            }),
            duration: Duration::from_millis(100),
        };
        let results = run(&plan, Arc::new(Live::default())).await?;
        server.abort();
        let tcp = results.tcp.ok_or("no tcp result")?;
        assert_eq!(tcp.ok(), 0);
        assert!(tcp.errors >= 1);
        assert_eq!(
            tcp.error_samples[0],
            "the echo came back different from what was sent"
        );
        Ok(())
    }

    #[tokio::test]
    async fn refused_port_counts_errors_without_spinning() -> Result<(), Box<dyn std::error::Error>>
    {
        // Bind then drop a listener to get a port that refuses connections.
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        drop(listener);
        let plan = Plan {
            http_addr: Some(addr),
            targets: vec![target("x", "/x", StatusCode::OK)],
            connections: 1,
            tcp: None,
            duration: Duration::from_millis(200),
        };
        let results = run(&plan, Arc::new(Live::default())).await?;
        let r = &results.http[0];
        assert!(r.errors >= 1);
        // The backoff bounds the attempts: 200 ms / 20 ms, plus one.
        assert!(r.errors <= 11, "{} attempts", r.errors);
        assert!(
            r.error_samples[0].contains("connect to"),
            "{:?}",
            r.error_samples
        );
        Ok(())
    }

    #[tokio::test]
    async fn bad_plans_are_refused() {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 1));
        let good = Plan {
            http_addr: Some(addr),
            targets: vec![target("x", "/x", StatusCode::OK)],
            connections: 1,
            tcp: None,
            duration: Duration::from_secs(1),
        };
        let cases = [
            Plan {
                duration: Duration::ZERO,
                ..good.clone()
            },
            Plan {
                targets: vec![],
                ..good.clone()
            },
            Plan {
                connections: 0,
                ..good.clone()
            },
            Plan {
                http_addr: None,
                ..good.clone()
            },
            Plan {
                tcp: Some(TcpPlan {
                    addr,
                    payload: 0,
                    interval: Duration::ZERO,
                }),
                ..good.clone()
            },
        ];
        for plan in cases {
            let result = run(&plan, Arc::new(Live::default())).await;
            assert!(matches!(result, Err(LabError::InvalidPlan(_))), "{plan:?}");
        }
    }

    #[test]
    fn merge_adds_counts_and_keeps_few_samples() -> Result<(), LabError> {
        let mut a = TargetResult::new("t")?;
        let mut b = TargetResult::new("t")?;
        a.success(Duration::from_micros(100), "api-1");
        b.success(Duration::from_micros(300), "api-1");
        b.success(Duration::from_micros(200), "api-2");
        for i in 0..5 {
            a.failure(format!("e{i}"));
        }
        b.failure("e0".into());
        b.failure("other".into());
        a.merge(b)?;
        assert_eq!(a.ok(), 3);
        assert_eq!(a.errors, 7);
        assert_eq!(a.backends["api-1"], 2);
        assert_eq!(a.backends["api-2"], 1);
        assert_eq!(a.error_samples, vec!["e0", "e1", "e2"]);
        assert_eq!(a.latency_us.max(), 300);
        Ok(())
    }

    #[test]
    fn out_of_range_latency_is_clamped_not_lost() -> Result<(), LabError> {
        let mut r = TargetResult::new("t")?;
        r.success(Duration::ZERO, "a");
        r.success(Duration::from_secs(3600), "a");
        assert_eq!(r.ok(), 2);
        assert!(r.latency_us.max() >= HISTOGRAM_MAX_US - HISTOGRAM_MAX_US / 1000);
        Ok(())
    }
}
