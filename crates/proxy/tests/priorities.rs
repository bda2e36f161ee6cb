//! Endpoint weights, priorities, locality and slow start (issue 17 item 7) against real
//! backends that are killed and brought back on purpose; and the issue's first check: one of
//! three endpoints killed under load.
//!
//! The node runs its workers and its health checker on runtimes of their own threads, so
//! tokio's paused clock cannot drive it from a test: these run on the wall clock with 100 ms
//! health-check intervals. The priority-load arithmetic, the weighted schedules and the
//! slow-start ramp are tested on the paused clock in `crates/proxy/src/lb.rs` and
//! `crates/proxy/src/lb/`.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Response;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A backend that can be killed (its port closed, its connections cut) and brought back on
/// the same address. Answers 200 naming itself in `x-backend`; counts what it served.
struct Killable {
    name: &'static str,
    addr: SocketAddr,
    hits: Arc<AtomicU64>,
    task: Option<JoinHandle<()>>,
}

impl Killable {
    async fn start(name: &'static str) -> Killable {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut k = Killable {
            name,
            addr: listener.local_addr().unwrap(),
            hits: Arc::default(),
            task: None,
        };
        k.serve(listener);
        k
    }

    fn serve(&mut self, listener: TcpListener) {
        let (name, hits) = (self.name, self.hits.clone());
        self.task = Some(tokio::spawn(async move {
            // Dropped with the task: a kill cuts every open connection too.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let hits = hits.clone();
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    if req.uri().path() != "/healthz" {
                        hits.fetch_add(1, Ordering::Relaxed);
                    }
                    async move {
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("x-backend", name)
                                .body(Full::new(Bytes::from_static(b"ok\n")))
                                .unwrap(),
                        )
                    }
                });
                conns.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        }));
    }

    fn kill(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }

    async fn revive(&mut self) {
        // The aborted task drops its listener at its next poll: retry the bind briefly.
        for _ in 0..100 {
            if let Ok(listener) = TcpListener::bind(self.addr).await {
                self.serve(listener);
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{} could not bind {} again", self.name, self.addr);
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

impl Drop for Killable {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A node with one http listener sending everything to cluster `pool` (written by `cluster`,
/// a YAML block under `clusters:`), retrying connect failures and resets on another endpoint.
fn config(admin: SocketAddr, web: SocketAddr, node: &str, cluster: &str) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
{node}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: pool
        timeout: 5s
        retries: {{ attempts: 2, on: [ connect-failure, reset, gateway-error ] }}
clusters:
  - name: pool
{cluster}
"#
    )
}

/// A TCP health check that notices a killed backend in ~200 ms and a revived one in ~200 ms.
const CHECK: &str =
    "health_check: { tcp: {}, interval: 100ms, timeout: 500ms, unhealthy_threshold: 2, healthy_threshold: 2 }";

/// The share of `pool`'s traffic priority `p` takes now, per `/metrics`.
async fn load(node: &TestNode, p: u32) -> f64 {
    let label = format!("priority=\"{p}\"");
    metric(
        node,
        "flatmesh_lb_level_load_percent",
        &["cluster=\"pool\"", label.as_str()],
    )
    .await
}

async fn unhealthy(node: &TestNode) -> f64 {
    metric(
        node,
        "flatmesh_health_unhealthy_endpoints",
        &["cluster=\"pool\""],
    )
    .await
}

/// `n` sequential GETs: who answered with what status (`(proxy)` when no backend did).
async fn tally_of(web: SocketAddr, n: usize) -> BTreeMap<(String, u16), usize> {
    let client = h1_client();
    let mut out = BTreeMap::new();
    for i in 0..n {
        let resp = get(&client, &format!("http://{web}/r/{i}"), &[]).await;
        let who = resp.backend().unwrap_or("(proxy)").to_owned();
        *out.entry((who, resp.status.as_u16())).or_insert(0) += 1;
    }
    out
}

fn answered_by(t: &BTreeMap<(String, u16), usize>, who: &str) -> usize {
    t.iter()
        .filter(|((w, s), _)| w == who && *s == 200)
        .map(|(_, n)| n)
        .sum()
}

fn failed(t: &BTreeMap<(String, u16), usize>) -> usize {
    t.iter()
        .filter(|((_, s), _)| *s != 200)
        .map(|(_, n)| n)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_split_traffic_three_to_one() {
    let a = Killable::start("a").await;
    let b = Killable::start("b").await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        "",
        &format!(
            "    endpoints: [ {{ address: {}, weight: 3 }}, {} ]",
            a.addr, b.addr
        ),
    ));
    let t = tally_of(web, 4000).await;
    let (to_a, to_b) = (answered_by(&t, "a"), answered_by(&t, "b"));
    assert_eq!(failed(&t), 0, "{t:?}");
    // Round robin over a 3:1 schedule is exact per worker; two workers each start at
    // their own place in it, so allow a few requests either way.
    assert!(
        (2950..=3050).contains(&to_a) && to_a + to_b == 4000,
        "weights 3:1 over 4000 requests gave a {to_a}, b {to_b}"
    );
    node.assert_alive("after the weighted run").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn priority_zero_down_fails_over_to_priority_one_and_back() {
    let mut a = Killable::start("a").await;
    let mut b = Killable::start("b").await;
    let c = Killable::start("c").await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        "",
        &format!(
            "    endpoints: [ {}, {}, {{ address: {}, priority: 1 }} ]\n    {CHECK}",
            a.addr, b.addr, c.addr
        ),
    ));
    // All healthy: priority 1 is idle.
    let t = tally_of(web, 200).await;
    assert_eq!(answered_by(&t, "c"), 0, "{t:?}");
    assert_eq!(answered_by(&t, "a") + answered_by(&t, "b"), 200, "{t:?}");
    assert_eq!(load(&node, 0).await, 100.0);

    a.kill();
    b.kill();
    assert!(
        eventually(Duration::from_secs(10), || async {
            load(&node, 1).await == 100.0
        })
        .await,
        "priority 1 never took the traffic: {}",
        node.metrics().await
    );
    assert_eq!(
        metric(
            &node,
            "flatmesh_lb_level_healthy_endpoints",
            &["cluster=\"pool\"", "priority=\"0\""]
        )
        .await,
        0.0
    );
    let sent = 500;
    let t = tally_of(web, sent).await;
    let lost = failed(&t);
    println!(
        "FAULT-SURVIVED | priority 0 down, failover to priority 1 | sent {sent} | failed {lost}"
    );
    assert_eq!(lost, 0, "{t:?}");
    assert_eq!(answered_by(&t, "c"), sent, "{t:?}");

    // Back: once both pass their checks, priority 0 takes everything again.
    a.revive().await;
    b.revive().await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            load(&node, 0).await == 100.0 && unhealthy(&node).await == 0.0
        })
        .await,
        "priority 0 never came back: {}",
        node.metrics().await
    );
    let before = c.hits();
    let t = tally_of(web, 200).await;
    assert_eq!(failed(&t), 0, "{t:?}");
    assert_eq!(c.hits(), before, "priority 1 still got traffic: {t:?}");
    assert!(
        answered_by(&t, "a") >= 60 && answered_by(&t, "b") >= 60,
        "{t:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_nodes_own_locality_is_preferred_then_the_nearest() {
    let mut a = Killable::start("a").await;
    let b = Killable::start("b").await;
    let c = Killable::start("c").await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        "node: { locality: us-east1/b }",
        &format!(
            "    endpoints: [ {{ address: {}, locality: eu-west1/a }}, {{ address: {}, locality: us-east1/c }}, {{ address: {}, locality: us-east1/b }} ]\n    {CHECK}",
            c.addr, b.addr, a.addr
        ),
    ));
    let t = tally_of(web, 200).await;
    assert_eq!(answered_by(&t, "a"), 200, "the local endpoint first: {t:?}");
    // The local one down: the same region, never the other continent.
    a.kill();
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "a never went out"
    );
    let t = tally_of(web, 200).await;
    assert_eq!(failed(&t), 0, "{t:?}");
    assert_eq!(answered_by(&t, "b"), 200, "the same region next: {t:?}");
    assert_eq!(c.hits(), 0);
}

