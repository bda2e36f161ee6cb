//! Active health checks (issue 17 item 3) against real backends: an HTTP health path that
//! answers 500 and then recovers, a port nobody listens on, a backend that accepts and
//! never answers, and a gRPC health server over HTTP/2.
//!
//! The checker runs on the node's control runtime, a thread of its own, so tokio's paused
//! clock cannot drive it from a test: these run on the wall clock with 100 ms intervals and
//! waits of seconds. The threshold state machine and the probing loop are tested on the
//! paused clock in `crates/proxy/src/resilience/health.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Response;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A backend whose `/healthz` answers 200 or 500 as `healthy` says; every other path
/// answers 200 naming the backend in `x-backend` and counts in `hits`.
struct Switchable {
    addr: SocketAddr,
    healthy: Arc<AtomicBool>,
    hits: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Switchable {
    async fn start(name: &'static str, healthy: bool) -> Switchable {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let healthy = Arc::new(AtomicBool::new(healthy));
        let hits = Arc::new(AtomicU64::new(0));
        let (h, n) = (healthy.clone(), hits.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (h, n) = (h.clone(), n.clone());
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let status = if req.uri().path() == "/healthz" {
                        if h.load(Ordering::Relaxed) {
                            200
                        } else {
                            500
                        }
                    } else {
                        n.fetch_add(1, Ordering::Relaxed);
                        200
                    };
                    async move {
                        Ok::<_, Infallible>(
                            Response::builder()
                                .status(status)
                                .header("x-backend", name)
                                .body(Full::new(Bytes::from_static(b"ok\n")))
                                .unwrap(),
                        )
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Switchable {
            addr,
            healthy,
            hits,
            task,
        }
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

impl Drop for Switchable {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn config(admin: SocketAddr, web: SocketAddr, endpoints: &[SocketAddr], check: &str) -> String {
    let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
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
        cluster: pool
        timeout: 5s
clusters:
  - name: pool
    endpoints: [ {endpoints} ]
    health_check: {check}
"#,
        endpoints = endpoints.join(", ")
    )
}

async fn unhealthy(node: &TestNode) -> f64 {
    metric(
        node,
        "flatmesh_health_unhealthy_endpoints",
        &["cluster=\"pool\""],
    )
    .await
}

async fn probes(node: &TestNode, result: &str) -> f64 {
    let label = format!("result=\"{result}\"");
    metric(
        node,
        "flatmesh_health_checks",
        &["cluster=\"pool\"", label.as_str()],
    )
    .await
}

/// `n` GETs; panics on any answer but 200.
async fn send_all(web: SocketAddr, n: usize) {
    let client = h1_client();
    for i in 0..n {
        let resp = get(&client, &format!("http://{web}/r/{i}"), &[]).await;
        assert_eq!(resp.status.as_u16(), 200, "request {i}: {}", resp.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_health_path_takes_the_endpoint_out_until_it_passes_again() {
    let a = Switchable::start("a", true).await;
    let b = Switchable::start("b", false).await;
    let c = Switchable::start("c", true).await;
    let (admin, web) = (free_addr(), free_addr());
    let yaml = config(
        admin,
        web,
        &[a.addr, b.addr, c.addr],
        "{ http: { path: /healthz }, interval: 100ms, timeout: 1s, unhealthy_threshold: 2, healthy_threshold: 3 }",
    );
    let node = TestNode::start(&yaml);
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "b never went out: {}",
        node.metrics().await
    );
    assert!(probes(&node, "fail").await >= 2.0);
    let before = b.hits();
    send_all(web, 60).await;
    assert_eq!(
        b.hits(),
        before,
        "an endpoint failing its health check got traffic"
    );
    assert!(
        a.hits() >= 20 && c.hits() >= 20,
        "a {} c {}",
        a.hits(),
        c.hits()
    );

    // A reload that keeps the cluster's check and endpoints keeps what the check found.
    node.write_config(&yaml);
    let (status, body) = node.reload().await;
    assert!(status.is_success(), "reload: {body}");
    assert_eq!(unhealthy(&node).await, 1.0, "the reload forgot b's health");
    send_all(web, 30).await;
    assert_eq!(b.hits(), before, "b got traffic right after the reload");

    // b passes again: back after three passes, and gets its share.
    b.healthy.store(true, Ordering::Relaxed);
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 0.0
        })
        .await,
        "b never came back"
    );
    send_all(web, 60).await;
    assert!(
        b.hits() - before >= 15,
        "b is back but got {} of 60",
        b.hits() - before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tcp_check_takes_a_closed_port_out() {
    let a = Switchable::start("a", true).await;
    let closed = free_addr();
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[a.addr, closed],
        "{ tcp: {}, interval: 100ms, timeout: 1s, unhealthy_threshold: 2, healthy_threshold: 1 }",
    ));
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "the closed port never went out: {}",
        node.metrics().await
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            probes(&node, "pass").await >= 2.0
        })
        .await,
        "the open port passes"
    );
    let before = a.hits();
    // Without the check every other request would go to the closed port.
    send_all(web, 40).await;
    assert_eq!(a.hits() - before, 40);
}

/// Accepts connections and never answers; counts those still open.
struct Mute {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Mute {
    async fn start() -> Mute {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let o = open.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let o = o.clone();
                o.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                    o.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        Mute { addr, open, task }
    }
}

impl Drop for Mute {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_probe_that_hangs_is_cut_at_the_timeout() {
    let a = Switchable::start("a", true).await;
    let mute = Mute::start().await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[a.addr, mute.addr],
        "{ http: { path: /healthz }, interval: 100ms, timeout: 200ms, unhealthy_threshold: 2, healthy_threshold: 1 }",
    ));
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "the hanging endpoint never went out: {}",
        node.metrics().await
    );
    // Rounds go on every ~300 ms (interval + timeout): the probes end at their timeout
    // instead of piling up, and each one's connection is closed when it is cut.
    let at = probes(&node, "timeout").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let timeouts = probes(&node, "timeout").await - at;
    assert!(
        (4.0..=9.0).contains(&timeouts),
        "{timeouts} timeouts in 2 s with a 100 ms interval and a 200 ms timeout"
    );
    assert!(
        mute.open.load(Ordering::Relaxed) <= 1,
        "{} probe connections left open",
        mute.open.load(Ordering::Relaxed)
    );
    send_all(web, 20).await;
}

