//! Graceful drain (issue 17, item 8; docs/resilience.md "Graceful drain"): once the node
//! drains (`POST /drain`, or its owner's `shutdown` on SIGTERM), it stops accepting, an HTTP/1
//! connection idle between requests closes at once, a request in flight finishes (its answer
//! says `Connection: close`), an HTTP/2 connection gets GOAWAY and its open streams finish,
//! and what is still open at `drain_timeout` is closed.
//!
//! The node runs on worker threads of its own with the real clock (a paused clock cannot
//! reach them), so the waits here are bounded and generous: a drain that works ends in
//! milliseconds, one that does not takes `drain_timeout` (30 s).

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::backends::{HttpBackend, Proto, TcpBackend, TcpMode};
use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn config(app: SocketAddr, echo: SocketAddr, drain_timeout: &str) -> String {
    format!(
        r#"
admin: 127.0.0.1:0
workers: 2
drain_timeout: {drain_timeout}
listeners:
  - name: web
    address: 127.0.0.1:0
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
  - name: raw
    address: 127.0.0.1:0
    protocol: tcp
    cluster: echo
clusters:
  - name: app
    endpoints: [ {app} ]
  - name: echo
    endpoints: [ {echo} ]
"#
    )
}

/// Reads one HTTP/1.1 answer (head and a `content-length` body) from `conn`; returns the
/// head, lower-cased.
async fn read_answer(conn: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + length {
                return head;
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk))
            .await
            .expect("the answer did not come within 10 s")
            .expect("read the answer");
        assert!(n > 0, "the connection closed before the answer was whole");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Waits (bounded) for the peer to close `conn`: true on EOF or reset.
async fn closed_within(conn: &mut TcpStream, limit: Duration) -> bool {
    let mut chunk = [0u8; 256];
    matches!(
        tokio::time::timeout(limit, conn.read(&mut chunk)).await,
        Ok(Ok(0) | Err(_))
    )
}

const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: t.local\r\n\r\n";
const SLOW_GET: &[u8] = b"GET /slow HTTP/1.1\r\nhost: t.local\r\nx-delay-ms: 1500\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_closes_idle_connections_finishes_the_request_in_flight_and_stops_accepting() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let mut node = TestNode::start(&config(app.addr, echo.addr, "30s"));
    let web = node.listener("web");

    let mut idle = TcpStream::connect(web).await.unwrap();
    idle.write_all(GET).await.unwrap();
    let head = read_answer(&mut idle).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("connection: close"), "{head}");

    let mut busy = TcpStream::connect(web).await.unwrap();
    busy.write_all(SLOW_GET).await.unwrap();
    let reached = eventually(Duration::from_secs(5), || {
        let hits = app.hits();
        async move { hits >= 1 }
    })
    .await;
    assert!(reached, "the first request never reached the backend");
    tokio::time::sleep(Duration::from_millis(200)).await;

    let (status, body) = node.drain().await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert!(body.starts_with("draining: "), "{body}");
    assert!(body.contains("drain_timeout (30s)"), "{body}");
    let (status, body) = node.admin_get("/ready").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    );
    // A second drain changes nothing.
    assert_eq!(node.drain().await.0, StatusCode::ACCEPTED);
    assert!(
        node.metrics().await.contains("\nflatmesh_draining 1\n"),
        "/metrics does not say the node drains:\n{}",
        node.metrics().await
    );

    assert!(
        closed_within(&mut idle, Duration::from_secs(5)).await,
        "a connection idle between requests stayed open after the drain began"
    );
    let head = read_answer(&mut busy).await;
    assert!(
        head.starts_with("http/1.1 200"),
        "the request in flight: {head}"
    );
    assert!(
        closed_within(&mut busy, Duration::from_secs(5)).await,
        "the connection stayed open after its request in flight was answered"
    );

    let refused = eventually(Duration::from_secs(5), || async {
        TcpStream::connect(web).await.is_err()
    })
    .await;
    assert!(refused, "the node still accepts connections while draining");

    let took = node.shutdown().await;
    assert!(
        took < Duration::from_secs(10),
        "shutdown waited {took:?}: a connection was left open (drain_timeout is 30 s)"
    );
    println!(
        "FAULT-SURVIVED | graceful drain (POST /drain) with a request in flight and an idle keep-alive connection | sent 2 | failed 0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_arrives_during_the_drain_is_answered_with_connection_close() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let node = TestNode::start(&config(app.addr, echo.addr, "30s"));
    let web = node.listener("web");
    // The head arrives in two pieces around the drain: the request began before it and is
    // the connection's last.
    let mut conn = TcpStream::connect(web).await.unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(node.drain().await.0, StatusCode::ACCEPTED);
    conn.write_all(b"host: t.local\r\n\r\n").await.unwrap();
    let head = read_answer(&mut conn).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(closed_within(&mut conn, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_gets_goaway_and_its_open_stream_finishes() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let mut node = TestNode::start(&config(app.addr, echo.addr, "30s"));
    let web = node.listener("web");

    let tcp = TcpStream::connect(web).await.unwrap();
    let (mut client, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(connection);
    let slow = http::Request::get("http://t.local/slow")
        .header("x-delay-ms", "1500")
        .body(())
        .unwrap();
    let (answer, _) = client.send_request(slow, true).unwrap();
    let reached = eventually(Duration::from_secs(5), || {
        let hits = app.hits();
        async move { hits >= 1 }
    })
    .await;
    assert!(reached, "the stream never reached the backend");

    assert_eq!(node.drain().await.0, StatusCode::ACCEPTED);
    let answer = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("the open stream was not answered within 10 s")
        .expect("the open stream failed after GOAWAY");
    assert_eq!(answer.status(), StatusCode::OK);
    let mut body = answer.into_body();
    while let Some(chunk) = body.data().await {
        let chunk: Bytes = chunk.expect("the stream's body broke off");
        let _ = body.flow_control().release_capacity(chunk.len());
    }

    // The connection ends: GOAWAY was sent, and the last stream is done.
    let ended = tokio::time::timeout(Duration::from_secs(5), driver).await;
    assert!(
        ended.is_ok(),
        "the HTTP/2 connection stayed open after GOAWAY and its last stream"
    );
    let took = node.shutdown().await;
    assert!(took < Duration::from_secs(10), "shutdown waited {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_timeout_closes_a_connection_that_does_not_end() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let mut node = TestNode::start(&config(app.addr, echo.addr, "1s"));
    // A tcp relay carries bytes the node cannot frame: it runs until its ends close it.
    let mut relayed = TcpStream::connect(node.listener("raw")).await.unwrap();
    relayed.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    relayed.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping");

    let took = node.shutdown().await;
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "shutdown took {took:?} with a relay open and drain_timeout 1s"
    );
    assert!(
        closed_within(&mut relayed, Duration::from_secs(5)).await,
        "the relay is still open after the drain timeout"
    );
}
