//! `flatmesh control` serves xDS from the control center's state: a placement (HCM) of an app on
//! a cluster of hosts and SmartNICs gives the EDS endpoints, and the orchestrator moves them. A
//! real `flatmesh node --xds` follows: heartbeats that show the SmartNIC overloaded migrate the
//! instance to the host (the step program sees the five cold-migration steps), a silent host
//! fails its server over, and traffic follows each move with no failed request.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flatmesh_control::heartbeat::{Heartbeat, HeartbeatKey, KEY_LEN, NO_SAMPLE};

const CLUSTER: &str = r#"
name: lab
server_types:
  Small:
    host:     {core: beefy, cores: 2, memory_mb: 4096, idle_watts: 83, peak_watts: 201, cost_usd: 4500, bandwidth_gbps: 0}
    smartnic: {core: wimpy, cores: 1, memory_mb: 1024, idle_watts: 15, peak_watts: 21, cost_usd: 150, bandwidth_gbps: 10}
    smartnic_count: 1
racks:
  - name: r0
    servers: [{type: Small, count: 2}]
"#;

const APP: &str = r#"
name: shop
rps: 1000
replicas: 0
stages: [{name: kvs, microservice: KVS, shards: 1}]
"#;

/// Topology order: per server its host, then its SmartNIC. The index is the heartbeat's node.
const NODES: [(&str, [u8; 4]); 4] = [
    ("r0-s0/host", [127, 0, 0, 1]),
    ("r0-s0/nic0", [127, 0, 0, 2]),
    ("r0-s1/host", [127, 0, 0, 3]),
    ("r0-s1/nic0", [127, 0, 0, 4]),
];

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn flatmesh(args: &[&str], log: &Path) -> Proc {
    let log = std::fs::File::create(log).unwrap();
    Proc(
        Command::new(env!("CARGO_BIN_EXE_flatmesh"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// Listeners on one port at every node address. A port the kernel found free on the first
/// address may be taken on another (an outgoing connection's local port, say), so a clash
/// means trying another port.
fn listeners_on_one_port() -> (u16, Vec<TcpListener>) {
    for _ in 0..50 {
        let first = TcpListener::bind(SocketAddr::from((NODES[0].1, 0))).unwrap();
        let port = first.local_addr().unwrap().port();
        let mut all = vec![first];
        for (_, ip) in &NODES[1..] {
            match TcpListener::bind(SocketAddr::from((*ip, port))) {
                Ok(listener) => all.push(listener),
                Err(_) => break,
            }
        }
        if all.len() == NODES.len() {
            return (port, all);
        }
    }
    panic!("no port was free on every node address in 50 tries");
}

/// An HTTP/1.1 backend on `listener` answering every request with `name`.
fn backend(listener: TcpListener, name: &'static str) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let reply = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{name}",
                            name.len()
                        );
                        if conn.write_all(reply.as_bytes()).is_err() {
                            return;
                        }
                    }
                    match conn.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
}

/// `200 BODY` from GET / on `addr`, or None if the connection failed.
fn get(addr: SocketAddr) -> Option<String> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(b"GET /kvs/x HTTP/1.1\r\nhost: shop.local\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?;
    let body = text.split_once("\r\n\r\n")?.1;
    Some(format!("{status} {body}"))
}

/// The web console's `GET /ui/state`, once it answers.
fn console_state(ui: SocketAddr) -> Option<serde_json::Value> {
    let mut conn = TcpStream::connect_timeout(&ui, Duration::from_secs(2)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(b"GET /ui/state HTTP/1.1\r\nhost: x\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.split_once("\r\n\r\n")?.1).ok()
}

fn wait_for(what: &str, logs: &[&Path], mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let logs: Vec<String> = logs
        .iter()
        .map(|p| {
            format!(
                "--- {}\n{}",
                p.display(),
                std::fs::read_to_string(p).unwrap_or_default()
            )
        })
        .collect();
    panic!(
        "timed out after 30 s waiting for: {what}\n{}",
        logs.join("\n")
    );
}

#[path = "../../proxy/tests/common/ports.rs"]
mod ports;
use ports::free_port;

/// Node `i`'s heartbeat key.
fn key(node: u32) -> HeartbeatKey {
    HeartbeatKey::from_bytes([node as u8 + 1; KEY_LEN])
}

/// Node `node`'s agent: a socket on the node's address (the control center takes a node's
/// heartbeats only from there) and its sequence numbers.
struct Agent {
    node: u32,
    socket: UdpSocket,
    seq: flatmesh_control::agent::Sequence,
}

impl Agent {
    fn new(node: u32) -> Agent {
        let ip = NODES[node as usize].1;
        Agent {
            node,
            socket: UdpSocket::bind(SocketAddr::from((ip, 0))).unwrap(),
            seq: Default::default(),
        }
    }

    fn beat(&mut self, to: SocketAddr, exec_us: u16) {
        let hb = Heartbeat {
            node: self.node,
            queue_len: 0,
            bw_util_pct: 10,
            slot_base: 0,
            exec_us: [exec_us, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE],
        };
        let seq = self.seq.next(flatmesh_control::agent::unix_now_us());
        self.socket
            .send_to(&hb.seal(seq, &key(self.node)), to)
            .unwrap();
    }
}

fn workdir() -> PathBuf {
    workdir_named("xds-control")
}

fn workdir_named(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn control_serves_placed_endpoints_and_the_orchestrator_moves_them() {
    let dir = workdir();
    let (service_port, listeners) = listeners_on_one_port();
    for ((node, _), listener) in NODES.iter().zip(listeners) {
        backend(listener, node);
    }
    let web: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let xds: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let heartbeats: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let cluster = file("cluster.yaml", CLUSTER);
    let app = file("app.yaml", APP);
    let nodes: Vec<String> = NODES
        .iter()
        .map(|(n, ip)| format!("{n}: {}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3]))
        .collect();
    let addresses = file(
        "addresses.yaml",
        &format!(
            "nodes: {{ {} }}\nservices: {{ shop/kvs: {service_port} }}\n",
            nodes.join(", ")
        ),
    );
    let state = file(
        "state.yaml",
        &format!(
            "listeners:\n  - name: web\n    address: {web}\n    protocol: http\n    routes: [ {{ match: {{ path: {{ prefix: /kvs/ }} }}, cluster: shop/kvs }} ]\nclusters:\n  - {{ name: shop/kvs, lb: least_request, endpoints: [] }}\n"
        ),
    );
    let steps = dir.join("steps.log");
    let step_command = file(
        "step.sh",
        &format!("#!/bin/sh\necho \"$@\" >> {}\n", steps.display()),
    );
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&step_command, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The node's admin endpoint is at r0-s0/host's IP: the console reads its traffic there.
    let admin_port = free_port();
    let base = file(
        "base.yaml",
        &format!("admin: 127.0.0.1:{admin_port}\nworkers: 1\n"),
    );
    let ui: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let keys: Vec<String> = NODES
        .iter()
        .enumerate()
        .map(|(i, (n, _))| format!("{n}: {}\n", key(i as u32).to_hex()))
        .collect();
    let keys = file("heartbeat-keys.yaml", &keys.concat());
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();

    let control_log = dir.join("control.log");
    let node_log = dir.join("node.log");
    let logs = [control_log.as_path(), node_log.as_path()];
    let _control = flatmesh(
        &[
            "control",
            "--listen",
            &xds.to_string(),
            "--state",
            &state,
            "--cluster",
            &cluster,
            "--app",
            &app,
            "--addresses",
            &addresses,
            "--heartbeats",
            &heartbeats.to_string(),
            "--heartbeat-keys",
            &keys,
            "--step-command",
            &step_command,
            "--ui",
            &ui.to_string(),
            "--node-admin-port",
            &admin_port.to_string(),
        ],
        &control_log,
    );
    let _node = flatmesh(
        &[
            "node",
            "--xds",
            &xds.to_string(),
            "--node-id",
            "node-1",
            "--config",
            &base,
        ],
        &node_log,
    );

    // 1. HCM puts the KVS on a SmartNIC (the offload rule allows it, SmartNICs come first).
    wait_for(
        "the node routes /kvs/ to the placed instance",
        &logs,
        || get(web).is_some_and(|b| b.starts_with("200 r0-s")),
    );
    let first = get(web).unwrap();
    assert_eq!(
        first, "200 r0-s0/nic0",
        "HCM placed the KVS on the first SmartNIC"
    );

    // Traffic runs through every move below; not one request may fail.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            let mut bad = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match get(web) {
                    Some(b) if b.starts_with("200 ") => ok.fetch_add(1, Ordering::Relaxed),
                    other => {
                        bad.push(other);
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                std::thread::sleep(Duration::from_millis(2));
            }
            bad
        })
    };

    // 2. The SmartNIC reports a slot 2x slower than its average: overload. The orchestrator
    //    migrates the KVS to its server's host in five steps and pushes the new endpoint.
    let mut nic = Agent::new(1);
    for _ in 0..6 {
        nic.beat(heartbeats, 100);
        std::thread::sleep(Duration::from_millis(20));
    }
    nic.beat(heartbeats, 200);
    wait_for("traffic follows the migration to r0-s0/host", &logs, || {
        get(web).as_deref() == Some("200 r0-s0/host")
    });
    let log = std::fs::read_to_string(&steps).unwrap();
    let expected: Vec<String> = [
        "push-binary",
        "remove",
        "cleanup",
        "migrate-state",
        "restart",
    ]
    .iter()
    .map(|s| format!("{s} shop/kvs-0 r0-s0/nic0 r0-s0/host"))
    .collect();
    assert_eq!(
        log.lines().take(5).collect::<Vec<_>>(),
        expected,
        "the cold-migration steps, in order"
    );

    // The web console shows the traffic it read from the node's admin endpoint: the route to
    // shop/kvs with its tier, the edge into shop/kvs, and the migration on the timeline; the
    // nodes with nothing at that port show their admin endpoint unreachable.
    wait_for("the console shows the node's traffic", &logs, || {
        console_state(ui).is_some_and(|s| {
            s["edges"].as_array().is_some_and(|edges| {
                edges
                    .iter()
                    .any(|e| e["to"] == "shop/kvs" && e["rps"].as_f64() > Some(0.0))
            })
        })
    });
    let shown = console_state(ui).unwrap();
    let routes = shown["routes"].as_array().unwrap();
    let kvs = routes
        .iter()
        .find(|r| r["node"] == "r0-s0/host" && r["cluster"] == "shop/kvs")
        .unwrap_or_else(|| panic!("{routes:?}"));
    assert_eq!(kvs["service"], "shop/kvs");
    assert_ne!(kvs["tier"], "-", "{kvs}");
    assert!(
        shown["timeline"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "migrated" && e["to"] == "r0-s0/host"),
        "{}",
        shown["timeline"]
    );
    let nodes = shown["nodes"].as_array().unwrap();
    let nic = nodes.iter().find(|n| n["id"] == "r0-s0/nic0").unwrap();
    assert!(nic["admin_error"].is_string(), "{nic}");

    // 3. The host goes silent after one heartbeat: its whole server (host and SmartNIC, one
    //    fault domain) fails over to the other server, and the endpoint follows again.
    Agent::new(0).beat(heartbeats, NO_SAMPLE);
    wait_for(
        "traffic follows the failover to server r0-s1",
        &logs,
        || get(web).is_some_and(|b| b.starts_with("200 r0-s1/")),
    );
    let log = std::fs::read_to_string(&steps).unwrap();
    assert!(
        log.lines()
            .any(|l| l.starts_with("restart shop/kvs-0 r0-s0/host r0-s1/")),
        "the failover restarts the KVS on the other server:\n{log}"
    );

    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let bad = load.join().unwrap();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert!(ok > 20, "the load ran: {ok} requests");
    assert_eq!(
        failed, 0,
        "no request failed across the moves ({ok} ok): {bad:?}"
    );
}

#[test]
fn control_refuses_incomplete_addresses_and_names_what_is_missing() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("xds-control-bad");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cluster.yaml"), CLUSTER).unwrap();
    std::fs::write(dir.join("app.yaml"), APP).unwrap();
    std::fs::write(
        dir.join("addresses.yaml"),
        "nodes: { r0-s0/host: 127.0.0.1, r0-s0/nic0: 127.0.0.2, r0-s1/host: 127.0.0.3 }\nservices: { shop/kvs: 9100 }\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_flatmesh"))
        .current_dir(&dir)
        .args([
            "control",
            "--listen",
            "127.0.0.1:0",
            "--cluster",
            "cluster.yaml",
            "--app",
            "app.yaml",
            "--addresses",
            "addresses.yaml",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("addresses.yaml: node `r0-s1/nic0` has no address"),
        "{stderr}"
    );

    // --cluster without --addresses is a usage error that says what is missing.
    let out = Command::new(env!("CARGO_BIN_EXE_flatmesh"))
        .current_dir(&dir)
        .args(["control", "--cluster", "cluster.yaml", "--app", "app.yaml"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--addresses"), "{stderr}");

    // The orchestrator needs a placement: --cluster, or Kubernetes with --schedule; and on
    // Kubernetes a move is a re-creation, which takes no step command. Both are refused
    // before anything starts (no API server is asked).
    for (args, says) in [
        (
            &["--kubeconfig", "none.yaml"][..],
            "give --cluster (with --app and --addresses), or --kubeconfig with --schedule",
        ),
        (
            &[
                "--kubeconfig",
                "none.yaml",
                "--schedule",
                "--step-command",
                "/bin/true",
            ][..],
            "--step-command drives the instances of --cluster",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_flatmesh"))
            .current_dir(&dir)
            .args([
                "control",
                "--heartbeats",
                "127.0.0.1:0",
                "--heartbeat-keys",
                "keys.yaml",
            ])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

fn run_ok(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flatmesh"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "flatmesh {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `200 BODY` from GET / over TLS on `addr`, verifying that the server presents `server_id`
/// (a certificate of the bundle `ca_pem`).
fn get_tls(addr: SocketAddr, ca_pem: &Path, server_id: &str) -> Result<String, String> {
    let bundle = flatmesh_identity::TrustBundle::load(ca_pem).map_err(|e| e.to_string())?;
    let config = flatmesh_identity::tls::client_config(
        None,
        &bundle,
        vec![flatmesh_identity::IdPattern::parse(server_id).unwrap()],
        &[b"http/1.1"],
    )
    .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let connection = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let tcp =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::StreamOwned::new(connection, tcp);
    tls.write_all(b"GET /x HTTP/1.1\r\nhost: shop.local\r\nconnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut text = String::new();
    // A TLS peer that closes without close_notify is an error to rustls; the answer is complete.
    let _ = tls.read_to_string(&mut text);
    let status = text.split(' ').nth(1).ok_or("no answer")?;
    let body = text.split_once("\r\n\r\n").ok_or("no body")?.1;
    Ok(format!("{status} {body}"))
}

/// The control center as CA, from the command line: `flatmesh ca init` and `ca token`, a
/// control center with `--ca-dir`/`--node-tokens`, and a node that gets the identity placed on
/// it over the TLS channel (`--xds-ca`, `--bootstrap-token`, `--identity`) and presents it on
/// its TLS listener. A node asking for an identity that is not placed on it does not start, and
/// says why.
#[test]
fn a_node_presents_the_identity_the_control_center_placed_on_it() {
    let dir = workdir_named("control-ca");
    let path = |name: &str| dir.join(name).display().to_string();
    run_ok(&[
        "ca",
        "init",
        "--trust-domain",
        "mesh.test",
        "--dir",
        &path("ca"),
    ]);
    let printed = run_ok(&["ca", "token", "--node", "r0-s0/nic0"]);
    let lines: Vec<&str> = printed.lines().filter(|l| !l.starts_with('#')).collect();
    let [token, entry] = lines.as_slice() else {
        panic!("`ca token` printed {printed}")
    };
    std::fs::write(dir.join("token"), token).unwrap();
    std::fs::write(dir.join("node-tokens.yaml"), format!("{entry}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(
        dir.join("node-tokens.yaml"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();

    let backend_listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let backend_addr = backend_listener.local_addr().unwrap();
    backend(backend_listener, "kvs");
    let addresses: String = NODES
        .iter()
        .map(|(id, ip)| format!("  {id}: {}.{}.{}.{}\n", ip[0], ip[1], ip[2], ip[3]))
        .collect();
    std::fs::write(dir.join("cluster.yaml"), CLUSTER).unwrap();
    std::fs::write(dir.join("app.yaml"), APP).unwrap();
    std::fs::write(
        dir.join("addresses.yaml"),
        format!("nodes:\n{addresses}services: {{ shop/kvs: 9100 }}\n"),
    )
    .unwrap();
    std::fs::write(
        dir.join("state.yaml"),
        "clusters: [ { name: shop/kvs, endpoints: [] } ]\n",
    )
    .unwrap();
    let xds = format!("127.0.0.1:{}", free_port());
    let control_log = dir.join("control.log");
    let _control = flatmesh(
        &[
            "control",
            "--listen",
            &xds,
            "--state",
            &path("state.yaml"),
            "--cluster",
            &path("cluster.yaml"),
            "--app",
            &path("app.yaml"),
            "--addresses",
            &path("addresses.yaml"),
            "--ca-dir",
            &path("ca"),
            "--node-tokens",
            &path("node-tokens.yaml"),
            "--cert-ttl",
            "1h",
        ],
        &control_log,
    );
    let web = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let ids = dir.join("ids");
    std::fs::write(
        dir.join("node.yaml"),
        format!(
            "admin: {{ address: 127.0.0.1:{admin} }}\nlisteners:\n  - name: web\n    address: {web}\n    protocol: http\n    tls: {{ cert: {ids}/ns.shop.sa.kvs.pem, key: {ids}/ns.shop.sa.kvs.key }}\n    routes: [ {{ cluster: local }} ]\nclusters:\n  - {{ name: local, endpoints: [ {backend_addr} ] }}\n",
            admin = free_port(),
            ids = ids.display()
        ),
    )
    .unwrap();
    let node_args = |identity: &str, ids: &str| -> Vec<String> {
        [
            "node",
            "--xds",
            &xds,
            "--node-id",
            "r0-s0/nic0",
            "--xds-ca",
            &path("ca/ca.pem"),
            "--bootstrap-token",
            &path("token"),
            "--identity",
            identity,
            "--identity-dir",
            ids,
            "--config",
            &path("node.yaml"),
        ]
        .map(String::from)
        .to_vec()
    };
    let node_log = dir.join("node.log");
    let args = node_args(
        "spiffe://mesh.test/ns/shop/sa/kvs",
        &ids.display().to_string(),
    );
    let _node = flatmesh(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &node_log,
    );
    let ca_pem = dir.join("ca/ca.pem");
    wait_for(
        "the node to serve TLS as spiffe://mesh.test/ns/shop/sa/kvs",
        &[&control_log, &node_log],
        || get_tls(web, &ca_pem, "spiffe://mesh.test/ns/shop/sa/kvs").is_ok_and(|a| a == "200 kvs"),
    );
    // The node presents that identity and no other: a client expecting another one refuses it.
    let refused = get_tls(web, &ca_pem, "spiffe://mesh.test/ns/shop/sa/other").unwrap_err();
    assert!(
        refused.contains("not") || refused.contains("certificate"),
        "{refused}"
    );

    // The same node asking for an identity placed nowhere near it gets nothing, and says why.
    let out = Command::new(env!("CARGO_BIN_EXE_flatmesh"))
        .args(node_args(
            "spiffe://mesh.test/ns/shop/sa/payments",
            &path("ids2"),
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is not an identity placed on node `r0-s0/nic0`"),
        "{stderr}"
    );
    assert!(!dir.join("ids2/ns.shop.sa.payments.key").exists());
}

/// `flatmesh ca revoke` and `flatmesh ca token --revoke` from the command line: the CRL lists
/// the certificate once however often it is revoked, bad serials are refused with the fix, and
/// the node's entry in the tokens file is marked revoked.
#[test]
fn certificates_and_node_tokens_are_revoked_from_the_command_line() {
    let dir = workdir_named("revoke");
    let path = |name: &str| dir.join(name).display().to_string();
    run_ok(&[
        "ca",
        "init",
        "--trust-domain",
        "mesh.test",
        "--dir",
        &path("ca"),
    ]);
    run_ok(&[
        "ca",
        "issue",
        "--dir",
        &path("ca"),
        "--id",
        "spiffe://mesh.test/ns/shop/sa/kvs",
        "--out",
        &path("kvs"),
    ]);
    let first = run_ok(&[
        "ca",
        "revoke",
        "--dir",
        &path("ca"),
        "--cert",
        &path("kvs.pem"),
    ]);
    assert!(first.contains("1 newly revoked, 1 listed"), "{first}");
    let again = run_ok(&[
        "ca",
        "revoke",
        "--dir",
        &path("ca"),
        "--cert",
        &path("kvs.pem"),
    ]);
    assert!(again.contains("0 newly revoked, 1 listed"), "{again}");
    let crls = flatmesh_identity::crl::load_crls(&dir.join("ca/crl.pem")).unwrap();
    assert_eq!(crls.len(), 1);
    let out = Command::new(env!("CARGO_BIN_EXE_flatmesh"))
        .args(["ca", "revoke", "--dir", &path("ca"), "--serial", "xyz"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("not a certificate serial number"),
        "{stderr}"
    );

    let printed = run_ok(&["ca", "token", "--node", "r0-s0/nic0"]);
    let entry = printed
        .lines()
        .filter(|l| !l.starts_with('#'))
        .nth(1)
        .unwrap();
    std::fs::write(dir.join("node-tokens.yaml"), format!("{entry}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(
        dir.join("node-tokens.yaml"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let revoked = run_ok(&[
        "ca",
        "token",
        "--revoke",
        "--node",
        "r0-s0/nic0",
        "--tokens",
        &path("node-tokens.yaml"),
    ]);
    assert!(
        revoked.contains("revoked the token of `r0-s0/nic0`"),
        "{revoked}"
    );
    let tokens =
        flatmesh_control::serve::ca::NodeTokens::load(&dir.join("node-tokens.yaml")).unwrap();
    assert_eq!(tokens.revoked_nodes().collect::<Vec<_>>(), ["r0-s0/nic0"]);
}
