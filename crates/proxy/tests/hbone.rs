//! HBONE between two in-process nodes: node A's `tcp` listener relays to a `tunnel: hbone`
//! cluster, whose connections ride as HTTP/2 CONNECT streams inside mutual TLS to node B's
//! `hbone` listener, which delivers them to a real echo backend. Also what B refuses (a
//! destination outside `hbone.destinations`, a bad `:authority`, a peer its policies deny,
//! a destination that refuses the connection), each with its status and reason, while the
//! other streams of the same tunnel connection go on.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::backends::{pattern, TcpBackend, TcpMode};
use common::hbone::node_b;
use common::pki::*;
use common::*;
use http::{Method, Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn metric(node: &TestNode, name: &str, labels: &[&str]) -> f64 {
    metric_samples(&node.metrics().await, name, labels)
        .iter()
        .map(|(_, v)| v)
        .sum()
}

/// Node A: a tcp listener `app` whose cluster tunnels to `endpoint` through node B at
/// `tunnel_port`, presenting `me`.
fn node_a(
    pki: &Pki,
    listen: SocketAddr,
    endpoint: SocketAddr,
    tunnel_port: u16,
    me: &str,
) -> TestNode {
    node_a_with(pki, listen, endpoint, tunnel_port, me, "")
}

/// [`node_a`] with `limits` (the inside of a YAML flow map) for node A.
fn node_a_with(
    pki: &Pki,
    listen: SocketAddr,
    endpoint: SocketAddr,
    tunnel_port: u16,
    me: &str,
    limits: &str,
) -> TestNode {
    let id = pki.issue("node-a", me);
    let ca = pki.ca_file();
    TestNode::start(&format!(
        r#"
admin: {admin}
workers: 1
limits: {{ {limits} }}
listeners:
  - name: app
    address: {listen}
    protocol: tcp
    cluster: remote
clusters:
  - name: remote
    endpoints: [ {endpoint} ]
    tunnel: hbone
    tunnel_port: {tunnel_port}
    tls: {{ ca: {ca}, cert: {id}.pem, key: {id}.key, server_ids: [ {NODE} ] }}
"#,
        admin = free_addr()
    ))
}

/// Sends `data` through `addr` to the echo backend and returns what came back.
async fn echo_through(addr: SocketAddr, data: Vec<u8>) -> Vec<u8> {
    try_echo_through(addr, data).await.unwrap()
}

/// [`echo_through`], with the connect error returned. What came back is the answer either way: a
/// node that refuses the connection may reset it before the client has connected (a CI run saw
/// ECONNRESET at connect) or while it writes, so write errors count as an end, like read errors.
async fn try_echo_through(addr: SocketAddr, data: Vec<u8>) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(addr).await?;
    let (mut r, mut w) = s.split();
    let (_, back) = tokio::join!(
        async move {
            if w.write_all(&data).await.is_ok() {
                let _ = w.shutdown().await;
            }
        },
        async move {
            let mut back = Vec::new();
            let _ = r.read_to_end(&mut back).await;
            back
        }
    );
    Ok(back)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_ride_one_tunnel_connection_to_the_echo_backend() {
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (a_listen, b_listen) = (free_addr(), free_addr());
    let b = node_b(&pki, b_listen, WEB, "");
    let a = node_a(&pki, a_listen, echo.addr, b_listen.port(), WEB);
    // One connection first: the tunnel connection is open before the crowd comes.
    let data = pattern(256 * 1024, 1);
    assert!(
        echo_through(a_listen, data.clone()).await == data,
        "the echo came back different"
    );
    let mut crowd = tokio::task::JoinSet::new();
    for i in 0..40u64 {
        crowd.spawn(async move {
            let data = pattern(16 * 1024 + i as usize * 100, i + 2);
            (echo_through(a_listen, data.clone()).await == data, i)
        });
    }
    while let Some(done) = crowd.join_next().await {
        let (same, i) = done.unwrap();
        assert!(same, "connection {i}: the echo came back different");
    }
    // 41 streams, one tunnel connection (node A has one worker; 41 is within the 100
    // streams a connection carries).
    assert_eq!(
        metric(&b, "flatmesh_hbone_streams_total", &["listener=\"tunnel\""]).await,
        41.0
    );
    assert_eq!(
        metric(
            &b,
            "flatmesh_downstream_connections_total",
            &["listener=\"tunnel\""]
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &a,
            "flatmesh_upstream_hbone_streams_total",
            &["cluster=\"remote\""]
        )
        .await,
        41.0
    );
    // Bytes both ways, counted on both nodes.
    let bytes: f64 = 2.0 * (256 * 1024) as f64
        + (0..40)
            .map(|i| 2.0 * (16 * 1024 + i * 100) as f64)
            .sum::<f64>();
    // A relay adds its bytes when its copy loop ends, which can be just after the client
    // read the echo's end: wait for the total (bounded), then check it is exact.
    for (node, listener) in [(&a, "app"), (&b, "tunnel")] {
        let label = format!("listener=\"{listener}\"");
        eventually(Duration::from_secs(5), || async {
            metric(node, "flatmesh_tcp_bytes_total", &[&label]).await >= bytes
        })
        .await;
        assert_eq!(
            metric(node, "flatmesh_tcp_bytes_total", &[&label]).await,
            bytes,
            "{listener}"
        );
    }
    b.assert_alive("after the tunnel").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_tunnel_connection_makes_node_a_open_another() {
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (a_listen, b_listen) = (free_addr(), free_addr());
    let b = node_b(&pki, b_listen, WEB, "");
    // Two streams per tunnel connection: five open connections need three.
    let a = node_a_with(
        &pki,
        a_listen,
        echo.addr,
        b_listen.port(),
        WEB,
        "http2_max_concurrent_streams: 2",
    );
    let mut held = Vec::new();
    for i in 0..5u8 {
        let mut s = TcpStream::connect(a_listen).await.unwrap();
        s.write_all(&[i; 3]).await.unwrap();
        let mut back = [0u8; 3];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
            .await
            .expect("echoed in time")
            .unwrap();
        assert_eq!(back, [i; 3]);
        held.push(s);
    }
    assert_eq!(
        metric(
            &b,
            "flatmesh_downstream_connections_total",
            &["listener=\"tunnel\""]
        )
        .await,
        3.0
    );
    assert_eq!(
        metric(
            &a,
            "flatmesh_upstream_connections_total",
            &["cluster=\"remote\""]
        )
        .await,
        3.0
    );
    // Every held connection still relays both ways.
    for (i, s) in held.iter_mut().enumerate() {
        s.write_all(b"again").await.unwrap();
        let mut back = [0u8; 5];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"again", "connection {i}");
    }
}

/// An HTTP/2 client over mutual TLS to B's listener, presenting `me`: an HBONE peer without
/// node A, to send any CONNECT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_before_any_tunnel_connection_shares_the_dials() {
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (a_listen, b_listen) = (free_addr(), free_addr());
    let b = node_b(&pki, b_listen, WEB, "");
    // Two streams per tunnel connection; seven connections arrive at once, before node A has
    // any tunnel connection: single-flight dials open four (each dial's connection is filled
    // by the streams that waited on it), not one per stream.
    let a = node_a_with(
        &pki,
        a_listen,
        echo.addr,
        b_listen.port(),
        WEB,
        "http2_max_concurrent_streams: 2",
    );
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..7u8 {
        burst.spawn(async move {
            let mut s = TcpStream::connect(a_listen).await.unwrap();
            s.write_all(&[i; 3]).await.unwrap();
            let mut back = [0u8; 3];
            tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
                .await
                .expect("echoed in time")
                .unwrap();
            assert_eq!(back, [i; 3]);
            s
        });
    }
    let mut held = Vec::new();
    while let Some(s) = burst.join_next().await {
        held.push(s.unwrap());
    }
    for (node, name, label) in [
        (
            &a,
            "flatmesh_upstream_connections_total",
            "cluster=\"remote\"",
        ),
        (
            &b,
            "flatmesh_downstream_connections_total",
            "listener=\"tunnel\"",
        ),
    ] {
        assert_eq!(metric(node, name, &[label]).await, 4.0, "{name}");
    }
    drop(held);
}

