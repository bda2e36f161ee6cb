//! Bad and hostile input: oversized headers, request smuggling shapes, upstream failures,
//! slow clients and garbage bytes. The proxy must answer clearly and stay up.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::backends::{pattern, HttpBackend, Proto, TcpBackend, TcpMode};
use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Setup {
    proxy: TestNode,
    web: SocketAddr,
    app: HttpBackend,
    _reset: TcpBackend,
}

async fn setup() -> Setup {
    let app = HttpBackend::start("app", Proto::H1).await;
    let reset = TcpBackend::start(TcpMode::Reset).await;
    let (admin, web) = (free_addr(), free_addr());
    let ghost = free_addr(); // nothing listens there
                             // One worker, so a client that blocks a worker blocks everyone (and the test sees it).
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
limits:
  header_read_timeout: 2s
  idle_timeout: 5s
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /ghost }} }}
        cluster: ghost-cluster
      - match: {{ path: {{ prefix: /reset }} }}
        cluster: resetter
      - match: {{ path: {{ exact: /direct }} }}
        direct_response: {{ status: 200, body: "direct" }}
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
clusters:
  - name: app
    endpoints: [ {app} ]
  - name: ghost-cluster
    endpoints: [ {ghost} ]
  - name: resetter
    endpoints: [ {reset} ]
"#,
        app = app.addr,
        reset = reset.addr,
    );
    let proxy = TestNode::start(&yaml);
    Setup {
        proxy,
        web,
        app,
        _reset: reset,
    }
}

/// A response read off a raw connection.
#[derive(Debug)]
struct RawResponse {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// Read one HTTP/1.1 response (head + Content-Length body) from `stream`.
/// `None` if the connection closed or failed before a full head arrived.
async fn read_response(stream: &mut TcpStream, limit: Duration) -> Option<RawResponse> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    let deadline = Instant::now() + limit;
    // Byte by byte so nothing of a pipelined next response is consumed with this one.
    while !head.ends_with(b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut byte)).await {
            Ok(Ok(1)) => head.push(byte[0]),
            _ => return None,
        }
    }
    parse_buffered(head, stream).await
}

/// Whether the peer closes (EOF or reset) within `limit`, discarding anything else it sends.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    let mut chunk = [0u8; 4096];
    tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    })
    .await
    .is_ok()
}

async fn connect(addr: SocketAddr) -> TcpStream {
    tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// Write `raw` (ignoring write errors: the proxy may close early) and read one response.
/// Returns the connection too, so callers can check whether the proxy closes it.
async fn exchange(addr: SocketAddr, raw: Vec<u8>) -> (TcpStream, Option<RawResponse>) {
    let (mut rd, mut wr) = connect(addr).await.into_split();
    // Write concurrently with reading, so an early answer and close cannot deadlock us.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&raw).await;
        wr
    });
    let mut head = Vec::new();
    let mut chunk = [0u8; 8192];
    let deadline = Instant::now() + Duration::from_secs(5);
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rd.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => head.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    let wr = writer.await.expect("writer task");
    let mut stream = rd.reunite(wr).expect("reunite halves");
    let parsed = parse_buffered(head, &mut stream).await;
    (stream, parsed)
}

/// Finish parsing a response whose first bytes (at least the whole head) are in `buf`:
/// read its body by Content-Length or chunked framing, and nothing past it.
async fn parse_buffered(buf: Vec<u8>, stream: &mut TcpStream) -> Option<RawResponse> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let header = |name: &str| {
        head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_ascii_lowercase())
        })
    };
    let mut rest = Reader {
        buffered: buf[end + 4..].to_vec(),
        stream,
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        loop {
            let line = rest.line().await?;
            let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
            if size == 0 {
                // Trailers until the empty line.
                while !rest.line().await?.is_empty() {}
                break;
            }
            body.extend_from_slice(&rest.exact(size).await?);
            rest.line().await?;
        }
        body
    } else {
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        rest.exact(len).await.unwrap_or_default()
    };
    Some(RawResponse { status, head, body })
}

/// Reads from already-buffered bytes first, then from the stream, bounded in time.
struct Reader<'a> {
    buffered: Vec<u8>,
    stream: &'a mut TcpStream,
}

impl Reader<'_> {
    async fn byte(&mut self) -> Option<u8> {
        if !self.buffered.is_empty() {
            return Some(self.buffered.remove(0));
        }
        let mut b = [0u8; 1];
        match tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut b)).await {
            Ok(Ok(1)) => Some(b[0]),
            _ => None,
        }
    }

    async fn exact(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            out.push(self.byte().await?);
        }
        Some(out)
    }

    async fn line(&mut self) -> Option<String> {
        let mut out = Vec::new();
        while !out.ends_with(b"\r\n") {
            out.push(self.byte().await?);
        }
        out.truncate(out.len() - 2);
        Some(String::from_utf8_lossy(&out).into_owned())
    }
}

