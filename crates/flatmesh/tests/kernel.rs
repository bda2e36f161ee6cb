//! Tier K wired into the node (`kernel:` section), as root, each test in a network namespace
//! of its own (the test re-runs itself under `unshare -n`) and with cgroup v2 for capture:
//! - tcp listeners go *socket direct* (client and backend sockets talk through sk_msg, the
//!   payload never crosses TCP nor the proxy) with large transfers, half-close, resets,
//!   1,000 concurrent connections and connections closed mid-transfer; or are spliced by the
//!   sk_skb verdict when sk_msg redirect is off;
//! - the L7 listener's first request is decided in the kernel where every request a spliced
//!   connection could carry gets one answer (otherwise never: a differential test of random
//!   keep-alive runs proves it), from the HTTP/1.1 request line or the HTTP/2 / gRPC `:path`
//!   (Huffman-coded as hyper and grpc-go send it), and every answer is compared with a
//!   user-tier-only node's;
//! - capture of a workload cgroup's connections to a service address, without ever capturing
//!   the node's own connection to that same address;
//! - lifecycle: pins while running, none after a clean exit, a crashed node's pins cleaned
//!   by the next start, `flatmesh kernel status` with per-program runs and bytes;
//! - the one-line degradation when tier K cannot attach (no bpffs pin dir, no root).

#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::backends::{pattern, HttpBackend, Proto, TcpBackend, TcpEnd, TcpMode};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Runs `body` in a fresh network namespace: the test binary runs this one test again under
/// `unshare -n` (loopback brought up first) and this process checks that it passed. Inside,
/// every address is the namespace's own, so the tests also prove that tier K keys loopback
/// sockets by namespace and leaves other namespaces alone (tests run in parallel, each in
/// its own namespace, each with its own node).
fn in_netns<F, Fut>(test: &str, body: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    common::require_root("the tier-K node tests attach eBPF programs and need root");
    common::netns::in_netns(test, Duration::from_secs(240), body);
}

/// A pin directory of this test's own, removed (with whatever a killed node left) on drop.
struct Pins(PathBuf);

impl Pins {
    fn new(test: &str) -> Pins {
        Pins(PathBuf::from(format!(
            "/sys/fs/bpf/fm-node-{test}-{}",
            std::process::id()
        )))
    }

    fn status(&self) -> flatmesh_kernel::KernelStatus {
        flatmesh_kernel::status(&self.0).unwrap()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        // The node was SIGKILLed: its links died with it; the pins are what is left.
        let _ = flatmesh_kernel::cleanup_stale(&self.0);
    }
}

async fn metric_sum(proxy: &Proxy, name: &str, labels: &[&str]) -> f64 {
    let text = proxy.metrics().await;
    metric_samples(&text, name, labels)
        .iter()
        .map(|(_, v)| v)
        .sum()
}

/// `flatmesh_requests_total` once it reaches `expected` (2 s at most): a request is counted when
/// the node has finished it, which may be just after the client read its answer.
async fn requests_counted(proxy: &Proxy, expected: f64) -> f64 {
    eventually(Duration::from_secs(2), || async {
        metric_sum(proxy, "flatmesh_requests_total", &[]).await >= expected
    })
    .await;
    metric_sum(proxy, "flatmesh_requests_total", &[]).await
}

async fn spliced_metric(proxy: &Proxy, listener: &str) -> f64 {
    metric_sum(
        proxy,
        "flatmesh_kernel_spliced_connections_total",
        &[&format!("listener=\"{listener}\"")],
    )
    .await
}

async fn tcp_bytes_metric(proxy: &Proxy, listener: &str, direction: &str) -> f64 {
    metric_sum(
        proxy,
        "flatmesh_tcp_bytes_total",
        &[
            &format!("listener=\"{listener}\""),
            &format!("direction=\"{direction}\""),
        ],
    )
    .await
}

/// A closed connection's counters, (bytes in, bytes out, spliced connections), once they
/// reach `expected` or after 30 s. The relay adds them only after both directions are done,
/// which can be a moment after the client has its last byte.
async fn connection_metrics(
    proxy: &Proxy,
    listener: &str,
    expected: (f64, f64, f64),
) -> (f64, f64, f64) {
    let mut seen = (0.0, 0.0, 0.0);
    for _ in 0..1500 {
        seen = (
            tcp_bytes_metric(proxy, listener, "downstream_to_upstream").await,
            tcp_bytes_metric(proxy, listener, "upstream_to_downstream").await,
            spliced_metric(proxy, listener).await,
        );
        if seen == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    seen
}

/// Polls `check` for up to 30 s (a bound for a loaded CI machine, not an expectation: on a quiet
/// one these conditions hold within a second).
async fn until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..1500 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

fn tcp_node(admin: SocketAddr, listen: SocketAddr, backend: SocketAddr, kernel: &str) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
kernel: {kernel}
listeners:
  - {{ name: db, address: {listen}, protocol: tcp, cluster: db }}
clusters:
  - {{ name: db, endpoints: [ {backend} ] }}
"#
    )
}