/// The issue's first check: three endpoints, one killed under load; after detection zero
/// failed requests (retries, then the health check and outlier detection take it out); it
/// comes back and gets traffic again after passing its health checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_three_endpoints_killed_under_load() {
    let a = Killable::start("a").await;
    let mut b = Killable::start("b").await;
    let c = Killable::start("c").await;
    let (admin, web) = (free_addr(), free_addr());
    let node = Arc::new(TestNode::start(&config(
        admin,
        web,
        "",
        &format!(
            "    endpoints: [ {}, {}, {} ]\n    {CHECK}\n    outlier_detection: {{ consecutive_connect_failures: 1, base_ejection_time: 1s, max_ejection_percent: 50 }}",
            a.addr, b.addr, c.addr
        ),
    )));

    // Load: four clients sending back to back; each result is tagged with whether the
    // node had taken b out when the request was sent.
    let stop = Arc::new(AtomicBool::new(false));
    let detected = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, detected) = (stop.clone(), detected.clone());
        load.push(tokio::spawn(async move {
            let client = h1_client();
            let (mut sent, mut failed, mut sent_after, mut failed_after) = (0, 0, 0, 0);
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let after = detected.load(Ordering::Relaxed);
                i += 1;
                let ok = matches!(
                    send(&client, get_req(&format!("http://{web}/load/{i}"))).await,
                    Ok(r) if r.status == 200
                );
                sent += 1;
                failed += usize::from(!ok);
                if after {
                    sent_after += 1;
                    failed_after += usize::from(!ok);
                }
            }
            (sent, failed, sent_after, failed_after)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.kill();
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "b never went out"
    );
    detected.store(true, Ordering::Relaxed);
    let b_hits = b.hits();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(b.hits(), b_hits, "a dead endpoint cannot answer");

    // b comes back: after passing its checks it gets its share again, still under load.
    b.revive().await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 0.0
        })
        .await,
        "b never came back"
    );
    assert!(
        eventually(Duration::from_secs(10), || async { b.hits() > b_hits + 50 }).await,
        "b passed its checks but got no traffic ({} since it came back)",
        b.hits() - b_hits
    );
    stop.store(true, Ordering::Relaxed);
    let (mut sent, mut lost, mut sent_after, mut lost_after) = (0, 0, 0, 0);
    for task in load {
        let (s, f, sa, fa) = task.await.unwrap();
        sent += s;
        lost += f;
        sent_after += sa;
        lost_after += fa;
    }
    println!(
        "FAULT-SURVIVED | one of three endpoints killed under load | sent {sent_after} | failed {lost_after}"
    );
    assert!(
        sent_after > 500,
        "too little load after detection: {sent_after}"
    );
    assert_eq!(lost_after, 0, "failed after detection");
    // Before detection, retries on another endpoint cover the dead one too.
    assert_eq!(lost, 0, "{lost} of {sent} failed before detection");
    assert!(a.hits() > 100 && c.hits() > 100);
}

