//! The golden signals (docs/observability.md, "Metrics") as a person reads them: a real
//! Prometheus (Debian's `prometheus`; the test fails without it and says how to install it)
//! scrapes two nodes, and every query of the Grafana dashboard (`deploy/grafana/flatmesh.json`)
//! is run through Prometheus's HTTP API and must give what the test sent: requests, success
//! rate and latency per route, per cluster and per tier.
//!
//! Each dashboard query is run twice. As written (Grafana's `$__rate_interval` a fixed
//! window): every route, cluster and tier the test used has a series, rates are positive and
//! success rates right where no request failed. And cumulative, each
//! `rate(X[$__rate_interval])` taken back to its counter `X`: then the numbers are exact
//! (requests per route, cluster and tier; success ratios), and the latency quantiles fall in
//! the buckets the backends' delays put them in.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::backends::{HttpBackend, Proto};
use common::prometheus::{Prometheus, Sample};
use common::*;
use http::StatusCode;

const DASHBOARD: &str = include_str!("../../../deploy/grafana/flatmesh.json");
const DOCS: &str = include_str!("../../../docs/observability.md");
/// The scrape job, what the dashboard's `$job` variable picks.
const JOB: &str = "flatmesh";
const SCRAPE: Duration = Duration::from_millis(250);
/// The window the test gives `$__rate_interval` (Grafana: at least four scrape intervals).
const RATE_WINDOW: &str = "1m";
/// The requests the latency histogram measured, per route (docs/observability.md).
const HISTOGRAM_COUNT: &str =
    r#"sum by (route) (flatmesh_request_duration_seconds_count{job=~"$job"})"#;
/// What the slow backend waits before each answer: its requests fall in the histogram's
/// (0.05 s, 0.1 s] bucket or above, the others below 0.05 s.
const SLOW: Duration = Duration::from_millis(60);
const SLOW_FLOOR: f64 = 0.05;

/// What the test sent on one route (or to one cluster, or in one tier): requests and those
/// of them that were not answered 5xx.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Sent {
    total: u64,
    ok: u64,
}

/// One kind of request the test sends: where, how many, and what it counts as.
struct Traffic {
    /// `edge` (node A) or `inner` (node B).
    node: &'static str,
    path: &'static str,
    /// The route each node that carries it counts it on, and the cluster it goes to (`""`:
    /// no route, no cluster).
    hops: &'static [(&'static str, &'static str)],
    count: u64,
    status: u16,
    slow: bool,
}

/// Node A (`edge`) sends `/api` to node B (`inner`) and `/direct` straight to the app; node B
/// sends `/api` to the app and `/reports` to the slow backend. Both have a cluster named `app`,
/// so the per-cluster queries add the two nodes up.
const TRAFFIC: &[Traffic] = &[
    Traffic {
        node: "edge",
        path: "/api/ok",
        hops: &[("to-inner", "inner"), ("api", "app")],
        count: 30,
        status: 200,
        slow: false,
    },
    Traffic {
        node: "edge",
        path: "/api/fail",
        hops: &[("to-inner", "inner"), ("api", "app")],
        count: 6,
        status: 503,
        slow: false,
    },
    Traffic {
        node: "edge",
        path: "/direct/ok",
        hops: &[("direct", "app")],
        count: 10,
        status: 200,
        slow: false,
    },
    Traffic {
        node: "edge",
        path: "/direct/fail",
        hops: &[("direct", "app")],
        count: 2,
        status: 500,
        slow: false,
    },
    Traffic {
        node: "inner",
        path: "/reports/q",
        hops: &[("reports", "slow")],
        count: 8,
        status: 200,
        slow: true,
    },
    Traffic {
        node: "edge",
        path: "/nothing-routes-this",
        hops: &[("none", "")],
        count: 4,
        status: 404,
        slow: false,
    },
];

