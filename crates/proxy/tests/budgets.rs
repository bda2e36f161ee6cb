//! Connection budgets and the HTTP/2 stall timeout against live clients on loopback:
//! connections past `limits.max_connections` or a listener's `max_connections` are closed at
//! accept and counted while everyone else is served, and an HTTP/2 client that never opens
//! its windows holds a bounded number of upstream connections, each only until its streams
//! are reset for stalling.

mod common;

use std::time::{Duration, Instant};

use common::hostile::{settle, BigBackend, H2Attacker};
use common::*;
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

/// Whether the node closed `stream` (EOF or reset) within `limit`; an admitted idle
/// connection stays open far longer (limits.idle_timeout).
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    matches!(
        tokio::time::timeout(limit, stream.read(&mut [0u8; 64])).await,
        Ok(Ok(0) | Err(_))
    )
}

async fn connect(addr: std::net::SocketAddr) -> TcpStream {
    TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// The value of one sample, 0 when absent.
fn sample(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metric_samples(metrics, name, labels)
        .first()
        .map_or(0.0, |(_, v)| *v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_node_or_listener_cap_are_closed_at_accept_and_counted() {
    let (admin, web, api) = (free_addr(), free_addr(), free_addr());
    let node = TestNode::start(&format!(
        r#"
admin: {admin}
workers: 2
limits: {{ max_connections: 6 }}
listeners:
  - name: web
    address: {web}
    protocol: http
    limits: {{ max_connections: 4 }}
    routes:
      - direct_response: {{ status: 200, body: "web" }}
  - name: api
    address: {api}
    protocol: http
    routes:
      - direct_response: {{ status: 200, body: "api" }}
"#
    ));
    let active = |listener: &'static str| {
        let node = &node;
        async move {
            let metrics = node.metrics().await;
            sample(
                &metrics,
                "flatmesh_downstream_connections_active",
                &[&format!("listener=\"{listener}\"")],
            )
        }
    };
    // The listener's own cap: 4 idle connections in, the 5th closed at once.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(connect(web).await);
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            active("web").await == 4.0
        })
        .await
    );
    let mut fifth = connect(web).await;
    assert!(
        closed_within(&mut fifth, Duration::from_secs(2)).await,
        "a 5th connection to a listener capped at 4 was kept"
    );
    // The node's cap: 2 more on the other listener, then the node is full.
    for _ in 0..2 {
        held.push(connect(api).await);
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            active("api").await == 2.0
        })
        .await
    );
    let mut seventh = connect(api).await;
    assert!(
        closed_within(&mut seventh, Duration::from_secs(2)).await,
        "a 7th connection to a node capped at 6 was kept"
    );
    // Those held are still open, and the admin port answers.
    for stream in &mut held {
        assert!(!closed_within(stream, Duration::from_millis(50)).await);
    }
    node.assert_alive("with every connection slot taken").await;
    let metrics = node.metrics().await;
    let refused = |listener: &str, reason: &str| {
        sample(
            &metrics,
            "flatmesh_downstream_connections_refused_total",
            &[
                &format!("listener=\"{listener}\""),
                &format!("reason=\"{reason}\""),
            ],
        )
    };
    assert_eq!(refused("web", "listener_max_connections"), 1.0, "{metrics}");
    assert_eq!(refused("api", "max_connections"), 1.0, "{metrics}");
    let (_, ready) = node.admin_get("/ready").await;
    assert!(
        ready.contains("connections: 6 open (limits.max_connections: 6)"),
        "{ready}"
    );

    // A connection that ends makes room: service resumes.
    held.truncate(3);
    assert!(
        eventually(Duration::from_secs(5), || async {
            active("web").await == 3.0
        })
        .await
    );
    let resp = get(&h1_client(), &format!("http://{web}/"), &[]).await;
    assert_eq!((resp.status.as_u16(), resp.body.as_str()), (200, "web"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_opens_its_windows_holds_few_upstreams_and_only_until_the_stall_timeout(
) {
    const STREAMS: usize = 60;
    const MAX_UPSTREAMS: usize = 20;
    let big = BigBackend::start(256 * 1024).await;
    let (admin, listen) = (free_addr(), free_addr());
    let node = TestNode::start(&format!(
        r#"
admin: {admin}
workers: 2
limits: {{ stream_stall_timeout: 1s, max_upstream_per_downstream: {MAX_UPSTREAMS} }}
listeners:
  - name: web
    address: {listen}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /big }} }}
        cluster: big
      - direct_response: {{ status: 200, body: "ok" }}
clusters:
  - name: big
    endpoints: [ {big} ]
"#,
        big = big.addr
    ));
    // Window 0: the node can send no byte of any answer. The client keeps reading (so it
    // answers PINGs and SETTINGS) and pings all along, so its connection never looks idle.
    let attacker = H2Attacker::open_pinging(
        listen,
        "/big",
        STREAMS,
        0,
        None,
        Some(Duration::from_millis(100)),
    )
    .await;
    assert!(
        eventually(Duration::from_secs(5), || async { big.open() > 0 }).await,
        "the client's streams never reached the backend"
    );
    // Stalled streams are reset and their upstream connections closed, while the client is
    // still connected and pinging; the streams waiting for one get it in turn.
    let started = Instant::now();
    while big.open() > 0 && started.elapsed() < Duration::from_secs(20) {
        settle(Duration::from_millis(50)).await;
    }
    assert_eq!(
        big.open(),
        0,
        "upstream connections still held by a client that takes no data"
    );
    assert!(
        big.peak() <= MAX_UPSTREAMS,
        "{} upstream connections at once for one client connection (limit {MAX_UPSTREAMS})",
        big.peak()
    );
    let metrics = node.metrics().await;
    let stalled = sample(
        &metrics,
        "flatmesh_http2_streams_reset_total",
        &["reason=\"stalled\""],
    );
    assert!(stalled >= MAX_UPSTREAMS as f64, "{metrics}");
    // Everyone else is served meanwhile.
    let resp = get(&h2c_client(), &format!("http://{listen}/"), &[]).await;
    assert_eq!((resp.status.as_u16(), resp.body.as_str()), (200, "ok"));
    node.assert_alive("next to a client that never opens its windows")
        .await;
    drop(attacker);
}
