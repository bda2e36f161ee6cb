//! Route matching (every match kind, first match wins, no-route 404), forwarding with header
//! rewrites, direct responses, HTTP/1.1 + h2c on one port, and HTTP/2 upstream clusters.

mod common;

use common::backends::{HttpBackend, Proto};
use common::*;
use http::{Method, StatusCode, Version};

/// A config whose routes are mostly direct responses: the body names the route that matched,
/// so matching is checked without a backend per route.
fn matching_config(admin: std::net::SocketAddr, web: std::net::SocketAddr) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ host: api.local }}
        direct_response: {{ status: 200, body: "host-exact" }}
      - match: {{ host: "*.example.com" }}
        direct_response: {{ status: 200, body: "host-wildcard" }}
      - match: {{ path: {{ exact: /exact }} }}
        direct_response: {{ status: 200, body: "path-exact" }}
      - match: {{ path: {{ prefix: /pre }} }}
        direct_response: {{ status: 200, body: "path-prefix" }}
      - match: {{ path: {{ regex: "^/v[0-9]+/items$" }} }}
        direct_response: {{ status: 200, body: "path-regex" }}
      - match: {{ path: {{ prefix: /m }}, method: DELETE }}
        direct_response: {{ status: 200, body: "method" }}
      - match: {{ path: {{ prefix: /h }}, headers: [ {{ name: x-exact, exact: "1" }} ] }}
        direct_response: {{ status: 200, body: "header-exact" }}
      - match: {{ path: {{ prefix: /h }}, headers: [ {{ name: x-prefix, prefix: "abc" }} ] }}
        direct_response: {{ status: 200, body: "header-prefix" }}
      - match: {{ path: {{ prefix: /h }}, headers: [ {{ name: x-present, present: true }} ] }}
        direct_response: {{ status: 200, body: "header-present" }}
      - match: {{ path: {{ prefix: /h }}, headers: [ {{ name: x-regex, regex: "^id-[0-9]{{3}}$" }} ] }}
        direct_response: {{ status: 200, body: "header-regex" }}
      - match: {{ path: {{ prefix: /q }}, query: [ {{ name: mode, exact: "fast" }} ] }}
        direct_response: {{ status: 200, body: "query-exact" }}
      - match: {{ path: {{ prefix: /q }}, query: [ {{ name: debug, present: true }} ] }}
        direct_response: {{ status: 200, body: "query-present" }}
      - match: {{ path: {{ prefix: /q }}, query: [ {{ name: user, prefix: "adm" }} ] }}
        direct_response: {{ status: 200, body: "query-prefix" }}
      - match: {{ path: {{ prefix: /q }}, query: [ {{ name: id, regex: "^[0-9]+$" }} ] }}
        direct_response: {{ status: 200, body: "query-regex" }}
      - match: {{ path: {{ prefix: /and }}, method: POST, headers: [ {{ name: x-and, exact: "yes" }} ] }}
        direct_response: {{ status: 200, body: "all-conditions" }}
      - match: {{ path: {{ prefix: /order }} }}
        direct_response: {{ status: 200, body: "order-first" }}
      - match: {{ path: {{ prefix: /order/second }} }}
        direct_response: {{ status: 200, body: "order-second" }}
      - match: {{ path: {{ exact: /teapot }} }}
        direct_response: {{ status: 418, body: "short and stout" }}
clusters: []
"#
    )
}

/// (method, path, headers, host, expected route body or None for "no route").
type Case = (
    Method,
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
    Option<&'static str>,
);

