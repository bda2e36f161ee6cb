//! The admin listener: /ready, /config, /rules and /metrics after real traffic.

mod common;

use std::net::SocketAddr;

use common::backends::{pattern, HttpBackend, Proto, TcpBackend, TcpMode};
use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Setup {
    proxy: TestNode,
    web: SocketAddr,
    tcp: SocketAddr,
    _app: HttpBackend,
    _echo: TcpBackend,
}

async fn setup() -> Setup {
    let app = HttpBackend::start("app", Proto::H1).await;
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (admin, web, tcp) = (free_addr(), free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - name: api-route
        match: {{ path: {{ prefix: /api }} }}
        cluster: api
      - name: health
        match: {{ path: {{ exact: /healthz }} }}
        direct_response: {{ status: 200, body: "ok" }}
  - name: db
    address: {tcp}
    protocol: tcp
    cluster: db
clusters:
  - name: api
    endpoints: [ {a} ]
  - name: db
    endpoints: [ {e} ]
"#,
        a = app.addr,
        e = echo.addr
    );
    let proxy = TestNode::start(&yaml);
    Setup {
        proxy,
        web,
        tcp,
        _app: app,
        _echo: echo,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_config_and_rules() {
    let s = setup().await;
    let (status, _) = s.proxy.admin_get("/ready").await;
    assert_eq!(status, StatusCode::OK);

    let config = s.proxy.config_json().await;
    let text = config.to_string();
    for needle in ["api-route", "health", "\"web\"", "\"db\"", "\"api\""] {
        assert!(text.contains(needle), "/config lacks {needle}: {text}");
    }

    let (status, rules) = s.proxy.admin_get("/rules").await;
    assert_eq!(status, StatusCode::OK, "{rules}");
    let rules: serde_json::Value =
        serde_json::from_str(&rules).unwrap_or_else(|e| panic!("/rules not JSON ({e}): {rules}"));
    let text = rules.to_string();
    assert!(
        text.contains("/api"),
        "/rules lacks the /api prefix rule: {text}"
    );
    assert!(
        text.contains("/healthz"),
        "/rules lacks the /healthz rule: {text}"
    );
    // Runtime truth: this node has no tier K, and says why; every rule runs in a user tier.
    assert_eq!(rules["node"]["kernel"]["state"], "off", "{text}");
    assert_eq!(
        rules["node"]["kernel"]["why"], "the config has no `kernel:` section",
        "{text}"
    );
    assert_eq!(rules["listeners"][0]["routes"][0]["tier"], "U7");
    assert_eq!(rules["listeners"][1]["rule"]["tier"], "U4");

    let (status, _) = s.proxy.admin_get("/no-such-admin-page").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// Sum of all samples of metrics starting with `flatmesh_` whose name contains `name_part`
/// and whose labels contain every one of `labels`. Counter names are not a contract, so
/// the test matches by meaning: a metric about requests, labelled by listener/route/etc.
fn sum_where(text: &str, name_part: &str, labels: &[&str]) -> f64 {
    metric_samples(text, "flatmesh_", labels)
        .into_iter()
        .filter(|(series, _)| {
            let name = series.split('{').next().unwrap_or("");
            name.contains(name_part)
                && !name.contains("duration")
                && !name.ends_with("_bucket")
                && !name.ends_with("_sum")
                && !name.ends_with("_created")
        })
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_listener_route_cluster_and_status_class() {
    let s = setup().await;
    let client = h1_client();
    for i in 0..25 {
        let resp = get(&client, &format!("http://{}/api/{i}", s.web), &[]).await;
        assert_eq!(resp.status, StatusCode::OK);
    }
    for _ in 0..7 {
        let resp = get(&client, &format!("http://{}/nothing-here", s.web), &[]).await;
        assert_eq!(resp.status, StatusCode::NOT_FOUND);
    }
    for _ in 0..3 {
        let resp = get(
            &client,
            &format!("http://{}/api/x", s.web),
            &[("x-status", "503")],
        )
        .await;
        assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);
    }

    // TCP traffic: 1 MiB each way.
    let data = pattern(1024 * 1024, 9);
    let mut conn = tokio::net::TcpStream::connect(s.tcp)
        .await
        .expect("connect tcp listener");
    let (mut rd, mut wr) = conn.split();
    let (w, r) = tokio::join!(
        async {
            wr.write_all(&data).await?;
            wr.shutdown().await
        },
        async {
            let mut back = Vec::new();
            rd.read_to_end(&mut back).await.map(|_| back)
        }
    );
    w.expect("write tcp");
    assert_eq!(r.expect("read tcp").len(), data.len());
    drop(conn);

    // Relay byte counters may be folded in when the connection ends, just after our read
    // returns: wait (bounded) for them before judging the whole scrape.
    let admin = s.proxy.admin;
    let want = 2.0 * data.len() as f64;
    eventually(std::time::Duration::from_secs(3), || async move {
        let Ok(resp) = send(&h1_client(), get_req(&format!("http://{admin}/metrics"))).await else {
            return false;
        };
        sum_where(&resp.body, "bytes", &["listener=\"db\""]) >= want
    })
    .await;
    let text = s.proxy.metrics().await;
    let all_flatmesh = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .all(|l| l.is_empty() || l.starts_with("flatmesh_"));
    assert!(
        all_flatmesh,
        "every metric should carry the flatmesh_ prefix:\n{text}"
    );

    let ok = sum_where(
        &text,
        "request",
        &[
            "listener=\"web\"",
            "route=\"api-route\"",
            "cluster=\"api\"",
            "2xx",
        ],
    );
    assert!(
        ok >= 25.0,
        "expected >= 25 2xx requests for web/api-route/api, found {ok}:\n{text}"
    );
    let server_err = sum_where(
        &text,
        "request",
        &["listener=\"web\"", "cluster=\"api\"", "5xx"],
    );
    assert!(
        server_err >= 3.0,
        "expected >= 3 5xx requests for web/api, found {server_err}:\n{text}"
    );
    let not_found = sum_where(&text, "request", &["listener=\"web\"", "4xx"]);
    assert!(
        not_found >= 7.0,
        "expected >= 7 4xx (no route) requests on web, found {not_found}:\n{text}"
    );

    // A request duration histogram exists and counted the requests.
    let buckets = metric_samples(&text, "flatmesh_", &["le=\"+Inf\""]);
    let histogram_total: f64 = buckets
        .iter()
        .filter(|(n, _)| n.contains("duration"))
        .map(|(_, v)| v)
        .sum();
    assert!(
        histogram_total >= 35.0,
        "request duration histogram counted {histogram_total} (< 35):\n{text}"
    );

    // Downstream connections and TCP bytes.
    let conns = sum_where(&text, "connection", &[]);
    assert!(
        conns >= 1.0,
        "no connection metrics with a non-zero value:\n{text}"
    );
    let bytes = sum_where(&text, "bytes", &["listener=\"db\""]);
    assert!(
        bytes >= 2.0 * data.len() as f64,
        "TCP byte counters for db sum to {bytes}, expected >= 2 MiB:\n{text}"
    );

    // Label cardinality stays bounded: request paths never become labels.
    assert!(
        !text.contains("/api/1"),
        "a request path leaked into metric labels:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_outcomes_are_counted() {
    let s = setup().await;
    let before = s.proxy.metrics().await;
    let good = std::fs::read_to_string(&s.proxy.config_path).expect("read config");
    s.proxy
        .write_config(&good.replace("body: \"ok\"", "body: \"ok2\""));
    s.proxy.reload().await;
    let web = s.web;
    let applied = eventually(std::time::Duration::from_secs(5), || async move {
        send(&h1_client(), get_req(&format!("http://{web}/healthz")))
            .await
            .map(|r| r.body)
            .ok()
            .as_deref()
            == Some("ok2")
    })
    .await;
    assert!(applied, "reload did not apply");
    let after = s.proxy.metrics().await;
    let reloads_before = sum_where(&before, "reload", &[]);
    let reloads_after = sum_where(&after, "reload", &[]);
    assert!(
        reloads_after > reloads_before,
        "no reload metric went up ({reloads_before} -> {reloads_after}):\n{after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_writes_json_lines() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let dir = TempDir::new();
    let log_path = dir.path.join("access.log");
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
access_log: {{ path: "{log}" }}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - name: api-route
        match: {{ path: {{ prefix: /api }} }}
        cluster: api
clusters:
  - name: api
    endpoints: [ {a} ]
"#,
        log = log_path.display(),
        a = app.addr
    );
    let _proxy = TestNode::start(&yaml);
    let client = h1_client();
    for i in 0..5 {
        let resp = get(&client, &format!("http://{web}/api/logged-{i}"), &[]).await;
        assert_eq!(resp.status, StatusCode::OK);
    }
    let resp = get(&client, &format!("http://{web}/unrouted"), &[]).await;
    assert_eq!(resp.status, StatusCode::NOT_FOUND);

    let log_path2 = log_path.clone();
    let complete = eventually(std::time::Duration::from_secs(5), || {
        let p = log_path2.clone();
        async move {
            std::fs::read_to_string(&p)
                .map(|t| t.lines().count() >= 6)
                .unwrap_or(false)
        }
    })
    .await;
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        complete,
        "access log has fewer than 6 lines after 6 requests:\n{text}"
    );
    for line in text.lines() {
        let entry: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("access log line is not JSON ({e}): {line}"));
        assert!(
            entry.is_object(),
            "access log line is not a JSON object: {line}"
        );
    }
    for i in 0..5 {
        let needle = format!("/api/logged-{i}");
        let line = text
            .lines()
            .find(|l| l.contains(&needle))
            .unwrap_or_else(|| panic!("no access log line for {needle}:\n{text}"));
        assert!(
            line.contains("200"),
            "access log line for {needle} lacks the status: {line}"
        );
    }
    let unrouted = text
        .lines()
        .find(|l| l.contains("/unrouted"))
        .unwrap_or_else(|| panic!("no access log line for /unrouted:\n{text}"));
    assert!(unrouted.contains("404"), "{unrouted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_and_connect_failures_are_counted() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let ghost = free_addr(); // nothing listens there
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /ghost }} }}
        cluster: ghost
      - match: {{ path: {{ prefix: / }} }}
        cluster: api