fn edge_config(inner: std::net::SocketAddr, app: std::net::SocketAddr) -> String {
    let (admin, web) = (free_addr(), free_addr());
    format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: edge
    address: {web}
    protocol: http
    routes:
      - name: to-inner
        match: {{ path: {{ prefix: /api }} }}
        cluster: inner
      - name: direct
        match: {{ path: {{ prefix: /direct }} }}
        cluster: app
clusters:
  - name: inner
    endpoints: [ {inner} ]
  - name: app
    endpoints: [ {app} ]
"#
    )
}

fn inner_config(
    web: std::net::SocketAddr,
    app: std::net::SocketAddr,
    slow: std::net::SocketAddr,
) -> String {
    let admin = free_addr();
    format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: inner
    address: {web}
    protocol: http
    routes:
      - name: api
        match: {{ path: {{ prefix: /api }} }}
        cluster: app
      - name: reports
        match: {{ path: {{ prefix: /reports }} }}
        cluster: slow
clusters:
  - name: app
    endpoints: [ {app} ]
  - name: slow
    endpoints: [ {slow} ]
"#
    )
}

/// Each route's tier as the node's `/rules` says (the one place the node places a route),
/// by route name.
async fn tiers_of(node: &TestNode, into: &mut BTreeMap<String, String>) {
    let (status, body) = node.admin_get("/rules").await;
    assert_eq!(status, StatusCode::OK, "/rules: {body}");
    let rules: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("/rules is not JSON ({e}): {body}"));
    let text = |v: &serde_json::Value| {
        v.as_str()
            .unwrap_or_else(|| panic!("/rules: {v} is not a string: {body}"))
            .to_owned()
    };
    let listeners = rules["listeners"].as_array().into_iter().flatten();
    for l in listeners {
        for r in l["routes"].as_array().into_iter().flatten() {
            into.insert(text(&r["name"]), text(&r["tier"]));
        }
    }
}

/// `expr` with the dashboard's variables given the test's values.
fn as_run(expr: &str) -> String {
    expr.replace("$job", JOB)
        .replace("$__rate_interval", RATE_WINDOW)
}

/// `expr` with each `rate(X[$__rate_interval])` taken back to the counter `X`: the same
/// query over everything counted so far, whose numbers are exact.
fn cumulative(expr: &str) -> String {
    const WINDOW: &str = "[$__rate_interval])";
    let (mut out, mut rest) = (String::new(), expr);
    while let Some(at) = rest.find("rate(") {
        out.push_str(&rest[..at]);
        let inside = &rest[at + "rate(".len()..];
        let end = inside
            .find(WINDOW)
            .unwrap_or_else(|| panic!("`{expr}`: a rate( without a [$__rate_interval] window"));
        out.push_str(&inside[..end]);
        rest = &inside[end + WINDOW.len()..];
    }
    out.push_str(rest);
    as_run(&out)
}

/// The dashboard's panels (rows left out): title and the expression of each target.
fn panels() -> Vec<(String, Vec<String>)> {
    let dashboard: serde_json::Value =
        serde_json::from_str(DASHBOARD).expect("deploy/grafana/flatmesh.json is JSON");
    let list = |v: &serde_json::Value, what: &str| -> Vec<serde_json::Value> {
        v.as_array()
            .unwrap_or_else(|| panic!("the dashboard's {what} is not a list: {v}"))
            .clone()
    };
    let text = |v: &serde_json::Value, what: &str| -> String {
        v.as_str()
            .unwrap_or_else(|| panic!("the dashboard's {what} is not a string: {v}"))
            .to_owned()
    };
    assert!(
        dashboard["schemaVersion"].as_u64() >= Some(39),
        "schemaVersion: {}",
        dashboard["schemaVersion"]
    );
    let datasource = list(&dashboard["templating"]["list"], "templating.list")
        .iter()
        .any(|v| v["type"] == "datasource" && v["query"] == "prometheus");
    assert!(
        datasource,
        "the dashboard has a Prometheus datasource variable"
    );
    list(&dashboard["panels"], "panels")
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| {
            let exprs = list(&p["targets"], "panel's targets")
                .iter()
                .map(|t| text(&t["expr"], "target's expr"))
                .collect();
            (text(&p["title"], "panel's title"), exprs)
        })
        .collect()
}