const CASES: &[Case] = &[
    // host exact; the port in Host is ignored
    (
        Method::GET,
        "/anything",
        &[],
        "api.local",
        Some("host-exact"),
    ),
    (
        Method::GET,
        "/anything",
        &[],
        "api.local:8080",
        Some("host-exact"),
    ),
    (Method::GET, "/anything", &[], "api.locals", None),
    // host wildcard: any subdomain, but not the bare domain or a look-alike suffix
    (
        Method::GET,
        "/anything",
        &[],
        "foo.example.com",
        Some("host-wildcard"),
    ),
    (
        Method::GET,
        "/anything",
        &[],
        "foo.example.com:9999",
        Some("host-wildcard"),
    ),
    (Method::GET, "/anything", &[], "example.com", None),
    (Method::GET, "/anything", &[], "fooexample.com", None),
    // path exact (the query string is not part of the path)
    (Method::GET, "/exact", &[], "t.local", Some("path-exact")),
    (
        Method::GET,
        "/exact?x=1",
        &[],
        "t.local",
        Some("path-exact"),
    ),
    (Method::GET, "/exact/more", &[], "t.local", None),
    (Method::GET, "/exac", &[], "t.local", None),
    // path prefix
    (Method::GET, "/pre", &[], "t.local", Some("path-prefix")),
    (
        Method::GET,
        "/pre/deeper/x",
        &[],
        "t.local",
        Some("path-prefix"),
    ),
    (Method::GET, "/pr", &[], "t.local", None),
    // path regex
    (Method::GET, "/v1/items", &[], "t.local", Some("path-regex")),
    (
        Method::GET,
        "/v42/items",
        &[],
        "t.local",
        Some("path-regex"),
    ),
    (Method::GET, "/vx/items", &[], "t.local", None),
    (Method::GET, "/v1/items/extra", &[], "t.local", None),
    // method
    (Method::DELETE, "/m", &[], "t.local", Some("method")),
    (Method::GET, "/m", &[], "t.local", None),
    // headers
    (
        Method::GET,
        "/h",
        &[("x-exact", "1")],
        "t.local",
        Some("header-exact"),
    ),
    (Method::GET, "/h", &[("x-exact", "12")], "t.local", None),
    (
        Method::GET,
        "/h",
        &[("x-prefix", "abcdef")],
        "t.local",
        Some("header-prefix"),
    ),
    (Method::GET, "/h", &[("x-prefix", "xabc")], "t.local", None),
    (
        Method::GET,
        "/h",
        &[("x-present", "")],
        "t.local",
        Some("header-present"),
    ),
    (
        Method::GET,
        "/h",
        &[("x-present", "whatever")],
        "t.local",
        Some("header-present"),
    ),
    (
        Method::GET,
        "/h",
        &[("x-regex", "id-123")],
        "t.local",
        Some("header-regex"),
    ),
    (
        Method::GET,
        "/h",
        &[("x-regex", "id-1234")],
        "t.local",
        None,
    ),
    (Method::GET, "/h", &[], "t.local", None),
    // query parameters
    (
        Method::GET,
        "/q?mode=fast",
        &[],
        "t.local",
        Some("query-exact"),
    ),
    (
        Method::GET,
        "/q?a=1&mode=fast&b=2",
        &[],
        "t.local",
        Some("query-exact"),
    ),
    (Method::GET, "/q?mode=faster", &[], "t.local", None),
    (
        Method::GET,
        "/q?debug",
        &[],
        "t.local",
        Some("query-present"),
    ),
    (
        Method::GET,
        "/q?debug=1",
        &[],
        "t.local",
        Some("query-present"),
    ),
    (
        Method::GET,
        "/q?user=admin",
        &[],
        "t.local",
        Some("query-prefix"),
    ),
    (Method::GET, "/q?user=root", &[], "t.local", None),
    (
        Method::GET,
        "/q?id=12345",
        &[],
        "t.local",
        Some("query-regex"),
    ),
    (Method::GET, "/q?id=12a", &[], "t.local", None),
    (Method::GET, "/q", &[], "t.local", None),
    // all conditions of one route must hold
    (
        Method::POST,
        "/and",
        &[("x-and", "yes")],
        "t.local",
        Some("all-conditions"),
    ),
    (Method::GET, "/and", &[("x-and", "yes")], "t.local", None),
    (Method::POST, "/and", &[("x-and", "no")], "t.local", None),
    // first match wins, even when a later route is more specific
    (
        Method::GET,
        "/order/second",
        &[],
        "t.local",
        Some("order-first"),
    ),
    (Method::GET, "/order", &[], "t.local", Some("order-first")),
    // nothing matches
    (Method::GET, "/nowhere", &[], "t.local", None),
];

