//! Retries (issue 17 item 4) against real backends that misbehave on purpose: one of three
//! endpoints answers 503 to 30% of its requests, or every endpoint always does. The node runs
//! its workers on runtimes of their own threads, so these run on the wall clock; the timing
//! of backoff and per-try timeouts is tested on the paused clock in
//! `crates/proxy/src/l7/retry.rs`, the budget's window in `crates/proxy/src/resilience/budget.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use common::*;
use http::Response;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A backend that reads each request whole, then answers 503 to `sick_per_10` of every 10
/// requests it gets (the first ones of each ten: deterministic) and 200 to the rest, naming
/// itself in `x-backend`.
struct Flaky {
    addr: SocketAddr,
    hits: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Flaky {
    async fn start(name: &'static str, sick_per_10: u64) -> Flaky {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicU64::new(0));
        let counted = hits.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let hits = counted.clone();
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let n = hits.fetch_add(1, Ordering::Relaxed);
                    let status = if n % 10 < sick_per_10 { 503 } else { 200 };
                    async move {
                        // The whole request first, as most servers do.
                        let _ = http_body_util::BodyExt::collect(req.into_body()).await;
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(status)
                                .header("x-backend", name)
                                .body(Full::new(Bytes::from_static(b"hello\n")))
                                .unwrap(),
                        )
                    }
                });
                conns.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Flaky { addr, hits, task }
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

impl Drop for Flaky {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn config(admin: SocketAddr, web: SocketAddr, endpoints: &[SocketAddr], retries: &str) -> String {
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
        retries: {retries}
clusters:
  - name: pool
    endpoints: [ {endpoints} ]
    circuit_breaker: {{ max_retries: 1000 }}
"#,
        endpoints = endpoints.join(", ")
    )
}

/// One metric sample's value (0 when the series is absent).
async fn metric(node: &TestNode, name: &str) -> f64 {
    let text = node.metrics().await;
    metric_samples(&text, name, &["cluster=\"pool\""])
        .first()
        .map_or(0.0, |(_, v)| *v)
}

