//! Distributed tracing (config `tracing`, docs/observability.md "Tracing") against a real
//! OTLP/gRPC receiver (`common::otlp`, tonic's gRPC server): two nodes in a row and the
//! parent/child chain the receiver got, sampling of failures, and a collector that never
//! answers costing requests nothing; then the two-node chain read back from a real Jaeger's
//! query API (`bench/.bin/jaeger`, built by `scripts/setup test`, or `FLATMESH_JAEGER`).

mod common;

use std::time::{Duration, Instant};

use common::backends::{HttpBackend, Proto};
use common::otlp::{OtlpReceiver, Received};
use common::*;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A node named `service` whose listener `web` sends everything to `upstream` (spoken as
/// `protocol`), tracing to `collector`.
fn node(service: &str, upstream: &str, protocol: &str, collector: &str, extra: &str) -> TestNode {
    let (admin, web) = (free_addr(), free_addr());
    TestNode::start(&format!(
        r#"
admin: {admin}
workers: 1
tracing: {{ otlp: "{collector}", sample: 0.0, service_name: {service}{extra} }}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        cluster: next
clusters:
  - name: next
    protocol: {protocol}
    endpoints: [ {upstream} ]
"#
    ))
}

async fn spans_within(receiver: &OtlpReceiver, count: usize) -> Vec<Received> {
    let arrived = eventually(Duration::from_secs(10), || async {
        receiver.spans().len() >= count
    })
    .await;
    assert!(
        arrived,
        "expected {count} spans, got {:#?}",
        receiver.spans()
    );
    receiver.spans()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_in_a_row_make_one_chain_of_spans_under_the_client_s() {
    let receiver = OtlpReceiver::start().await;
    let collector = receiver.addr.to_string();
    let app = HttpBackend::start("app", Proto::H1).await;
    // B: HTTP/1 to the app (the HTTP/1 head writer); A: HTTP/2 to B (the general path).
    let b = node("node-b", &app.addr.to_string(), "http1", &collector, "");
    let b_addr = b.listener("web");
    let a = node("node-a", &b_addr.to_string(), "http2", &collector, "");
    let url = format!("http://{}/hello", a.listener("web"));
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    // sample is 0.0: the client's sampled flag alone makes both nodes record.
    let resp = get(
        &h1_client(),
        &url,
        &[("traceparent", &traceparent), ("tracestate", "rojo=1")],
    )
    .await;
    assert_eq!(resp.status, 200);
    let seen = resp.echo()["headers"].clone();

    let spans = spans_within(&receiver, 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let span_a = spans
        .iter()
        .find(|s| s.service == "node-a")
        .expect("node A's span");
    let span_b = spans
        .iter()
        .find(|s| s.service == "node-b")
        .expect("node B's span");
    // client → A → B → app, one trace.
    assert_eq!(hex(&span_a.span.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&span_b.span.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&span_a.span.parent_span_id), CLIENT_SPAN);
    assert_eq!(span_b.span.parent_span_id, span_a.span.span_id);
    assert_ne!(span_a.span.span_id, span_b.span.span_id);
    let app_saw = seen["traceparent"]
        .as_str()
        .expect("the app got a traceparent");
    assert_eq!(
        app_saw,
        format!("00-{CLIENT_TRACE}-{}-01", hex(&span_b.span.span_id)),
        "the app's parent is node B's span"
    );
    assert_eq!(seen["tracestate"].as_str(), Some("rojo=1"));
    let request_id = seen["x-request-id"].as_str().expect("x-request-id added");
    // Both nodes name the one request id A made.
    assert_eq!(
        span_a.attr("http.request.header.x-request-id").as_deref(),
        Some(request_id)
    );
    assert_eq!(
        span_b.attr("http.request.header.x-request-id").as_deref(),
        Some(request_id)
    );
    // What each span says about the request.
    for (span, upstream) in [(span_a, b_addr), (span_b, app.addr)] {
        assert_eq!(span.span.kind, flatmesh_proxy::otlp::SPAN_KIND_SERVER);
        assert_eq!(span.span.name, "GET web/0");
        assert_eq!(
            span.attr("http.response.status_code").as_deref(),
            Some("200")
        );
        assert_eq!(span.attr("http.request.method").as_deref(), Some("GET"));
        assert_eq!(span.attr("flatmesh.route").as_deref(), Some("web/0"));
        assert_eq!(span.attr("flatmesh.cluster").as_deref(), Some("next"));
        assert_eq!(span.attr("flatmesh.upstream"), Some(upstream.to_string()));
        assert!(span.span.end_time_unix_nano >= span.span.start_time_unix_nano);
        assert_eq!(span.span.flags & 1, 1);
    }
    // B's span lies within A's.
    assert!(span_b.span.start_time_unix_nano >= span_a.span.start_time_unix_nano);
    assert!(span_b.span.end_time_unix_nano <= span_a.span.end_time_unix_nano);
    // Counted once the receiver's answer is back (just after it stored the span).
    let counted = eventually(Duration::from_secs(10), || async {
        metric(&a, "flatmesh_tracing_spans_exported_total", &[]).await == 1.0
    })
    .await;
    assert!(counted, "node A counts its exported span");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsampled_requests_are_exported_only_when_they_end_in_5xx() {
    let receiver = OtlpReceiver::start().await;
    let app = HttpBackend::start("app", Proto::H1).await;
    let n = node(
        "node",
        &app.addr.to_string(),
        "http1",
        &receiver.addr.to_string(),
        "",
    );
    let url = format!("http://{}/x", n.listener("web"));
    let client = h1_client();
    // No caller decision and sample 0.0: not sampled; a malformed traceparent is ignored.
    let ok = get(
        &client,
        &url,
        &[("traceparent", "00-nothex-00f067aa0ba902b7-01")],
    )
    .await;
    assert_eq!(ok.status, 200);
    let sent = ok.echo()["headers"]["traceparent"]
        .as_str()
        .expect("a new traceparent")
        .to_owned();
    assert!(
        sent.ends_with("-00") && !sent.contains(CLIENT_SPAN),
        "{sent}"
    );
    let failed = get(&client, &url, &[("x-status", "503")]).await;
    assert_eq!(failed.status, 503);
    let spans = spans_within(&receiver, 1).await;
    // Long enough for a second batch to have been flushed, if the 200 had been kept.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let spans_later = receiver.spans();
    assert_eq!(spans_later.len(), 1, "{spans_later:#?}");
    let span = &spans[0];
    assert_eq!(
        span.attr("http.response.status_code").as_deref(),
        Some("503")
    );
    assert_eq!(span.attr("flatmesh.kept").as_deref(), Some("error"));
    assert_eq!(span.span.status.as_ref().map(|s| s.code), Some(2));
    assert_eq!(span.span.flags & 1, 0, "exported, but not sampled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_costs_requests_nothing() {
    // Accepts TCP connections (the kernel's backlog) and never reads: every export hangs
    // until its timeout (5 s).
    let black_hole = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let app = HttpBackend::start("app", Proto::H1).await;
    let n = node(
        "node",
        &app.addr.to_string(),
        "http1",
        &black_hole.local_addr().expect("addr").to_string(),
        ", queue: 16",
    );
    let url = format!("http://{}/x", n.listener("web"));
    let client = h1_client();
    const REQUESTS: usize = 1000;
    let mut slowest = Duration::ZERO;
    let began = Instant::now();
    for _ in 0..REQUESTS {
        let t = Instant::now();
        // Sampled by the caller: every request makes a span.
        let resp = get(
            &client,
            &url,
            &[(
                "traceparent",
                &format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),
            )],
        )
        .await;
        assert_eq!(resp.status, 200);
        slowest = slowest.max(t.elapsed());
    }
    // One export call blocks for 5 s: had a request waited for the exporter, it would show.
    assert!(
        slowest < Duration::from_secs(1),
        "the slowest request took {slowest:?}"
    );
    // The exporter holds at most one batch (512) and the queue 16; the rest was dropped.
    let dropped = metric(
        &n,
        "flatmesh_tracing_spans_dropped_total",
        &[r#"reason="queue_full""#],
    )
    .await;
    assert!(
        dropped >= (REQUESTS - 512 - 16) as f64,
        "dropped {dropped} of {REQUESTS} spans in {:?}",
        began.elapsed()
    );
    assert_eq!(
        metric(&n, "flatmesh_tracing_spans_exported_total", &[]).await,
        0.0
    );
    drop(black_hole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_moves_spans_to_the_new_collector_and_sampling() {
    let (first, second) = (OtlpReceiver::start().await, OtlpReceiver::start().await);
    let app = HttpBackend::start("app", Proto::H1).await;
    let n = node(
        "node",
        &app.addr.to_string(),
        "http1",
        &first.addr.to_string(),
        "",
    );
    let url = format!("http://{}/x", n.listener("web"));
    let client = h1_client();
    // sample 0.0: only the failure goes to the first collector.
    assert_eq!(get(&client, &url, &[("x-status", "503")]).await.status, 503);
    assert_eq!(spans_within(&first, 1).await.len(), 1);

    // The same node, now sampling everything into the second collector.
    let yaml = std::fs::read_to_string(&n.config_path).expect("read config");
    let moved = yaml
        .replace(&first.addr.to_string(), &second.addr.to_string())
        .replace("sample: 0.0", "sample: 1.0");
    assert_ne!(moved, yaml);
    n.write_config(&moved);
    let (status, body) = n.reload().await;
    assert_eq!(status, 200, "{body}");
    // A new connection takes the new tracer.
    let client = h1_client();
    for _ in 0..3 {
        assert_eq!(get(&client, &url, &[]).await.status, 200);
    }
    assert_eq!(spans_within(&second, 3).await.len(), 3);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        first.spans().len(),
        1,
        "nothing more reached the old collector"
    );

    // Tracing removed by a reload: nothing is exported any more.
    let off: String = moved
        .lines()
        .filter(|l| !l.starts_with("tracing:"))
        .map(|l| format!("{l}\n"))
        .collect();
    n.write_config(&off);
    let (status, body) = n.reload().await;
    assert_eq!(status, 200, "{body}");
    let client = h1_client();
    assert_eq!(get(&client, &url, &[("x-status", "503")]).await.status, 503);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(second.spans().len(), 3, "no span after tracing was removed");
}

/// A Jaeger (v1.76, the v2 backend built from `bench/jaeger`) run by the test with the
/// benchmarks' config, `bench/jaeger/jaeger.yaml`: OTLP/gRPC and the query API on free loopback
/// ports, traces in memory, nothing else listening. Killed when dropped.
struct Jaeger {
    child: std::process::Child,
    otlp: std::net::SocketAddr,
    query: std::net::SocketAddr,
}

impl Jaeger {
    fn start() -> Jaeger {
        let binary = std::env::var_os("FLATMESH_JAEGER")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/.bin/jaeger")
            });
        assert!(
            binary.exists(),
            "no Jaeger at {}: run `scripts/setup test` (it builds bench/.bin/jaeger from \
             bench/jaeger) or set FLATMESH_JAEGER to a jaeger v1.76 binary",
            binary.display()
        );
        let (otlp, query, query_grpc) = (free_addr(), free_addr(), free_addr());
        let config =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/jaeger/jaeger.yaml");
        let child = std::process::Command::new(&binary)
            .arg(format!("--config=file:{}", config.display()))
            .env("JAEGER_OTLP", otlp.to_string())
            .env("JAEGER_QUERY", query.to_string())
            .env("JAEGER_QUERY_GRPC", query_grpc.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        Jaeger { child, otlp, query }
    }
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jaeger_shows_the_two_node_chain_under_the_client_s_span() {
    let jaeger = Jaeger::start();
    let (collector, query_api) = (jaeger.otlp.to_string(), jaeger.query);
    let client = h1_client();
    let up = eventually(Duration::from_secs(60), || async {
        send(
            &client,
            get_req(&format!("http://{query_api}/api/services")),
        )
        .await
        .is_ok_and(|r| r.status == 200)
    })
    .await;
    assert!(up, "jaeger's query API did not come up");
    // A trace id of this run alone.
    let trace = hex(&rand::random::<[u8; 16]>());
    let app = HttpBackend::start("app", Proto::H1).await;
    let b = node(
        "jaeger-node-b",
        &app.addr.to_string(),
        "http1",
        &collector,
        "",
    );
    let a = node(
        "jaeger-node-a",
        &b.listener("web").to_string(),
        "http2",
        &collector,
        "",
    );
    let url = format!("http://{}/hello", a.listener("web"));
    let traceparent = format!("00-{trace}-{CLIENT_SPAN}-01");
    let resp = get(&client, &url, &[("traceparent", &traceparent)]).await;
    assert_eq!(resp.status, 200);

    let query = format!("http://{query_api}/api/traces/{trace}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let (found, complete) = loop {
        let json = match send(&client, get_req(&query)).await {
            Ok(r) => serde_json::from_str::<serde_json::Value>(&r.body).unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        };
        let spans = json["data"][0]["spans"].as_array().map_or(0, Vec::len);
        if spans >= 2 || Instant::now() > deadline {
            break (json, spans >= 2);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(complete, "jaeger has not got both spans: {found}");
    let data = &found["data"][0];
    let service_of = |span: &serde_json::Value| {
        let process = span["processID"].as_str().unwrap_or_default();
        data["processes"][process]["serviceName"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let spans = data["spans"].as_array().expect("spans");
    let by = |service: &str| {
        spans
            .iter()
            .find(|s| service_of(s) == service)
            .unwrap_or_else(|| panic!("no span of {service}: {data}"))
    };
    let (span_a, span_b) = (by("jaeger-node-a"), by("jaeger-node-b"));
    let parent_of = |span: &serde_json::Value| {
        span["references"]
            .as_array()
            .and_then(|refs| refs.iter().find(|r| r["refType"] == "CHILD_OF"))
            .and_then(|r| r["spanID"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(parent_of(span_a), CLIENT_SPAN, "{data}");
    assert_eq!(
        parent_of(span_b),
        span_a["spanID"].as_str().unwrap_or_default(),
        "{data}"
    );
    assert_eq!(span_a["operationName"], "GET web/0");
}
