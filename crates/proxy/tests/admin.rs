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
    let (status, ready) = s.proxy.admin_get("/ready").await;
    assert_eq!(status, StatusCode::OK);
    // Where TLS runs, and why not in the kernel when it does not (these kernels lack CONFIG_TLS).
    assert!(
        ready.contains("kernel TLS: ") && ready.contains("rustls in user space"),
        "{ready}"
    );

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

/// A node with one direct-response route and `admin: {ADMIN}` written as `admin_yaml`
/// (`{admin}` in it is replaced by a free loopback address).
fn node_with_admin(admin_yaml: &str) -> (TestNode, SocketAddr) {
    let (admin, web) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
{admin_section}
workers: 1
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - name: secret-route
        match: {{ path: {{ prefix: / }}, headers: [ {{ name: x-api-key, exact: "match-secret-value" }} ] }}
        direct_response: {{ status: 200, body: "ok" }}
        request_headers_to_add: {{ authorization: "Bearer upstream-secret-value" }}
        response_headers_to_add: {{ x-edit: "edit-secret-value" }}
"#,
        admin_section = admin_yaml.replace("{admin}", &admin.to_string())
    );
    (TestNode::start(&yaml), web)
}

/// Send `raw` on a new connection to `addr` and read until the server closes (bounded).
async fn raw_exchange(addr: SocketAddr, raw: &str) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    conn.write_all(raw.as_bytes()).await.expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        conn.read_to_end(&mut answer),
    )
    .await;
    String::from_utf8_lossy(&answer).into_owned()
}

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_is_needed_for_everything_but_ready_and_open_paths() {
    let (node, _) = node_with_admin(&format!(
        "admin: {{ address: \"{{admin}}\", token: {TOKEN}, open_paths: [ /metrics ] }}"
    ));
    let admin = node.admin;
    let call = |method: http::Method, path: &str, token: Option<&str>| {
        let url = format!("http://{admin}{path}");
        let auth = token.map(|t| format!("Bearer {t}"));
        async move {
            let headers: Vec<(&str, &str)> = auth
                .as_deref()
                .map(|a| vec![("authorization", a)])
                .unwrap_or_default();
            send(&h1_client(), request(method, &url, &headers, ""))
                .await
                .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    use http::Method;
    for path in ["/config", "/rules", "/listeners"] {
        let refused = call(Method::GET, path, None).await;
        assert_eq!(
            refused.status,
            StatusCode::UNAUTHORIZED,
            "{path}: {refused:?}"
        );
        assert!(refused.header("www-authenticate").is_some(), "{refused:?}");
        let wrong = call(Method::GET, path, Some("0123456789abcdef0123456789abcdeX")).await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(
            call(Method::GET, path, Some(TOKEN)).await.status,
            StatusCode::OK,
            "{path}"
        );
    }
    // A probe without the token learns that the node is ready, not how it is built.
    let ready = call(Method::GET, "/ready", None).await;
    assert_eq!(
        (ready.status, ready.body.as_str()),
        (StatusCode::OK, "ready\n")
    );
    let detailed = call(Method::GET, "/ready", Some(TOKEN)).await;
    assert_eq!(detailed.status, StatusCode::OK);
    assert!(detailed.body.contains("fd limit: "), "{}", detailed.body);
    assert_eq!(
        call(Method::GET, "/metrics", None).await.status,
        StatusCode::OK
    );
    // Changing the node always needs the token.
    assert_eq!(
        call(Method::POST, "/reload", None).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(Method::POST, "/reload", Some(TOKEN)).await.status,
        StatusCode::OK
    );
    let metrics = call(Method::GET, "/metrics", None).await.body;
    let refused: f64 = metric_samples(&metrics, "flatmesh_admin_refused", &["reason=\"token\""])
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert!(refused >= 7.0, "refusals not counted:\n{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_refuses_a_host_that_does_not_name_it() {
    let (node, _) =
        node_with_admin("admin: { address: \"{admin}\", hosts: [ node-1.mesh.internal ] }");
    let url = format!("http://{}/config", node.admin);
    for (host, want) in [
        ("attacker.example", StatusCode::FORBIDDEN),
        ("attacker.example:15000", StatusCode::FORBIDDEN),
        ("localhost:15000", StatusCode::OK),
        ("node-1.mesh.internal", StatusCode::OK),
    ] {
        let resp = send(
            &h1_client(),
            request(http::Method::GET, &url, &[("host", host)], ""),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(resp.status, want, "Host: {host}: {}", resp.body);
    }
    // The client's own Host (the loopback address and port) passes.
    assert_eq!(node.admin_get("/config").await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_hides_header_values_and_the_token() {
    let (node, _) = node_with_admin(&format!(
        "admin: {{ address: \"{{admin}}\", token: {TOKEN} }}"
    ));
    let url = format!("http://{}/config", node.admin);
    let auth = format!("Bearer {TOKEN}");
    let resp = send(
        &h1_client(),
        request(http::Method::GET, &url, &[("authorization", &auth)], ""),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resp.status, StatusCode::OK, "{}", resp.body);
    for secret in [
        TOKEN,
        "match-secret-value",
        "upstream-secret-value",
        "edit-secret-value",
    ] {
        assert!(
            !resp.body.contains(secret),
            "/config shows {secret}:\n{}",
            resp.body
        );
    }
    for kept in [
        "x-api-key",
        "authorization",
        "x-edit",
        "secret-route",
        "[redacted]",
    ] {
        assert!(
            resp.body.contains(kept),
            "/config lost {kept}:\n{}",
            resp.body
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_admin_request_is_cut_off() {
    let (node, _) = node_with_admin("admin: { address: \"{admin}\", header_read_timeout: 300ms }");
    let started = std::time::Instant::now();
    // Half a request head, then silence: the node must not keep the connection for ever.
    let answer = raw_exchange(node.admin, "GET /config HTTP/1.1\r\nHost: localhost\r\n").await;
    let waited = started.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(3),
        "an unfinished request head held its admin connection for {waited:?} (answer {answer:?})"
    );
    node.assert_alive("after a slow admin client").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_admin_connections_are_capped() {
    let (node, _) = node_with_admin("admin: { address: \"{admin}\", max_connections: 3 }");
    // Three idle connections take every slot (they send nothing)...
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(
            tokio::net::TcpStream::connect(node.admin)
                .await
                .expect("connect"),
        );
    }
    // ... so the next one is answered "busy" and closed at once, instead of costing an fd
    // for as long as the client likes.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let answer = raw_exchange(node.admin, "GET /ready HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "a connection over admin.max_connections was served: {answer:?}"
    );
    drop(idle);
    let served = eventually(std::time::Duration::from_secs(3), || async {
        raw_exchange(
            node.admin,
            "GET /ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        )
        .await
        .starts_with("HTTP/1.1 200")
    })
    .await;
    assert!(
        served,
        "the admin endpoint did not recover once the idle connections closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_on_a_unix_socket_is_for_its_owner_only() {
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    let dir = TempDir::new();
    let socket = dir.path.join("admin.sock");
    let web = free_addr();
    let yaml = format!(
        "admin: unix:{}\nworkers: 1\nlisteners:\n  - name: web\n    address: {web}\n    protocol: http\n    routes:\n      - direct_response: {{ status: 200 }}\n",
        socket.display()
    );
    let config = flatmesh_config::parse(&yaml, "t.yaml").unwrap_or_else(|e| panic!("{e}"));
    let node = flatmesh_proxy::Node::start(config.clone(), flatmesh_proxy::ConfigSource::Inline)
        .unwrap_or_else(|e| panic!("{e}"));
    let meta = std::fs::metadata(&socket).expect("the socket file exists");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let mut conn = tokio::net::UnixStream::connect(&socket)
        .await
        .expect("connect");
    conn.write_all(b"GET /ready HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .expect("write");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("read");
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    // A second node cannot take a socket that a live node answers on.
    let second = flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline);
    let err = second.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("another process answers on it"), "{err}");
    std::thread::spawn(move || node.shutdown())
        .join()
        .expect("shutdown");
    assert!(!socket.exists(), "the socket file outlived the node");
}