/// The answer as label value of `by` → value; panics on a repeated key.
fn by(samples: &[Sample], label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for s in samples {
        let key = s.label(label).to_owned();
        assert!(
            out.insert(key.clone(), s.value).is_none(),
            "two series for {label}={key}: {samples:?}"
        );
    }
    out
}

async fn send_traffic(edge: &TestNode, inner: &TestNode, share: impl Fn(u64) -> u64) {
    let client = h1_client();
    for t in TRAFFIC {
        let addr = match t.node {
            "edge" => edge.listener("edge"),
            _ => inner.listener("inner"),
        };
        let status = t.status.to_string();
        let delay = SLOW.as_millis().to_string();
        let mut headers = vec![("x-status", status.as_str())];
        if t.slow {
            headers.push(("x-delay-ms", delay.as_str()));
        }
        for _ in 0..share(t.count) {
            let resp = get(&client, &format!("http://{addr}{}", t.path), &headers).await;
            assert_eq!(resp.status.as_u16(), t.status, "{}: {}", t.path, resp.body);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_reads_the_golden_signals_of_two_nodes_as_the_dashboard_asks() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let slow = HttpBackend::start("slow", Proto::H1).await;
    let inner_web = free_addr();
    let inner = TestNode::start(&inner_config(inner_web, app.addr, slow.addr));
    let edge = TestNode::start(&edge_config(inner_web, app.addr));
    let prometheus = Prometheus::start(JOB, &[edge.admin, inner.admin], SCRAPE).await;

    // What each route, cluster and tier must show, summed over both nodes.
    let mut tiers = BTreeMap::new();
    tiers_of(&edge, &mut tiers).await;
    tiers_of(&inner, &mut tiers).await;
    let (mut routes, mut clusters, mut by_tier) =
        (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    let mut slow_routes = Vec::new();
    for t in TRAFFIC {
        for (route, cluster) in t.hops {
            // Requests no route took are the user tier's (docs/observability.md).
            let tier = tiers.get(*route).map_or("U7", String::as_str).to_owned();
            let ok = if t.status >= 500 { 0 } else { t.count };
            for (map, key) in [
                (&mut routes, route.to_string()),
                (&mut clusters, cluster.to_string()),
                (&mut by_tier, tier),
            ] {
                let s: &mut Sent = map.entry(key).or_default();
                s.total += t.count;
                s.ok += ok;
            }
            if t.slow {
                slow_routes.extend([route.to_string(), cluster.to_string()]);
            }
        }
    }
    clusters.remove(""); // the per-cluster queries leave out requests no route took
    let total: u64 = routes.values().map(|s| s.total).sum();

    // Two halves with a scrape between, so every series grows while Prometheus watches it
    // and the dashboard's rates have two samples to work from.
    let first = |n: u64| n / 2;
    send_traffic(&edge, &inner, first).await;
    let half: u64 = TRAFFIC
        .iter()
        .map(|t| first(t.count) * t.hops.len() as u64)
        .sum();
    let everything = format!("sum(flatmesh_requests_total{{job=\"{JOB}\"}})");
    let scraped = |want: u64| move |s: &[Sample]| s.first().is_some_and(|s| s.value == want as f64);
    let (got, ok) = prometheus
        .query_until(&everything, Duration::from_secs(20), scraped(half))
        .await;
    assert!(
        ok,
        "Prometheus did not see the first {half} requests within 20 s: {got:?}\n{}",
        prometheus.log()
    );
    send_traffic(&edge, &inner, |n| n - first(n)).await;
    let (got, ok) = prometheus
        .query_until(&everything, Duration::from_secs(20), scraped(total))
        .await;
    assert!(
        ok,
        "Prometheus did not see all {total} requests within 20 s: {got:?}\n{}",
        prometheus.log()
    );
    // Both nodes' last scrape is in (the total is), and the histograms are scraped with the
    // counters: the latency histogram measured every request of every route.
    assert!(
        DOCS.contains(HISTOGRAM_COUNT),
        "the docs show {HISTOGRAM_COUNT}"
    );
    let counted = by(&prometheus.query(&as_run(HISTOGRAM_COUNT)).await, "route");
    let want: BTreeMap<String, f64> = routes
        .iter()
        .map(|(r, s)| (r.clone(), s.total as f64))
        .collect();
    assert_eq!(counted, want, "histogram counts per route");

    let panels = panels();
    let titles: Vec<&str> = panels.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(
        titles,
        [
            "Requests per second by route",
            "Success rate by route",
            "Latency p50 and p99 by route",
            "Requests per second by cluster",
            "Success rate by cluster",
            "Latency p50 and p99 by cluster",
            "Requests per second by tier",
        ],
        "each panel of the dashboard has its check here"
    );
    for (title, exprs) in &panels {
        for expr in exprs {
            assert!(
                DOCS.contains(expr.as_str()),
                "docs/observability.md shows the query of `{title}` as the dashboard has it: {expr}"
            );
        }
        let (label, sent) = if title.ends_with("by route") {
            ("route", &routes)
        } else if title.ends_with("by cluster") {
            ("cluster", &clusters)
        } else {
            ("tier", &by_tier)
        };
        let keys: Vec<&String> = sent.keys().collect();
        let mut quantiles = Vec::new();
        for expr in exprs {
            // As the dashboard runs it: a series for each route, cluster or tier, all positive.
            let live = by(&prometheus.query(&as_run(expr)).await, label);
            assert_eq!(live.keys().collect::<Vec<_>>(), keys, "`{title}`: {expr}");
            assert!(
                live.values().all(|v| *v > 0.0),
                "`{title}`: {expr} gave {live:?}"
            );
            // Cumulative: exact.
            let samples = prometheus.query(&cumulative(expr)).await;
            let got = by(&samples, label);
            assert_eq!(got.keys().collect::<Vec<_>>(), keys, "`{title}`: {expr}");
            if title.starts_with("Requests per second") {
                for (key, s) in sent {
                    assert_eq!(got[key], s.total as f64, "`{title}`, {key}: {samples:?}");
                }
                if label == "route" {
                    for s in &samples {
                        let want = tiers.get(s.label("route")).map_or("U7", String::as_str);
                        assert_eq!(s.label("tier"), want, "`{title}`: the tier of {s:?}");
                    }
                }
            } else if title.starts_with("Success rate") {
                for (key, s) in sent {
                    let want = s.ok as f64 / s.total as f64;
                    assert!(
                        (got[key] - want).abs() < 1e-9,
                        "`{title}`, {key}: {} of {} ok, Prometheus says {}",
                        s.ok,
                        s.total,
                        got[key]
                    );
                    if s.ok == s.total {
                        assert_eq!(live[key], 1.0, "`{title}` as run, {key}");
                    } else {
                        assert!(live[key] < 1.0, "`{title}` as run, {key}: {}", live[key]);
                    }
                }
            } else {
                for (key, q) in &got {
                    let slow = slow_routes.contains(key);
                    assert!(
                        if slow {
                            (SLOW_FLOOR..=5.0).contains(q)
                        } else {
                            *q > 0.0 && *q <= 5.0
                        },
                        "`{expr}`: {key} took {q} s (slow backend: {slow})"
                    );
                }
                quantiles.push(got);
            }
        }
        if let [p50, p99] = &quantiles[..] {
            for (key, q) in p50 {
                assert!(
                    *q <= p99[key],
                    "`{title}`: {key}'s p50 {q} > p99 {}",
                    p99[key]
                );
                if !slow_routes.contains(key) {
                    assert!(*q < SLOW_FLOOR, "`{title}`: {key}'s p50 is {q} s");
                }
            }
        }
    }
}

#[test]
fn the_cumulative_form_takes_each_rate_back_to_its_counter() {
    assert_eq!(
        cumulative(
            r#"sum by (route) (rate(a{job=~"$job"}[$__rate_interval])) / sum(rate(b[$__rate_interval]))"#
        ),
        r#"sum by (route) (a{job=~"flatmesh"}) / sum(b)"#
    );
}
