//! In-kernel L7 dispatch with real sockets: the sk_skb verdict reads the first HTTP/1.1
//! request line or gRPC :path, the test's proxy (following the documented hand-off) opens
//! the upstream, and the rest of the connection is spliced in the kernel. Whatever the kernel
//! leaves to user space gets the same answer from the user-tier reference.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use flatmesh_kernel::{
    huffman, lower_routes, FallbackReason, KernelTier, L7Decision, PathMatch, Protocols, RouteSpec,
};

/// Backend `id`: after each chunk it reads, answers "b<id> <total bytes so far>\n"; at EOF it
/// sends everything it received on `done`.
fn backend(id: u32, done: mpsc::Sender<(u32, Vec<u8>)>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let done = done.clone();
            std::thread::spawn(move || {
                let mut all = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            all.extend_from_slice(&buf[..n]);
                            if s.write_all(format!("b{id} {}\n", all.len()).as_bytes())
                                .is_err()
                            {
                                break;
                            }
                        }
                    }
                }
                let _ = done.send((id, all));
            });
        }
    });
    addr
}

/// The proxy's side of one connection, following the hand-off documented in dispatch.rs.
struct Hop {
    client: TcpStream,
    cookie: u64,
    buffered: Vec<u8>,
    upstream: Option<TcpStream>,
}

fn accept(tier: &KernelTier, l: &TcpListener) -> Hop {
    let (client, _) = l.accept().unwrap_or_else(|e| panic!("accept: {e}"));
    let cookie = tier.l7_register(&client).unwrap_or_else(|e| panic!("{e}"));
    Hop {
        client,
        cookie,
        buffered: Vec::new(),
        upstream: None,
    }
}

