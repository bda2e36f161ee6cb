//! Fault injection and mirroring (issue 17 item 6) against real backends: aborts over many
//! requests (their share within statistical bounds), delays, gRPC aborts, and a mirror
//! cluster that hangs or is not there at all, which the caller must never notice.
//!
//! The node runs its workers on runtimes of their own threads, so these tests run on the wall
//! clock with generous bounds; the exact delay and timeout arithmetic is tested on the paused
//! clock in `crates/proxy/src/l7/fault.rs` and `mirror.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::backends::{HttpBackend, Proto};
use common::grpc::GrpcBackend;
use common::*;
use http::{Method, Response};
use http_body_util::{BodyExt as _, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A node with listener `web` whose one route forwards to cluster `app` (at `app`) with the
/// route settings `route` (YAML lines, indented by 8), and a cluster `shadow` at `shadow`.
fn config(
    admin: SocketAddr,
    web: SocketAddr,
    app: &str,
    shadow: SocketAddr,
    route: &str,
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
      - match: {{ path: {{ prefix: / }} }}
        cluster: app
        timeout: 10s
{route}
clusters:
  - name: app
{app}
  - name: shadow
    endpoints: [ {shadow} ]
"#
    )
}

/// A mirror backend: reports each request's host and body, then answers only after `hold`
/// (or never, if the test ends first).
struct Recorder {
    addr: SocketAddr,
    seen: mpsc::UnboundedReceiver<(String, Bytes)>,
    task: JoinHandle<()>,
}

