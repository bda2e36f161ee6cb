//! `type: original_dst` clusters, end to end: each test runs in a network namespace of its
//! own (the test binary re-runs itself under `unshare --net`), where an nftables `redirect`
//! rule in the `nat` OUTPUT chain sends the client's connections (those from 127.0.0.2 only,
//! so the node's own upstream connections are left alone) to the node's listener, as
//! iptables `REDIRECT` does for a sidecar. The node reads each connection's original
//! destination (`SO_ORIGINAL_DST`) and forwards it there, within the cluster's allow-list.
//! Root is needed for the namespace and the rule; the host's tables are never touched.

#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::backends::{HttpBackend, Proto};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The address the client's connections come from: the only one the redirect applies to.
const CLIENT: [u8; 4] = [127, 0, 0, 2];

/// Runs `body` in a network namespace of its own (`common::netns`), as root.
fn in_netns<F, Fut>(test: &str, body: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    assert!(
        rustix::process::geteuid().is_root(),
        "the original_dst tests make a network namespace and an nftables rule: run them as root"
    );
    common::netns::in_netns(test, Duration::from_secs(120), body);
}

/// Runs `cmd args` (with `stdin`), panicking with its output if it fails.
fn run(cmd: &str, args: &[&str], stdin: Option<&str>) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(cmd)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {cmd}: {e}"));
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// In this namespace: the client's connections to `ports` go to `listener`'s port instead
/// (nftables `redirect` in the nat OUTPUT hook: conntrack keeps the original destination).
fn redirect(table: &str, ports: &[u16], listener: SocketAddr) {
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    let client = std::net::Ipv4Addr::from(CLIENT);
    run(
        "nft",
        &["-f", "-"],
        Some(&format!(
            "table ip {table} {{\n  chain out {{\n    type nat hook output priority -100; policy accept;\n    ip saddr {client} tcp dport {{ {} }} redirect to :{}\n  }}\n}}\n",
            ports.join(", "),
            listener.port()
        )),
    );
}

/// A connection from the client's address to `to`.
async fn dial(to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((CLIENT, 0)))?;
    tokio::time::timeout(Duration::from_secs(5), socket.connect(to))
        .await
        .map_err(|_| std::io::Error::other("connect timed out"))?
}

/// One HTTP/1.1 GET to `to`, from the client's address; the whole answer as text.
async fn http_get(to: SocketAddr) -> String {
    let mut stream = dial(to).await.unwrap();
    stream
        .write_all(
            format!("GET /where HTTP/1.1\r\nhost: {to}\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the answer within 10 s")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A TCP backend that writes its name on every connection and closes; counts connections.
struct Named {
    addr: SocketAddr,
    accepted: Arc<AtomicU64>,
}

impl Named {
    async fn start(ip: [u8; 4], name: &'static str) -> Named {
        let listener = TcpListener::bind(SocketAddr::from((ip, 0))).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::Relaxed);
                let _ = s.write_all(name.as_bytes()).await;
            }
        });
        Named { addr, accepted }
    }

    fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

/// What a tcp connection to `to` from the client reads before it closes (empty: closed or
/// reset without a byte).
async fn tcp_read(to: SocketAddr) -> String {
    // A reset can come before the connect is seen to complete.
    let Ok(mut stream) = dial(to).await else {
        return String::new();
    };
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got))
        .await
        .expect("the connection ends within 10 s");
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn tcp_connections_reach_the_address_their_client_dialled() {
    in_netns(
        "tcp_connections_reach_the_address_their_client_dialled",
        || async {
            let a = Named::start([127, 0, 0, 1], "backend-a").await;
            let b = Named::start([127, 0, 0, 1], "backend-b").await;
            // Outside the allow-list (127.0.0.1/32 only).
            let outside = Named::start([127, 0, 0, 3], "outside").await;
            let listen = free_addr();
            let node = TestNode::start(&format!(
                "admin: {admin}\nlisteners:\n  - {{ name: capture, address: {listen}, protocol: tcp, cluster: passthrough }}\nclusters:\n  - name: passthrough\n    type: original_dst\n    allow: [ 127.0.0.1/32 ]\n",
                admin = free_addr(),
            ));
            redirect(
                "fm_tcp",
                &[a.addr.port(), b.addr.port(), outside.addr.port()],
                node.listener("capture"),
            );

            // Two destinations, both captured to the one listener, each reaches its own.
            assert_eq!(tcp_read(a.addr).await, "backend-a");
            assert_eq!(tcp_read(b.addr).await, "backend-b");
            assert_eq!(tcp_read(a.addr).await, "backend-a");
            assert_eq!((a.accepted(), b.accepted()), (2, 1));

            // Outside the allow-list: closed, and the destination never sees a connection.
            assert_eq!(tcp_read(outside.addr).await, "");
            assert_eq!(
                outside.accepted(),
                0,
                "a refused destination is not dialled"
            );

            // Dialled straight to the node, not redirected: forwarding it would loop.
            assert_eq!(tcp_read(node.listener("capture")).await, "");
            node.assert_alive("after the refusals").await;
            assert_eq!((a.accepted(), b.accepted()), (2, 1));
        },
    );
}