async fn connect(addr: SocketAddr) -> TcpStream {
    tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .expect("connect in time")
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// Sends `data` and reads the echo concurrently; returns the stream and what came back.
async fn echo_through(stream: TcpStream, data: Vec<u8>) -> (Vec<u8>, flatmesh_kernel::TcpCounters) {
    let (mut rd, mut wr) = stream.into_split();
    let len = data.len();
    let writer = tokio::spawn(async move {
        for chunk in data.chunks(64 * 1024) {
            wr.write_all(chunk).await.unwrap();
        }
        // Half-close: the echo backend must still answer everything, then close.
        wr.shutdown().await.unwrap();
        wr
    });
    let mut back = Vec::with_capacity(len);
    tokio::time::timeout(Duration::from_secs(60), rd.read_to_end(&mut back))
        .await
        .expect("the echo came back in time")
        .unwrap();
    let wr = writer.await.unwrap();
    let stream = rd.reunite(wr).unwrap();
    let counters = flatmesh_kernel::tcp_counters(&stream).unwrap();
    (back, counters)
}

#[test]
fn tcp_socket_direct_moves_large_transfers_outside_tcp_and_the_proxy() {
    in_netns(
        "tcp_socket_direct_moves_large_transfers_outside_tcp_and_the_proxy",
        || async {
            let pins = Pins::new("direct");
            let echo = TcpBackend::start(TcpMode::Echo).await;
            let (admin, listen) = (free_addr(), free_addr());
            let kernel = format!("{{ pin_dir: {}, redirect: true }}", pins.0.display());
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, echo.addr, &kernel)).await;

            const LEN: usize = 8 * 1024 * 1024;
            let data = pattern(LEN, 7);
            // One byte there and back first: the proxy forwards it each way, which arms both
            // directions' shortcuts. From then on the kernel carries every byte, however
            // loaded the machine is (a shortcut arms only once the proxy has caught up, which
            // under load could take a good part of a transfer that starts at once).
            let mut stream = connect(listen).await;
            stream.write_all(b"w").await.unwrap();
            let mut warm = [0u8; 1];
            stream.read_exact(&mut warm).await.unwrap();
            let client_before = flatmesh_kernel::tcp_counters(&stream).unwrap();
            let direct_before = pins.status().stat("fm_sk_msg_direct").bytes;
            let (back, client) = echo_through(stream, data.clone()).await;
            assert_eq!(back.len(), LEN, "every byte came back");
            assert!(back == data, "the bytes came back unchanged and in order");
            // The client's socket received 8 MiB, none of it through TCP (the FIN counts 1).
            let (received, sent) = (
                client.received - client_before.received,
                client.sent - client_before.sent,
            );
            assert!(
                received <= 1 && sent == 0,
                "payload crossed the client's TCP stack: {received} received, {sent} sent"
            );
            // How much goes direct is a matter of timing: a direction goes direct only while
            // the proxy has forwarded every earlier byte, and on a loaded machine the echo's
            // direction (the backend answers at kernel speed while the proxy drains) can fail
            // to catch up for a whole transfer (seen 1 run in 8 with two fuzzers running). So
            // this asserts the mechanism, at least one direction carried by the kernel; the
            // share is measured in BENCHMARKS.md, not here.
            let st = pins.status();
            let direct = st.stat("fm_sk_msg_direct").bytes - direct_before;
            assert!(
                direct >= (LEN as u64) * 9 / 10,
                "the kernel carried only {direct} of {} bytes socket direct\n{st}",
                2 * LEN
            );
            // The proxy still accounts for every byte (the warm-up's too) and the connection.
            let expected = (LEN as f64 + 1.0, LEN as f64 + 1.0, 1.0);
            assert_eq!(
                connection_metrics(&proxy, "db", expected).await,
                expected,
                "(bytes in, bytes out, spliced connections) in the node's metrics"
            );
            let st = pins.status();
            assert_eq!(
                st.entries("fm_shortcuts"),
                0,
                "shortcuts removed at close\n{st}"
            );
            assert_eq!(st.entries("fm_direct_bytes"), 0, "{st}");
        },
    );
}

#[test]
fn tcp_socket_direct_keeps_half_close_and_reset_semantics() {
    in_netns(
        "tcp_socket_direct_keeps_half_close_and_reset_semantics",
        || async {
            let pins = Pins::new("direct-close");
            let kernel = format!("{{ pin_dir: {}, redirect: true }}", pins.0.display());

            // Client half-close: the backend answers only after the client's FIN, which must
            // come after all of the client's (direct) bytes.
            let counter = TcpBackend::start(TcpMode::Count).await;
            let (admin, listen) = (free_addr(), free_addr());
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, counter.addr, &kernel)).await;
            for round in 0..5 {
                let data = pattern(256 * 1024 + round, round as u64);
                let mut s = connect(listen).await;
                // A first message, then a pause so the shortcut is armed, then the rest.
                s.write_all(&data[..1000]).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                s.write_all(&data[1000..]).await.unwrap();
                s.shutdown().await.unwrap();
                let mut reply = String::new();
                tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut reply))
                    .await
                    .expect("reply after half-close in time")
                    .unwrap();
                assert_eq!(
                    reply,
                    format!("{} {}\n", data.len(), crc32fast::hash(&data))
                );
            }
            assert!(
                pins.status().stat("fm_sk_msg_direct").bytes > 0,
                "{}",
                pins.status()
            );
            drop(proxy);

            // Server first, then server half-close: "hello" and EOF reach the client, and the
            // client's later bytes still reach the backend.
            let mut greeter = TcpBackend::start(TcpMode::GreetThenHold).await;
            let (admin, listen) = (free_addr(), free_addr());
            let pins2 = Pins::new("direct-greet");
            let kernel2 = format!("{{ pin_dir: {}, redirect: true }}", pins2.0.display());
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, greeter.addr, &kernel2)).await;
            let mut s = connect(listen).await;
            let mut hello = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut hello))
                .await
                .expect("greeting and EOF in time")
                .unwrap();
            assert_eq!(hello, b"hello");
            s.write_all(&[7u8; 100_000]).await.unwrap();
            s.shutdown().await.unwrap();
            assert_eq!(
                greeter.next_end(Duration::from_secs(10)).await,
                Some(TcpEnd::Eof(100_000))
            );
            drop(proxy);

            // The backend resets: the client sees a reset (or EOF), never a hang.
            let resetter = TcpBackend::start(TcpMode::Reset).await;
            let (admin, listen) = (free_addr(), free_addr());
            let pins3 = Pins::new("direct-reset");
            let kernel3 = format!("{{ pin_dir: {}, redirect: true }}", pins3.0.display());
            let _proxy =
                Proxy::start(admin, &tcp_node(admin, listen, resetter.addr, &kernel3)).await;
            let mut s = connect(listen).await;
            s.write_all(b"trigger").await.unwrap();
            let mut buf = [0u8; 16];
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
                .await
                .expect("the reset reached the client in time")
            {
                Ok(0) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                other => panic!("after the backend's reset the client read {other:?}"),
            }

            // The client resets: the backend sees the reset.
            let mut holder = TcpBackend::start(TcpMode::Hold).await;
            let (admin, listen) = (free_addr(), free_addr());
            let pins4 = Pins::new("direct-creset");
            let kernel4 = format!("{{ pin_dir: {}, redirect: true }}", pins4.0.display());
            let _proxy = Proxy::start(admin, &tcp_node(admin, listen, holder.addr, &kernel4)).await;
            let s = connect(listen).await;
            let mut s = s;
            s.write_all(&[1u8; 5000]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            s.set_zero_linger().unwrap();
            drop(s);
            match holder.next_end(Duration::from_secs(10)).await {
                Some(TcpEnd::Error(n, std::io::ErrorKind::ConnectionReset)) => assert_eq!(n, 5000),
                other => panic!("the backend should see the client's reset, saw {other:?}"),
            }
        },
    );
}

