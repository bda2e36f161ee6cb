//! The demo's load: open-loop HTTP requests to the API gateway through the node proxies'
//! entrances, at a rate that follows a schedule, bounded in time and in concurrency.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::sync::Semaphore;

/// Requests in flight at most; past it the generator sheds (counted, never queued unbounded).
const MAX_IN_FLIGHT: usize = 512;
/// Failures kept as examples for the report.
const EXAMPLES: usize = 8;

#[derive(Debug, Default)]
pub struct LoadStats {
    pub sent: AtomicU64,
    pub ok: AtomicU64,
    /// 429 from the gateway's rate limiter: the limiter working, not a failure.
    pub limited: AtomicU64,
    pub failed: AtomicU64,
    /// Not sent because MAX_IN_FLIGHT requests were outstanding.
    pub shed: AtomicU64,
    /// Latencies (µs) of successful requests since the last `take_latencies`.
    latencies: Mutex<Vec<u32>>,
    pub failures: Mutex<Vec<String>>,
}

impl LoadStats {
    /// (p50, p99) in ms of the window, and clears it.
    pub fn take_percentiles(&self) -> Option<(f64, f64)> {
        let mut v = std::mem::take(&mut *self.latencies.lock());
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let at = |q: f64| f64::from(v[((v.len() - 1) as f64 * q) as usize]) / 1000.0;
        Some((at(0.5), at(0.99)))
    }
}

#[derive(Debug, Clone)]
pub struct LoadPlan {
    pub entrances: Vec<SocketAddr>,
    pub duration: Duration,
    /// Requests/s of the well-behaved clients before `step_at`, and after.
    pub low_rps: u32,
    pub high_rps: u32,
    pub step_at: Duration,
    /// One client that sends this much more than the gateway's limit allows, all along.
    pub greedy_rps: u32,
    pub clients: u32,
}

impl LoadPlan {
    pub fn rate_at(&self, t: Duration) -> u32 {
        if t < self.step_at {
            self.low_rps
        } else {
            self.high_rps
        }
    }
}

/// Sends until the plan's duration is over or `stop` is set, then waits (bounded) for outstanding
/// requests.
pub async fn run(plan: LoadPlan, stats: Arc<LoadStats>, stop: Arc<AtomicBool>) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut due, mut due_greedy) = (0.0f64, 0.0f64);
    let mut n: u64 = 0;
    let mut last = Duration::ZERO;
    while start.elapsed() < plan.duration && !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let now = start.elapsed();
        let dt = (now - last).as_secs_f64();
        last = now;
        due += f64::from(plan.rate_at(now)) * dt;
        due_greedy += f64::from(plan.greedy_rps) * dt;
        while due >= 1.0 || due_greedy >= 1.0 {
            let client_id = if due_greedy >= 1.0 {
                due_greedy -= 1.0;
                "greedy".to_string()
            } else {
                due -= 1.0;
                format!("c{}", n % u64::from(plan.clients.max(1)))
            };
            n += 1;
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                stats.shed.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let entrance = plan.entrances[(n as usize) % plan.entrances.len()];
            let url = format!(
                "http://{entrance}/api/event?client={client_id}&key=k{}&value={}",
                n % 64,
                n % 1000
            );
            let client = client.clone();
            let stats = stats.clone();
            stats.sent.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                one(&client, &url, &stats).await;
                drop(permit);
            });
        }
    }
    // Outstanding requests finish (each has its own timeout), bounded.
    let _ = tokio::time::timeout(
        Duration::from_secs(15),
        slots.acquire_many(MAX_IN_FLIGHT as u32),
    )
    .await;
}

async fn one(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    url: &str,
    stats: &LoadStats,
) {
    let started = Instant::now();
    let fail = |why: String| {
        stats.failed.fetch_add(1, Ordering::Relaxed);
        let mut f = stats.failures.lock();
        if f.len() < EXAMPLES {
            f.push(why);
        }
    };
    let Ok(req) = http::Request::get(url).body(Full::new(Bytes::new())) else {
        return fail(format!("{url}: cannot build the request"));
    };
    match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
        Ok(Ok(resp)) => {
            let status = resp.status();
            let body = resp.into_body().collect().await.map(|b| b.to_bytes());
            match (status.as_u16(), body) {
                (200, Ok(_)) => {
                    stats.ok.fetch_add(1, Ordering::Relaxed);
                    let us = u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX);
                    stats.latencies.lock().push(us);
                }
                (429, Ok(_)) => {
                    stats.limited.fetch_add(1, Ordering::Relaxed);
                }
                (s, Ok(b)) => fail(format!("{url}: {s} {}", String::from_utf8_lossy(&b).trim())),
                (s, Err(e)) => fail(format!("{url}: {s}, body: {e}")),
            }
        }
        Ok(Err(e)) => fail(format!("{url}: {e}")),
        Err(_) => fail(format!("{url}: no answer in 10 s")),
    }
}