/// A request head with `count` headers of `size` bytes each.
fn big_headers(count: usize, size: usize) -> Vec<u8> {
    let mut req = b"GET /direct HTTP/1.1\r\nHost: t.local\r\n".to_vec();
    for i in 0..count {
        req.extend_from_slice(format!("x-big-{i}: {}\r\n", "a".repeat(size)).as_bytes());
    }
    req.extend_from_slice(b"\r\n");
    req
}

async fn assert_still_serving(s: &mut Setup, context: &str) {
    s.proxy.assert_alive(context).await;
    let resp = send(&h1_client(), get_req(&format!("http://{}/direct", s.web)))
        .await
        .unwrap_or_else(|e| panic!("proxy stopped serving {context}: {e}"));
    assert_eq!(resp.status, StatusCode::OK, "{context}: {resp:?}");
    assert_eq!(resp.body, "direct");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_block_over_64k_gets_431() {
    let mut s = setup().await;
    // Just under the default limit: accepted.
    let (_c, resp) = exchange(s.web, big_headers(8, 7 * 1024)).await;
    let resp = resp.expect("a response to a 56 KiB header block");
    assert_eq!(
        resp.status, 200,
        "56 KiB of headers is under the 64 KiB limit: {}",
        resp.head
    );

    // Over the limit in many headers.
    let (_c, resp) = exchange(s.web, big_headers(10, 7 * 1024)).await;
    let resp = resp.expect("a response (431) to a 70 KiB header block, not a dropped connection");
    assert_eq!(resp.status, 431, "70 KiB header block: {}", resp.head);

    // Over the limit in one header line.
    let (_c, resp) = exchange(s.web, big_headers(1, 80 * 1024)).await;
    let resp = resp.expect("a response (431) to one 80 KiB header, not a dropped connection");
    assert_eq!(resp.status, 431, "80 KiB header line: {}", resp.head);
    assert_still_serving(&mut s, "after oversized headers").await;
}

async fn assert_400_and_close(s: &mut Setup, name: &str, raw: &[u8]) {
    let hits_before = s.app.hits();
    let (mut conn, resp) = exchange(s.web, raw.to_vec()).await;
    let resp = resp
        .unwrap_or_else(|| panic!("{name}: expected a 400 response, the connection just closed"));
    assert_eq!(resp.status, 400, "{name}: {}", resp.head);
    assert!(
        closed_within(&mut conn, Duration::from_secs(3)).await,
        "{name}: the proxy answered 400 but kept the connection open"
    );
    assert_eq!(
        s.app.hits(),
        hits_before,
        "{name}: the ambiguous request reached the backend"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_with_transfer_encoding_is_400_and_closed() {
    let mut s = setup().await;
    let raw = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: t.local\r\n\r\n";
    assert_400_and_close(&mut s, "CL + TE", raw).await;
    assert_still_serving(&mut s, "after CL + TE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_content_length_is_400_and_closed() {
    let mut s = setup().await;
    let two_headers = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello!!";
    assert_400_and_close(&mut s, "two Content-Length headers", two_headers).await;
    let list = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nContent-Length: 5, 7\r\n\r\nhello!!";
    assert_400_and_close(&mut s, "Content-Length list", list).await;
    let not_a_number = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nContent-Length: five\r\n\r\nhello";
    assert_400_and_close(&mut s, "non-numeric Content-Length", not_a_number).await;
    assert_still_serving(&mut s, "after conflicting Content-Length").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chunk_size_is_rejected_and_closed() {
    let mut s = setup().await;
    // A well-formed chunked body first: the backend gets exactly the payload.
    let good = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
    let (_c, resp) = exchange(s.web, good.to_vec()).await;
    let resp = resp.expect("response to a good chunked request");
    assert_eq!(resp.status, 200, "{}", resp.head);
    let echo: serde_json::Value = serde_json::from_slice(&resp.body).expect("backend echo");
    assert_eq!(echo["body_len"], 11);
    assert_eq!(echo["body_crc"], crc32fast::hash(b"hello world"));

    let bad = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n";
    let (mut conn, resp) = exchange(s.web, bad.to_vec()).await;
    match &resp {
        Some(r) => assert_eq!(r.status, 400, "bad chunk size: {}", r.head),
        None => eprintln!("NOTE: bad chunk size: connection closed without a 400 response"),
    }
    assert!(
        closed_within(&mut conn, Duration::from_secs(3)).await,
        "bad chunk size: connection left open"
    );
    if resp.is_some() {
        eprintln!("bad chunk size: answered 400 and closed");
    }
    assert_still_serving(&mut s, "after a bad chunk size").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let s = setup().await;
    let raw = b"GET /first HTTP/1.1\r\nHost: t.local\r\n\r\nGET /direct HTTP/1.1\r\nHost: t.local\r\n\r\nGET /third HTTP/1.1\r\nHost: t.local\r\n\r\n";
    let mut conn = connect(s.web).await;
    conn.write_all(raw).await.expect("write");
    let one = read_response(&mut conn, Duration::from_secs(5))
        .await
        .expect("first response");
    let two = read_response(&mut conn, Duration::from_secs(5))
        .await
        .expect("second response");
    let three = read_response(&mut conn, Duration::from_secs(5))
        .await
        .expect("third response");
    let path = |r: &RawResponse| {
        serde_json::from_slice::<serde_json::Value>(&r.body).expect("echo")["path"].clone()
    };
    assert_eq!(path(&one), "/first");
    assert_eq!(two.body, b"direct");
    assert_eq!(path(&three), "/third");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_unreachable_is_503_naming_the_cluster() {
    let mut s = setup().await;
    let resp = get(&h1_client(), &format!("http://{}/ghost/x", s.web), &[]).await;
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE, "{resp:?}");
    assert!(
        resp.body.contains("ghost-cluster"),
        "503 body should name the cluster: {:?}",
        resp.body
    );
    assert_still_serving(&mut s, "after an unreachable upstream").await;
}

// A route timeout (504), the header read timeout (408) and the idle timeout are timed on
// tokio's paused clock: the unit tests of `h1/conn.rs`, `h2/mod.rs` and `dispatch.rs`.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_is_a_5xx_and_the_proxy_carries_on() {
    let mut s = setup().await;
    let resp = get(&h1_client(), &format!("http://{}/reset/x", s.web), &[]).await;
    assert!(
        resp.status == StatusCode::BAD_GATEWAY || resp.status == StatusCode::SERVICE_UNAVAILABLE,
        "upstream reset should give 502 or 503, got {resp:?}"
    );
    assert!(
        !resp.body.is_empty(),
        "the error response should say what happened"
    );
    assert_still_serving(&mut s, "after an upstream reset").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_does_not_block_other_clients() {
    let mut s = setup().await;
    // Twenty clients that send half a request head and stall, plus five that send nothing.
    let mut partial = Vec::new();
    for i in 0..20 {
        let mut c = connect(s.web).await;
        c.write_all(format!("GET /x{i} HTTP/1.1\r\nHost: t.local\r\nX-Slow: ").as_bytes())
            .await
            .expect("write half a head");
        partial.push(c);
    }
    let mut silent = Vec::new();
    for _ in 0..5 {
        silent.push(connect(s.web).await);
    }
    // Everyone else is served promptly on the single worker.
    let started = Instant::now();
    for i in 0..30 {
        let client = h1_client(); // a fresh connection each time
        let t0 = Instant::now();
        let resp = get(&client, &format!("http://{}/ok/{i}", s.web), &[]).await;
        assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "request {i} took {:?} behind slow clients",
            t0.elapsed()
        );
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    // When the stalled clients are cut off (header_read_timeout, idle_timeout) is timed on
    // the paused clock, in `dispatch.rs`'s unit tests.
    drop((partial, silent));
    assert_still_serving(&mut s, "after slow clients").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn very_long_request_line_is_rejected_cleanly() {
    let mut s = setup().await;
    let raw = format!(
        "GET /{} HTTP/1.1\r\nHost: t.local\r\n\r\n",
        "p".repeat(100 * 1024)
    )
    .into_bytes();
    let (mut conn, resp) = exchange(s.web, raw).await;
    if let Some(r) = &resp {
        assert!(
            (400..500).contains(&r.status),
            "100 KiB request line: expected a 4xx, got {}",
            r.head
        );
    } else {
        assert!(
            closed_within(&mut conn, Duration::from_secs(3)).await,
            "no answer and not closed"
        );
    }
    let bad_version = b"GET / HTTP/9.9\r\nHost: t.local\r\n\r\n".to_vec();
    let (_c, resp) = exchange(s.web, bad_version).await;
    if let Some(r) = resp {
        assert!(
            r.status >= 400,
            "HTTP/9.9 should be refused, got {}",
            r.head
        );
    }
    let no_method = b"  / HTTP/1.1\r\n\r\n".to_vec();
    let (_c, resp) = exchange(s.web, no_method).await;
    if let Some(r) = resp {
        assert_eq!(r.status, 400, "malformed request line: {}", r.head);
    }
    assert_still_serving(&mut s, "after malformed request lines").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_bytes_never_crash_the_proxy() {
    let mut s = setup().await;
    let admin = s.proxy.admin;
    let prefixes: [&[u8]; 6] = [
        b"",
        b"GET / HTTP/1.1\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        b"GET / HTTP/1.1\r\nHost: t.local\r\nContent-Length: 100000000\r\n\r\n",
    ];
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..240u64 {
        let target = if i % 8 == 7 { admin } else { s.web };
        let mut blob = prefixes[(i as usize) % prefixes.len()].to_vec();
        blob.extend_from_slice(&pattern(1 + (i as usize * 397) % 9000, i + 11));
        tasks.spawn(async move {
            let Ok(Ok(mut c)) =
                tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(target)).await
            else {
                return;
            };
            let _ = c.write_all(&blob).await;
            let mut sink = [0u8; 4096];
            // Read whatever comes back for a short while; the outcome does not matter here.
            let _ = tokio::time::timeout(Duration::from_millis(300), c.read(&mut sink)).await;
        });
        // At most ~24 at once.
        if tasks.len() >= 24 {
            let _ = tasks.join_next().await;
        }
    }
    while tasks.join_next().await.is_some() {}
    assert_still_serving(&mut s, "after 240 connections of garbage").await;
    let (status, _) = s.proxy.admin_get("/ready").await;
    assert_eq!(status, StatusCode::OK, "admin still answers after garbage");
    // Also over HTTP/2: a valid preface and then a garbage frame.
    let mut c = connect(s.web).await;
    let mut h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    h2.extend_from_slice(&[0, 0, 4, 0xff, 0xff, 0, 0, 0, 1, 1, 2, 3, 4]);
    h2.extend_from_slice(&[0, 0, 0xff, 1, 4, 0, 0, 0, 1]); // HEADERS frame claiming 255 bytes of junk
    h2.extend_from_slice(&pattern(255, 3));
    let _ = c.write_all(&h2).await;
    let _ = closed_within(&mut c, Duration::from_secs(2)).await;
    assert_still_serving(&mut s, "after a garbage HTTP/2 frame").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_encoding_without_final_chunked_is_400_and_closed() {
    let mut s = setup().await;
    // RFC 9112 §6.3: a request whose Transfer-Encoding does not end in chunked cannot be framed.
    let raw = b"POST /echo HTTP/1.1\r\nHost: t.local\r\nTransfer-Encoding: gzip\r\n\r\nhello";
    assert_400_and_close(&mut s, "Transfer-Encoding: gzip", raw).await;
    assert_still_serving(&mut s, "after a bad Transfer-Encoding").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_header_lines_are_400() {
    let mut s = setup().await;
    // RFC 9112 §5.1: whitespace between a field name and the colon MUST be rejected with 400.
    let space = b"GET /echo HTTP/1.1\r\nHost: t.local\r\nX-Evil : 1\r\n\r\n";
    assert_400_and_close(&mut s, "space before colon", space).await;
    let no_colon = b"GET /echo HTTP/1.1\r\nHost: t.local\r\nthis is not a header\r\n\r\n";
    assert_400_and_close(&mut s, "header line without a colon", no_colon).await;
    let nul = b"GET /echo HTTP/1.1\r\nHost: t.local\r\nX-Nul: a\x00b\r\n\r\n";
    assert_400_and_close(&mut s, "NUL in a header value", nul).await;
    // RFC 9112 §3.2: an HTTP/1.1 request without Host MUST get 400.
    let no_host = b"GET /echo HTTP/1.1\r\nX-Other: 1\r\n\r\n";
    let hits_before = s.app.hits();
    let (_c, resp) = exchange(s.web, no_host.to_vec()).await;
    let resp = resp.expect("a response to an HTTP/1.1 request without Host");
    assert_eq!(resp.status, 400, "HTTP/1.1 without Host: {}", resp.head);
    assert_eq!(
        s.app.hits(),
        hits_before,
        "a Host-less request reached the backend"
    );
    assert_still_serving(&mut s, "after malformed header lines").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_honoured() {
    let s = setup().await;
    let mut conn = connect(s.web).await;
    conn.write_all(
        b"POST /echo HTTP/1.1\r\nHost: t.local\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
    )
    .await
    .expect("write head");
    // A client waits for 100 Continue before it sends the body (curl waits 1 s, then gives up).
    let interim = read_response(&mut conn, Duration::from_secs(2))
        .await
        .expect("an interim 100 Continue within 2 s");
    assert_eq!(interim.status, 100, "{}", interim.head);
    conn.write_all(b"hello").await.expect("write body");
    let resp = read_response(&mut conn, Duration::from_secs(5))
        .await
        .expect("final response");
    assert_eq!(resp.status, 200, "{}", resp.head);
    let echo: serde_json::Value = serde_json::from_slice(&resp.body).expect("backend echo");
    assert_eq!(echo["body_len"], 5);
}