#[test]
fn a_thousand_concurrent_connections_go_socket_direct() {
    in_netns(
        "a_thousand_concurrent_connections_go_socket_direct",
        || async {
            let pins = Pins::new("direct-1000");
            let echo = TcpBackend::start(TcpMode::Echo).await;
            let (admin, listen) = (free_addr(), free_addr());
            let kernel = format!("{{ pin_dir: {}, redirect: true }}", pins.0.display());
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, echo.addr, &kernel)).await;
            let before = pins.status().stat("fm_sk_msg_direct");
            let fallbacks_before = pins.status().stat("fm_sk_msg").fallbacks;
            let mut conns = Vec::new();
            for _ in 0..1000 {
                conns.push(connect(listen).await);
            }
            // All open at once; each carries its own id there and back, twice (the second
            // round trip is certain to go direct: the first armed the shortcut).
            for round in 0..2u32 {
                let mut tasks = tokio::task::JoinSet::new();
                for (i, mut s) in conns.drain(..).enumerate() {
                    tasks.spawn(async move {
                        let msg = format!("{i:06}-{round}");
                        s.write_all(msg.as_bytes()).await.unwrap();
                        let mut back = vec![0u8; msg.len()];
                        tokio::time::timeout(Duration::from_secs(60), s.read_exact(&mut back))
                            .await
                            .expect("echo in time")
                            .unwrap();
                        assert_eq!(back, msg.as_bytes(), "connection {i} got another's bytes");
                        (i, s)
                    });
                }
                let mut back = Vec::new();
                while let Some(r) = tasks.join_next().await {
                    back.push(r.unwrap());
                }
                back.sort_by_key(|(i, _)| *i);
                conns = back.into_iter().map(|(_, s)| s).collect();
            }
            let st = pins.status();
            let direct = st.stat("fm_sk_msg_direct").hits - before.hits;
            assert!(
                direct >= 2 * 1000,
                "at least the second round went direct both ways: {direct}\n{st}"
            );
            // A message the kernel could not hand to the proxy's socket went through TCP
            // (a `fm_sk_msg` fallback), and the proxy then gives that direction's shortcut up
            // for good (crates/proxy/src/kernel/direct.rs): under load a few connections lose
            // one. Every shortcut missing must be one of those messages.
            let relayed = st.stat("fm_sk_msg").fallbacks - fallbacks_before;
            assert!(
                st.entries("fm_shortcuts") as u64 + relayed >= 2 * 1000,
                "{relayed} messages went through TCP\n{st}"
            );
            drop(conns);
            // The node saw every connection open and close, though it carried none of the bytes
            // after the first round trip. A connection's shortcuts go when its relay ends, so
            // wait for that first: a relay still open is a different fault from a leak.
            let mut active = -1.0;
            for _ in 0..1500 {
                active = metric_sum(
                    &proxy,
                    "flatmesh_downstream_connections_active",
                    &["listener=\"db\""],
                )
                .await;
                if active == 0.0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(
                active,
                0.0,
                "open connections 30 s after all closed\n{}",
                pins.status()
            );
            // Every relay has ended, and each removed its shortcuts as it did (a relay's removal
            // may trail the connection count by a moment: failed once in CI; 30 s at most).
            until("the ended connections' shortcuts to be removed", || {
                let st = pins.status();
                st.entries("fm_shortcuts") == 0 && st.entries("fm_direct_bytes") == 0
            })
            .await;
            until("the sockhash to empty", || {
                pins.status().entries("fm_redirect_socks") == 0
            })
            .await;
            assert_eq!(
                metric_sum(
                    &proxy,
                    "flatmesh_downstream_connections_total",
                    &["listener=\"db\""]
                )
                .await,
                1000.0
            );
        },
    );
}

#[test]
fn connections_closed_mid_transfer_leave_nothing_behind() {
    in_netns(
        "connections_closed_mid_transfer_leave_nothing_behind",
        || async {
            let pins = Pins::new("direct-abort");
            let mut holder = TcpBackend::start(TcpMode::Hold).await;
            let (admin, listen) = (free_addr(), free_addr());
            let kernel = format!("{{ pin_dir: {}, redirect: true }}", pins.0.display());
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, holder.addr, &kernel)).await;
            // 20 clients stream and vanish mid-transfer, half with a reset, half with a FIN.
            for i in 0..20 {
                let mut s = connect(listen).await;
                let chunk = pattern(64 * 1024, i);
                for _ in 0..8 {
                    s.write_all(&chunk).await.unwrap();
                }
                if i % 2 == 0 {
                    s.set_zero_linger().unwrap();
                }
                drop(s);
            }
            let mut ends = 0;
            while ends < 20 {
                match holder.next_end(Duration::from_secs(10)).await {
                    Some(_) => ends += 1,
                    None => {
                        panic!("only {ends} of 20 aborted connections reached the backend's end")
                    }
                }
            }
            until("the aborted connections' kernel state to go", || {
                let st = pins.status();
                st.entries("fm_shortcuts") == 0
                    && st.entries("fm_direct_bytes") == 0
                    && st.entries("fm_redirect_socks") == 0
            })
            .await;
            // The node is unharmed: a new connection carries bytes both ways.
            drop(proxy);
            let echo = TcpBackend::start(TcpMode::Echo).await;
            let (admin, listen) = (free_addr(), free_addr());
            let pins2 = Pins::new("direct-abort2");
            let kernel2 = format!("{{ pin_dir: {}, redirect: true }}", pins2.0.display());
            let _proxy = Proxy::start(admin, &tcp_node(admin, listen, echo.addr, &kernel2)).await;
            let (back, _) = echo_through(connect(listen).await, b"still alive".to_vec()).await;
            assert_eq!(back, b"still alive");
        },
    );
}

#[test]
fn tcp_splice_moves_the_bytes_in_the_kernel_when_redirect_is_off() {
    in_netns(
        "tcp_splice_moves_the_bytes_in_the_kernel_when_redirect_is_off",
        || async {
            let pins = Pins::new("tcp");
            let echo = TcpBackend::start(TcpMode::Echo).await;
            let (admin, listen) = (free_addr(), free_addr());
            let kernel = format!(
                "{{ pin_dir: {}, redirect: false, tcp_splice: true }}",
                pins.0.display()
            );
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, echo.addr, &kernel)).await;

            const LEN: usize = 4 * 1024 * 1024;
            let data = pattern(LEN, 7);
            let (back, _) = echo_through(connect(listen).await, data.clone()).await;
            assert_eq!(back.len(), LEN, "every byte came back");
            assert!(back == data, "the bytes came back unchanged");
            let verdict = pins.status().stat("fm_verdict");
            // Almost all of the 2 × 4 MiB went through the kernel; a first chunk sent before the
            // splice may reach the relay.
            assert!(
                verdict.bytes >= (2 * LEN as u64) * 9 / 10,
                "the kernel moved only {} of {} bytes: {verdict:?}",
                verdict.bytes,
                2 * LEN
            );
            // Relayed plus spliced: every byte and the connection are accounted for.
            let expected = (LEN as f64, LEN as f64, 1.0);
            assert_eq!(
                connection_metrics(&proxy, "db", expected).await,
                expected,
                "(bytes in, bytes out, spliced connections) in the node's metrics"
            );
        },
    );
}

/// One HTTP/1.1 request on its own connection; returns (status, x-backend or body).
async fn ask(addr: SocketAddr, method: &str, path: &str, extra: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\n{extra}Connection: close\r\nContent-Length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut resp))
        .await
        .expect("answer in time")
        .unwrap();
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let backend = text
        .lines()
        .find_map(|l| l.strip_prefix("x-backend: "))
        .map(str::to_owned)
        .unwrap_or_else(|| text.rsplit("\r\n\r\n").next().unwrap_or("").to_owned());
    (status, backend)
}

