//! Circuit breaking and outlier detection (issue 17 items 1 and 2) against real backends
//! that misbehave on purpose: one that hangs, one that always answers 503, one that is not
//! there at all.
//!
//! The node runs its workers on runtimes of their own threads, so tokio's paused clock
//! cannot drive it from a test: the ejection tests run on the wall clock with short ejection
//! times (1–2 s) and phases that take a few milliseconds of local requests, so the bounds
//! are generous. The ejection-time arithmetic itself is tested on the paused clock in
//! `crates/proxy/src/resilience/outlier.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::backends::{HttpBackend, Proto};
use common::*;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A backend that answers every request with `status`, naming itself in `x-backend`.
struct Fixed {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Fixed {
    async fn start(name: &'static str, status: u16) -> Fixed {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let service = service_fn(move |_req| async move {
                    Ok::<_, Infallible>(
                        Response::builder()
                            .status(status)
                            .header("x-backend", name)
                            .body(Full::new(Bytes::from_static(b"sick\n")))
                            .unwrap(),
                    )
                });
                conns.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Fixed { addr, task }
    }
}

impl Drop for Fixed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn config(admin: SocketAddr, web: SocketAddr, endpoints: &[SocketAddr], cluster: &str) -> String {
    let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
    format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: pool
        timeout: 30s
clusters:
  - name: pool
    endpoints: [ {endpoints} ]
{cluster}
"#,
        endpoints = endpoints.join(", ")
    )
}

/// `n` sequential GETs; who answered each and with what status.
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

fn count_status(t: &BTreeMap<(String, u16), usize>, status: u16) -> usize {
    t.iter()
        .filter(|((_, s), _)| *s == status)
        .map(|(_, n)| n)
        .sum()
}