async fn hbone_peer(pki: &Pki, addr: SocketAddr, me: &str) -> h2::client::SendRequest<Bytes> {
    let svid = pki.svid(me);
    let tls = tls_connect(addr, client_config(&pki.bundle(), Some(&svid), NODE, b"h2"))
        .await
        .unwrap();
    let (send, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);
    send
}

/// A CONNECT to `authority`; returns its status and, when 200, the stream's two halves.
async fn connect(
    send: &h2::client::SendRequest<Bytes>,
    authority: &str,
) -> (StatusCode, Option<(h2::SendStream<Bytes>, h2::RecvStream)>) {
    let mut send = send.clone().ready().await.unwrap();
    let request = Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .body(())
        .unwrap();
    let (response, stream) = send.send_request(request, false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(5), response)
        .await
        .expect("answered in time")
        .unwrap();
    let status = response.status();
    (
        status,
        (status == StatusCode::OK).then(|| (stream, response.into_body())),
    )
}

/// Writes `data` on an open CONNECT stream and reads as much back.
async fn ping(stream: &mut (h2::SendStream<Bytes>, h2::RecvStream), data: &'static [u8]) {
    stream.0.send_data(Bytes::from_static(data), false).unwrap();
    let mut back = Vec::new();
    while back.len() < data.len() {
        let chunk = tokio::time::timeout(Duration::from_secs(5), stream.1.data())
            .await
            .expect("echoed in time")
            .expect("the stream is open")
            .unwrap();
        let _ = stream.1.flow_control().release_capacity(chunk.len());
        back.extend_from_slice(&chunk);
    }
    assert_eq!(back, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_streams_get_their_status_and_reason_and_the_others_go_on() {
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let closed = free_addr();
    let b_listen = free_addr();
    let b = node_b(
        &pki,
        b_listen,
        WEB,
        &format!("    hbone: {{ destinations: [ {}, {closed} ] }}", echo.addr),
    );
    let peer = hbone_peer(&pki, b_listen, WEB).await;
    let (status, open) = connect(&peer, &echo.addr.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    let mut open = open.unwrap();
    ping(&mut open, b"before").await;
    for (authority, want, reason) in [
        // Not in hbone.destinations: not an open relay.
        (
            "10.1.2.3:80",
            StatusCode::FORBIDDEN,
            "destination_not_allowed",
        ),
        // Loopback, but another port than the one allowed.
        (
            &*format!("127.0.0.1:{}", echo.addr.port() + 1),
            StatusCode::FORBIDDEN,
            "destination_not_allowed",
        ),
        // A name, not an IP:PORT: the node resolves nothing for a peer.
        ("example.org:80", StatusCode::BAD_REQUEST, "bad_authority"),
        // Allowed, but nothing listens there.
        (
            &*closed.to_string(),
            StatusCode::SERVICE_UNAVAILABLE,
            "connect_failed",
        ),
    ] {
        let (status, _) = connect(&peer, authority).await;
        assert_eq!(status, want, "{authority}");
        let label = format!("reason=\"{reason}\"");
        assert!(
            metric(
                &b,
                "flatmesh_hbone_streams_refused_total",
                &["listener=\"tunnel\"", &label]
            )
            .await
                >= 1.0,
            "{authority}: no refusal counted for {reason}"
        );
    }
    // The stream opened first noticed nothing, and the connection takes new streams.
    ping(&mut open, b"after").await;
    let (status, again) = connect(&peer, &echo.addr.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    ping(&mut again.unwrap(), b"again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_the_listener_does_not_allow_is_refused() {
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    // Without `hbone:` a listener delivers to loopback only: a documentation address
    // (TEST-NET-1) is refused before anything is connected.
    let open_b = free_addr();
    let _open_b = node_b(&pki, open_b, WEB, "");
    let peer = hbone_peer(&pki, open_b, WEB).await;
    let (status, _) = connect(&peer, "192.0.2.10:80").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // Through node A, to a B that allows 10.0.0.0/8 only: A's client sees its connection
    // closed, A counts the peer's 403, and the echo backend is never reached.
    let (a_listen, b_listen) = (free_addr(), free_addr());
    let b = node_b(
        &pki,
        b_listen,
        WEB,
        "    hbone: { destinations: [ 10.0.0.0/8 ] }",
    );
    let a = node_a(&pki, a_listen, echo.addr, b_listen.port(), WEB);
    // Closed or reset, nothing comes back.
    let back = try_echo_through(a_listen, b"x".to_vec())
        .await
        .unwrap_or_default();
    assert!(back.is_empty(), "a refused tunnel relayed {back:?}");
    assert_eq!(
        metric(
            &a,
            "flatmesh_upstream_hbone_streams_refused_total",
            &["reason=\"peer_403\""]
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(
            &b,
            "flatmesh_hbone_streams_refused_total",
            &["reason=\"destination_not_allowed\""]
        )
        .await,
        1.0
    );
    assert_eq!(echo.accepted.load(std::sync::atomic::Ordering::Relaxed), 0);
    b.assert_alive("after refusing").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_the_listener_does_not_allow_is_refused() {
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let b_listen = free_addr();
    // TLS admits the shop namespace; the policies allow only web.
    let b = node_b(
        &pki,
        b_listen,
        &format!("\"{TD}/ns/shop/*\""),
        &format!(
            "    authorization:\n      policies:\n        - {{ name: only-web, action: allow, from: {{ principals: [ {WEB} ] }} }}"
        ),
    );
    // Cart passes TLS but not the policy: every CONNECT gets 403, counted as denied.
    let cart = hbone_peer(&pki, b_listen, CART).await;
    let (status, _) = connect(&cart, &echo.addr.to_string()).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        metric(
            &b,
            "flatmesh_hbone_streams_refused_total",
            &["reason=\"denied\""]
        )
        .await,
        1.0
    );
    assert!(
        metric(
            &b,
            "flatmesh_authz_decisions_total",
            &["listener=\"tunnel\"", "decision=\"deny\""]
        )
        .await
            >= 1.0
    );
    // Web passes both.
    let web = hbone_peer(&pki, b_listen, WEB).await;
    let (status, open) = connect(&web, &echo.addr.to_string()).await;
    assert_eq!(status, StatusCode::OK);
    ping(&mut open.unwrap(), b"web").await;
    // DB is outside the TLS allow list: no tunnel connection at all. (TLS 1.3 shows a refused
    // client certificate on the client's first read, so the CONNECT is what fails.)
    let db = pki.svid(DB);
    let refused = async {
        let tls = tls_connect(
            b_listen,
            client_config(&pki.bundle(), Some(&db), NODE, b"h2"),
        )
        .await
        .ok()?;
        let (send, conn) = h2::client::handshake(tls).await.ok()?;
        tokio::spawn(conn);
        let mut send = send.ready().await.ok()?;
        let request = Request::builder()
            .method(Method::CONNECT)
            .uri(echo.addr.to_string())
            .body(())
            .unwrap();
        let (response, _stream) = send.send_request(request, false).ok()?;
        Some(response.await.ok()?.status())
    };
    let answered = tokio::time::timeout(Duration::from_secs(5), refused)
        .await
        .expect("refused in time");
    assert_eq!(answered, None, "an identity outside `allow` got an answer");
    // The node sends its alert before it counts the refusal, so the client can see the
    // refusal first: the count may lag it by a moment (2 s at most).
    let counted = async {
        loop {
            let refusals = metric(
                &b,
                "flatmesh_tls_handshake_failures_total",
                &["listener=\"tunnel\"", "reason=\"not_allowed\""],
            )
            .await;
            if refusals >= 1.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(2), counted)
        .await
        .expect("the refused handshake is counted as not_allowed");
}
