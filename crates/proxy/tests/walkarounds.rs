//! Requests that try to walk around a rule (issue 23, items 5 and 9): paths that a backend
//! reads as a denied one (`//admin`, `/./admin`, `/%61dmin`, `/x/../admin`), escaped slashes,
//! and hosts that are not `host[:port]`, over HTTP/1.1 and HTTP/2. The listener with a deny
//! route normalises paths by default; what the routes match is what the backend gets.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::backends::{HttpBackend, Proto};
use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Setup {
    _proxy: TestNode,
    app: HttpBackend,
    /// Defaults: a deny route, so paths are normalised and escaped slashes refused.
    web: SocketAddr,
    /// `path_with_escaped_slashes_action: unescape_and_redirect`.
    redirect: SocketAddr,
    /// `path_with_escaped_slashes_action: unescape_and_forward`.
    forward: SocketAddr,
    /// Every normalisation switched off: paths as received.
    raw: SocketAddr,
}

async fn setup() -> Setup {
    let app = HttpBackend::start("app", Proto::H1).await;
    let admin = free_addr();
    let (web, redirect, forward, raw) = (free_addr(), free_addr(), free_addr(), free_addr());
    let routes = r#"    routes:
      - match: { path: { prefix: /admin } }
        direct_response: { status: 403, body: "denied" }
      - match: { path: { prefix: / } }
        cluster: app"#;
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {web}
    protocol: http
{routes}
  - name: redirect
    address: {redirect}
    protocol: http
    path_with_escaped_slashes_action: unescape_and_redirect
{routes}
  - name: forward
    address: {forward}
    protocol: http
    path_with_escaped_slashes_action: unescape_and_forward
{routes}
  - name: raw
    address: {raw}
    protocol: http
    normalize_path: false
    merge_slashes: false
    path_with_escaped_slashes_action: keep_unchanged
{routes}
clusters:
  - name: app
    endpoints: [ {} ]
"#,
        app.addr
    );
    Setup {
        _proxy: TestNode::start(&yaml),
        app,
        web,
        redirect,
        forward,
        raw,
    }
}

/// Sends `target` as written (no client library tidies it) and reads the answer's head and
/// body (the answers here all carry a Content-Length).
async fn get_raw(addr: SocketAddr, target: &str, host: &str) -> (u16, String, String) {
    let mut c = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    c.write_all(req.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line for {target}: {text:?}"));
    (status, head.to_owned(), body.to_owned())
}

/// The walk-arounds of the attack run, each of which reached the backend past a deny route
/// on `/admin` before paths were normalised.
const WALKS: [&str; 8] = [
    "//admin",
    "/./admin",
    "/%61dmin",
    "/x/../admin",
    "///admin/x",
    "/%2e/admin",
    "/a/b/../../admin",
    "/admin/./x",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_normal_paths_cannot_walk_around_a_deny_route_over_http1() {
    let s = setup().await;
    for walk in WALKS {
        let (status, _, body) = get_raw(s.web, walk, "t").await;
        assert_eq!((status, body.as_str()), (403, "denied"), "{walk}");
    }
    assert_eq!(s.app.hits(), 0, "no walk-around reached the backend");
    // Paths are case-sensitive (RFC 3986, Envoy): `/ADMIN` is another path, sent on as such.
    let (status, _, body) = get_raw(s.web, "/ADMIN", "t").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#""path":"/ADMIN""#), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_normal_paths_cannot_walk_around_a_deny_route_over_http2() {
    let s = setup().await;
    let client = h2c_client();
    for walk in WALKS {
        let resp = get(&client, &format!("http://{}{walk}", s.web), &[]).await;
        assert_eq!(resp.status, StatusCode::FORBIDDEN, "{walk}: {resp:?}");
    }
    assert_eq!(s.app.hits(), 0, "no walk-around reached the backend");
    // The backend gets the normalised path, over HTTP/2 as over HTTP/1.
    let resp = get(
        &client,
        &format!("http://{}/a/./b/../c//d?q=/../x", s.web),
        &[],
    )
    .await;
    assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
    assert_eq!(resp.echo()["path"], "/a/c/d");
    assert_eq!(resp.echo()["query"], "q=/../x", "the query is not touched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_gets_the_path_the_routes_matched() {
    let s = setup().await;
    let (status, _, body) = get_raw(s.web, "/a/./b/../c//d/%7Euser%2d?x=%2e%2e/", "t").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""path":"/a/c/d/~user-""#), "{body}");
    assert!(body.contains(r#""query":"x=%2e%2e/""#), "{body}");
    // With normalisation off, the path goes on as it came (and the deny route is walked
    // around: the listener's own choice).
    let (status, _, body) = get_raw(s.raw, "//admin", "t").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""path":"//admin""#), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escaped_slashes_are_refused_redirected_or_unescaped_as_configured() {
    let s = setup().await;
    // Default where a route denies: 400.
    let (status, _, body) = get_raw(s.web, "/x%2F..%2Fadmin", "t").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("escaped slash"), "{body}");
    let (status, _, _) = get_raw(s.web, "/a%5cb", "t").await;
    assert_eq!(status, 400);
    // A `%` that escapes nothing is not a path.
    let (status, _, body) = get_raw(s.web, "/a%zz", "t").await;
    assert_eq!(status, 400, "{body}");
    // unescape_and_redirect: 307 to the plain path, query kept.
    let (status, head, _) = get_raw(s.redirect, "/a%2Fb?q=1", "t").await;
    assert_eq!(status, 307, "{head}");
    assert!(
        head.to_ascii_lowercase().contains("location: /a/b?q=1"),
        "{head}"
    );
    // unescape_and_forward: unescaped, then normalised and matched.
    let (status, _, body) = get_raw(s.forward, "/x%2F..%2Fadmin", "t").await;
    assert_eq!((status, body.as_str()), (403, "denied"));
    let (status, _, body) = get_raw(s.forward, "/a%2Fb", "t").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#""path":"/a/b""#), "{body}");
    assert_eq!(s.app.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_hosts_are_refused_over_http1_and_http2() {
    let s = setup().await;
    for host in [
        "a b",
        "user@evil",
        "[::1",
        "x:y",
        "a/b",
        "<script>",
        "h:123456",
    ] {
        let (status, _, body) = get_raw(s.web, "/x", host).await;
        assert_eq!(status, 400, "Host {host:?}: {body}");
    }
    let (status, _, body) = get_raw(s.web, "http://a%zz/x", "t").await;
    assert_eq!(status, 400, "absolute-form authority: {body}");
    // HTTP/2: a Host header next to :authority is checked as well.
    let client = h2c_client();
    let resp = get(&client, &format!("http://{}/x", s.web), &[("host", "a b")]).await;
    assert_eq!(resp.status, StatusCode::BAD_REQUEST, "{resp:?}");
    assert_eq!(s.app.hits(), 0, "no garbage host reached the backend");
    // Valid ones pass: names, ports, IPv6 literals.
    for host in ["api.local", "api.local:8080", "[::1]:80", "10.0.0.1"] {
        let (status, _, body) = get_raw(s.web, "/x", host).await;
        assert_eq!(status, 200, "Host {host:?}: {body}");
    }
}