/// A `grpc.health.v1.Health` server over cleartext HTTP/2 (the h2 crate), answering
/// SERVING or NOT_SERVING as `serving` says, and NOT_FOUND for a service it does not know.
struct GrpcHealth {
    addr: SocketAddr,
    serving: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl GrpcHealth {
    async fn start(serving: bool) -> GrpcHealth {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = Arc::new(AtomicBool::new(serving));
        let s = serving.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(mut conn) = h2::server::handshake(stream).await else {
                        return;
                    };
                    while let Some(Ok((req, mut respond))) = conn.accept().await {
                        let s = s.clone();
                        tokio::spawn(async move {
                            assert_eq!(req.uri().path(), "/grpc.health.v1.Health/Check");
                            let mut body = req.into_body();
                            let mut message = Vec::new();
                            while let Some(Ok(chunk)) = body.data().await {
                                let _ = body.flow_control().release_capacity(chunk.len());
                                message.extend_from_slice(&chunk);
                            }
                            // The request: a 5-byte prefix, then field 1 (service) if set.
                            let service = &message[5..];
                            let known = service.is_empty() || service == b"\x0a\x04echo";
                            let response = http::Response::builder()
                                .header("content-type", "application/grpc")
                                .body(())
                                .unwrap();
                            let mut trailers = http::HeaderMap::new();
                            if !known {
                                trailers.insert("grpc-status", "5".parse().unwrap());
                                let mut only = respond.send_response(response, false).unwrap();
                                only.send_trailers(trailers).unwrap();
                                return;
                            }
                            let status = if s.load(Ordering::Relaxed) { 1 } else { 2 };
                            let mut send = respond.send_response(response, false).unwrap();
                            send.send_data(Bytes::from(vec![0, 0, 0, 0, 2, 0x08, status]), false)
                                .unwrap();
                            trailers.insert("grpc-status", "0".parse().unwrap());
                            send.send_trailers(trailers).unwrap();
                        });
                    }
                });
            }
        });
        GrpcHealth {
            addr,
            serving,
            task,
        }
    }
}

impl Drop for GrpcHealth {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grpc_check_follows_the_serving_status() {
    let up = GrpcHealth::start(true).await;
    let down = GrpcHealth::start(false).await;
    let (admin, web) = (free_addr(), free_addr());
    let node = TestNode::start(&config(
        admin,
        web,
        &[up.addr, down.addr],
        "{ grpc: { service: echo }, interval: 100ms, timeout: 1s, unhealthy_threshold: 2, healthy_threshold: 2 }",
    ));
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 1.0
        })
        .await,
        "NOT_SERVING never went out: {}",
        node.metrics().await
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            probes(&node, "pass").await >= 2.0
        })
        .await,
        "SERVING passes"
    );
    down.serving.store(true, Ordering::Relaxed);
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node).await == 0.0
        })
        .await,
        "SERVING again but still out"
    );
    // A service the server does not know (NOT_FOUND) fails: both go out.
    let node2_yaml = config(
        free_addr(),
        free_addr(),
        &[up.addr, down.addr],
        "{ grpc: { service: other }, interval: 100ms, timeout: 1s, unhealthy_threshold: 2, healthy_threshold: 2 }",
    );
    let node2 = TestNode::start(&node2_yaml);
    assert!(
        eventually(Duration::from_secs(10), || async {
            unhealthy(&node2).await == 2.0
        })
        .await,
        "an unknown service passed: {}",
        node2.metrics().await
    );
}
