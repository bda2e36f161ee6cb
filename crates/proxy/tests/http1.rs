//! The HTTP/1 path's protocol corners, against scripted raw upstreams and raw clients, so
//! that every byte on both sides is known: HTTP/1.0 clients, `Expect: 100-continue`,
//! informational answers, HEAD, bodies delimited by close or chunked, keep-alive connections
//! the upstream closes while idle, absolute-form targets, invalid upstream answers, and a
//! chunked upload to an HTTP/2 cluster.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::backends::{HttpBackend, Proto};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw upstream: for each request it reads the head (and a Content-Length body), records
/// the head, and writes `answer(n)` where n counts requests across connections. If the
/// answer ends with `"<close>"` (removed before sending), it closes the connection after it.
struct Scripted {
    addr: SocketAddr,
    heads: Arc<tokio::sync::Mutex<Vec<String>>>,
    requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Scripted {
    async fn start(answer: impl Fn(usize) -> Vec<u8> + Send + Sync + 'static) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let heads = Arc::new(tokio::sync::Mutex::new(Vec::new()));
        let requests = Arc::new(AtomicUsize::new(0));
        let answer = Arc::new(answer);
        let (h, r) = (heads.clone(), requests.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    continue;
                };
                let (heads, requests, answer) = (h.clone(), r.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let Some(end) = read_head(&mut conn, &mut buf).await else {
                            return;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        let length = header(&head, "content-length")
                            .and_then(|v| v.parse::<usize>().ok())
                            .unwrap_or(0);
                        while buf.len() < end + length {
                            let mut chunk = [0u8; 4096];
                            match conn.read(&mut chunk).await {
                                Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                                _ => return,
                            }
                        }
                        buf.drain(..end + length);
                        heads.lock().await.push(head);
                        let n = requests.fetch_add(1, Ordering::SeqCst);
                        let mut out = answer(n);
                        let close = out.ends_with(b"<close>");
                        if close {
                            out.truncate(out.len() - 7);
                        }
                        if conn.write_all(&out).await.is_err() || close {
                            return;
                        }
                    }
                });
            }
        });
        Scripted {
            addr,
            heads,
            requests,
            task,
        }
    }

    async fn head(&self, i: usize) -> String {
        self.heads.lock().await.get(i).cloned().unwrap_or_default()
    }
}

/// Reads until `buf` holds a whole head; returns its length (blank line included).
async fn read_head(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(p + 4);
        }
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
}

fn header<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Reads from `conn` until `done(bytes so far)` or the connection ends or 5 s pass.
async fn read_until(conn: &mut TcpStream, done: impl Fn(&[u8]) -> bool) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if done(&got) {
            return (got, false);
        }
        match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&chunk[..n]),
            Ok(_) => return (got, true),
            Err(_) => panic!("timed out; got so far: {:?}", String::from_utf8_lossy(&got)),
        }
    }
}