fn l7_config(
    admin: SocketAddr,
    web: SocketAddr,
    kernel: &str,
    api: SocketAddr,
    canary: SocketAddr,
    grpc: SocketAddr,
) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
{kernel}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /api/v2 }}, headers: [ {{ name: x-canary, exact: "1" }} ] }}
        cluster: canary
      - match: {{ path: {{ prefix: /api }} }}
        cluster: api
      - match: {{ path: {{ exact: /healthz }} }}
        direct_response: {{ status: 200, body: "ok" }}
      - match: {{ path: {{ prefix: /v2 }}, method: POST }}
        cluster: canary
      - match: {{ path: {{ prefix: /grpc.Echo/ }} }}
        cluster: grpc
      - match: {{ path: {{ prefix: /h1only/ }} }}
        cluster: api
      - match: {{ path: {{ regex: "^/r[0-9]+$" }} }}
        cluster: api
clusters:
  - {{ name: api, endpoints: [ {api} ] }}
  - {{ name: canary, endpoints: [ {canary} ] }}
  - {{ name: grpc, protocol: http2, endpoints: [ {grpc} ] }}
"#
    )
}

/// One h2c (prior knowledge) request on its own connection, as hyper sends it (HPACK with
/// Huffman-coded strings); returns (status, x-backend).
async fn ask_h2(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let client = h2c_client();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), send(&client, req))
        .await
        .expect("h2 answer in time")
        .unwrap_or_else(|e| panic!("h2 {method} {path}: {e}"));
    // A local answer names the authority, which differs between the two nodes compared.
    let body = resp.body.replace(&addr.to_string(), "NODE");
    (
        resp.status.as_u16(),
        resp.backend().map(str::to_owned).unwrap_or(body),
    )
}

/// A shim in front of `target` that makes an HTTP/2 client behave as grpc-go does: after
/// its connection preface and first SETTINGS frame it sends nothing more until a SETTINGS
/// frame from the server has arrived. Returns the shim's address.
async fn grpc_go_like(target: SocketAddr) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let _ = shim_conn(client, target).await;
            });
        }
    });
    addr
}

/// Reads complete HTTP/2 frames' worth of bytes into `buf` until `done(frames)` says stop.
fn frames_end(buf: &[u8], mut at: usize, mut want: impl FnMut(u8, u8) -> bool) -> Option<usize> {
    while let Some(h) = buf.get(at..at + 9) {
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        if buf.len() < at + 9 + len {
            return None;
        }
        at += 9 + len;
        if want(h[3], h[4]) {
            return Some(at);
        }
    }
    None
}

async fn shim_conn(mut client: TcpStream, target: SocketAddr) -> std::io::Result<()> {
    let mut server = TcpStream::connect(target).await?;
    let mut head = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    // The client's preface and first frame (its SETTINGS) go on; the rest waits.
    let first = loop {
        if let Some(end) = frames_end(&head, 24, |_, _| true) {
            break end;
        }
        let n = client.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    };
    server.write_all(&head[..first]).await?;
    // The server's bytes go to the client; wait for its SETTINGS (not an ACK).
    let mut from_server = Vec::new();
    loop {
        let n = server.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        client.write_all(&buf[..n]).await?;
        from_server.extend_from_slice(&buf[..n]);
        if frames_end(&from_server, 0, |kind, flags| kind == 4 && flags & 1 == 0).is_some() {
            break;
        }
    }
    server.write_all(&head[first..]).await?;
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}

/// The L7 listener with tier K against the same config without it: every answer must be
/// the same, for `redirect` on (decided connections go socket direct) and off (they are
/// spliced). First a listener whose routes lead to several clusters: the kernel splices
/// none of its connections (a spliced connection would carry later requests to the first
/// one's cluster), /rules says so, and the kernel never decides a request. Then a listener
/// whose every request goes to one HTTP/2 endpoint: the kernel decides gRPC connections
/// (HPACK :path, grpc-go's wait for the server's SETTINGS) and leaves HTTP/1.1 clients,
/// which the cluster cannot take spliced, to the user tier.
async fn l7_equivalence(test: &str, redirect: bool) {
    let api = HttpBackend::start("api", Proto::H1).await;
    let canary = HttpBackend::start("canary", Proto::H1).await;
    let grpc = HttpBackend::start("grpc", Proto::H2c).await;
    {
        let pins = Pins::new(test);
        let (admin_k, web_k, admin_u, web_u) = (free_addr(), free_addr(), free_addr(), free_addr());
        let kernel = format!(
            "kernel: {{ pin_dir: {}, redirect: {redirect}, l7_dispatch: true }}",
            pins.0.display()
        );
        let with_kernel = Proxy::start(
            admin_k,
            &l7_config(admin_k, web_k, &kernel, api.addr, canary.addr, grpc.addr),
        )
        .await;
        let user_only = Proxy::start(
            admin_u,
            &l7_config(admin_u, web_u, "", api.addr, canary.addr, grpc.addr),
        )
        .await;

        // Runtime truth: /rules says where each route runs on this node, and why.
        let tiers = |rules: &str| -> (serde_json::Value, Vec<String>) {
            let v: serde_json::Value = serde_json::from_str(rules).unwrap();
            let t = v["listeners"][0]["routes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["tier"].as_str().unwrap().to_owned())
                .collect();
            (v["node"].clone(), t)
        };
        let rules = with_kernel.admin_get("/rules").await.1;
        let (node, t) = tiers(&rules);
        assert_eq!(node["kernel"]["state"], "attached", "{node}");
        assert!(t.iter().all(|t| t == "U7"), "{t:?}");
        assert!(rules.contains("the kernel splices none"), "{rules}");
        let (node, t) = tiers(&user_only.admin_get("/rules").await.1);
        assert_eq!(node["kernel"]["state"], "off", "{node}");
        assert!(t.iter().all(|t| t == "U7"), "{t:?}");
        let out = run_flatmesh(
            &["check", "--explain", "--admin", &admin_k.to_string()],
            Duration::from_secs(30),
        )
        .await;
        assert!(
            out.stdout.contains("this node: tier K attached\n")
                && out
                    .stdout
                    .contains("tier K: its route table is not installed, no connection is spliced"),
            "{}",
            out.all_output()
        );

        let cases = [
            ("GET", "/api/items", ""),
            ("GET", "/api/items?x=1", "x-canary: 1\r\n"),
            ("GET", "/api/v2/items", ""),
            ("GET", "/api/v2/items", "x-canary: 1\r\n"),
            ("GET", "/healthz", ""),
            ("POST", "/v2/orders", ""),
            ("GET", "/v2/orders", ""),
            ("GET", "/r42", ""),
            ("GET", "/nothing", ""),
            // An HTTP/1.1 client to the HTTP/2 cluster: the user tier translates.
            ("POST", "/grpc.Echo/Unary", ""),
        ];
        for (method, path, extra) in cases {
            let k = ask(web_k, method, path, extra).await;
            let u = ask(web_u, method, path, extra).await;
            assert_eq!(
                k, u,
                "{method} {path} {extra:?}: the kernel path answered differently"
            );
        }
        let h2_cases = [
            ("POST", "/grpc.Echo/Unary"),
            ("GET", "/grpc.Echo/Stream?x=1"),
            ("GET", "/api/items"),
            ("GET", "/nothing"),
        ];
        for (method, path) in h2_cases {
            let k = ask_h2(web_k, method, path).await;
            let u = ask_h2(web_u, method, path).await;
            assert_eq!(
                k, u,
                "h2 {method} {path}: the kernel path answered differently"
            );
        }
        // The kernel decided nothing and spliced nothing: both nodes answered every request.
        let st = pins.status();
        assert_eq!(st.stat("fm_verdict").hits, 0, "{st}");
        assert_eq!(spliced_metric(&with_kernel, "web").await, 0.0);
        for node in [&with_kernel, &user_only] {
            let expected = (cases.len() + h2_cases.len()) as f64;
            assert_eq!(
                requests_counted(node, expected).await,
                expected,
                "every request was answered by the node's user tier"
            );
        }
    }

    // One answer for every request: every route to the one HTTP/2 endpoint.
    let pins = Pins::new(&format!("{test}-h2"));
    let (admin_k, web_k, admin_u, web_u) = (free_addr(), free_addr(), free_addr(), free_addr());
    let h2_config = |admin: SocketAddr, web: SocketAddr, kernel: &str| {
        format!(
            r#"
admin: {admin}
workers: 2
{kernel}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /grpc.Echo/ }} }}
        cluster: grpc
      - match: {{}}
        cluster: grpc
