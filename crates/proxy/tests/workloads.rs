//! Workloads: node A carries each local workload's connections through an HBONE tunnel to
//! node B presenting *that workload's* certificate, so B's policies admit or refuse each
//! workload by its own SPIFFE ID. The workloads are real processes: `bash` clients started
//! under users of their own (identified without tier K, by the uid that owns the client's
//! socket in /proc/net/tcp) or in cgroups of their own (identified by tier K's capture
//! programs, which record each captured connection's cgroup in the client's `connect()`).
//! A workload cannot claim another's identity: nothing it sends is read for it.
//!
//! Needs root (processes under other users, cgroups, eBPF): `cargo test --release -p
//! flatmesh-proxy --test workloads` as root.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use common::backends::{TcpBackend, TcpMode};
use common::pki::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NODE_A: &str = "spiffe://td/ns/mesh/sa/node-a";

fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the workload tests run clients under other users and in cgroups: run them as root"
    );
}

/// Node B: an hbone listener `tunnel` whose TLS admits the mesh and the shop namespace, and
/// whose policies allow web and node A only (cart is refused, 403). Its local workload `echo`
/// is known by the port it listens on.
fn node_b(pki: &Pki, listen: SocketAddr, echo: SocketAddr) -> TestNode {
    let id = pki.issue("node-b", NODE);
    let ca = pki.ca_file();
    TestNode::start(&format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: tunnel
    address: {listen}
    protocol: hbone
    tls: {{ cert: {id}.pem, key: {id}.key, client_ca: {ca}, allow: [ "{TD}/ns/shop/*", "{TD}/ns/mesh/*" ] }}
    authorization:
      default: deny
      policies:
        - {{ name: web, action: allow, from: {{ principals: [ {WEB} ] }} }}
        - {{ name: node-a, action: allow, from: {{ principals: [ {NODE_A} ] }} }}
workloads:
  - {{ name: echo, identity: "{TD}/ns/shop/sa/echo", match: {{ port: {port} }} }}
"#,
        admin = free_addr(),
        port = echo.port(),
    ))
}

/// Node A's config: tcp listener `app` to tunnel cluster `remote` (node A's own certificate
/// for connections of no workload) and `strict` to `remote-strict` (no certificate of its
/// own: such connections are refused), then `extra` (the `kernel:` and `workloads:`).
fn node_a(pki: &Pki, echo: SocketAddr, b: SocketAddr, extra: &str) -> String {
    let id = pki.issue("node-a", NODE_A);
    let ca = pki.ca_file();
    format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - {{ name: app, address: {app}, protocol: tcp, cluster: remote }}
  - {{ name: strict, address: {strict}, protocol: tcp, cluster: remote-strict }}
clusters:
  - name: remote
    endpoints: [ {echo} ]
    tunnel: hbone
    tunnel_port: {port}
    tls: {{ ca: {ca}, cert: {id}.pem, key: {id}.key, server_ids: [ {NODE} ] }}
  - name: remote-strict
    endpoints: [ {echo} ]
    tunnel: hbone
    tunnel_port: {port}
    tls: {{ ca: {ca}, server_ids: [ {NODE} ] }}
{extra}
"#,
        admin = free_addr(),
        app = free_addr(),
        strict = free_addr(),
        port = b.port(),
    )
}

/// `workloads:` entries for web and cart, matched by `how` (`uid: N` / `cgroup: PATH`).
fn workloads(pki: &Pki, web: &str, cart: &str) -> String {
    let w = pki.issue("web", WEB);
    let c = pki.issue("cart", CART);
    format!(
        "workloads:\n  - {{ name: web, identity: {WEB}, cert: {w}.pem, key: {w}.key, match: {{ {web} }} }}\n  - {{ name: cart, identity: {CART}, cert: {c}.pem, key: {c}.key, match: {{ {cart} }} }}\n"
    )
}