#[test]
fn http_requests_reach_the_address_their_client_dialled() {
    in_netns(
        "http_requests_reach_the_address_their_client_dialled",
        || async {
            let a = HttpBackend::start("backend-a", Proto::H1).await;
            let b = HttpBackend::start("backend-b", Proto::H1).await;
            let outside = Named::start([127, 0, 0, 3], "outside").await;
            let listen = free_addr();
            let node = TestNode::start(&format!(
                "admin: {admin}\nlisteners:\n  - name: capture\n    address: {listen}\n    protocol: http\n    routes: [ {{ match: {{ path: {{ prefix: / }} }}, cluster: passthrough }} ]\nclusters:\n  - name: passthrough\n    type: original_dst\n    allow: [ 127.0.0.1/32 ]\n    max_destinations: 8\n",
                admin = free_addr(),
            ));
            redirect(
                "fm_http",
                &[a.addr.port(), b.addr.port(), outside.addr.port()],
                node.listener("capture"),
            );

            for _ in 0..2 {
                let answer = http_get(a.addr).await;
                assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
                assert!(answer.contains("x-backend: backend-a"), "{answer}");
                let answer = http_get(b.addr).await;
                assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
                assert!(answer.contains("x-backend: backend-b"), "{answer}");
            }
            assert_eq!((a.hits(), b.hits()), (2, 2));

            // Outside the allow-list: 403, naming the address and the list.
            let answer = http_get(outside.addr).await;
            assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
            assert!(
                answer.contains(&format!("original destination {}", outside.addr))
                    && answer.contains("allow-list [127.0.0.1/32]"),
                "{answer}"
            );
            assert_eq!(
                outside.accepted(),
                0,
                "a refused destination is not dialled"
            );

            // Straight to the node: 403, a loop.
            let answer = http_get(node.listener("capture")).await;
            assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
            assert!(answer.contains("would loop"), "{answer}");
            assert_eq!((a.hits(), b.hits()), (2, 2));
        },
    );
}

#[test]
fn an_original_dst_cluster_without_an_allow_list_is_refused_at_load() {
    let dir = TempDir::new();
    let path = dir.write(
        "flatmesh.yaml",
        "listeners:\n  - { name: capture, address: 127.0.0.1:15001, protocol: tcp, cluster: passthrough }\nclusters:\n  - name: passthrough\n    type: original_dst\n",
    );
    let err = flatmesh_config::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("flatmesh.yaml:5:11") && err.contains("has no `allow` list"),
        "{err}"
    );
    assert!(
        err.contains("allow: [ 10.0.0.0/8 ]"),
        "the hint shows how: {err}"
    );
}

/// With tier K's capture instead of a netfilter rule: a workload's connections to two service
/// addresses are sent to the node's one listener by the kernel (cgroup connect4), and the
/// node finds each one's destination in the capture map; a captured address outside the
/// allow-list is refused.
#[test]
fn tier_k_captured_connections_reach_the_address_their_client_dialled() {
    in_netns(
        "tier_k_captured_connections_reach_the_address_their_client_dialled",
        || async {
            for ip in ["10.250.7.1/32", "10.250.7.2/32", "10.250.8.1/32"] {
                run("ip", &["addr", "add", ip, "dev", "lo"], None);
            }
            let a = Named::start([10, 250, 7, 1], "backend-a").await;
            let b = Named::start([10, 250, 7, 2], "backend-b").await;
            let outside = Named::start([10, 250, 8, 1], "outside").await;
            let pins = format!("/sys/fs/bpf/fm-odst-{}", std::process::id());
            let cgroup = flatmesh_kernel::default_cgroup_root()
                .join(format!("fm-odst-{}", std::process::id()));
            std::fs::create_dir_all(&cgroup).unwrap();
            let services: Vec<String> = [a.addr, b.addr, outside.addr]
                .iter()
                .map(|s| format!("{{ address: \"{s}\", listener: capture, plaintext_ok: true }}"))
                .collect();
            let node = TestNode::start(&format!(
                "admin: {admin}\nkernel:\n  pin_dir: {pins}\n  redirect: false\n  tcp_splice: false\n  capture: {{ cgroup: {cg}, services: [ {services} ] }}\nlisteners:\n  - {{ name: capture, address: {listen}, protocol: tcp, cluster: passthrough }}\nclusters:\n  - name: passthrough\n    type: original_dst\n    allow: [ 10.250.7.0/24 ]\n",
                admin = free_addr(),
                listen = free_addr(),
                cg = cgroup.display(),
                services = services.join(", "),
            ));
            let (_, rules) = node.admin_get("/rules").await;
            assert!(
                rules.contains("\"state\": \"attached\""),
                "tier K did not attach: {rules}"
            );
            // A workload in the capture cgroup reads what each address answers.
            let workload = |to: SocketAddr| {
                format!(
                    "echo $$ > {procs} || exit 2; exec 3<>/dev/tcp/{ip}/{port} && cat <&3",
                    procs = cgroup.join("cgroup.procs").display(),
                    ip = to.ip(),
                    port = to.port()
                )
            };
            let script = format!(
                "({}); ({}); ({})",
                workload(a.addr),
                workload(b.addr),
                workload(outside.addr)
            );
            // Off the runtime's threads: the node serves the workload meanwhile.
            let out = tokio::time::timeout(
                Duration::from_secs(20),
                tokio::task::spawn_blocking(move || {
                    std::process::Command::new("bash")
                        .arg("-c")
                        .arg(&script)
                        .output()
                }),
            )
            .await
            .expect("the workload finished in time")
            .unwrap()
            .unwrap();
            drop(node);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let _ = std::fs::remove_dir(&cgroup);
            let _ = flatmesh_kernel::cleanup_stale(std::path::Path::new(&pins));
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "backend-abackend-b",
                "stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!((a.accepted(), b.accepted()), (1, 1));
            assert_eq!(
                outside.accepted(),
                0,
                "a refused destination is not dialled"
            );
        },
    );
}
