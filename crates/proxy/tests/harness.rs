//! Self-checks of the test harness, with no proxy in the path: the backends and clients the
//! other test files rely on behave as documented. When a proxy test fails, this file passing
//! means the fault is on the proxy's side of the wire.

mod common;

use std::time::Duration;

use common::backends::{pattern, HttpBackend, Proto, TcpBackend, TcpEnd, TcpMode};
use common::grpc::{self, EchoRequest, GrpcBackend};
use common::*;
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_stream::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_backends_echo_and_identify_themselves() {
    let h1 = HttpBackend::start("one", Proto::H1).await;
    let h2 = HttpBackend::start("two", Proto::H2c).await;
    let req = request(
        Method::POST,
        &format!("http://{}/p?q=1", h1.addr),
        &[("x-a", "b")],
        "body",
    );
    let resp = send(&h1_client(), req).await.expect("h1 backend");
    assert_eq!(resp.backend(), Some("one"));
    let echo = resp.echo();
    assert_eq!(echo["path"], "/p");
    assert_eq!(echo["query"], "q=1");
    assert_eq!(echo["headers"]["x-a"], "b");
    assert_eq!(echo["body_len"], 4);
    assert_eq!(echo["version"], "HTTP/1.1");

    let resp = get(
        &h2c_client(),
        &format!("http://{}/x", h2.addr),
        &[("x-status", "418")],
    )
    .await;
    assert_eq!(resp.status, StatusCode::IM_A_TEAPOT);
    assert_eq!(resp.echo()["version"], "HTTP/2.0");
    assert_eq!(h2.hits(), 1);

    let t0 = std::time::Instant::now();
    let resp = get(
        &h1_client(),
        &format!("http://{}/d", h1.addr),
        &[("x-delay-ms", "200")],
    )
    .await;
    assert_eq!(resp.status, StatusCode::OK);
    assert!(t0.elapsed() >= Duration::from_millis(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_backend_serves_all_four_kinds() {
    let backend = GrpcBackend::start("g").await;
    let mut client = grpc::connect(backend.addr).await;
    assert_eq!(
        grpc::unary(&mut client, "x")
            .await
            .expect("unary")
            .into_inner()
            .message,
        "g:x"
    );
    let err = grpc::unary(&mut client, "fail").await.expect_err("fail");
    assert_eq!(err.code(), tonic::Code::NotFound);
    let reply = grpc::client_stream(&mut client, vec!["a".into(), "b".into()])
        .await
        .expect("client stream");
    assert_eq!((reply.message.as_str(), reply.index), ("a,b", 2));
    let mut stream = grpc::server_stream(&mut client, "fail-after", 2)
        .await
        .expect("server stream");
    assert_eq!(stream.next().await.expect("1").expect("ok").index, 0);
    assert_eq!(stream.next().await.expect("2").expect("ok").index, 1);
    let status = stream
        .next()
        .await
        .expect("status")
        .expect_err("error status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        status
            .metadata()
            .get("x-trailer")
            .and_then(|v| v.to_str().ok()),
        Some("t1")
    );
    let (tx, mut replies) = grpc::bidi(&mut client).await.expect("bidi");
    tx.send(EchoRequest {
        message: "p".into(),
        count: 0,
    })
    .await
    .expect("send");
    let r = tokio::time::timeout(Duration::from_secs(5), replies.next())
        .await
        .expect("reply in time");
    assert_eq!(r.expect("item").expect("ok").message, "re:p");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_backends_behave() {
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let mut s = TcpStream::connect(echo.addr).await.expect("connect");
    s.write_all(b"abc").await.expect("write");
    s.shutdown().await.expect("shutdown");
    let mut back = Vec::new();
    s.read_to_end(&mut back).await.expect("read");
    assert_eq!(back, b"abc");

    let count = TcpBackend::start(TcpMode::Count).await;
    let data = pattern(1000, 1);
    let mut s = TcpStream::connect(count.addr).await.expect("connect");
    s.write_all(&data).await.expect("write");
    s.shutdown().await.expect("shutdown");
    let mut reply = String::new();
    s.read_to_string(&mut reply).await.expect("read");
    assert_eq!(reply, format!("1000 {}\n", crc32fast::hash(&data)));

    let reset = TcpBackend::start(TcpMode::Reset).await;
    let mut s = TcpStream::connect(reset.addr).await.expect("connect");
    s.write_all(b"x").await.expect("write");
    let mut buf = [0u8; 8];
    let got = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("in time");
    assert_eq!(
        got.expect_err("reset").kind(),
        std::io::ErrorKind::ConnectionReset
    );

    let mut hold = TcpBackend::start(TcpMode::Hold).await;
    let s = TcpStream::connect(hold.addr).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.set_zero_linger().expect("linger");
    drop(s);
    let end = hold
        .next_end(Duration::from_secs(5))
        .await
        .expect("end event");
    assert_eq!(end, TcpEnd::Error(0, std::io::ErrorKind::ConnectionReset));
}

#[test]
fn metric_samples_parses_prometheus_text() {
    let text = "# HELP flatmesh_x x\nflatmesh_x_total{a=\"1\",b=\"2xx\"} 5\nflatmesh_x_total{a=\"2\"} 7\nother 1\n";
    let found = metric_samples(text, "flatmesh_x", &["b=\"2xx\""]);
    assert_eq!(
        found,
        vec![("flatmesh_x_total{a=\"1\",b=\"2xx\"}".to_owned(), 5.0)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_backend_counts_cancelled_streams() {
    let backend = GrpcBackend::start("g").await;
    let mut client = grpc::connect(backend.addr).await;
    let mut stream = grpc::server_stream(&mut client, "forever", 0)
        .await
        .expect("stream");
    assert_eq!(stream.next().await.expect("tick").expect("ok").index, 0);
    drop(stream);
    let cancelled = backend.cancelled.clone();
    let seen = eventually(Duration::from_secs(5), || {
        let cancelled = cancelled.clone();
        async move { cancelled.load(std::sync::atomic::Ordering::Relaxed) == 1 }
    })
    .await;
    assert!(
        seen,
        "dropping the client stream was not seen by the backend"
    );
}