/// A whole response with a Content-Length body is in `b`.
fn response_complete(b: &[u8]) -> bool {
    let Some(end) = b.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&b[..end]);
    let length = header(&head, "content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    b.len() >= end + 4 + length
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

async fn proxy_to(upstream: SocketAddr, protocol: &str) -> (TestNode, SocketAddr) {
    proxy_routes(upstream, protocol, "").await
}

/// As [`proxy_to`], with `routes` (YAML list items, indented by 6) before the catch-all.
async fn proxy_routes(
    upstream: SocketAddr,
    protocol: &str,
    routes: &str,
) -> (TestNode, SocketAddr) {
    let (admin, web) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
{routes}
      - match: {{ path: {{ prefix: / }} }}
        cluster: up
        response_headers_to_add: {{ x-proxied: "1" }}
clusters:
  - name: up
    protocol: {protocol}
    endpoints: [ {upstream} ]
"#
    );
    (TestNode::start(&yaml), web)
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_client_gets_a_dechunked_body_and_a_close() {
    let up = Scripted::start(|_| {
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            .to_vec()
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"GET /a HTTP/1.0\r\n\r\n").await.unwrap();
    let (got, closed) = read_until(&mut c, |_| false).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        closed,
        "an HTTP/1.0 response without a length ends with the close"
    );
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.ends_with("\r\n\r\nhello world"), "dechunked: {text}");
    assert!(!contains(&got, "transfer-encoding"), "{text}");
    // The upstream got HTTP/1.1 with a Host (the endpoint's, since the client sent none).
    let head = up.head(0).await;
    assert!(head.starts_with("GET /a HTTP/1.1\r\n"), "{head}");
    assert_eq!(header(&head, "host"), Some(up.addr.to_string().as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_keep_alive_is_honoured() {
    let up = Scripted::start(|_| b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec()).await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    for _ in 0..3 {
        c.write_all(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await
            .unwrap();
        let (got, closed) = read_until(&mut c, |b| b.ends_with(b"\r\n\r\nok")).await;
        assert!(!closed);
        assert!(contains(
            &got.to_ascii_lowercase(),
            "connection: keep-alive"
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delimited_upstream_body_is_chunked_to_a_keep_alive_client() {
    let up =
        Scripted::start(|n| format!("HTTP/1.0 200 OK\r\n\r\nbody-{n}<close>").into_bytes()).await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    for n in 0..2 {
        c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let (got, closed) = read_until(&mut c, |b| b.ends_with(b"0\r\n\r\n")).await;
        assert!(!closed, "the client's connection stays open");
        let text = String::from_utf8_lossy(&got);
        assert!(contains(&got, "transfer-encoding: chunked"), "{text}");
        assert!(
            text.ends_with(&format!("\r\n6\r\nbody-{n}\r\n0\r\n\r\n")),
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_then_the_body_flows() {
    let up =
        Scripted::start(|_| b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n".to_vec()).await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"PUT /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, |b| contains(b, "\r\n\r\n")).await;
    assert!(
        got.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    c.write_all(b"hello").await.unwrap();
    let (got, _) = read_until(&mut c, |b| contains(b, "201")).await;
    assert!(contains(&got, "HTTP/1.1 201 Created"));
    let head = up.head(0).await;
    assert_eq!(
        header(&head, "expect"),
        None,
        "the proxy answered it: {head}"
    );
    assert_eq!(header(&head, "content-length"), Some("5"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn informational_answers_pass_through_to_http11_clients() {
    let up = Scripted::start(|_| {
        b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            .to_vec()
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, |b| b.ends_with(b"\r\n\r\nok")).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 103 Early Hints\r\n"), "{text}");
    assert!(contains(&got, "HTTP/1.1 200 OK"), "{text}");
    assert!(
        !text
            .split("HTTP/1.1 200")
            .next()
            .unwrap_or("")
            .contains("x-proxied"),
        "route headers go on the final answer only: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_answers_keep_their_length_and_send_no_body() {
    let up = Scripted::start(|n| match n {
        0 => b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n".to_vec(),
        _ => b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext".to_vec(),
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\nGET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, |b| b.ends_with(b"next")).await;
    let text = String::from_utf8_lossy(&got);
    let first = text.split("HTTP/1.1 200 OK").nth(1).unwrap_or_default();
    assert!(
        first.contains("content-length: 1234") || first.contains("Content-Length: 1234"),
        "{text}"
    );
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_connection_the_upstream_closed_while_idle_is_replaced() {
    // The upstream answers with keep-alive but closes every connection right after it.
    let up = Scripted::start(|n| {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n{}<close>",
            n % 10
        )
        .into_bytes()
    })
    .await;
    let (proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    for i in 0..10 {
        c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let (got, closed) = read_until(&mut c, response_complete).await;
        assert!(!closed);
        assert!(
            got.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&got)
        );
        // Give the proxy's reactor time to see the close, or not: both must work (the
        // first finds the pooled connection stale, the second fails on it and retries).
        if i % 2 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 10);
    let metrics = proxy.metrics().await;
    assert!(
        metric_samples(
            &metrics,
            "flatmesh_requests_total",
            &["status_class=\"5xx\""]
        )
        .iter()
        .all(|(_, v)| *v == 0.0),
        "no 5xx: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_targets_are_sent_in_origin_form_with_their_host() {
    let up = Scripted::start(|_| b"HTTP/1.1 204 No Content\r\n\r\n".to_vec()).await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"GET http://api.example:8080/p?q=1 HTTP/1.1\r\nHost: ignored\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, |b| contains(b, "\r\n\r\n")).await;
    assert!(got.starts_with(b"HTTP/1.1 204"));
    let head = up.head(0).await;
    assert!(head.starts_with("GET /p?q=1 HTTP/1.1\r\n"), "{head}");
    assert_eq!(header(&head, "host"), Some("api.example:8080"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_upstream_answers_are_502_and_the_proxy_carries_on() {
    let up = Scripted::start(|n| match n {
        0 => b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx".to_vec(),
        1 => b"garbage\r\n\r\n".to_vec(),
        _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    for want in ["502", "502", "200"] {
        let mut c = connect(web).await;
        c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let (got, _) = read_until(&mut c, |_| false).await;
        assert!(
            got.starts_with(format!("HTTP/1.1 {want}").as_bytes()),
            "{}",
            String::from_utf8_lossy(&got)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_upload_to_an_http2_cluster() {
    let backend = HttpBackend::start("h2", Proto::H2c).await;
    let (_proxy, web) = proxy_to(backend.addr, "http2").await;
    let mut c = connect(web).await;
    let mut body = Vec::new();
    let mut sent = Vec::new();
    for i in 0..50u32 {
        let piece = common::backends::pattern(1000 + i as usize, u64::from(i));
        body.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        body.extend_from_slice(&piece);
        body.extend_from_slice(b"\r\n");
        sent.extend_from_slice(&piece);
    }
    body.extend_from_slice(b"0\r\n\r\n");
    c.write_all(b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    c.write_all(&body).await.unwrap();
    let (got, _) = read_until(&mut c, |b| b.ends_with(b"}")).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    let json = &text[text.find('{').expect("json body")..];
    let echo: serde_json::Value = serde_json::from_str(json).expect("echo");
    assert_eq!(echo["version"], "HTTP/2.0");
    assert_eq!(echo["body_len"], sent.len());
    assert_eq!(echo["body_crc"], crc32fast::hash(&sent));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrade_becomes_a_tunnel() {
    // An upstream that switches protocols and then echoes upper-cased bytes until EOF.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let upstream = listener.local_addr().expect("addr");
    let seen = Arc::new(tokio::sync::Mutex::new(String::new()));
    let seen_by_upstream = seen.clone();
    let server = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        let mut buf = Vec::new();
        let end = read_head(&mut conn, &mut buf).await.expect("a head");
        *seen_by_upstream.lock().await = String::from_utf8_lossy(&buf[..end]).into_owned();
        conn.write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
            .await
            .expect("101");
        let mut rest = buf[end..].to_vec();
        let mut chunk = [0u8; 1024];
        loop {
            if !rest.is_empty() {
                conn.write_all(&rest.to_ascii_uppercase())
                    .await
                    .expect("echo");
                rest.clear();
            }
            match conn.read(&mut chunk).await {
                Ok(n) if n > 0 => rest.extend_from_slice(&chunk[..n]),
                _ => break,
            }
        }
        let _ = conn.shutdown().await;
    });
    // Upgrades are a route's opt-in (issue 23 item 5): /chat lets WebSocket through.
    let chat = "      - match: { path: { prefix: /chat } }\n        cluster: up\n        upgrades: [ websocket ]";
    let (_proxy, web) = proxy_routes(upstream, "http1", chat).await;
    let mut c = connect(web).await;
    c.write_all(b"GET /chat HTTP/1.1\r\nHost: t\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\nearly")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, |b| b.ends_with(b"EARLY")).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
        "{text}"
    );
    assert!(
        contains(&got.to_ascii_lowercase(), "upgrade: websocket"),
        "{text}"
    );
    assert!(contains(&got, "connection: upgrade"), "{text}");
    for word in ["hello", "world"] {
        c.write_all(word.as_bytes()).await.unwrap();
        let (got, _) = read_until(&mut c, |b| {
            b.ends_with(word.to_ascii_uppercase().as_bytes())
        })
        .await;
        assert!(!got.is_empty());
    }
    c.shutdown().await.unwrap();
    let (_, closed) = read_until(&mut c, |_| false).await;
    assert!(closed, "the tunnel closes when both sides are done");
    server.await.expect("upstream finished");
    let head = seen.lock().await.clone();
    assert_eq!(header(&head, "upgrade"), Some("websocket"), "{head}");
    assert_eq!(header(&head, "connection"), Some("upgrade"), "{head}");
    assert_eq!(
        header(&head, "sec-websocket-key"),
        Some("dGhlIHNhbXBsZSBub25jZQ==")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_the_route_does_not_allow_is_403_and_never_reaches_the_upstream() {
    // Issue 23 item 5: any Upgrade used to become a raw tunnel on a 101, out of the rules'
    // reach. Without `upgrades` on the route, Envoy's answer: 403.
    let up = Scripted::start(|_| {
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            .to_vec()
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"GET /chat HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        .await
        .unwrap();
    let (got, closed) = read_until(&mut c, |_| false).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{text}");
    assert!(text.contains("list it in the route's `upgrades`"), "{text}");
    assert!(closed, "the connection closes after a refused upgrade");
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        0,
        "the upstream never saw it"
    );
    // `Upgrade: h2c` is dropped (as Envoy drops it): the request is served as HTTP/1.1.
    let up = Scripted::start(|_| b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec()).await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, response_complete).await;
    assert!(
        got.starts_with(b"HTTP/1.1 200 OK\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    let head = up.head(0).await;
    for gone in ["upgrade", "http2-settings", "connection"] {
        assert_eq!(header(&head, gone), None, "{gone} went upstream: {head}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_trailers_lose_the_fields_no_trailer_may_carry() {
    // Issue 23 item 9: trailers were forwarded unchecked (NUL, obs-fold, Content-Length, Host).
    let up = Scripted::start(|_| {
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-sum\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 1\r\nContent-Length: 99\r\nHost: evil\r\nx-nul: a\0b\r\nx-fold: a\r\n b\r\nSet-Cookie: s=1\r\n\r\n"
            .to_vec()
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, |b| {
        contains(b, "\r\n0\r\n") && b.ends_with(b"\r\n\r\n")
    })
    .await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.ends_with("\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_lose_the_fields_no_trailer_may_carry() {
    // An upstream that records the whole chunked request body as it arrives.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let upstream = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.expect("accept");
        // The body ends with the trailer section's empty line, after the last chunk.
        let (got, _) = read_until(&mut conn, |b| {
            contains(b, "\r\n0\r\n") && b.ends_with(b"\r\n\r\n")
        })
        .await;
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            .await
            .expect("answer");
        String::from_utf8_lossy(&got).into_owned()
    });
    let (_proxy, web) = proxy_to(upstream, "http1").await;
    let mut c = connect(web).await;
    c.write_all(b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 1\r\nHost: evil\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    let (got, _) = read_until(&mut c, response_complete).await;
    assert!(
        got.starts_with(b"HTTP/1.1 200 OK\r\n"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    let seen = server.await.expect("upstream");
    assert!(
        seen.ends_with("\r\n\r\n5\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n"),
        "{seen}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_codings_besides_chunked_reach_the_client() {
    // Issue 23 item 9: `gzip, chunked` reached the client as `chunked`, its gzip lost.
    let up = Scripted::start(|n| match n {
        0 => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\nGZIP\r\n0\r\n\r\n"
            .to_vec(),
        // Close-delimited and gzip-coded: re-chunked for the client, gzip kept.
        1 => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nGZIP<close>".to_vec(),
        _ => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\nGZIP\r\n0\r\n\r\n"
            .to_vec(),
    })
    .await;
    let (_proxy, web) = proxy_to(up.addr, "http1").await;
    for _ in 0..2 {
        let mut c = connect(web).await;
        c.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let (got, _) = read_until(&mut c, |b| b.ends_with(b"0\r\n\r\n")).await;
        let text = String::from_utf8_lossy(&got);
        assert!(
            contains(&got, "transfer-encoding: gzip, chunked\r\n"),
            "{text}"
        );
        assert!(text.ends_with("\r\n\r\n4\r\nGZIP\r\n0\r\n\r\n"), "{text}");
    }
    // An HTTP/1.0 client can be sent no transfer coding: 502 rather than a body it misreads.
    let mut c = connect(web).await;
    c.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    let (got, _) = read_until(&mut c, |_| false).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{text}");
    assert!(
        text.contains("transfer coding other than chunked"),
        "{text}"
    );
}