/// Reads what the client sent until the kernel decides (or `wait` passes); on a backend
/// decision opens the upstream and splices.
fn drive(tier: &KernelTier, hop: &mut Hop, backends: &[SocketAddr], wait: Duration) -> L7Decision {
    let deadline = Instant::now() + wait;
    let _ = hop.client.set_read_timeout(Some(Duration::from_millis(20)));
    let decision = loop {
        let mut tmp = [0u8; 4096];
        match hop.client.read(&mut tmp) {
            Ok(n) => hop.buffered.extend_from_slice(&tmp[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => panic!("proxy read: {e}"),
        }
        let d = tier
            .l7_decision(hop.cookie)
            .unwrap_or_else(|e| panic!("{e}"));
        if d != L7Decision::Pending || Instant::now() > deadline {
            break d;
        }
    };
    // No backends: the caller only wants the decision.
    if let (L7Decision::Backend { backend, .. }, false) = (decision, backends.is_empty()) {
        let mut up = TcpStream::connect(backends[backend as usize])
            .unwrap_or_else(|e| panic!("upstream: {e}"));
        let up_cookie = tier
            .l7_attach_upstream(hop.cookie, &up)
            .unwrap_or_else(|e| panic!("{e}"));
        up.write_all(&hop.buffered)
            .unwrap_or_else(|e| panic!("{e}"));
        tier.l7_pair(hop.cookie, up_cookie)
            .unwrap_or_else(|e| panic!("{e}"));
        hop.upstream = Some(up);
    }
    decision
}

/// Nothing reached the proxy's user space since the splice.
fn assert_nothing_in_user_space(hop: &mut Hop) {
    let _ = hop.client.set_nonblocking(true);
    let mut b = [0u8; 64];
    match hop.client.read(&mut b) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("client bytes reached the proxy after the splice: {other:?}"),
    }
    if let Some(up) = &mut hop.upstream {
        let _ = up.set_nonblocking(true);
        match up.read(&mut b) {
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            other => panic!("backend bytes reached the proxy after the splice: {other:?}"),
        }
    }
}

fn line(s: &mut TcpStream) -> String {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    while !out.ends_with(b"\n") {
        match s.read(&mut b) {
            Ok(1) => out.push(b[0]),
            other => panic!(
                "reading a reply line: {other:?} after {:?}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    String::from_utf8_lossy(&out).trim_end().to_string()
}

fn specs() -> Vec<RouteSpec> {
    let r = |id, method: Option<&str>, path, other, backend| RouteSpec {
        route_id: id,
        method: method.map(str::to_string),
        path,
        other_conditions: other,
        backend,
        protocols: Protocols::HTTP1 | Protocols::HTTP2,
    };
    vec![
        r(
            0,
            Some("GET"),
            PathMatch::Exact("/a".into()),
            false,
            Some(0),
        ),
        r(1, None, PathMatch::Prefix("/canary/".into()), true, Some(0)), // + a header match
        r(2, None, PathMatch::Prefix("/api/".into()), false, Some(1)),
        r(
            3,
            Some("POST"),
            PathMatch::Prefix("/svc.Echo/".into()),
            false,
            Some(0),
        ),
        // A cluster that speaks HTTP/1.1 only: an HTTP/2 client must not be spliced to it.
        RouteSpec {
            protocols: Protocols::HTTP1,
            ..r(
                4,
                None,
                PathMatch::Prefix("/h1only/".into()),
                false,
                Some(1),
            )
        },
    ]
}

/// The user tier's answer, straight from the specs: first match, with the canary rule
/// needing header `x-canary: 1`.
fn user_tier(method: &str, path: &str, canary_header: bool) -> Option<u32> {
    specs().into_iter().find_map(|s| {
        let m = s.method.as_deref().is_none_or(|x| x == method);
        let p = match &s.path {
            PathMatch::Exact(x) => x == path,
            PathMatch::Prefix(x) => path.starts_with(x.as_str()),
            PathMatch::Other => false,
        };
        (m && p && (!s.other_conditions || canary_header))
            .then_some(s.backend)
            .flatten()
    })
}

fn tier(test: &str) -> KernelTier {
    tier_mode(test, false)
}

/// `stream_parser`: also attach the sk_skb stream parser (strparser mode).
fn tier_mode(test: &str, stream_parser: bool) -> KernelTier {
    require_root();
    let mut cfg = config(test);
    cfg.l7_dispatch = true;
    cfg.l7_stream_parser = stream_parser;
    let t = KernelTier::attach(&cfg).unwrap_or_else(|e| panic!("{e}"));
    t.set_routes(&lower_routes(&specs()))
        .unwrap_or_else(|e| panic!("{e}"));
    t
}

fn h2_headers(method_post: bool, path: &[u8], huffman: bool) -> Vec<u8> {
    let mut block = vec![if method_post { 0x83 } else { 0x82 }, 0x86, 0x04];
    block.push(if huffman { 0x80 } else { 0 } | path.len() as u8);
    block.extend_from_slice(path);
    block.push(0x41);
    block.push(9);
    block.extend_from_slice(b"localhost");
    block.push(0x5f);
    block.push(16);
    block.extend_from_slice(b"application/grpc");
    block.extend_from_slice(&[0x00, 2, b't', b'e', 8]);
    block.extend_from_slice(b"trailers");
    let mut f = vec![
        (block.len() >> 16) as u8,
        (block.len() >> 8) as u8,
        block.len() as u8,
        1,
        0x4,
        0,
        0,
        0,
        1,
    ];
    f.extend_from_slice(&block);
    f
}

fn h2_preface_and_settings() -> Vec<u8> {
    let mut v = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    v.extend_from_slice(&[0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 100]); // SETTINGS max streams
    v.extend_from_slice(&[0, 0, 4, 8, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]); // WINDOW_UPDATE
    v
}

#[test]
fn http1_first_request_is_decided_and_the_connection_spliced() {
    http1_splice(tier("l7-h1"));
}

#[test]
fn http1_splice_works_in_stream_parser_mode_too() {
    http1_splice(tier_mode("l7-h1-strp", true));
}

/// Sustained small-message ping-pong over a spliced pair (what the latency benchmark does).
#[test]
fn spliced_pair_survives_sustained_ping_pong() {
    let tier = tier("l7-pingpong");
    let (done_tx, _done_rx) = mpsc::channel();
    let backends = [backend(0, done_tx.clone()), backend(1, done_tx)];
    let (l, port) = listener();
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let _ = client.set_nodelay(true);
    let mut hop = accept(&tier, &l);
    let req = b"GET /a HTTP/1.1\r\n\r\n";
    write_all(&mut client, req);
    assert_eq!(
        drive(&tier, &mut hop, &backends, Duration::from_secs(2)),
        L7Decision::Backend {
            backend: 0,
            route_id: 0
        }
    );
    let mut total = req.len();
    assert_eq!(line(&mut client), format!("b0 {total}"));
    for i in 0..3000 {
        let msg = format!("ping {i:06}\n");
        write_all(&mut client, msg.as_bytes());
        total += msg.len();
        assert_eq!(line(&mut client), format!("b0 {total}"), "round {i}");
    }
    assert_nothing_in_user_space(&mut hop);
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

/// A FIN that arrives on its own (after the peer's last bytes were spliced) is not spliced:
/// the proxy reads the end of the stream and carries the half-close itself. The verdict used
/// to redirect that empty skb too; the kernel then failed to send zero bytes out of the other
/// socket and set EPIPE on it, so the proxy's read there failed and the pair was reset with
/// the reply still in flight (docs/kernel.md, "Half-close").
#[test]
fn a_lone_fin_is_not_spliced_and_breaks_nothing() {
    let tier = tier("l7-fin");
    let (lc, pc) = listener();
    let (lb, pb) = listener();
    let mut client = TcpStream::connect(("127.0.0.1", pc)).unwrap_or_else(|e| panic!("{e}"));
    let (mut hop_client, _) = lc.accept().unwrap_or_else(|e| panic!("{e}"));
    let mut hop_up = TcpStream::connect(("127.0.0.1", pb)).unwrap_or_else(|e| panic!("{e}"));
    let (mut backend, _) = lb.accept().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = tier
        .splice(&hop_client, &hop_up)
        .unwrap_or_else(|e| panic!("{e}"));
    write_all(&mut backend, b"reply\n");
    assert_eq!(line(&mut client), "reply");
    // The reply has been delivered, so the FIN comes in an skb of its own.
    backend
        .shutdown(std::net::Shutdown::Write)
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = hop_up.set_read_timeout(Some(Duration::from_secs(5)));
    let mut buf = [0u8; 64];
    match hop_up.read(&mut buf) {
        Ok(0) => {}
        other => panic!("the proxy's upstream socket should read the FIN: {other:?}"),
    }
    // The other socket must stay healthy (no EPIPE from the kernel's backlog). The kernel
    // work that would set it runs right after the verdict; give it a bounded moment.
    for _ in 0..20 {
        if let Some(e) = hop_client.take_error().unwrap_or_else(|e| panic!("{e}")) {
            panic!("the client-side socket got an error from the splice: {e}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // The proxy passes the half-close on; the client still talks to the backend.
    hop_client
        .shutdown(std::net::Shutdown::Write)
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = client.set_read_timeout(Some(Duration::from_secs(5)));
    match client.read(&mut buf) {
        Ok(0) => {}
        other => panic!("the client should read the FIN: {other:?}"),
    }
    write_all(&mut client, b"bye\n");
    assert_eq!(line(&mut backend), "bye");
    let _ = hop_client.set_nonblocking(true);
    match hop_client.read(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("client bytes reached the proxy after the splice: {other:?}"),
    }
    tier.l7_forget(a).unwrap_or_else(|e| panic!("{e}"));
    tier.l7_forget(b).unwrap_or_else(|e| panic!("{e}"));
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

fn http1_splice(tier: KernelTier) {
    let (done_tx, done_rx) = mpsc::channel();
    let backends = [backend(0, done_tx.clone()), backend(1, done_tx)];
    let (l, port) = listener();
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let mut hop = accept(&tier, &l);
    let req1 = b"GET /api/users?id=7 HTTP/1.1\r\nHost: x\r\n\r\n";
    write_all(&mut client, req1);
    let d = drive(&tier, &mut hop, &backends, Duration::from_secs(2));
    assert_eq!(
        d,
        L7Decision::Backend {
            backend: 1,
            route_id: 2
        }
    );
    assert_eq!(line(&mut client), format!("b1 {}", req1.len()));
    let before = tier
        .status()
        .unwrap_or_else(|e| panic!("{e}"))
        .stat("fm_verdict");
    // Keep-alive: the next request and its reply go client <-> backend in the kernel.
    let req2 = b"GET /anything HTTP/1.1\r\nHost: x\r\n\r\n";
    write_all(&mut client, req2);
    assert_eq!(line(&mut client), format!("b1 {}", req1.len() + req2.len()));
    let big = vec![b'z'; 300_000];
    write_all(&mut client, &big);
    let mut last = String::new();
    while last != format!("b1 {}", req1.len() + req2.len() + big.len()) {
        last = line(&mut client);
    }
    assert_nothing_in_user_space(&mut hop);
    let after = tier
        .status()
        .unwrap_or_else(|e| panic!("{e}"))
        .stat("fm_verdict");
    assert!(
        after.bytes - before.bytes >= (req2.len() + big.len()) as u64,
        "verdict spliced {} bytes",
        after.bytes - before.bytes
    );
    // Client closes: the proxy sees EOF and closes the upstream; the backend got exactly the
    // client's bytes, in order.
    drop(client);
    let _ = hop.client.set_nonblocking(false);
    let _ = hop.client.set_read_timeout(Some(Duration::from_secs(5)));
    let mut rest = Vec::new();
    let _ = hop.client.read_to_end(&mut rest);
    assert!(rest.is_empty(), "unexpected bytes at EOF: {}", rest.len());
    drop(hop);
    let (id, got) = done_rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("backend: {e}"));
    assert_eq!(id, 1);
    let mut want = req1.to_vec();
    want.extend_from_slice(req2);
    want.extend_from_slice(&big);
    assert!(
        got == want,
        "backend received {} bytes, expected {}",
        got.len(),
        want.len()
    );
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn grpc_path_in_a_later_chunk_is_decided_and_spliced() {
    let tier = tier("l7-h2");
    let (done_tx, _done_rx) = mpsc::channel();
    let backends = [backend(0, done_tx.clone()), backend(1, done_tx)];
    let (l, port) = listener();
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let mut hop = accept(&tier, &l);
    let first = h2_preface_and_settings();
    write_all(&mut client, &first);
    assert_eq!(
        drive(&tier, &mut hop, &backends, Duration::from_millis(200)),
        L7Decision::Pending
    );
    let headers = h2_headers(true, b"/svc.Echo/Ping", false);
    write_all(&mut client, &headers);
    let d = drive(&tier, &mut hop, &backends, Duration::from_secs(2));
    assert_eq!(
        d,
        L7Decision::Backend {
            backend: 0,
            route_id: 3
        }
    );
    assert_eq!(
        line(&mut client),
        format!("b0 {}", first.len() + headers.len())
    );
    // A DATA frame goes through the kernel.
    let data = [0, 0, 5, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0];
    write_all(&mut client, &data);
    assert_eq!(
        line(&mut client),
        format!("b0 {}", first.len() + headers.len() + data.len())
    );
    assert_nothing_in_user_space(&mut hop);
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}

/// (request bytes, method, path, carries x-canary, kernel outcome: backend or fallback reason)
type Case = (
    Vec<u8>,
    &'static str,
    String,
    bool,
    Result<u32, FallbackReason>,
);

/// One request through the kernel; returns its decision.
fn kernel_decision(tier: &KernelTier, l: &TcpListener, port: u16, chunks: &[&[u8]]) -> L7Decision {
    let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    let mut hop = accept(tier, l);
    let mut d = L7Decision::Pending;
    for c in chunks {
        write_all(&mut client, c);
        d = drive(tier, &mut hop, &[], Duration::from_millis(300));
        if d != L7Decision::Pending {
            break;
        }
    }
    let _ = tier.l7_forget(hop.cookie);
    d
}

#[test]
fn kernel_answers_equal_the_user_tier_and_fallbacks_are_explicit() {
    let tier = tier("l7-fallback");
    let (l, port) = listener();
    // (request, method, path, has x-canary, expected kernel outcome: Some(backend) or fallback reason)
    let long = format!("/api/{}", "q".repeat(120));
    let cases: Vec<Case> = vec![
        (
            b"GET /a HTTP/1.1\r\n\r\n".to_vec(),
            "GET",
            "/a".into(),
            false,
            Ok(0),
        ),
        (
            b"GET /a?x=1 HTTP/1.1\r\n\r\n".to_vec(),
            "GET",
            "/a".into(),
            false,
            Ok(0),
        ),
        (
            b"POST /a HTTP/1.1\r\n\r\n".to_vec(),
            "POST",
            "/a".into(),
            false,
            Err(FallbackReason::NoMatch),
        ),
        (
            b"GET /ab HTTP/1.1\r\n\r\n".to_vec(),
            "GET",
            "/ab".into(),
            false,
            Err(FallbackReason::NoMatch),
        ),
        (
            b"DELETE /api/x HTTP/1.1\r\n\r\n".to_vec(),
            "DELETE",
            "/api/x".into(),
            false,
            Ok(1),
        ),
        (
            format!("GET {long} HTTP/1.1\r\n\r\n").into_bytes(),
            "GET",
            long.clone(),
            false,
            Ok(1),
        ),
        (
            b"GET /canary/x HTTP/1.1\r\nx-canary: 1\r\n\r\n".to_vec(),
            "GET",
            "/canary/x".into(),
            true,
            Err(FallbackReason::PuntRule),
        ),
        (
            b"GET /canary/x HTTP/1.1\r\n\r\n".to_vec(),
            "GET",
            "/canary/x".into(),
            false,
            Err(FallbackReason::PuntRule),
        ),
        (
            b"GET /api".to_vec(),
            "GET",
            "/api".into(),
            false,
            Err(FallbackReason::Truncated),
        ),
        (
            b"GET http://h/api/x HTTP/1.1\r\n\r\n".to_vec(),
            "GET",
            "http://h/api/x".into(),
            false,
            Err(FallbackReason::Malformed),
        ),
        (
            b"\x16\x03\x01\x02\x00".to_vec(),
            "",
            String::new(),
            false,
            Err(FallbackReason::Truncated),
        ),
    ];
    for (req, method, path, canary, want) in &cases {
        let d = kernel_decision(&tier, &l, port, &[req]);
        match (d, want) {
            (L7Decision::Backend { backend, .. }, Ok(b)) => {
                assert_eq!(backend, *b, "{path}");
                assert_eq!(
                    user_tier(method, path, *canary),
                    Some(backend),
                    "kernel and user tier disagree on {method} {path}"
                );
            }
            (L7Decision::Fallback { reason, .. }, Err(r)) => {
                assert_eq!(reason, *r, "{method} {path}")
            }
            (d, w) => panic!("{method} {path}: kernel said {d:?}, expected {w:?}"),
        }
    }
    // gRPC: literal :path decided.
    let pre = h2_preface_and_settings();
    let lit = h2_headers(true, b"/svc.Echo/Ping", false);
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&pre, &lit]),
        L7Decision::Backend {
            backend: 0,
            route_id: 3
        }
    );
    assert_eq!(user_tier("POST", "/svc.Echo/Ping", false), Some(0));
    let mut both = pre.clone();
    both.extend_from_slice(&h2_headers(true, b"/api/grpc.X/Y", false));
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&both]),
        L7Decision::Backend {
            backend: 1,
            route_id: 2
        }
    );
    // grpc-go and h2 Huffman-code :path: decoded in the kernel, same decision.
    let huff = h2_headers(true, &huffman::encode(b"/svc.Echo/Ping"), true);
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&pre, &huff]),
        L7Decision::Backend {
            backend: 0,
            route_id: 3
        }
    );
    let huff_q = h2_headers(true, &huffman::encode(b"/api/x?q=/svc.Echo/"), true);
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&pre, &huff_q]),
        L7Decision::Backend {
            backend: 1,
            route_id: 2
        }
    );
    // A Huffman string with bad padding (a whole byte of ones after the code) is not a path.
    let mut bad = huffman::encode(b"/svc.Echo/Ping");
    bad.push(0xff);
    match kernel_decision(&tier, &l, port, &[&pre, &h2_headers(true, &bad, true)]) {
        L7Decision::Fallback {
            reason: FallbackReason::Malformed,
            ..
        } => {}
        d => panic!("badly padded Huffman :path: {d:?}"),
    }
    // Pseudo-header rules (RFC 9113 8.3): a repeated :path, a regular header before the
    // pseudo-headers, :status in a request, a request without :scheme, a CONNECT with
    // :scheme and :path, or a table size update after a field is malformed, so the user tier
    // (which refuses it) must answer it. The walk covers the whole block, so a violation
    // after :method and :path counts too.
    let frame = |block: Vec<u8>| {
        let mut f = vec![0, 0, block.len() as u8, 1, 0x4, 0, 0, 0, 1];
        f.extend(block);
        f
    };
    // The well-formed base the cases below break: :method POST, :scheme http, :path /api/x.
    let mut base = vec![0x83, 0x86, 0x04, 6];
    base.extend_from_slice(b"/api/x");
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&pre, &frame(base.clone())]),
        L7Decision::Backend {
            backend: 1,
            route_id: 2
        }
    );
    let svc = huffman::encode(b"/svc");
    let mut twice = base.clone();
    twice.extend_from_slice(&[0x5f, 1, b'x']); // content-type: x, then :path again
    twice.push(0x04);
    twice.push(0x80 | svc.len() as u8);
    twice.extend(svc);
    let mut twice_adjacent = base.clone();
    twice_adjacent.extend_from_slice(&[0x84]);
    let mut late = vec![0x40, 1, b'x', 1, b'1'];
    late.extend_from_slice(&base);
    let mut status = vec![0x88];
    status.extend_from_slice(&base);
    let mut no_scheme = vec![0x83, 0x04, 6];
    no_scheme.extend_from_slice(b"/api/x");
    let mut connect = vec![0x02, 7];
    connect.extend_from_slice(b"CONNECT");
    connect.extend_from_slice(&[0x86, 0x84]);
    let mut unknown_pseudo = base.clone();
    unknown_pseudo.extend_from_slice(&[0x00, 4, b':', b'f', b'o', b'o', 1, b'1']);
    let mut size_update_late = base.clone();
    size_update_late.push(0x20);
    for (what, block) in [
        ("a second :path after a regular header", twice),
        ("a second :path", twice_adjacent),
        ("a regular header first", late),
        (":status in a request", status),
        ("no :scheme", no_scheme),
        ("CONNECT with :scheme and :path", connect),
        ("an unknown pseudo-header", unknown_pseudo),
        ("a table size update after a field", size_update_late),
    ] {
        match kernel_decision(&tier, &l, port, &[&pre, &frame(block)]) {
            L7Decision::Fallback {
                reason: FallbackReason::Malformed,
                ..
            } => {}
            d => panic!("{what}: {d:?}"),
        }
    }
    // A block that goes on in a CONTINUATION frame is not decided on its first part.
    let mut open = frame(base.clone());
    open[4] = 0; // no END_HEADERS
    match kernel_decision(&tier, &l, port, &[&pre, &open]) {
        L7Decision::Fallback {
            reason: FallbackReason::TooLong,
            ..
        } => {}
        d => panic!("HEADERS without END_HEADERS: {d:?}"),
    }
    // An HTTP/2 client to an HTTP/1.1-only cluster: the user tier translates.
    let h1only = h2_headers(true, &huffman::encode(b"/h1only/x"), true);
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&pre, &h1only]),
        L7Decision::Fallback {
            reason: FallbackReason::Protocol,
            route_id: Some(4)
        }
    );
    let get = h2_headers(false, b"/svc.Echo/Ping", false);
    assert_eq!(
        kernel_decision(&tier, &l, port, &[&pre, &get]),
        L7Decision::Fallback {
            reason: FallbackReason::NoMatch,
            route_id: None
        }
    );
    let st = tier.status().unwrap_or_else(|e| panic!("{e}"));
    // 9 decided (4 HTTP/1.1 + 5 gRPC), 19 left to user space, each counted once.
    assert_eq!(
        (st.stat("fm_verdict").hits, st.stat("fm_verdict").fallbacks),
        (9, 19),
        "{st}"
    );
    tier.detach().unwrap_or_else(|e| panic!("{e}"));
}
