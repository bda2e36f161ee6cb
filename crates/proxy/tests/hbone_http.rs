//! HBONE under the L7 path: node A's `http` listener routes to a `tunnel: hbone` cluster, so
//! each upstream HTTP connection (an HTTP/1.1 pooled connection, or the HTTP/2 connection of
//! a `protocol: http2` cluster) is one HTTP/2 CONNECT stream inside mutual TLS to node B's
//! `hbone` listener, which relays it to the backend. Keep-alive reuses the tunnelled
//! connections; a stream the peer refuses is a connect failure of that endpoint (503, or a
//! retry elsewhere on `connect-failure`); a peer outside `server_ids` gets no request.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;

use common::backends::{HttpBackend, Proto};
use common::hbone::node_b;
use common::pki::*;
use common::*;
use http::StatusCode;

/// Sum of every sample of `name` carrying all `labels`.
async fn total(node: &TestNode, name: &str, labels: &[&str]) -> f64 {
    metric_samples(&node.metrics().await, name, labels)
        .iter()
        .map(|(_, v)| v)
        .sum()
}

/// Node A: an http listener `web` whose one route goes to cluster `remote` (of `protocol`,
/// with `endpoints`), tunnelled through node B's `tunnel_port`, expecting `server_id` there.
/// `route` is more YAML for the route (its `retries`), `cluster` for the cluster (its
/// `outlier_detection`).
fn node_a(
    pki: &Pki,
    endpoints: &[SocketAddr],
    protocol: &str,
    tunnel_port: u16,
    server_id: &str,
    (route, cluster): (&str, &str),
) -> TestNode {
    let id = pki.issue("node-a", WEB);
    let ca = pki.ca_file();
    let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
    TestNode::start(&format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {listen}
    protocol: http
    routes:
      - cluster: remote
{route}
clusters:
  - name: remote
    protocol: {protocol}
    endpoints: [ {endpoints} ]
    tunnel: hbone
    tunnel_port: {tunnel_port}
    tls: {{ ca: {ca}, cert: {id}.pem, key: {id}.key, server_ids: [ {server_id} ] }}
{cluster}
"#,
        admin = free_addr(),
        listen = free_addr(),
        endpoints = endpoints.join(", "),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_requests_reuse_their_tunnelled_connections() {
    let pki = Pki::new();
    let backend = HttpBackend::start("far", Proto::H1).await;
    let b_listen = free_addr();
    let b = node_b(&pki, b_listen, WEB, "");
    let a = node_a(
        &pki,
        &[backend.addr],
        "http1",
        b_listen.port(),
        NODE,
        ("", ""),
    );
    let url = format!("http://{}/tunnelled", a.listener("web"));
    // One request first, so the tunnel connection is open before the crowd comes (streams
    // opened at once on a worker without one would each open their own).
    let resp = get(&h1_client(), &url, &[]).await;
    assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
    // Then seven keep-alive clients, seven requests each, at once: 50 in all.
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..7 {
        let url = url.clone();
        clients.spawn(async move {
            let client = h1_client();
            for i in 0..7 {
                let resp = get(&client, &url, &[]).await;
                assert_eq!(
                    resp.status,
                    StatusCode::OK,
                    "client {c} request {i}: {resp:?}"
                );
                assert_eq!(resp.backend(), Some("far"));
                assert_eq!(resp.echo()["path"], "/tunnelled");
            }
        });
    }
    while let Some(done) = clients.join_next().await {
        done.unwrap();
    }
    assert_eq!(backend.hits(), 50);
    // Counted on node A as requests answered (once each answer is through: a moment after
    // the client has it), on both nodes as tunnel streams.
    let counted = || async {
        total(
            &a,
            "flatmesh_requests_total",
            &["listener=\"web\"", "status_class=\"2xx\""],
        )
        .await
            == 50.0
    };
    assert!(
        eventually(std::time::Duration::from_secs(5), counted).await,
        "node A did not count 50 answered requests"
    );
    let streams_out = total(
        &a,
        "flatmesh_upstream_hbone_streams_total",
        &["cluster=\"remote\""],
    )
    .await;
    let streams_in = total(&b, "flatmesh_hbone_streams_total", &["listener=\"tunnel\""]).await;
    assert_eq!(streams_out, streams_in);
    // Keep-alive: at most one tunnelled connection per client at a time, each reused.
    assert!(
        (1.0..=7.0).contains(&streams_out),
        "{streams_out} tunnel streams for 50 requests from 7 keep-alive clients at once"
    );
    assert_eq!(
        backend.conns() as f64,
        streams_in,
        "one backend connection per stream"
    );
    // All of them on one tunnel connection (node A has one worker).
    assert_eq!(
        total(
            &a,
            "flatmesh_upstream_connections_total",
            &["cluster=\"remote\""]
        )
        .await,
        1.0
    );
    assert_eq!(
        total(
            &b,
            "flatmesh_downstream_connections_total",
            &["listener=\"tunnel\""]
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_cluster_multiplexes_over_one_tunnelled_stream() {
    let pki = Pki::new();
    let backend = HttpBackend::start("h2", Proto::H2c).await;
    let b_listen = free_addr();
    let b = node_b(&pki, b_listen, WEB, "");
    let a = node_a(
        &pki,
        &[backend.addr],
        "http2",
        b_listen.port(),
        NODE,
        ("", ""),
    );
    let url = format!("http://{}/multiplexed", a.listener("web"));
    // One request first, so the stream is open before the crowd comes.
    let resp = get(&h2c_client(), &url, &[]).await;
    assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
    assert_eq!(resp.echo()["version"], "HTTP/2.0");
    let mut crowd = tokio::task::JoinSet::new();
    for i in 0..30 {
        let url = url.clone();
        crowd.spawn(async move {
            // HTTP/1.1 and HTTP/2 clients alike.
            let client = if i % 2 == 0 {
                h1_client()
            } else {
                h2c_client()
            };
            let resp = get(&client, &url, &[]).await;
            assert_eq!(resp.status, StatusCode::OK, "request {i}: {resp:?}");
            assert_eq!(resp.backend(), Some("h2"));
        });
    }
    while let Some(done) = crowd.join_next().await {
        done.unwrap();
    }
    assert_eq!(backend.hits(), 31);
    assert_eq!(backend.conns(), 1, "every request on one HTTP/2 connection");
    assert_eq!(
        total(
            &a,
            "flatmesh_upstream_hbone_streams_total",
            &["cluster=\"remote\""]
        )
        .await,
        1.0
    );
    assert_eq!(
        total(&b, "flatmesh_hbone_streams_total", &["listener=\"tunnel\""]).await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_stream_is_a_connect_failure_that_a_retry_moves_past() {
    let pki = Pki::new();
    let good = HttpBackend::start("good", Proto::H1).await;
    // Node B delivers to the good backend only: a stream to anything else is refused 403.
    let b_listen = free_addr();
    let b = node_b(
        &pki,
        b_listen,
        WEB,
        &format!("    hbone: {{ destinations: [ {} ] }}", good.addr),
    );
    let refused = free_addr();
    let a = node_a(&pki, &[refused], "http1", b_listen.port(), NODE, ("", ""));
    let url = format!("http://{}/", a.listener("web"));
    let resp = get(&h1_client(), &url, &[]).await;
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE, "{resp:?}");
    assert!(
        resp.body
            .contains("upstream connect error: cluster `remote`")
            && resp.body.contains("peer_403"),
        "{}",
        resp.body
    );
    assert_eq!(
        total(
            &a,
            "flatmesh_upstream_hbone_streams_refused_total",
            &["cluster=\"remote\"", "reason=\"peer_403\""]
        )
        .await,
        1.0
    );
    assert_eq!(
        total(
            &b,
            "flatmesh_hbone_streams_refused_total",
            &["reason=\"destination_not_allowed\""]
        )
        .await,
        1.0
    );
    b.assert_alive("after refusing").await;

    // Two endpoints, one refused: a retry on connect-failure goes to the other.
    let a = node_a(
        &pki,
        &[refused, good.addr],
        "http1",
        b_listen.port(),
        NODE,
        (
            "        retries: { attempts: 1, on: [ connect-failure ] }",
            "",
        ),
    );
    let url = format!("http://{}/", a.listener("web"));
    let client = h1_client();
    for i in 0..10 {
        let resp = get(&client, &url, &[]).await;
        assert_eq!(resp.status, StatusCode::OK, "request {i}: {resp:?}");
        assert_eq!(resp.backend(), Some("good"));
    }
    let refusals = total(
        &a,
        "flatmesh_upstream_hbone_streams_refused_total",
        &["reason=\"peer_403\""],
    )
    .await;
    assert!(
        refusals >= 1.0,
        "round robin never tried the refused endpoint"
    );
    assert_eq!(
        total(
            &a,
            "flatmesh_upstream_retries_total",
            &["cluster=\"remote\""]
        )
        .await,
        refusals,
        "one retry per refused stream"
    );
    assert_eq!(good.hits(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_outside_server_ids_gets_no_request() {
    let pki = Pki::new();
    let backend = HttpBackend::start("far", Proto::H1).await;
    let b_listen = free_addr();
    let b = node_b(&pki, b_listen, WEB, "");
    // Node B presents the node identity; node A expects the cart service's.
    let a = node_a(
        &pki,
        &[backend.addr],
        "http1",
        b_listen.port(),
        CART,
        ("", ""),
    );
    let resp = get(&h1_client(), &format!("http://{}/", a.listener("web")), &[]).await;
    assert_eq!(resp.status, StatusCode::SERVICE_UNAVAILABLE, "{resp:?}");
    assert!(resp.body.contains("(tls,"), "{}", resp.body);
    assert_eq!(
        total(
            &a,
            "flatmesh_upstream_hbone_streams_refused_total",
            &["cluster=\"remote\"", "reason=\"tls\""]
        )
        .await,
        1.0
    );
    assert!(
        total(
            &a,
            "flatmesh_upstream_tls_handshake_failures_total",
            &["cluster=\"remote\""]
        )
        .await
            >= 1.0
    );
    assert_eq!(backend.hits(), 0);
    assert_eq!(
        total(&b, "flatmesh_hbone_streams_total", &["listener=\"tunnel\""]).await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_streams_eject_their_endpoint() {
    let pki = Pki::new();
    let good = HttpBackend::start("good", Proto::H1).await;
    let b_listen = free_addr();
    let _b = node_b(
        &pki,
        b_listen,
        WEB,
        &format!("    hbone: {{ destinations: [ {} ] }}", good.addr),
    );
    let refused = free_addr();
    let a = node_a(
        &pki,
        &[good.addr, refused],
        "http1",
        b_listen.port(),
        NODE,
        (
            "",
            "    outlier_detection: { consecutive_connect_failures: 2, consecutive_5xx: 0, base_ejection_time: 60s, max_ejection_percent: 50 }",
        ),
    );
    let url = format!("http://{}/", a.listener("web"));
    let client = h1_client();
    // Round robin: every other request meets the refused endpoint until its second refusal
    // in a row ejects it.
    let mut failed = 0;
    for i in 0..20 {
        let resp = get(&client, &url, &[]).await;
        if resp.status == StatusCode::SERVICE_UNAVAILABLE {
            failed += 1;
            if failed == 2 {
                break;
            }
        } else {
            assert_eq!(resp.status, StatusCode::OK, "request {i}: {resp:?}");
        }
    }
    assert_eq!(failed, 2);
    for i in 0..20 {
        let resp = get(&client, &url, &[]).await;
        assert_eq!(
            resp.status,
            StatusCode::OK,
            "after the ejection, request {i}: {resp:?}"
        );
    }
    assert_eq!(
        total(
            &a,
            "flatmesh_outlier_ejections_total",
            &[
                "cluster=\"remote\"",
                "reason=\"consecutive_connect_failures\""
            ]
        )
        .await,
        1.0
    );
    assert_eq!(
        total(
            &a,
            "flatmesh_upstream_hbone_streams_refused_total",
            &["reason=\"peer_403\""]
        )
        .await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_and_their_trailers_ride_the_tunnel() {
    use common::grpc::{self, GrpcBackend};
    let pki = Pki::new();
    let backend = GrpcBackend::start("g1").await;
    let b_listen = free_addr();
    let b = node_b(&pki, b_listen, WEB, "");
    let a = node_a(
        &pki,
        &[backend.addr],
        "http2",
        b_listen.port(),
        NODE,
        ("", ""),
    );
    let mut client = grpc::connect(a.listener("web")).await;
    for i in 0..10 {
        let resp = grpc::unary(&mut client, &format!("hello{i}"))
            .await
            .unwrap_or_else(|s| panic!("unary {i} failed through the tunnel: {s:?}"));
        assert_eq!(resp.into_inner().message, format!("g1:hello{i}"));
    }
    // A status in the trailers comes back as the backend sent it.
    let status = grpc::unary(&mut client, "fail").await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    // A server stream, message by message.
    let mut replies = grpc::server_stream(&mut client, "s", 50).await.unwrap();
    let mut got = 0;
    while let Some(reply) = replies.message().await.unwrap() {
        assert_eq!(reply.index, got);
        got += 1;
    }
    assert_eq!(got, 50);
    // Every call on one tunnelled stream.
    assert_eq!(
        total(&b, "flatmesh_hbone_streams_total", &["listener=\"tunnel\""]).await,
        1.0
    );
}
