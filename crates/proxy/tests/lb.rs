//! Load-balancing policies and weighted splits: distributions within tolerance.
//!
//! Tolerances are wide enough that a correct implementation fails with negligible probability
//! (several standard deviations) and narrow enough that a broken one (always the first
//! endpoint, or ignoring weights) cannot pass.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::backends::{HttpBackend, Proto};
use common::*;
use http::StatusCode;

fn lb_config(
    admin: SocketAddr,
    web: SocketAddr,
    lb: &str,
    backends: &[&HttpBackend],
    extra: &str,
) -> String {
    let endpoints: Vec<String> = backends.iter().map(|b| b.addr.to_string()).collect();
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
clusters:
  - name: pool
    lb: {lb}
    endpoints: [ {endpoints} ]
{extra}
"#,
        endpoints = endpoints.join(", ")
    )
}

async fn backends(n: usize) -> Vec<HttpBackend> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push(HttpBackend::start(&format!("b{i}"), Proto::H1).await);
    }
    out
}

/// Send `total` GETs from `conns` concurrent keep-alive clients; return who answered each.
async fn spread(
    web: SocketAddr,
    total: usize,
    conns: usize,
    headers: Vec<(String, String)>,
) -> BTreeMap<String, usize> {
    let per = total / conns;
    let mut tasks = Vec::new();
    for c in 0..conns {
        let headers = headers.clone();
        tasks.push(tokio::spawn(async move {
            let client = h1_client();
            let hdrs: Vec<(&str, &str)> = headers
                .iter()
                .map(|(a, b)| (a.as_str(), b.as_str()))
                .collect();
            let mut names = Vec::new();
            for i in 0..per {
                let resp = get(&client, &format!("http://{web}/r/{c}/{i}"), &hdrs).await;
                assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
                names.push(resp.backend().expect("x-backend header").to_owned());
            }
            names
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("client task"));
    }
    tally(all.iter().map(String::as_str))
}

fn assert_each_within(
    counts: &BTreeMap<String, usize>,
    names: &[&str],
    lo: usize,
    hi: usize,
    policy: &str,
) {
    for name in names {
        let n = counts.get(*name).copied().unwrap_or(0);
        assert!(
            (lo..=hi).contains(&n),
            "{policy}: backend {name} got {n} requests, expected {lo}..={hi}; all: {counts:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_evenly() {
    let bs = backends(3).await;
    let (admin, web) = (free_addr(), free_addr());
    let refs: Vec<&HttpBackend> = bs.iter().collect();
    let _proxy = TestNode::start(&lb_config(admin, web, "round_robin", &refs, ""));
    // One keep-alive connection: round robin must rotate per request, not per connection.
    let counts = spread(web, 300, 1, vec![]).await;
    assert_each_within(
        &counts,
        &["b0", "b1", "b2"],
        95,
        105,
        "round_robin (1 connection)",
    );
    // Several connections (landing on different workers) still balance.
    let counts = spread(web, 300, 4, vec![]).await;
    assert_each_within(
        &counts,
        &["b0", "b1", "b2"],
        80,
        120,
        "round_robin (4 connections)",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_spreads_within_tolerance() {
    let bs = backends(3).await;
    let (admin, web) = (free_addr(), free_addr());
    let refs: Vec<&HttpBackend> = bs.iter().collect();
    let _proxy = TestNode::start(&lb_config(admin, web, "random", &refs, ""));
    // Expected 200 each of 600; binomial sd ~11.5, so 150..=250 is over 4 sd.
    let counts = spread(web, 600, 4, vec![]).await;
    assert_each_within(&counts, &["b0", "b1", "b2"], 150, 250, "random");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_avoids_the_slow_endpoint() {
    let slow = HttpBackend::start_with_delay("slow", Proto::H1, Duration::from_millis(150)).await;
    let fast0 = HttpBackend::start("fast0", Proto::H1).await;
    let fast1 = HttpBackend::start("fast1", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&lb_config(
        admin,
        web,
        "least_request",
        &[&slow, &fast0, &fast1],
        "",
    ));

    // Sequential requests: nothing is outstanding, so ties must still be spread (not always
    // the first endpoint). Every endpoint gets a fair share.
    let counts = spread(web, 150, 1, vec![]).await;
    for name in ["slow", "fast0", "fast1"] {
        let n = counts.get(name).copied().unwrap_or(0);
        assert!(
            n >= 20,
            "least_request with no load: {name} got {n}/150, ties are not spread; all: {counts:?}"
        );
    }

    // Concurrent load: the slow endpoint holds requests longer, so it must get far fewer.
    let counts = spread(web, 400, 8, vec![]).await;
    let slow_n = counts.get("slow").copied().unwrap_or(0);
    assert!(
        slow_n * 100 <= 400 * 20,
        "least_request under load sent {slow_n}/400 to the slow endpoint (want <= 20%); all: {counts:?}"
    );
    for name in ["fast0", "fast1"] {
        let n = counts.get(name).copied().unwrap_or(0);
        assert!(
            n >= 120,
            "least_request under load: {name} got only {n}/400; all: {counts:?}"
        );
    }
}

/// Same key -> same backend (across connections); different keys spread over the endpoints.
async fn check_consistent_hashing(lb: &str) {
    let bs = backends(4).await;
    let (admin, web) = (free_addr(), free_addr());
    let refs: Vec<&HttpBackend> = bs.iter().collect();
    let extra = "    hash_on: { header: x-user }";
    let _proxy = TestNode::start(&lb_config(admin, web, lb, &refs, extra));

    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for round in 0..3 {
        // A fresh client per round: stickiness must not depend on the connection.
        let client = h1_client();
        for k in 0..60 {
            let user = format!("user-{k}");
            let resp = get(
                &client,
                &format!("http://{web}/k/{round}"),
                &[("x-user", &user)],
            )
            .await;
            assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
            let who = resp.backend().expect("x-backend").to_owned();
            match owner.get(&user) {
                Some(prev) => assert_eq!(
                    prev, &who,
                    "{lb}: key {user} moved from {prev} to {who} in round {round}"
                ),
                None => {
                    owner.insert(user, who);
                }
            }
        }
    }
    let per_backend = tally(owner.values().map(String::as_str));
    // 60 keys over 4 endpoints (15 expected each): all four used, none owning more than half.
    assert_eq!(
        per_backend.len(),
        4,
        "{lb}: keys did not spread over all 4 endpoints: {per_backend:?}"
    );
    for (name, n) in &per_backend {
        assert!(*n <= 30, "{lb}: {name} owns {n}/60 keys: {per_backend:?}");
    }

    // No header: falls back to the client address, so one client keeps one endpoint.
    let client = h1_client();
    let mut seen = Vec::new();
    for _ in 0..10 {
        let resp = get(&client, &format!("http://{web}/nokey"), &[]).await;
        assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
        seen.push(resp.backend().expect("x-backend").to_owned());
    }
    let distinct = tally(seen.iter().map(String::as_str));
    assert_eq!(
        distinct.len(),
        1,
        "{lb}: without x-user one client should stick to one endpoint: {distinct:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_hash_is_sticky_per_key_and_spreads_keys() {
    check_consistent_hashing("ring_hash").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maglev_is_sticky_per_key_and_spreads_keys() {
    check_consistent_hashing("maglev").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_split_90_10() {
    let main = HttpBackend::start("main", Proto::H1).await;
    let canary = HttpBackend::start("canary", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        split: [ {{ cluster: main, weight: 90 }}, {{ cluster: canary, weight: 10 }} ]
clusters:
  - name: main
    endpoints: [ {m} ]
  - name: canary
    endpoints: [ {c} ]
"#,
        m = main.addr,
        c = canary.addr
    );
    let _proxy = TestNode::start(&yaml);
    let counts = spread(web, 1000, 4, vec![]).await;
    let canary_n = counts.get("canary").copied().unwrap_or(0);
    let main_n = counts.get("main").copied().unwrap_or(0);
    assert_eq!(canary_n + main_n, 1000, "{counts:?}");
    // Expected 100 with sd ~9.5: 60..=140 is over 4 sd.
    assert!(
        (60..=140).contains(&canary_n),
        "90/10 split sent {canary_n}/1000 to canary; all: {counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_on_connect_failure_reaches_the_live_endpoint() {
    let live = HttpBackend::start("live", Proto::H1).await;
    let dead = free_addr(); // nothing listens there
    let (admin, web) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /retry }} }}
        cluster: pool
        retries: {{ attempts: 2, on: [ connect-failure ] }}
      - match: {{ path: {{ prefix: / }} }}
        cluster: pool
clusters:
  - name: pool
    lb: round_robin
    endpoints: [ {dead}, {l} ]
"#,
        l = live.addr
    );
    let _proxy = TestNode::start(&yaml);
    let client = h1_client();
    // With retries every request lands on the live endpoint.
    for i in 0..20 {
        let resp = get(&client, &format!("http://{web}/retry/{i}"), &[]).await;
        assert_eq!(
            resp.status,
            StatusCode::OK,
            "request {i} with retries: {resp:?}"
        );
        assert_eq!(resp.backend(), Some("live"));
    }
    // Without retries, round robin sends some requests to the dead endpoint: 503.
    let mut unavailable = 0;
    for i in 0..20 {
        let resp = get(&client, &format!("http://{web}/plain/{i}"), &[]).await;
        if resp.status == StatusCode::SERVICE_UNAVAILABLE {
            unavailable += 1;
        } else {
            assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
        }
    }
    assert!(
        unavailable > 0,
        "no request failed without retries: is the dead endpoint really used?"
    );
}