clusters:
  - {{ name: grpc, protocol: http2, endpoints: [ {grpc} ] }}
"#,
            grpc = grpc.addr
        )
    };
    let kernel = format!(
        "kernel: {{ pin_dir: {}, redirect: {redirect}, l7_dispatch: true }}",
        pins.0.display()
    );
    let with_kernel = Proxy::start(admin_k, &h2_config(admin_k, web_k, &kernel)).await;
    let user_only = Proxy::start(admin_u, &h2_config(admin_u, web_u, "")).await;
    let rules: serde_json::Value =
        serde_json::from_str(&with_kernel.admin_get("/rules").await.1).unwrap();
    for r in rules["listeners"][0]["routes"].as_array().unwrap() {
        assert_eq!(r["tier"], "K", "{r}");
    }
    // HTTP/1.1 clients: the kernel falls back (the cluster speaks HTTP/2), the user tier
    // translates.
    let h1_cases = [("POST", "/grpc.Echo/Unary"), ("GET", "/anything")];
    for (method, path) in h1_cases {
        let k = ask(web_k, method, path, "").await;
        let u = ask(web_u, method, path, "").await;
        assert_eq!(
            k, u,
            "{method} {path}: the kernel path answered differently"
        );
    }
    assert_eq!(pins.status().stat("fm_verdict").hits, 0);
    // HTTP/2 (hyper Huffman-codes :path): decided in the kernel, every path.
    let h2_cases = [
        ("POST", "/grpc.Echo/Unary"),
        ("GET", "/grpc.Echo/Stream?x=1"),
        ("GET", "/api/items"),
    ];
    for (method, path) in h2_cases {
        let before = pins.status().stat("fm_verdict").hits;
        let k = ask_h2(web_k, method, path).await;
        let u = ask_h2(web_u, method, path).await;
        assert_eq!(
            k, u,
            "h2 {method} {path}: the kernel path answered differently"
        );
        let after = pins.status().stat("fm_verdict").hits;
        assert_eq!(
            after - before,
            1,
            "h2 {method} {path}: decided in the kernel? {}",
            pins.status()
        );
    }
    // A client that waits for the server's SETTINGS before its first HEADERS (grpc-go):
    // the proxy must speak first while the kernel waits for the request, and neither the
    // backend nor the user tier may see the client's ACK of that SETTINGS (both would treat
    // an ACK of settings they never sent as a protocol error).
    let (shim_k, shim_u) = (grpc_go_like(web_k).await, grpc_go_like(web_u).await);
    let waiting_cases = [("POST", "/grpc.Echo/Unary"), ("GET", "/healthz")];
    for (method, path) in waiting_cases {
        let before = pins.status().stat("fm_verdict").hits;
        let k = ask_h2(shim_k, method, path).await;
        let u = ask_h2(shim_u, method, path).await;
        assert_eq!(
            k, u,
            "waiting h2 client, {method} {path}: the kernel path answered differently"
        );
        let after = pins.status().stat("fm_verdict").hits;
        assert_eq!(
            after - before,
            1,
            "waiting h2 {method} {path}: decided in the kernel?"
        );
    }
    assert_eq!(spliced_metric(&user_only, "web").await, 0.0);
    let st = pins.status();
    assert!(
        st.stat("fm_verdict").fallbacks >= 1,
        "fallbacks were counted: {st}"
    );
    let sockops = st.stat("fm_sockops_l7");
    assert!(
        sockops.hits >= (h1_cases.len() + h2_cases.len() + waiting_cases.len()) as u64,
        "each connection was registered at establishment: {st}"
    );
    if redirect {
        assert!(
            st.stat("fm_sk_msg_direct").bytes > 0,
            "decided connections went socket direct: {st}"
        );
    }
}

#[test]
fn l7_decisions_and_fallbacks_answer_as_the_user_tier_socket_direct() {
    in_netns(
        "l7_decisions_and_fallbacks_answer_as_the_user_tier_socket_direct",
        || l7_equivalence("l7-direct", true),
    );
}

#[test]
fn l7_decisions_and_fallbacks_answer_as_the_user_tier_spliced() {
    in_netns(
        "l7_decisions_and_fallbacks_answer_as_the_user_tier_spliced",
        || l7_equivalence("l7-splice", false),
    );
}

