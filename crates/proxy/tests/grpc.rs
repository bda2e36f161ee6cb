//! gRPC through the proxy against a tonic backend: unary, client/server/bidi streaming,
//! trailers and non-OK grpc-status passed through.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::grpc::{self, EchoRequest, GrpcBackend};
use common::*;
use tokio_stream::StreamExt;

const STEP: Duration = Duration::from_secs(10);

async fn setup() -> (GrpcBackend, TestNode, SocketAddr) {
    let backend = GrpcBackend::start("g1").await;
    let (admin, web) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: grpc
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /test.Echo/ }} }}
        cluster: echo
clusters:
  - name: echo
    protocol: http2
    endpoints: [ {b} ]
"#,
        b = backend.addr
    );
    let proxy = TestNode::start(&yaml);
    (backend, proxy, web)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_ok_and_metadata() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    for i in 0..20 {
        let resp = tokio::time::timeout(STEP, grpc::unary(&mut client, &format!("hello{i}")))
            .await
            .expect("unary within time")
            .unwrap_or_else(|s| panic!("unary failed through the proxy: {s:?}"));
        assert_eq!(
            resp.metadata()
                .get("x-backend")
                .and_then(|v| v.to_str().ok()),
            Some("g1")
        );
        assert_eq!(resp.into_inner().message, format!("g1:hello{i}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_non_ok_status_passes_through() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let status = tokio::time::timeout(STEP, grpc::unary(&mut client, "fail"))
        .await
        .expect("unary within time")
        .expect_err("backend answers NOT_FOUND");
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    assert_eq!(status.message(), "no such thing: fail");
    // The channel still works after an error status.
    let ok = tokio::time::timeout(STEP, grpc::unary(&mut client, "again"))
        .await
        .expect("in time");
    assert_eq!(ok.expect("ok after error").into_inner().message, "g1:again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_streaming() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let messages: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    let reply = tokio::time::timeout(STEP, grpc::client_stream(&mut client, messages.clone()))
        .await
        .expect("client stream within time")
        .unwrap_or_else(|s| panic!("client streaming failed: {s:?}"));
    assert_eq!(reply.index, 200);
    assert_eq!(reply.message, messages.join(","));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_streaming() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let mut stream = tokio::time::timeout(STEP, grpc::server_stream(&mut client, "s", 500))
        .await
        .expect("in time")
        .unwrap_or_else(|s| panic!("server streaming failed to start: {s:?}"));
    let mut n = 0;
    while let Some(item) = tokio::time::timeout(STEP, stream.next())
        .await
        .expect("next message in time")
    {
        let reply = item.unwrap_or_else(|s| panic!("stream error after {n} messages: {s:?}"));
        assert_eq!(reply.index, n);
        assert_eq!(reply.message, format!("s#{n}"));
        n += 1;
    }
    assert_eq!(n, 500, "expected 500 streamed replies");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_with_error_status_after_messages() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let mut stream = tokio::time::timeout(STEP, grpc::server_stream(&mut client, "fail-after", 3))
        .await
        .expect("in time")
        .unwrap_or_else(|s| panic!("server streaming failed to start: {s:?}"));
    let mut got = 0;
    let status = loop {
        match tokio::time::timeout(STEP, stream.next()).await.expect("next item in time") {
            Some(Ok(reply)) => {
                assert_eq!(reply.index, got);
                got += 1;
            }
            Some(Err(status)) => break status,
            None => panic!("stream ended with OK after {got} messages; expected RESOURCE_EXHAUSTED in trailers"),
        }
    };
    assert_eq!(got, 3, "all messages before the trailers arrive");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "stopped on purpose");
    assert_eq!(
        status
            .metadata()
            .get("x-trailer")
            .and_then(|v| v.to_str().ok()),
        Some("t1"),
        "custom trailer lost: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bidi_streaming_ping_pong() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let (tx, mut replies) = tokio::time::timeout(STEP, grpc::bidi(&mut client))
        .await
        .expect("bidi opens in time")
        .unwrap_or_else(|s| panic!("bidi failed to open: {s:?}"));
    // Each reply must arrive before the next request is sent: a proxy that buffers the
    // request stream (or the response stream) stalls here.
    for i in 0..50 {
        tx.send(EchoRequest {
            message: format!("p{i}"),
            count: 0,
        })
        .await
        .expect("send");
        let reply = tokio::time::timeout(Duration::from_secs(5), replies.next())
            .await
            .unwrap_or_else(|_| {
                panic!("no reply to message {i} within 5 s: the stream is buffered")
            })
            .expect("stream still open")
            .unwrap_or_else(|s| panic!("bidi error at {i}: {s:?}"));
        assert_eq!(reply.index, i);
        assert_eq!(reply.message, format!("re:p{i}"));
    }
    drop(tx);
    let end = tokio::time::timeout(STEP, replies.next())
        .await
        .expect("stream ends in time");
    assert!(
        end.is_none(),
        "expected a clean end after the client closed, got {end:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_calls_on_one_channel() {
    let (_b, _p, web) = setup().await;
    let client = grpc::connect(web).await;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let r = tokio::time::timeout(STEP, grpc::unary(&mut c, &format!("c{i}"))).await;
            (i, r)
        }));
    }
    for t in tasks {
        let (i, r) = t.await.expect("task");
        let reply = r
            .expect("in time")
            .unwrap_or_else(|s| panic!("call {i} failed: {s:?}"));
        assert_eq!(reply.into_inner().message, format!("g1:c{i}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_cross_flow_control_windows() {
    let (_b, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    // 1 MiB is 16 times HTTP/2's default 64 KiB window: the proxy must honour WINDOW_UPDATEs.
    let big = "z".repeat(1024 * 1024);
    let reply = tokio::time::timeout(STEP, grpc::unary(&mut client, &big))
        .await
        .expect("1 MiB unary within time")
        .unwrap_or_else(|s| panic!("1 MiB unary failed: {s:?}"));
    assert_eq!(reply.into_inner().message.len(), big.len() + 3);
    let parts: Vec<String> = (0..8)
        .map(|i| format!("{i}{}", "y".repeat(256 * 1024)))
        .collect();
    let reply = tokio::time::timeout(STEP, grpc::client_stream(&mut client, parts.clone()))
        .await
        .expect("2 MiB client stream within time")
        .unwrap_or_else(|s| panic!("2 MiB client stream failed: {s:?}"));
    assert_eq!(reply.message, parts.join(","));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_call_cancels_it_upstream() {
    let (backend, _p, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let mut stream = tokio::time::timeout(STEP, grpc::server_stream(&mut client, "forever", 0))
        .await
        .expect("in time")
        .unwrap_or_else(|s| panic!("endless stream failed to start: {s:?}"));
    for i in 0..5 {
        let tick = tokio::time::timeout(STEP, stream.next())
            .await
            .expect("tick in time")
            .expect("stream open")
            .unwrap_or_else(|s| panic!("tick {i}: {s:?}"));
        assert_eq!(tick.index, i);
    }
    assert_eq!(
        backend.cancelled.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // Dropping the response stream resets the HTTP/2 stream; the proxy must pass the reset on,
    // or the backend streams forever into a dead call.
    drop(stream);
    let cancelled = backend.cancelled.clone();
    let propagated = eventually(Duration::from_secs(5), || {
        let cancelled = cancelled.clone();
        async move { cancelled.load(std::sync::atomic::Ordering::Relaxed) == 1 }
    })
    .await;
    assert!(
        propagated,
        "the backend still streams 5 s after the client cancelled the call"
    );
    // The channel is still usable.
    let ok = tokio::time::timeout(STEP, grpc::unary(&mut client, "after"))
        .await
        .expect("in time");
    assert_eq!(
        ok.expect("unary after cancel").into_inner().message,
        "g1:after"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_survives_a_reload() {
    let (_b, proxy, web) = setup().await;
    let mut client = grpc::connect(web).await;
    let mut stream = tokio::time::timeout(STEP, grpc::server_stream(&mut client, "forever", 0))
        .await
        .expect("in time")
        .unwrap_or_else(|s| panic!("endless stream failed to start: {s:?}"));
    let first = tokio::time::timeout(STEP, stream.next())
        .await
        .expect("tick in time");
    assert_eq!(first.expect("open").expect("ok").index, 0);
    // Reload with a changed route table while the stream is open.
    let yaml = std::fs::read_to_string(&proxy.config_path).expect("read config");
    let changed = yaml.replace(
        "    routes:\n",
        "    routes:\n      - match: { path: { exact: /new } }\n        direct_response: { status: 200, body: \"new\" }\n",
    );
    assert_ne!(changed, yaml, "test bug: route table not changed");
    proxy.write_config(&changed);
    proxy.reload().await;
    let applied = eventually(Duration::from_secs(5), || async move {
        send(&h1_client(), get_req(&format!("http://{web}/new")))
            .await
            .map(|r| r.body)
            .ok()
            .as_deref()
            == Some("new")
    })
    .await;
    assert!(applied, "reload did not apply");
    // The stream opened before the reload keeps flowing afterwards.
    for _ in 0..10 {
        let tick = tokio::time::timeout(STEP, stream.next())
            .await
            .expect("tick after reload in time");
        tick.expect("stream still open after reload")
            .unwrap_or_else(|s| panic!("stream broken by reload: {s:?}"));
    }
}

/// Many bidi streams whose replies are read late, behind a tiny client window: every stream
/// must still deliver all its replies in order and end cleanly. (The ENHANCE_YOUR_CALM
/// resets that h2's small-DATA-frame budget once caused showed only under load, in the
/// benchmark's `grpc_stream` scenario, which counts them; this test did not reproduce them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_bidi_streams_with_small_messages_read_late() {
    let (_b, _p, web) = setup().await;
    let mut tasks = Vec::new();
    for s in 0..30 {
        tasks.push(tokio::spawn(async move {
            // A tiny stream window: the proxy cannot pass replies on, so they wait, unread,
            // on its upstream connection.
            let mut client = grpc::connect_with_window(web, Some(64)).await;
            let (tx, mut replies) = tokio::time::timeout(STEP, grpc::bidi(&mut client))
                .await
                .expect("bidi opens in time")
                .unwrap_or_else(|st| panic!("stream {s}: bidi failed to open: {st:?}"));
            for i in 0..40 {
                tx.send(EchoRequest {
                    message: format!("s{s}m{i}"),
                    count: 0,
                })
                .await
                .expect("send");
            }
            drop(tx);
            let mut got = 0;
            while let Some(reply) = tokio::time::timeout(STEP, replies.next())
                .await
                .unwrap_or_else(|_| panic!("stream {s}: no reply within {STEP:?}"))
            {
                let reply = reply
                    .unwrap_or_else(|st| panic!("stream {s}: reset after {got} replies: {st:?}"));
                assert_eq!(reply.message, format!("re:s{s}m{got}"));
                got += 1;
            }
            assert_eq!(got, 40, "stream {s} ended early");
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
}

/// `grpc_field`: routes decided on a field of the first request message (papers/003), by the
/// user tier; the message still reaches the backend whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_on_a_field_of_the_first_message() {
    let (g1, g2) = (
        GrpcBackend::start("g1").await,
        GrpcBackend::start("g2").await,
    );
    let (admin, web) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: grpc
    address: {web}
    protocol: http
    routes:
      - name: vip
        match: {{ path: {{ prefix: /test.Echo/ }}, grpc_field: {{ number: 1, prefix: "vip-" }} }}
        cluster: second
      - name: three
        match: {{ path: {{ prefix: /test.Echo/ }}, grpc_field: {{ number: 2, exact: "3" }} }}
        cluster: second
      - name: rest
        match: {{ path: {{ prefix: /test.Echo/ }} }}
        cluster: first
clusters:
  - name: first
    protocol: http2
    endpoints: [ {a} ]
  - name: second
    protocol: http2
    endpoints: [ {b} ]
"#,
        a = g1.addr,
        b = g2.addr
    );
    let proxy = TestNode::start(&yaml);
    let mut client = grpc::connect(web).await;
    // A string field, by prefix; a message long enough to cross several DATA frames.
    let long = format!("vip-{}", "x".repeat(100_000));
    for (message, want) in [
        ("vip-alice", "g2"),
        ("vi", "g1"),
        ("alice-vip-", "g1"),
        ("", "g1"),
        (long.as_str(), "g2"),
    ] {
        let resp = tokio::time::timeout(STEP, grpc::unary(&mut client, message))
            .await
            .expect("unary within time")
            .unwrap_or_else(|s| panic!("unary failed through the proxy: {s:?}"));
        assert_eq!(
            resp.into_inner().message,
            format!("{want}:{message}"),
            "message {:.20}",
            message
        );
    }
    // A varint field, by its decimal text: the server stream's `count`; which route took
    // each call is read from the node's per-route counters.
    let routed = |route: &'static str| {
        let proxy = &proxy;
        async move {
            let labels = [format!("route=\"{route}\"")];
            let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
            metric_samples(&proxy.metrics().await, "flatmesh_requests_total", &labels)
                .iter()
                .map(|(_, v)| *v)
                .sum::<f64>()
        }
    };
    let (three, rest) = (routed("three").await, routed("rest").await);
    for (count, route) in [(3, "three"), (2, "rest"), (30, "rest")] {
        let before = routed(route).await;
        let mut stream = tokio::time::timeout(STEP, grpc::server_stream(&mut client, "n", count))
            .await
            .expect("server stream within time")
            .unwrap_or_else(|s| panic!("server stream failed: {s:?}"));
        let mut got = 0;
        while let Some(reply) = tokio::time::timeout(STEP, stream.next())
            .await
            .expect("reply within time")
        {
            reply.unwrap_or_else(|s| panic!("stream reply failed: {s:?}"));
            got += 1;
        }
        assert_eq!(got, count, "count {count}: every reply arrives");
        assert_eq!(
            routed(route).await,
            before + 1.0,
            "count {count} goes to route {route}"
        );
    }
    assert_eq!(routed("three").await, three + 1.0);
    assert_eq!(routed("rest").await, rest + 2.0);
    // Client streaming: the first message decides; every message reaches that backend.
    let before = routed("vip").await;
    let reply = tokio::time::timeout(
        STEP,
        grpc::client_stream(&mut client, vec!["vip-1".into(), "b".into(), "c".into()]),
    )
    .await
    .expect("client stream within time")
    .unwrap_or_else(|s| panic!("client stream failed: {s:?}"));
    assert_eq!(reply.message, "vip-1,b,c");
    assert_eq!(routed("vip").await, before + 1.0);
}