/// `total` GETs from `concurrency` callers at once; the statuses they got.
async fn load(web: SocketAddr, total: usize, concurrency: usize) -> Vec<u16> {
    let mut callers = Vec::new();
    for c in 0..concurrency {
        callers.push(tokio::spawn(async move {
            let client = h1_client();
            let mut statuses = Vec::new();
            for i in (c..total).step_by(concurrency) {
                let resp = get(&client, &format!("http://{web}/r/{i}"), &[]).await;
                statuses.push(resp.status.as_u16());
            }
            statuses
        }));
    }
    let mut all = Vec::new();
    for c in callers {
        all.extend(c.await.unwrap());
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_endpoint_answering_503_to_30_percent_is_survived_inside_the_budget() {
    let sick = Flaky::start("sick", 3).await;
    let a = Flaky::start("a", 0).await;
    let b = Flaky::start("b", 0).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[sick.addr, a.addr, b.addr],
        "{ attempts: 2, on: [ 5xx ] }",
    ));
    let sent = 2000;
    let started = Instant::now();
    let statuses = load(web, sent, 8).await;
    let elapsed = started.elapsed().as_secs_f64();
    let failed = statuses.iter().filter(|s| **s != 200).count();
    println!("FAULT-SURVIVED | one of three endpoints answers 503 to 30% of requests (retries with a budget) | sent {sent} | failed {failed}");
    assert_eq!(statuses.len(), sent);
    assert!(
        failed * 1000 <= sent,
        "{failed} of {sent} failed: more than 0.1%"
    );
    // The sick endpoint got its share and failed 30% of it: those were retried.
    let sick_503 = (sick.hits() / 10) * 3 + (sick.hits() % 10).min(3);
    assert!(sick.hits() > 300, "the sick endpoint got {}", sick.hits());
    let retries = metric(&node, "flatmesh_upstream_retries_total").await;
    assert!(
        retries >= (sick_503 as f64) - failed as f64,
        "{retries} retries for {sick_503} 503s"
    );
    // The default budget: 20% of the requests plus 10/s over the (at least 10 s) window.
    let cap = 0.2 * sent as f64 + 10.0 * (10.0 + elapsed.ceil());
    assert!(
        retries <= cap,
        "{retries} retries, over the budget of {cap}"
    );
    assert_eq!(
        metric(&node, "flatmesh_upstream_retries_over_budget_total").await,
        0.0,
        "a 10% failure rate fits the budget"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_every_endpoint_fails_retries_are_capped_by_the_budget() {
    let backends = [
        Flaky::start("x", 10).await,
        Flaky::start("y", 10).await,
        Flaky::start("z", 10).await,
    ];
    let (admin, web) = (free_addr(), free_addr());
    let endpoints: Vec<SocketAddr> = backends.iter().map(|b| b.addr).collect();
    let node = TestNode::start(&config(
        admin,
        web,
        &endpoints,
        "{ attempts: 3, on: [ 5xx ], backoff: { base: 1ms }, budget: { ratio: 0.2, min_per_s: 2 } }",
    ));
    let sent = 500;
    let started = Instant::now();
    let statuses = load(web, sent, 8).await;
    let elapsed = started.elapsed().as_secs_f64();
    assert!(statuses.iter().all(|s| *s == 503), "every endpoint fails");
    let retries = metric(&node, "flatmesh_upstream_retries_total").await;
    let refused = metric(&node, "flatmesh_upstream_retries_over_budget_total").await;
    let hits: u64 = backends.iter().map(Flaky::hits).sum();
    // Without the budget: 3 retries each, 1500. With it: 20% of 500 plus 2/s over the window
    // (and one more per worker that may decide at the same instant).
    let cap = 0.2 * sent as f64 + 2.0 * (10.0 + elapsed.ceil()) + 2.0;
    assert!(
        retries <= cap,
        "{retries} retries, over the budget of {cap}"
    );
    assert!(
        retries >= 0.2 * sent as f64,
        "the budget's share was used: {retries}"
    );
    assert_eq!(
        hits as f64,
        sent as f64 + retries,
        "every try reached a backend"
    );
    // A request that made fewer than 3 retries was refused one: it is counted.
    assert!(
        refused >= sent as f64 - retries / 3.0,
        "each request over the budget counted: {refused}"
    );
}

/// POSTs of `len` pattern bytes, `n` of them one after the other, from `client`; each
/// answer's status, the backend that gave it, and the body length and CRC it got.
async fn posts(
    client: &Client,
    web: SocketAddr,
    n: usize,
    len: usize,
) -> Vec<(u16, String, u64, u64)> {
    let data = backends::pattern(len, 7);
    let mut out = Vec::new();
    for i in 0..n {
        let req = http::Request::post(format!("http://{web}/up/{i}"))
            .header("content-length", len.to_string())
            .body(http_body_util::Full::new(Bytes::from(data.clone())))
            .unwrap();
        let resp = send(client, req).await.unwrap();
        let (len, crc) = if resp.status == 200 {
            let echo = resp.echo();
            (
                echo["body_len"].as_u64().unwrap(),
                echo["body_crc"].as_u64().unwrap(),
            )
        } else {
            (0, 0)
        };
        out.push((
            resp.status.as_u16(),
            resp.backend().unwrap_or("").to_owned(),
            len,
            crc,
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_post_s_body_is_replayed_whole_to_the_next_endpoint() {
    let sick = Flaky::start("sick", 10).await;
    let good = backends::HttpBackend::start("good", backends::Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[sick.addr, good.addr],
        "{ attempts: 1, on: [ 5xx ] }",
    ));
    let len = 40 * 1024;
    let crc = u64::from(crc32fast::hash(&backends::pattern(len, 7)));
    // HTTP/1.1 to the HTTP/1.1 cluster (the codec's own relay), and HTTP/2 (bodies held in
    // `http` types).
    for (client, proto) in [(h1_client(), "h1"), (h2c_client(), "h2c")] {
        let before = sick.hits();
        for (status, backend, got, got_crc) in posts(&client, web, 6, len).await {
            assert_eq!(status, 200, "{proto}: every POST ends at the good endpoint");
            assert_eq!(backend, "good", "{proto}");
            assert_eq!(
                (got, got_crc),
                (len as u64, crc),
                "{proto}: the body arrived whole"
            );
        }
        assert!(
            sick.hits() > before,
            "{proto}: some POSTs went to the sick endpoint first"
        );
    }
    let retries = metric(&node, "flatmesh_upstream_retries_total").await;
    assert_eq!(retries, sick.hits() as f64, "each 503 was retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_over_max_replay_body_is_sent_once() {
    let sick = Flaky::start("sick", 10).await;
    let good = backends::HttpBackend::start("good", backends::Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[sick.addr, good.addr],
        "{ attempts: 1, on: [ 5xx ], max_replay_body: 1024 }",
    ));
    for client in [h1_client(), h2c_client()] {
        let answers = posts(&client, web, 6, 4096).await;
        let sick_answers = answers.iter().filter(|a| a.1 == "sick").count();
        assert!(sick_answers > 0, "{answers:?}");
        for (status, backend, got, _) in answers {
            match backend.as_str() {
                "sick" => assert_eq!(status, 503, "not retried: the 503 goes back"),
                _ => assert_eq!((status, got), (200, 4096)),
            }
        }
    }
    assert_eq!(metric(&node, "flatmesh_upstream_retries_total").await, 0.0);
    // A bodyless request on the same route is still retried.
    let client = h1_client();
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for i in 0..4 {
            s.push(
                get(&client, &format!("http://{web}/g/{i}"), &[])
                    .await
                    .status
                    .as_u16(),
            );
        }
        s
    };
    assert_eq!(statuses, [200; 4]);
    assert!(metric(&node, "flatmesh_upstream_retries_total").await >= 1.0);
}