#[test]
fn a_captured_workload_reaches_the_service_through_the_node_and_the_node_is_never_captured() {
    in_netns(
        "a_captured_workload_reaches_the_service_through_the_node_and_the_node_is_never_captured",
        || async {
            let pins = Pins::new("cap");
            let cgroup = flatmesh_kernel::default_cgroup_root()
                .join(format!("fm-node-cap-{}", std::process::id()));
            std::fs::create_dir_all(&cgroup).unwrap();
            // The service address is real in this namespace: an echo server listens on it.
            // The node's own upstream connection goes to that same address; were the node
            // captured, it would loop back to itself.
            let add = std::process::Command::new("ip")
                .args(["addr", "add", "10.250.7.1/32", "dev", "lo"])
                .status()
                .unwrap();
            assert!(add.success(), "ip addr add 10.250.7.1/32 dev lo");
            let vip: SocketAddr = "10.250.7.1:80".parse().unwrap();
            let service = tokio::net::TcpListener::bind(vip).await.unwrap();
            let served = tokio::spawn(async move {
                let mut n = 0u32;
                loop {
                    let (mut s, _) = service.accept().await.unwrap();
                    n += 1;
                    let mut buf = [0u8; 8];
                    let got = s.read(&mut buf).await.unwrap_or(0);
                    let _ = s
                        .write_all(
                            format!("svc:{}", String::from_utf8_lossy(&buf[..got])).as_bytes(),
                        )
                        .await;
                    let _ = s.shutdown().await;
                    if n == 2 {
                        return n;
                    }
                }
            });
            let (admin, listen) = (free_addr(), free_addr());
            let yaml = format!(
                r#"
admin: {admin}
workers: 1
kernel:
  pin_dir: {pins}
  redirect: false
  tcp_splice: false
  capture: {{ cgroup: {cg}, services: [ {{ address: "{vip}", listener: svc, plaintext_ok: true }} ] }}
listeners:
  - {{ name: svc, address: {listen}, protocol: tcp, cluster: svc }}
clusters:
  - {{ name: svc, endpoints: [ {vip} ] }}
"#,
                pins = pins.0.display(),
                cg = cgroup.display(),
            );
            let proxy = Proxy::start(admin, &yaml).await;
            // The node itself joins the capture cgroup: only its bypass keeps its own
            // connection to the service address from being sent back to its listener.
            std::fs::write(cgroup.join("cgroup.procs"), proxy.pid().to_string()).unwrap();
            // A workload: a shell that joins the cgroup, then talks to the service address.
            let script = format!(
                "echo $$ > {procs} && exec 3<>/dev/tcp/10.250.7.1/80 && printf captured >&3 && cat <&3",
                procs = cgroup.join("cgroup.procs").display()
            );
            let out = tokio::time::timeout(
                Duration::from_secs(10),
                tokio::process::Command::new("bash")
                    .arg("-c")
                    .arg(&script)
                    .output(),
            )
            .await
            .expect("the workload finished in time")
            .unwrap();
            // A process outside the cgroup reaches the service directly.
            let mut direct = connect(vip).await;
            direct.write_all(b"direct").await.unwrap();
            let mut answer = String::new();
            direct.read_to_string(&mut answer).await.unwrap();
            let _ = std::fs::remove_dir(&cgroup);
            assert!(
                out.status.success(),
                "workload failed: {}; node output:\n{}",
                String::from_utf8_lossy(&out.stderr),
                proxy.output()
            );
            assert_eq!(String::from_utf8_lossy(&out.stdout), "svc:captured");
            assert_eq!(answer, "svc:direct");
            assert_eq!(
                served.await.unwrap(),
                2,
                "the service saw exactly two connections"
            );
            let opened = metric_sum(
                &proxy,
                "flatmesh_downstream_connections_total",
                &["listener=\"svc\""],
            )
            .await;
            let st = pins.status();
            assert_eq!(st.stat("fm_connect4").hits, 1, "one captured connect: {st}");
            assert_eq!(
                opened, 1.0,
                "the node's listener saw {opened} connections (2 would mean it captured itself)"
            );
            assert!(
                st.stat("fm_sockops_capture").hits >= 2,
                "both ends' original destination recorded: {st}"
            );
        },
    );
}

/// A node process this test controls directly (signals, restarts).
fn spawn_node(config: &std::path::Path, log: &std::path::Path) -> std::process::Child {
    let out = std::fs::File::create(log).unwrap();
    std::process::Command::new(flatmesh_bin())
        .args(["node", "--config"])
        .arg(config)
        .env("RUST_LOG", "info")
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap()
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {}", child.id());
}

async fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    for _ in 0..500 {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = child.kill();
    panic!("the node did not exit within 10 s");
}