clusters:
  - name: api
    endpoints: [ {a} ]
  - name: ghost
    endpoints: [ {ghost} ]
"#,
        a = app.addr
    );
    let proxy = TestNode::start(&yaml);
    let client = h1_client();
    for i in 0..5 {
        assert_eq!(
            get(&client, &format!("http://{web}/ok/{i}"), &[])
                .await
                .status,
            StatusCode::OK
        );
    }
    for i in 0..3 {
        let resp = get(&client, &format!("http://{web}/ghost/{i}"), &[]).await;
        assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let text = proxy.metrics().await;
    let opened = sum_where(&text, "upstream_connections", &["cluster=\"api\""]);
    assert!(
        opened >= 1.0,
        "no upstream connection counted for api:\n{text}"
    );
    let failures: f64 = metric_samples(&text, "flatmesh_", &["cluster=\"ghost\""])
        .into_iter()
        .filter(|(series, _)| series.contains("fail"))
        .map(|(_, v)| v)
        .sum();
    assert!(
        failures >= 3.0,
        "expected >= 3 connect failures for ghost, found {failures}:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_reloads_are_counted() {
    let s = setup().await;
    let failed_of = |text: &str| -> f64 {
        metric_samples(text, "flatmesh_", &[])
            .into_iter()
            .filter(|(series, _)| series.contains("reload") && series.contains("fail"))
            .map(|(_, v)| v)
            .sum()
    };
    let before = failed_of(&s.proxy.metrics().await);
    s.proxy.write_config("listeners: [ this is not a config");
    s.proxy.reload().await;
    let admin = s.proxy.admin;
    let counted = eventually(std::time::Duration::from_secs(5), || async move {
        let Ok(resp) = send(&h1_client(), get_req(&format!("http://{admin}/metrics"))).await else {
            return false;
        };
        failed_of(&resp.body) > before
    })
    .await;
    assert!(
        counted,
        "a refused reload was not counted as failed:\n{}",
        s.proxy.metrics().await
    );
    // The old config still serves.
    let resp = get(&h1_client(), &format!("http://{}/healthz", s.web), &[]).await;
    assert_eq!(resp.body, "ok");
}