/// A workload: `bash` as user `uid` (or root), first joining `cgroup` when given, that
/// connects to `to`, sends `hello` and prints what comes back (nothing when refused).
async fn workload_says_hello(uid: Option<u32>, cgroup: Option<&Path>, to: SocketAddr) -> String {
    let join = cgroup.map_or(String::new(), |c| {
        format!("echo $$ > {}/cgroup.procs || exit 2; ", c.display())
    });
    let script = format!(
        "{join}exec 3<>/dev/tcp/{}/{} || exit 3; printf hello >&3; timeout 5 head -c 5 <&3",
        to.ip(),
        to.port()
    );
    let out = tokio::task::spawn_blocking(move || {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("bash");
        cmd.arg("-c").arg(script);
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        // `head` is bounded by `timeout 5`: this returns.
        cmd.output().unwrap_or_else(|e| panic!("running bash: {e}"))
    })
    .await
    .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// This test process (root, in no workload's cgroup): sends hello to `to` and returns what
/// comes back (nothing when refused). A node that resets the connection at once can make the
/// connect itself fail (ECONNRESET before the socket turned writable): that is a refusal too.
async fn undeclared_says_hello(to: SocketAddr) -> String {
    let Ok(mut s) = tokio::net::TcpStream::connect(to).await else {
        return String::new();
    };
    let _ = s.write_all(b"hello").await;
    let mut back = [0u8; 5];
    match tokio::time::timeout(std::time::Duration::from_secs(5), s.read_exact(&mut back)).await {
        Ok(Ok(_)) => String::from_utf8_lossy(&back).into_owned(),
        _ => String::new(),
    }
}

async fn count(node: &TestNode, name: &str, labels: &[&str]) -> f64 {
    metric(node, name, labels).await
}

/// What both tests check once web, cart and an undeclared client have each made one
/// connection through `app`, and web a second one.
async fn each_tunnel_presented_its_workload(a: &TestNode, b: &TestNode) {
    // B saw three principals: web and node A allowed by their policies, cart denied.
    for (policy, decision, n) in [
        ("web", "allow", 2.0),
        ("node-a", "allow", 1.0),
        ("(none)", "deny", 1.0),
    ] {
        assert_eq!(
            count(
                b,
                "flatmesh_authz_decisions_total",
                &[
                    &format!("policy=\"{policy}\""),
                    &format!("decision=\"{decision}\"")
                ]
            )
            .await,
            n,
            "policy {policy} {decision}"
        );
    }
    // Three identities, three tunnel connections: web's two connections shared one, and no
    // workload ever rode another's.
    assert_eq!(
        count(
            a,
            "flatmesh_upstream_connections_total",
            &["cluster=\"remote\""]
        )
        .await,
        3.0
    );
    assert_eq!(
        count(
            b,
            "flatmesh_downstream_connections_total",
            &["listener=\"tunnel\""]
        )
        .await,
        3.0
    );
    for (workload, n) in [("web", 2.0), ("cart", 1.0), ("(none)", 1.0)] {
        assert_eq!(
            count(
                a,
                "flatmesh_workload_connections_total",
                &["listener=\"app\"", &format!("workload=\"{workload}\"")]
            )
            .await,
            n,
            "connections of {workload}"
        );
    }
    assert_eq!(
        count(
            a,
            "flatmesh_upstream_hbone_streams_refused_total",
            &["cluster=\"remote\"", "reason=\"peer_403\""]
        )
        .await,
        1.0
    );
    // B names the local workload each delivered stream was for, by its port.
    assert_eq!(
        count(
            b,
            "flatmesh_workload_connections_total",
            &["listener=\"tunnel\"", "workload=\"echo\""]
        )
        .await,
        3.0
    );
}

/// Without tier K: web and cart are users 4201 and 4202; the node reads the owner of each
/// client socket from /proc/net/tcp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workloads_known_by_uid_present_their_own_identity() {
    require_root();
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let b_listen = free_addr();
    let b = node_b(&pki, b_listen, echo.addr);
    let a = TestNode::start(&node_a(
        &pki,
        echo.addr,
        b_listen,
        &workloads(&pki, "uid: 4201", "uid: 4202"),
    ));
    let app = a.listener("app");
    assert_eq!(
        workload_says_hello(Some(4201), None, app).await,
        "hello",
        "web is allowed"
    );
    assert_eq!(
        workload_says_hello(Some(4202), None, app).await,
        "",
        "cart is refused"
    );
    assert_eq!(
        workload_says_hello(Some(4201), None, app).await,
        "hello",
        "web again"
    );
    // No declared workload: node A's own identity, which B allows.
    assert_eq!(undeclared_says_hello(app).await, "hello");
    each_tunnel_presented_its_workload(&a, &b).await;

    // A cluster without a certificate of its own carries declared workloads only.
    let strict = a.listener("strict");
    assert_eq!(workload_says_hello(Some(4201), None, strict).await, "hello");
    assert_eq!(
        undeclared_says_hello(strict).await,
        "",
        "no identity to present"
    );
    assert_eq!(
        count(
            &a,
            "flatmesh_upstream_hbone_streams_refused_total",
            &["cluster=\"remote-strict\"", "reason=\"no_identity\""]
        )
        .await,
        1.0
    );
    // Each workload's certificate is watched for expiry like the node's own.
    for id in [WEB, CART] {
        assert_eq!(
            metric_samples(
                &a.metrics().await,
                "flatmesh_tls_certificate_expiry_timestamp_seconds",
                &[&format!("identity=\"{id}\"")]
            )
            .len(),
            1,
            "expiry of {id}"
        );
    }
    a.assert_alive("after refusing").await;
    b.assert_alive("after refusing").await;
}