async fn wait_ready(admin: SocketAddr) {
    let client = h1_client();
    for _ in 0..500 {
        if let Ok(r) = send(&client, get_req(&format!("http://{admin}/ready"))).await {
            if r.status == http::StatusCode::OK {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("node at {admin} not ready in 10 s");
}

#[test]
fn lifecycle_pins_status_clean_exit_and_crash_cleanup() {
    in_netns(
        "lifecycle_pins_status_clean_exit_and_crash_cleanup",
        || async {
            let pins = Pins::new("life");
            let dir = TempDir::new();
            let echo = TcpBackend::start(TcpMode::Echo).await;
            let (admin, listen) = (free_addr(), free_addr());
            let kernel = format!(
                "{{ pin_dir: {}, redirect: true, l7_dispatch: false }}",
                pins.0.display()
            );
            let config = dir.write("node.yaml", &tcp_node(admin, listen, echo.addr, &kernel));

            // Running: programs and maps pinned; status shows runs and bytes.
            let mut node = spawn_node(&config, &dir.path.join("1.log"));
            wait_ready(admin).await;
            assert!(pins.0.join("prog_fm_sk_msg").exists());
            let (back, _) = echo_through(connect(listen).await, pattern(100_000, 3)).await;
            assert_eq!(back.len(), 100_000);
            let out = std::process::Command::new(flatmesh_bin())
                .args(["kernel", "status", "--pin-dir"])
                .arg(&pins.0)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "kernel status failed: {text}");
            assert!(
                text.contains(&format!("attached by pid {}", node.id())),
                "{text}"
            );
            let row = text
                .lines()
                .find(|l| l.starts_with("fm_sk_msg "))
                .unwrap_or_else(|| panic!("no fm_sk_msg row in\n{text}"));
            let cols: Vec<u64> = row
                .split_whitespace()
                .skip(2)
                .filter_map(|c| c.parse().ok())
                .collect();
            assert!(
                cols[0] > 0 && cols[1] >= 200_000,
                "fm_sk_msg runs and bytes: {row}"
            );
            assert!(text.contains("fm_redirect_socks"), "{text}");

            // Clean exit: nothing left behind.
            signal(&node, "-TERM");
            assert!(
                wait_exit(&mut node).await.success(),
                "{}",
                std::fs::read_to_string(dir.path.join("1.log")).unwrap_or_default()
            );
            assert!(
                !pins.0.exists(),
                "pins left after a clean exit: {:?}",
                std::fs::read_dir(&pins.0).map(|d| d.count())
            );

            // Crash: the pins stay (the owner is dead), the next start removes them, says so once,
            // and attaches afresh.
            let mut node = spawn_node(&config, &dir.path.join("2.log"));
            wait_ready(admin).await;
            signal(&node, "-KILL");
            let _ = wait_exit(&mut node).await;
            assert!(
                pins.0.join("fm_owner").exists(),
                "a killed node's pins remain until the next start"
            );
            let text = String::from_utf8_lossy(
                &std::process::Command::new(flatmesh_bin())
                    .args(["kernel", "status", "--pin-dir"])
                    .arg(&pins.0)
                    .output()
                    .unwrap()
                    .stdout,
            )
            .into_owned();
            assert!(text.contains(&format!("pid {}", node.id())), "{text}");
            let mut node = spawn_node(&config, &dir.path.join("3.log"));
            wait_ready(admin).await;
            let (back, _) = echo_through(connect(listen).await, b"after a crash".to_vec()).await;
            assert_eq!(back, b"after a crash");
            signal(&node, "-TERM");
            assert!(wait_exit(&mut node).await.success());
            let log = std::fs::read_to_string(dir.path.join("3.log")).unwrap();
            assert_eq!(
                log.lines()
                    .filter(|l| l.contains("left by a node that is no longer running"))
                    .count(),
                1,
                "one line about the crashed node's pins:\n{log}"
            );
            assert!(
                !pins.0.exists(),
                "pins left after the restarted node's clean exit"
            );
        },
    );
}

#[test]
fn without_kernel_support_the_node_logs_one_line_and_runs_on_the_user_tiers() {
    in_netns(
        "without_kernel_support_the_node_logs_one_line_and_runs_on_the_user_tiers",
        || async {
            let echo = TcpBackend::start(TcpMode::Echo).await;
            // A pin directory outside bpffs cannot hold eBPF pins: tier K cannot attach.
            let dir = TempDir::new();
            let (admin, listen) = (free_addr(), free_addr());
            let kernel = format!("{{ pin_dir: {}/flatmesh }}", dir.path.display());
            let proxy = Proxy::start(admin, &tcp_node(admin, listen, echo.addr, &kernel)).await;
            let (back, _) = echo_through(connect(listen).await, b"ping".to_vec()).await;
            assert_eq!(back, b"ping");
            // /rules: the tcp rule the config puts in the kernel runs in the user L4 relay,
            // and says why.
            let rules: serde_json::Value =
                serde_json::from_str(&proxy.admin_get("/rules").await.1).unwrap();
            let rule = &rules["listeners"][0]["rule"];
            assert_eq!(rule["tier"], "U4", "{rules}");
            let reason = rule["reason"].as_str().unwrap();
            assert!(
                reason.contains("tier K is not attached on this node") && reason.contains("bpffs"),
                "{reason}"
            );
            let out = proxy.output();
            let lines: Vec<&str> = out
                .lines()
                .filter(|l| l.contains("running on the user tiers"))
                .collect();
            assert_eq!(
                lines.len(),
                1,
                "one line says tier K is off and why:\n{out}"
            );
            assert!(
                lines[0].contains("bpffs"),
                "the line names what is missing: {}",
                lines[0]
            );
            drop(proxy);

            // Without root: the line names the missing privilege.
            let dir = TempDir::new();
            let (admin, listen) = (free_addr(), free_addr());
            let config = dir.write(
                "node.yaml",
                &tcp_node(admin, listen, echo.addr, "{ redirect: true }"),
            );
            // The unprivileged node must be able to read its config.
            let _ = std::process::Command::new("chmod")
                .args(["-R", "a+rX"])
                .arg(&dir.path)
                .status();
            let log = dir.path.join("node.log");
            let out = std::fs::File::create(&log).unwrap();
            let mut node = std::process::Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
                .arg(flatmesh_bin())
                .args(["node", "--config"])
                .arg(&config)
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .expect("setpriv (util-linux) runs the node unprivileged");
            wait_ready(admin).await;
            let (back, _) = echo_through(connect(listen).await, b"pong".to_vec()).await;
            let explain = run_flatmesh(
                &["check", "--explain", "--admin", &admin.to_string()],
                Duration::from_secs(30),
            )
            .await;
            let _ = node.kill();
            let _ = node.wait();
            assert_eq!(back, b"pong");
            let text = std::fs::read_to_string(&log).unwrap();
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("running on the user tiers"))
                .collect();
            assert_eq!(lines.len(), 1, "one line:\n{text}");
            assert!(
                lines[0].contains("root"),
                "it says root is missing: {}",
                lines[0]
            );
            assert!(
                explain
                    .stdout
                    .contains("this node: tier K not attached: missing root privileges"),
                "{}",
                explain.all_output()
            );
        },
    );
}

/// A small seeded generator (splitmix64): the differential test prints its seed on failure,
/// and `FM_DIFF_SEED=<n>` replays it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

/// One HTTP/1.1 answer read off a keep-alive connection, reduced to what the client sees
/// of it: status, which backend answered (the `x-backend` header), what the backend saw of
/// the request (method and path from its echo) or the body the node answered itself, and
/// whether the connection stays open. The echo's `headers` are left out: the user tier adds
/// `x-forwarded-for`, which a spliced connection does not (docs/kernel.md).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    status: u16,
    backend: Option<String>,
    body: String,
    open: bool,
}

/// Sends `method path` on `conn` (reconnecting to `addr` first when the last answer closed
/// it) and reads the one answer.
async fn ask_on(
    conn: &mut Option<TcpStream>,
    addr: SocketAddr,
    method: &str,
    path: &str,
) -> Answer {
    if conn.is_none() {
        *conn = Some(TcpStream::connect(addr).await.unwrap());
    }
    let s = conn.as_mut().unwrap();
    let req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let read = async {
        let head_end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(
                n > 0,
                "{method} {path}: the connection closed before an answer"
            );
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
        let header = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                .map(|v| v.trim().to_owned())
        };
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{method} {path}: no content-length in {head:?}"));
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "{method} {path}: the connection closed mid-body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {head:?}"));
        let body = String::from_utf8_lossy(&buf[head_end..head_end + len]).into_owned();
        let body = match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(echo) if echo.get("backend").is_some() => {
                format!("backend saw {} {}", echo["method"], echo["path"])
            }
            _ => body,
        };
        Answer {
            status,
            backend: header("x-backend"),
            body,
            open: header("connection").as_deref() != Some("close"),
        }
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer in 10 s"));
    if !answer.open {
        *conn = None;
    }
    answer
}

/// Routes to two clusters (`pool`: two endpoints, round robin; `one`: one endpoint), one by
/// method, and a deny route answered by the node.
fn mixed_routes_config(
    admin: SocketAddr,
    web: SocketAddr,
    kernel: &str,
    pool: [SocketAddr; 2],
    one: SocketAddr,
) -> String {
    format!(
        r#"
admin: {admin}
workers: 1
{kernel}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /deny }} }}
        direct_response: {{ status: 403, body: "denied" }}
      - match: {{ path: {{ prefix: /pool }} }}
        cluster: pool
      - match: {{ path: {{ prefix: /write }}, method: POST }}
        cluster: pool
      - match: {{ path: {{ prefix: /one }} }}
        cluster: one
      - match: {{ path: {{ prefix: /write }} }}
        cluster: one