/// The test process's resident set (the node runs in it), from /proc.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hanging_backend_gets_max_requests_and_the_rest_overflow_at_once() {
    let hang = HttpBackend::start("hang", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[hang.addr],
        "    circuit_breaker: { max_requests: 4 }",
    ));
    // Four requests the backend holds for 7 s: the refused ones below take milliseconds.
    let mut held = Vec::new();
    for i in 0..4 {
        held.push(tokio::spawn(async move {
            let client = h1_client();
            get(
                &client,
                &format!("http://{web}/held/{i}"),
                &[("x-delay-ms", "7000")],
            )
            .await
        }));
    }
    let holding = Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || async { hang.conns() >= 4 }).await,
        "the four held requests reached the backend"
    );
    // The fifth, and 2,000 more, are answered at once with the overflow, not queued: the
    // node's memory stays flat (its budget in use, and the process's resident set), measured
    // from after the fifth, once the client's own connection and its buffers exist.
    let mut budget_before = 0.0;
    let mut rss_before = 0;
    let client = h1_client();
    for i in 0..2001 {
        if i == 1 {
            budget_before = metric(&node, "flatmesh_memory_budget_used_bytes", &[]).await;
            rss_before = resident_bytes();
        }
        let started = Instant::now();
        let resp = get(&client, &format!("http://{web}/more/{i}"), &[]).await;
        assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE, "{resp:?}");
        assert_eq!(
            resp.header("x-flatmesh-overflow"),
            Some("requests"),
            "{resp:?}"
        );
        assert!(resp.body.contains("max_requests"), "{}", resp.body);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "request {i} waited {:?}: queued instead of refused",
            started.elapsed()
        );
    }
    assert_eq!(hang.conns(), 4, "no refused request reached the backend");
    let budget_after = metric(&node, "flatmesh_memory_budget_used_bytes", &[]).await;
    assert!(
        budget_after <= budget_before + 64.0 * 1024.0,
        "the node's memory budget in use grew from {budget_before} to {budget_after} bytes"
    );
    let grown = resident_bytes().saturating_sub(rss_before);
    assert!(
        grown < 16 << 20,
        "the process grew by {grown} bytes over 2,001 refused requests"
    );
    println!(
        "FAULT-SURVIVED | a backend that hangs: 4 requests held (max_requests 4), 2,001 more answered 503 overflow at once, memory flat | sent 2005 | failed 0"
    );
    assert!(
        holding.elapsed() < Duration::from_secs(5),
        "the refusals took {:?}: the held requests may have ended meanwhile",
        holding.elapsed()
    );
    // What is outstanding stays at the limit: nothing piled up.
    let open = |kind: &'static str| {
        let node = &node;
        async move {
            metric(
                node,
                "flatmesh_upstream_breaker_open",
                &["cluster=\"pool\"", &format!("kind=\"{kind}\"")],
            )
            .await
        }
    };
    assert_eq!(open("requests").await, 4.0);
    assert_eq!(open("pending").await, 0.0);
    assert_eq!(open("connections").await, 4.0);
    assert_eq!(
        metric(
            &node,
            "flatmesh_upstream_overflows_total",
            &["cluster=\"pool\"", "kind=\"requests\""]
        )
        .await,
        2001.0
    );
    // The held requests end: their places free up and requests go through again.
    for h in held {
        assert_eq!(h.await.unwrap().status, StatusCode::OK);
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            open("requests").await == 0.0
        })
        .await,
        "the finished requests gave their places back"
    );
    let resp = get(&client, &format!("http://{web}/after"), &[]).await;
    assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_connections_refuses_new_connections_over_the_limit() {
    let hang = HttpBackend::start("hang", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[hang.addr],
        "    circuit_breaker: { max_connections: 2 }",
    ));
    let mut held = Vec::new();
    for i in 0..2 {
        held.push(tokio::spawn(async move {
            let client = h1_client();
            get(
                &client,
                &format!("http://{web}/held/{i}"),
                &[("x-delay-ms", "60000")],
            )
            .await
        }));
    }
    assert!(eventually(Duration::from_secs(5), || async { hang.conns() >= 2 }).await);
    let resp = get(&h1_client(), &format!("http://{web}/third"), &[]).await;
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE, "{resp:?}");
    assert_eq!(resp.header("x-flatmesh-overflow"), Some("connections"));
    assert_eq!(
        metric(
            &node,
            "flatmesh_upstream_overflows_total",
            &["cluster=\"pool\"", "kind=\"connections\""]
        )
        .await,
        1.0
    );
    for h in held {
        h.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_over_max_retries_is_not_made() {
    let bad = Fixed::start("bad", 503).await;
    let (admin, web) = (free_addr(), free_addr());
    let yaml = config(
        admin,
        web,
        &[bad.addr],
        "    circuit_breaker: { max_retries: 0 }",
    )
    .replace(
        "        timeout: 30s",
        "        timeout: 30s\n        retries: { attempts: 2, on: [ 5xx ] }",
    );
    let node = TestNode::start(&yaml);
    let resp = get(&h1_client(), &format!("http://{web}/"), &[]).await;
    // The original answer goes back, untried again.
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(resp.backend(), Some("bad"), "the endpoint's own answer");
    assert_eq!(resp.header("x-flatmesh-overflow"), None);
    let retries = metric(
        &node,
        "flatmesh_upstream_retries_total",
        &["cluster=\"pool\""],
    )
    .await;
    assert_eq!(retries, 0.0);
    assert_eq!(
        metric(
            &node,
            "flatmesh_upstream_overflows_total",
            &["cluster=\"pool\"", "kind=\"retries\""]
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_endpoint_that_always_answers_503_is_ejected_then_readmitted() {
    let good0 = HttpBackend::start("good0", Proto::H1).await;
    let good1 = HttpBackend::start("good1", Proto::H1).await;
    let bad = Fixed::start("bad", 503).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[good0.addr, bad.addr, good1.addr],
        "    outlier_detection: { consecutive_5xx: 3, base_ejection_time: 2s, max_ejection_percent: 50 }",
    ));
    // Until the third consecutive 503, the bad endpoint gets its share.
    let client = h1_client();
    let mut before = 0;
    for i in 0..100 {
        let resp = get(&client, &format!("http://{web}/before/{i}"), &[]).await;
        if resp.status == StatusCode::SERVICE_UNAVAILABLE {
            before += 1;
            if before == 3 {
                break;
            }
        }
    }
    assert_eq!(before, 3, "the bad endpoint answered three times");
    let ejected_at = Instant::now();
    // Ejected: every request goes to the other two (the phase takes milliseconds, well
    // inside the 2 s ejection).
    let after = tally_of(web, 60).await;
    assert!(
        ejected_at.elapsed() < Duration::from_millis(1500),
        "the phase outlasted the ejection: {:?}",
        ejected_at.elapsed()
    );
    assert_eq!(count_status(&after, 503), 0, "{after:?}");
    assert_eq!(count_status(&after, 200), 60, "{after:?}");
    assert!(
        after.contains_key(&("good0".into(), 200)) && after.contains_key(&("good1".into(), 200)),
        "both healthy endpoints served: {after:?}"
    );
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejections_total",
            &["cluster=\"pool\"", "reason=\"consecutive_5xx\""]
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejected_endpoints",
            &["cluster=\"pool\""]
        )
        .await,
        1.0
    );
    // After the ejection time it is back and gets traffic (and its 503s) again.
    tokio::time::sleep(Duration::from_millis(2100).saturating_sub(ejected_at.elapsed())).await;
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejected_endpoints",
            &["cluster=\"pool\""]
        )
        .await,
        0.0
    );
    let back = tally_of(web, 2).await;
    let back_more = tally_of(web, 6).await;
    assert!(
        count_status(&back, 503) + count_status(&back_more, 503) > 0,
        "re-admitted: {back:?} {back_more:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_ejection_percent_keeps_the_second_bad_endpoint_in() {
    let good = HttpBackend::start("good", Proto::H1).await;
    let bad0 = Fixed::start("bad0", 503).await;
    let bad1 = Fixed::start("bad1", 503).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[bad0.addr, good.addr, bad1.addr],
        "    outlier_detection: { consecutive_5xx: 3, base_ejection_time: 60s, max_ejection_percent: 50 }",
    ));
    let seen = tally_of(web, 90).await;
    // 50% of three endpoints: one may be out, not two.
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejected_endpoints",
            &["cluster=\"pool\""]
        )
        .await,
        1.0,
        "{seen:?}"
    );
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejections_total",
            &["cluster=\"pool\""]
        )
        .await,
        1.0
    );
    // The other bad endpoint still gets traffic, up to the end.
    let late = tally_of(web, 30).await;
    assert!(count_status(&late, 503) > 0, "{late:?}");
    assert_eq!(
        late.keys().filter(|(_, s)| *s == 503).count(),
        1,
        "only one of the bad endpoints answers now: {late:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_endpoint_whose_success_rate_falls_far_below_the_others_is_ejected() {
    // Five good endpoints and one that answers 503: no consecutive kind is on, so only the
    // interval's success rate can eject it (0% against a mean of 83%, limit mean - 1.9
    // standard deviations = 12.5%).
    let mut good = Vec::new();
    for name in ["g0", "g1", "g2", "g3", "g4"] {
        good.push(HttpBackend::start(name, Proto::H1).await);
    }
    let bad = Fixed::start("bad", 503).await;
    let mut endpoints: Vec<SocketAddr> = good.iter().map(|b| b.addr).collect();
    endpoints.push(bad.addr);
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &endpoints,
        "    outlier_detection: { consecutive_5xx: 0, consecutive_connect_failures: 0, interval: 1s, base_ejection_time: 60s, max_ejection_percent: 20, success_rate: { minimum_hosts: 5, request_volume: 5 } }",
    ));
    let ejections = || async {
        metric(
            &node,
            "flatmesh_outlier_ejections_total",
            &["cluster=\"pool\"", "reason=\"success_rate\""],
        )
        .await
    };
    // Traffic until an interval with enough requests at every endpoint has ended and been
    // judged (by the first request after it), within a few intervals.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut before = BTreeMap::new();
    while ejections().await == 0.0 {
        assert!(
            Instant::now() < deadline,
            "not ejected in 5 s (1 s intervals): {before:?}"
        );
        for (k, n) in tally_of(web, 60).await {
            *before.entry(k).or_insert(0) += n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        count_status(&before, 503) > 0,
        "it served before: {before:?}"
    );
    // Out: nothing more reaches it.
    let after = tally_of(web, 60).await;
    assert_eq!(count_status(&after, 503), 0, "{after:?}");
    assert_eq!(count_status(&after, 200), 60, "{after:?}");
    assert_eq!(ejections().await, 1.0);
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejected_endpoints",
            &["cluster=\"pool\""]
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connect_failures_eject_a_dead_endpoint() {
    let good0 = HttpBackend::start("good0", Proto::H1).await;
    let good1 = HttpBackend::start("good1", Proto::H1).await;
    let dead = free_addr();
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[good0.addr, dead, good1.addr],
        "    outlier_detection: { consecutive_connect_failures: 2, consecutive_5xx: 0, base_ejection_time: 60s, max_ejection_percent: 50 }",
    ));
    let mut failed = 0;
    let client = h1_client();
    for i in 0..100 {
        let resp = get(&client, &format!("http://{web}/before/{i}"), &[]).await;
        if resp.status == StatusCode::SERVICE_UNAVAILABLE {
            failed += 1;
            if failed == 2 {
                break;
            }
        }
    }
    assert_eq!(failed, 2);
    let after = tally_of(web, 60).await;
    assert_eq!(count_status(&after, 200), 60, "{after:?}");
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejections_total",
            &[
                "cluster=\"pool\"",
                "reason=\"consecutive_connect_failures\""
            ]
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tcp_relay_s_connect_failures_eject_too() {
    use common::backends::{TcpBackend, TcpMode};
    let alive = TcpBackend::start(TcpMode::Echo).await;
    let dead = free_addr();
    let (admin, front) = (free_addr(), free_addr());
    let node = TestNode::start(&format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: front
    address: {front}
    protocol: tcp
    cluster: pool
clusters:
  - name: pool
    endpoints: [ {dead}, {alive} ]
    outlier_detection: {{ consecutive_connect_failures: 1, base_ejection_time: 60s, max_ejection_percent: 50 }}
"#,
        alive = alive.addr
    ));
    // Round robin: the first connection tries the dead endpoint first (and moves on); the
    // ejection keeps every later one off it.
    for _ in 0..6 {
        let mut conn = tokio::net::TcpStream::connect(front).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut conn, b"ping")
            .await
            .unwrap();
        let mut buf = [0u8; 4];
        tokio::io::AsyncReadExt::read_exact(&mut conn, &mut buf)
            .await
            .unwrap();
        assert_eq!(&buf, b"ping");
    }
    assert_eq!(
        metric(
            &node,
            "flatmesh_upstream_connect_failures_total",
            &["cluster=\"pool\""]
        )
        .await,
        1.0,
        "the dead endpoint was tried once, then skipped"
    );
    assert_eq!(
        metric(
            &node,
            "flatmesh_outlier_ejections_total",
            &[
                "cluster=\"pool\"",
                "reason=\"consecutive_connect_failures\""
            ]
        )
        .await,
        1.0
    );
}