/// Slow start: an endpoint that passes its health check again gets a small share at first
/// and its full share once the window is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_returning_endpoint_ramps_up_over_the_slow_start_window() {
    let a = Killable::start("a").await;
    let mut b = Killable::start("b").await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        "",
        &format!(
            "    endpoints: [ {}, {} ]\n    {CHECK}\n    slow_start: {{ window: 4s, min_weight_percent: 5 }}",
            a.addr, b.addr
        ),
    ));
    let t = tally_of(web, 200).await;
    assert_eq!(
        answered_by(&t, "b"),
        100,
        "no ramp for the endpoints a cluster starts with: {t:?}"
    );
    b.kill();
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "b never went out"
    );
    tally_of(web, 20).await; // the balancer sees b out
    b.revive().await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 0.0
        })
        .await,
        "b never came back"
    );
    // Shares per window quarter: the first is well under b's half, the last after the
    // window is back to it.
    let early = tally_of(web, 400).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let middle = tally_of(web, 400).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = tally_of(web, 400).await;
    let share = |t: &BTreeMap<(String, u16), usize>| answered_by(t, "b") as f64 / 400.0;
    let (early, middle, after) = (share(&early), share(&middle), share(&after));
    println!("slow start: b's share {early:.2} → {middle:.2} → {after:.2}");
    assert!(early < 0.25, "b got {early:.2} right after coming back");
    assert!(
        middle > early,
        "b's share did not grow: {early:.2} → {middle:.2}"
    );
    assert!(
        (0.45..=0.55).contains(&after),
        "b's share after the window: {after:.2}"
    );
}