clusters:
  - {{ name: pool, lb: round_robin, endpoints: [ {p0}, {p1} ] }}
  - {{ name: one, endpoints: [ {one} ] }}
"#,
        p0 = pool[0],
        p1 = pool[1],
    )
}

/// The differential test of issue 18: random keep-alive runs of mixed routes, methods and
/// paths over several connections, through a node with `kernel.l7_dispatch` and one
/// without; every answer and every backend hit must be the same, request by request.
async fn kernel_never_answers_differently(test: &str, redirect: bool) {
    let seed: u64 = std::env::var("FM_DIFF_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x18_18_18);
    let pins = Pins::new(test);
    let pool = [
        HttpBackend::start("pool-0", Proto::H1).await,
        HttpBackend::start("pool-1", Proto::H1).await,
    ];
    let one = HttpBackend::start("one", Proto::H1).await;
    let pool_addrs = [pool[0].addr, pool[1].addr];
    let (admin_k, web_k, admin_u, web_u) = (free_addr(), free_addr(), free_addr(), free_addr());
    let kernel = format!(
        "kernel: {{ pin_dir: {}, redirect: {redirect}, l7_dispatch: true }}",
        pins.0.display()
    );
    let with_kernel = Proxy::start(
        admin_k,
        &mixed_routes_config(admin_k, web_k, &kernel, pool_addrs, one.addr),
    )
    .await;
    let user_only = Proxy::start(
        admin_u,
        &mixed_routes_config(admin_u, web_u, "", pool_addrs, one.addr),
    )
    .await;

    const CONNS: usize = 6;
    const REQUESTS: usize = 240;
    let methods = ["GET", "POST", "PUT", "DELETE"];
    let prefixes = ["/pool", "/one", "/write", "/deny", "/nothing", "/"];
    let mut rng = Rng(seed);
    let mut conns_k: Vec<Option<TcpStream>> = (0..CONNS).map(|_| None).collect();
    let mut conns_u: Vec<Option<TcpStream>> = (0..CONNS).map(|_| None).collect();
    let mut sent = 0;
    let mut log = Vec::new();
    while sent < REQUESTS {
        // A keep-alive run of 1 to 5 requests on one connection, each to a random route.
        let c = rng.below(CONNS);
        for _ in 0..1 + rng.below(5) {
            let method = rng.pick(&methods);
            let path = format!(
                "{}{}",
                rng.pick(&prefixes),
                rng.pick(&["", "/x", "/a/b", "x"])
            );
            let k = ask_on(&mut conns_k[c], web_k, method, &path).await;
            let u = ask_on(&mut conns_u[c], web_u, method, &path).await;
            log.push(format!("conn {c}: {method} {path} -> {u:?}"));
            assert_eq!(
                k,
                u,
                "request {sent} (seed {seed}, replay with FM_DIFF_SEED={seed}): {method} {path} on connection {c} answered differently with tier K; the requests so far:\n{}",
                log.join("\n")
            );
            sent += 1;
        }
    }
    drop((conns_k, conns_u));
    // /rules says the truth: no route of this listener runs in the kernel, and why.
    let rules: serde_json::Value =
        serde_json::from_str(&with_kernel.admin_get("/rules").await.1).unwrap();
    assert_eq!(rules["node"]["kernel"]["state"], "attached", "{rules}");
    for r in rules["listeners"][0]["routes"].as_array().unwrap() {
        assert_eq!(r["tier"], "U7", "{r}");
    }
    let reasons = rules["listeners"][0]["routes"].to_string();
    assert!(reasons.contains("the kernel splices none"), "{reasons}");
    // Every backend hit the same: the two nodes' requests together, half each.
    let hits = [pool[0].hits(), pool[1].hits(), one.hits()];
    assert!(
        hits.iter().all(|h| h % 2 == 0),
        "each backend answered both nodes equally often (seed {seed}): {hits:?}"
    );
    assert!(
        hits.iter().all(|h| *h > 0),
        "every backend was reached: {hits:?}"
    );
    assert_eq!(spliced_metric(&with_kernel, "web").await, 0.0);
    // Both nodes counted every request in their own metrics.
    for node in [&with_kernel, &user_only] {
        assert_eq!(requests_counted(node, sent as f64).await, sent as f64);
    }
}

#[test]
fn the_kernel_tier_never_answers_differently_spliced() {
    in_netns("the_kernel_tier_never_answers_differently_spliced", || {
        kernel_never_answers_differently("diff-splice", false)
    });
}

#[test]
fn the_kernel_tier_never_answers_differently_socket_direct() {
    in_netns(
        "the_kernel_tier_never_answers_differently_socket_direct",
        || kernel_never_answers_differently("diff-direct", true),
    );
}

/// A listener whose every request goes to one single-endpoint cluster, with nothing per
/// request: the kernel still decides its connections and splices them, and every keep-alive
/// request on them reaches that endpoint.
async fn a_uniform_listener_is_spliced(test: &str, redirect: bool) {
    let pins = Pins::new(test);
    let only = HttpBackend::start("only", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let config = format!(
        r#"
admin: {admin}
workers: 1
kernel: {{ pin_dir: {pins}, redirect: {redirect}, l7_dispatch: true }}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /api }}, method: GET }}
        cluster: only
      - match: {{ path: {{ prefix: /api }} }}
        cluster: only
      # Every request, `OPTIONS *` included (`prefix: /` would miss it).
      - match: {{}}
        cluster: only
clusters:
  - {{ name: only, endpoints: [ {only} ] }}
"#,
        pins = pins.0.display(),
        only = only.addr,
    );
    let proxy = Proxy::start(admin, &config).await;
    let rules: serde_json::Value =
        serde_json::from_str(&proxy.admin_get("/rules").await.1).unwrap();
    for r in rules["listeners"][0]["routes"].as_array().unwrap() {
        assert_eq!(r["tier"], "K", "{r}");
    }
    const CONNS: usize = 3;
    for c in 0..CONNS {
        let mut conn = None;
        for (method, path) in [("GET", "/api/x"), ("POST", "/other"), ("GET", "/")] {
            let a = ask_on(&mut conn, web, method, path).await;
            assert_eq!(
                (a.status, a.backend.as_deref(), a.body.as_str()),
                (
                    200,
                    Some("only"),
                    format!("backend saw \"{method}\" \"{path}\"").as_str()
                ),
                "connection {c}"
            );
        }
    }
    let mut seen = 0.0;
    for _ in 0..100 {
        seen = spliced_metric(&proxy, "web").await;
        if seen == CONNS as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, CONNS as f64, "every connection was spliced");
    assert_eq!(only.hits(), 3 * CONNS as u64);
}

#[test]
fn a_listener_with_one_answer_is_still_spliced() {
    in_netns("a_listener_with_one_answer_is_still_spliced", || {
        a_uniform_listener_is_spliced("uniform-splice", false)
    });
}