impl Recorder {
    async fn start(hold: Duration) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, seen) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let tx = tx.clone();
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let tx = tx.clone();
                    async move {
                        let host = req
                            .headers()
                            .get(http::header::HOST)
                            .map(|h| h.to_str().unwrap_or("?").to_owned())
                            .or_else(|| req.uri().authority().map(|a| a.to_string()))
                            .unwrap_or_default();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let _ = tx.send((host, body));
                        tokio::time::sleep(hold).await;
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"shadow"))))
                    }
                });
                conns.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Recorder { addr, seen, task }
    }

    /// The next copy the mirror got, within 5 s.
    async fn next(&mut self) -> (String, Bytes) {
        tokio::time::timeout(Duration::from_secs(5), self.seen.recv())
            .await
            .expect("the mirror got no copy within 5 s")
            .unwrap()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn endpoints(addr: SocketAddr) -> String {
    format!("    endpoints: [ {addr} ]")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn half_the_requests_are_aborted_within_statistical_bounds() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &endpoints(app.addr),
        free_addr(),
        "        fault: { abort: { status: 503, percent: 50 } }",
    ));
    const N: usize = 4000;
    let client = h1_client();
    let url = format!("http://{web}/x");
    let mut aborted = 0;
    for _ in 0..N {
        let resp = get(&client, &url, &[]).await;
        match resp.status.as_u16() {
            503 => {
                assert_eq!(resp.header("x-flatmesh-fault"), Some("abort"));
                aborted += 1;
            }
            200 => assert_eq!(resp.backend(), Some("app")),
            other => panic!("unexpected status {other}: {resp:?}"),
        }
    }
    // 50 % of 4,000 is 2,000 with a standard deviation of 32: ±5 % (200) is over 6 of them.
    assert!(
        (1800..=2200).contains(&aborted),
        "{aborted} of {N} aborted, expected 2000 ± 200"
    );
    assert_eq!(
        app.hits() as usize,
        N - aborted,
        "an aborted request never reaches the app"
    );
    assert_eq!(
        metric(&node, "flatmesh_faults_injected_total", &["kind=\"abort\""]).await as usize,
        aborted
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_request_is_aborted_at_100_percent_over_both_http_versions() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let _node = TestNode::start(&config(
        admin,
        web,
        &endpoints(app.addr),
        free_addr(),
        "        fault: { abort: { status: 429 } }",
    ));
    for client in [h1_client(), h2c_client()] {
        for _ in 0..50 {
            let resp = send(
                &client,
                request(Method::POST, &format!("http://{web}/x"), &[], "a body"),
            )
            .await
            .unwrap();
            assert_eq!(resp.status, 429);
            assert_eq!(resp.header("x-flatmesh-fault"), Some("abort"));
        }
    }
    assert_eq!(app.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delayed_request_is_forwarded_after_the_delay() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &endpoints(app.addr),
        free_addr(),
        "        fault: { delay: { duration: 300ms } }",
    ));
    for client in [h1_client(), h2c_client()] {
        let started = Instant::now();
        let resp = send(
            &client,
            request(
                Method::POST,
                &format!("http://{web}/x"),
                &[],
                "delayed body",
            ),
        )
        .await
        .unwrap();
        let took = started.elapsed();
        assert_eq!(resp.status, 200, "{resp:?}");
        assert_eq!(resp.echo()["body_len"], 12, "{}", resp.body);
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(3),
            "took {took:?}"
        );
    }
    assert_eq!(app.hits(), 2);
    assert_eq!(
        metric(&node, "flatmesh_faults_injected_total", &["kind=\"delay\""]).await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_clients_get_the_abort_as_a_grpc_status() {
    let backend = GrpcBackend::start("grpc").await;
    for (fault, code) in [
        (
            "{ abort: { grpc_status: 8 } }",
            tonic::Code::ResourceExhausted,
        ),
        // HTTP 503 maps to UNAVAILABLE, as Envoy maps it.
        ("{ abort: { status: 503 } }", tonic::Code::Unavailable),
    ] {
        let (admin, web) = (free_addr(), free_addr());
        let _node = TestNode::start(&config(
            admin,
            web,
            &format!("    protocol: http2\n{}", endpoints(backend.addr)),
            free_addr(),
            &format!("        fault: {fault}"),
        ));
        let mut client = common::grpc::connect(web).await;
        let status = common::grpc::unary(&mut client, "hi").await.unwrap_err();
        assert_eq!(status.code(), code, "{fault}: {status:?}");
        assert!(status.message().contains("fault injected"), "{status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mirroring_delivers_the_copy_and_the_caller_s_latency_does_not_include_it() {
    let app = HttpBackend::start("app", Proto::H1).await;
    // The mirror holds every answer for 5 s: a caller that waited for it would see it.
    let mut shadow = Recorder::start(Duration::from_secs(5)).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &endpoints(app.addr),
        shadow.addr,
        "        mirror: { cluster: shadow }",
    ));
    for (client, body) in [
        (h1_client(), "copy me (h1)"),
        (h2c_client(), "copy me (h2)"),
    ] {
        let started = Instant::now();
        let resp = send(
            &client,
            request(Method::POST, &format!("http://{web}/orders"), &[], body),
        )
        .await
        .unwrap();
        let took = started.elapsed();
        assert_eq!(resp.status, 200, "{resp:?}");
        assert_eq!(resp.echo()["body_len"], body.len(), "{}", resp.body);
        assert!(took < Duration::from_secs(2), "the caller waited {took:?}");
        let (host, copied) = shadow.next().await;
        // `-shadow` goes on the host, before the port, as Envoy puts it.
        assert_eq!(host, format!("127.0.0.1-shadow:{}", web.port()));
        assert_eq!(copied, body.as_bytes());
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            metric(
                &node,
                "flatmesh_mirror_requests_total",
                &["result=\"sent\""],
            )
            .await
                == 2.0
        })
        .await
    );
    // A body over the copy's bound: forwarded whole, not mirrored, counted.
    let big = "x".repeat(100 * 1024);
    let resp = send(
        &h1_client(),
        request(Method::POST, &format!("http://{web}/big"), &[], &big),
    )
    .await
    .unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.echo()["body_len"], big.len());
    assert!(
        eventually(Duration::from_secs(5), || async {
            metric(
                &node,
                "flatmesh_mirror_dropped_total",
                &["reason=\"body_too_large\""],
            )
            .await
                == 1.0
        })
        .await
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), shadow.seen.recv())
            .await
            .is_err(),
        "no copy of the big body"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_mirror_cluster_never_touches_the_caller() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    // Nothing listens at the mirror's address.
    let node = TestNode::start(&config(
        admin,
        web,
        &endpoints(app.addr),
        free_addr(),
        "        mirror: { cluster: shadow, percent: 100 }",
    ));
    const N: usize = 200;
    let mut failed = 0;
    for (k, client) in [h1_client(), h2c_client()].iter().enumerate() {
        for i in 0..N / 2 {
            let resp = send(
                client,
                request(
                    Method::POST,
                    &format!("http://{web}/r/{k}/{i}"),
                    &[],
                    "payload",
                ),
            )
            .await
            .unwrap();
            if resp.status != 200 || resp.echo()["body_len"] != 7 {
                failed += 1;
            }
        }
    }
    assert_eq!(failed, 0);
    assert_eq!(app.hits() as usize, N);
    assert!(
        eventually(Duration::from_secs(5), || async {
            metric(
                &node,
                "flatmesh_mirror_requests_total",
                &["result=\"failed\""],
            )
            .await
                == N as f64
        })
        .await,
        "every copy failed to connect, and was counted"
    );
    node.assert_alive("after 200 copies to a dead mirror").await;
    println!("FAULT-SURVIVED | mirror cluster down | sent {N} | failed {failed}");
}