/// A cgroup v2 directory for one test, removed (with its children) at the end.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(name: &str) -> Cgroup {
        let path = flatmesh_kernel::default_cgroup_root()
            .join(format!("fm-wl-{name}-{}", std::process::id()));
        for dir in [path.clone(), path.join("web"), path.join("cart")] {
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| {
                panic!(
                    "creating cgroup {}: {e} (cgroup v2 mounted?)",
                    dir.display()
                )
            });
        }
        Cgroup(path)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The workloads have exited; the kernel may take a moment to let their cgroups go.
        for dir in [self.0.join("web"), self.0.join("cart"), self.0.clone()] {
            for _ in 0..50 {
                if std::fs::remove_dir(&dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

/// With tier K: the workloads connect to a service address that the capture programs send
/// to node A's listener, and each is known by the cgroup it runs in (all as root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_workloads_known_by_cgroup_present_their_own_identity() {
    require_root();
    let cgroup = Cgroup::new("capture");
    let pins = format!("/sys/fs/bpf/fm-wl-{}", std::process::id());
    let pki = Pki::new();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let b_listen = free_addr();
    let b = node_b(&pki, b_listen, echo.addr);
    let vip: SocketAddr = "10.251.7.1:80".parse().unwrap();
    let kernel = format!(
        "kernel:\n  pin_dir: {pins}\n  redirect: false\n  tcp_splice: false\n  capture: {{ cgroup: {}, services: [ {{ address: \"{vip}\", listener: app }} ] }}\n",
        cgroup.0.display()
    );
    let a = TestNode::start(&format!(
        "{}{}",
        node_a(&pki, echo.addr, b_listen, &kernel),
        workloads(
            &pki,
            &format!("cgroup: {}", cgroup.0.join("web").display()),
            &format!("cgroup: {}", cgroup.0.join("cart").display())
        )
    ));
    let (_, rules) = a.admin_get("/rules").await;
    assert!(
        rules.contains("\"state\": \"attached\""),
        "tier K did not attach: {rules}"
    );
    let web = cgroup.0.join("web");
    let cart = cgroup.0.join("cart");
    assert_eq!(
        workload_says_hello(None, Some(&web), vip).await,
        "hello",
        "web is allowed"
    );
    assert_eq!(
        workload_says_hello(None, Some(&cart), vip).await,
        "",
        "cart is refused"
    );
    assert_eq!(
        workload_says_hello(None, Some(&web), vip).await,
        "hello",
        "web again"
    );
    // Captured, but from the capture cgroup itself, which names no workload: node A's own
    // identity.
    assert_eq!(
        workload_says_hello(None, Some(&cgroup.0), vip).await,
        "hello"
    );
    each_tunnel_presented_its_workload(&a, &b).await;
    drop(a);
    // The node stops off the test's thread; give it a moment before the cgroups go.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
}