async fn check_cases_h1(client: &Client, web: std::net::SocketAddr) {
    let mut failures = Vec::new();
    for (method, path, headers, host, expected) in CASES {
        let mut all_headers: Vec<(&str, &str)> = headers.to_vec();
        all_headers.push(("host", host));
        let req = request(
            method.clone(),
            &format!("http://{web}{path}"),
            &all_headers,
            "",
        );
        match send(client, req).await {
            Ok(resp) => {
                if let Some(problem) = judge(expected, &resp) {
                    failures.push(format!(
                        "{method} {path} host={host} {headers:?}: {problem}"
                    ));
                }
            }
            Err(e) => failures.push(format!(
                "{method} {path} host={host} {headers:?}: transport error {e}"
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} routing case(s) wrong via HTTP/1.1:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `None` if the response is what `expected` says (a route body, or the no-route 404).
fn judge(expected: &Option<&str>, resp: &Resp) -> Option<String> {
    match expected {
        Some(body) if resp.status == StatusCode::OK && resp.body == *body => None,
        Some(body) => Some(format!(
            "expected 200 {body:?}, got {} {:?}",
            resp.status, resp.body
        )),
        None if resp.status == StatusCode::NOT_FOUND
            && resp.body.to_ascii_lowercase().contains("no route") =>
        {
            None
        }
        None => Some(format!(
            "expected 404 saying no route matched, got {} {:?}",
            resp.status, resp.body
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_match_kind_and_first_match_wins_http1() {
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&matching_config(admin, web));
    check_cases_h1(&h1_client(), web).await;
}

/// The same cases over HTTP/2 (h2c prior knowledge): host comes from `:authority`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_match_kind_and_first_match_wins_h2c() {
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&matching_config(admin, web));
    let mut failures = Vec::new();
    for (method, path, headers, host, expected) in CASES {
        let resp = match h2c_request(web, method.clone(), host, path, headers).await {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{method} {path} host={host}: transport error {e}"));
                continue;
            }
        };
        if let Some(problem) = judge(expected, &resp) {
            failures.push(format!(
                "{method} {path} host={host} {headers:?}: {problem}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} routing case(s) wrong via h2c:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// One h2c request on its own connection to `addr`, with `:authority` = `host`.
async fn h2c_request(
    addr: std::net::SocketAddr,
    method: Method,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Resp, String> {
    use http_body_util::{BodyExt, Full};
    let fut = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .handshake::<_, Full<bytes::Bytes>>(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut builder = http::Request::builder()
            .method(method)
            .uri(format!("http://{host}{path}"));
        for (n, v) in headers {
            builder = builder.header(*n, *v);
        }
        let req = builder
            .body(Full::new(bytes::Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Resp {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
            raw: body,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| Err("timed out".into()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_response_status_and_body() {
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&matching_config(admin, web));
    let resp = get(&h1_client(), &format!("http://{web}/teapot"), &[]).await;
    assert_eq!(resp.status, StatusCode::IM_A_TEAPOT, "{resp:?}");
    assert_eq!(resp.body, "short and stout");
}

fn forwarding_config(
    admin: std::net::SocketAddr,
    web: std::net::SocketAddr,
    h1: &HttpBackend,
    h2: &HttpBackend,
) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - name: to-h2
        match: {{ path: {{ prefix: /h2 }} }}
        cluster: upstream-h2
      - name: to-h1
        match: {{ path: {{ prefix: / }} }}
        cluster: upstream-h1
        request_headers_to_add: {{ x-via: flatmesh, x-route: to-h1 }}
        request_headers_to_remove: [ x-secret ]
        response_headers_to_add: {{ x-resp-added: "yes" }}
clusters:
  - name: upstream-h1
    endpoints: [ {h1} ]
  - name: upstream-h2
    protocol: http2
    endpoints: [ {h2} ]
"#,
        h1 = h1.addr,
        h2 = h2.addr,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_with_request_and_response_headers_added() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));

    let body = "x".repeat(100_000);
    let req = request(
        Method::POST,
        &format!("http://{web}/api/thing?a=1&b=two"),
        &[
            ("x-client", "kept"),
            ("x-secret", "s3cr3t"),
            ("content-type", "text/plain"),
        ],
        &body,
    );
    let resp = send(&h1_client(), req)
        .await
        .expect("request through proxy");
    assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
    assert_eq!(resp.backend(), Some("b-h1"));
    assert_eq!(
        resp.header("x-resp-added"),
        Some("yes"),
        "response_headers_to_add missing: {resp:?}"
    );
    let echo = resp.echo();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/api/thing");
    assert_eq!(echo["query"], "a=1&b=two");
    assert_eq!(echo["body_len"], 100_000);
    assert_eq!(echo["body_crc"], crc32fast::hash(body.as_bytes()));
    assert_eq!(
        echo["headers"]["x-via"], "flatmesh",
        "request_headers_to_add missing: {echo}"
    );
    assert_eq!(echo["headers"]["x-route"], "to-h1");
    assert_eq!(
        echo["headers"]["x-client"], "kept",
        "client header lost: {echo}"
    );
    assert!(
        echo["headers"].get("x-secret").is_none(),
        "request_headers_to_remove ignored: {echo}"
    );
    assert_eq!(
        echo["headers"]["host"],
        web.to_string(),
        "Host not passed through: {echo}"
    );
    assert_eq!(echo["version"], "HTTP/1.1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_and_h2c_downstream_on_the_same_port() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));

    let url = format!("http://{web}/same-port");
    let one = get(&h1_client(), &url, &[]).await;
    assert_eq!(one.status, StatusCode::OK, "{one:?}");
    assert_eq!(one.version, Version::HTTP_11);
    assert_eq!(one.backend(), Some("b-h1"));

    let client = h2c_client();
    for _ in 0..5 {
        let two = get(&client, &url, &[]).await;
        assert_eq!(two.status, StatusCode::OK, "{two:?}");
        assert_eq!(
            two.version,
            Version::HTTP_2,
            "h2c client got {:?}",
            two.version
        );
        assert_eq!(two.backend(), Some("b-h1"));
        assert_eq!(two.header("x-resp-added"), Some("yes"));
        assert_eq!(two.echo()["headers"]["x-via"], "flatmesh");
    }

    // Many concurrent streams over one h2c connection.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let client = client.clone();
        let url = format!("{url}?i={i}");
        tasks.push(tokio::spawn(async move { get(&client, &url, &[]).await }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let resp = t.await.expect("task");
        assert_eq!(resp.status, StatusCode::OK);
        assert_eq!(resp.echo()["query"], format!("i={i}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_upstream_cluster_speaks_h2c_to_the_backend() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));

    for client in [h1_client(), h2c_client()] {
        let req = request(
            Method::PUT,
            &format!("http://{web}/h2/obj?k=v"),
            &[("x-client", "c")],
            "payload",
        );
        let resp = send(&client, req).await.expect("request through proxy");
        assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
        assert_eq!(resp.backend(), Some("b-h2"));
        let echo = resp.echo();
        assert_eq!(
            echo["version"], "HTTP/2.0",
            "backend should see HTTP/2: {echo}"
        );
        assert_eq!(echo["method"], "PUT");
        assert_eq!(echo["path"], "/h2/obj");
        assert_eq!(echo["query"], "k=v");
        assert_eq!(echo["body_len"], 7);
        assert_eq!(echo["headers"]["x-client"], "c");
    }

    // Concurrent requests multiplexed upstream all come back right.
    let client = h1_client();
    let mut tasks = Vec::new();
    for i in 0..30 {
        let client = client.clone();
        let url = format!("http://{web}/h2/n{i}");
        tasks.push(tokio::spawn(async move { get(&client, &url, &[]).await }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let resp = t.await.expect("task");
        assert_eq!(resp.status, StatusCode::OK);
        assert_eq!(resp.echo()["path"], format!("/h2/n{i}"));
    }
    assert!(h2.hits() >= 32, "h2 backend saw {} requests", h2.hits());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_downstream_to_http1_upstream_carries_the_authority_as_host() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));
    let resp = h2c_request(
        web,
        Method::GET,
        "svc.internal:8080",
        "/a?b=c",
        &[("x-secret", "s")],
    )
    .await
    .expect("h2c request");
    assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
    let echo = resp.echo();
    assert_eq!(echo["version"], "HTTP/1.1");
    assert_eq!(echo["headers"]["host"], "svc.internal:8080", "{echo}");
    assert_eq!(echo["query"], "b=c");
    assert!(echo["headers"].get("x-secret").is_none(), "{echo}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));

    // HTTP/1.1 keep-alive upstream: sequential requests share a pooled connection.
    let client = h1_client();
    for i in 0..100 {
        let resp = get(&client, &format!("http://{web}/seq/{i}"), &[]).await;
        assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
    }
    assert!(
        h1.conns() <= 2,
        "100 sequential requests opened {} upstream HTTP/1.1 connections; keep-alive pooling should need 1 (2 workers: at most 2)",
        h1.conns()
    );

    // HTTP/2 upstream: concurrent requests multiplex over few connections.
    let mut tasks = Vec::new();
    for c in 0..4 {
        tasks.push(tokio::spawn(async move {
            let client = h1_client();
            let mut inner = Vec::new();
            for i in 0..10 {
                let client = client.clone();
                inner.push(tokio::spawn(async move {
                    get(&client, &format!("http://{web}/h2/{c}/{i}"), &[]).await
                }));
            }
            for t in inner {
                assert_eq!(t.await.expect("task").status, StatusCode::OK);
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    assert_eq!(h2.hits(), 40);
    assert!(
        h2.conns() <= 4,
        "40 concurrent requests to an http2 cluster opened {} upstream connections; they should multiplex (one per worker)",
        h2.conns()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_both_directions_over_h1_and_h2() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));

    const LEN: usize = 8 * 1024 * 1024;
    let upload = common::backends::pattern(LEN, 99);
    let upload_crc = crc32fast::hash(&upload);
    // (downstream client, path prefix picking the h1 or h2 cluster)
    let cases = [
        ("h1", "/big"),
        ("h1", "/h2/big"),
        ("h2c", "/big"),
        ("h2c", "/h2/big"),
    ];
    for (down, prefix) in cases {
        let client = if down == "h1" {
            h1_client()
        } else {
            h2c_client()
        };
        let req = http::Request::post(format!("http://{web}{prefix}/up"))
            .body(http_body_util::Full::new(bytes::Bytes::from(
                upload.clone(),
            )))
            .expect("request");
        let resp = send(&client, req).await.expect("upload through the proxy");
        assert_eq!(
            resp.status,
            StatusCode::OK,
            "{down} {prefix}: {}",
            resp.status
        );
        let echo = resp.echo();
        assert_eq!(echo["body_len"], LEN, "{down} {prefix}: upload length");
        assert_eq!(
            echo["body_crc"], upload_crc,
            "{down} {prefix}: upload corrupted"
        );

        let len = LEN.to_string();
        let resp = get(
            &client,
            &format!("http://{web}{prefix}/down"),
            &[("x-response-bytes", &len)],
        )
        .await;
        assert_eq!(
            resp.status,
            StatusCode::OK,
            "{down} {prefix}: {}",
            resp.status
        );
        assert_eq!(resp.raw.len(), LEN, "{down} {prefix}: download length");
        let want = resp.header("x-body-crc").expect("x-body-crc").to_owned();
        assert_eq!(
            crc32fast::hash(&resp.raw).to_string(),
            want,
            "{down} {prefix}: download corrupted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_downstream_connections() {
    let h1 = HttpBackend::start("b-h1", Proto::H1).await;
    let h2 = HttpBackend::start("b-h2", Proto::H2c).await;
    let (admin, web) = (free_addr(), free_addr());
    let _proxy = TestNode::start(&forwarding_config(admin, web, &h1, &h2));
    // 200 clients, each on its own keep-alive connection, 5 requests each, all at once.
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..200 {
        tasks.spawn(async move {
            let client = h1_client();
            for i in 0..5 {
                let resp = get(&client, &format!("http://{web}/c{c}/{i}"), &[]).await;
                assert_eq!(
                    resp.status,
                    StatusCode::OK,
                    "client {c} request {i}: {resp:?}"
                );
                assert_eq!(resp.echo()["path"], format!("/c{c}/{i}"));
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("client task");
    }
    assert_eq!(h1.hits(), 1000);
}
