//! Interop: a flatmesh node driven by go-control-plane (a real third-party xDS server, built from
//! tests/interop with `go build`). Routes, clusters and endpoints appear, change and disappear and
//! traffic follows; an unsupported resource is NACKed with the field named and the last good
//! config keeps serving; the control plane restarts and the node reconnects. Run for both the
//! state-of-the-world and the delta protocol.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;

use common::{free_port, get, go_test_server, wait_for, Backend};
use flatmesh_xds::client::{Client, Options, Protocol};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// The Go server as a child process: snapshots go in on stdin, request events come out.
struct GoServer {
    child: Child,
    stdin: ChildStdin,
    events: Arc<Mutex<Vec<Value>>>,
    addr: String,
}

impl GoServer {
    fn start(addr: &str, node: &str) -> GoServer {
        let mut child = Command::new(go_test_server())
            .args(["-addr", addr, "-node", node])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
        assert_eq!(first["event"], "listening", "{first}");
        let addr = first["addr"].as_str().unwrap().to_string();
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    sink.lock().push(v);
                }
            }
        });
        GoServer {
            child,
            stdin,
            events,
            addr,
        }
    }

    fn push(&mut self, snapshot: Value) {
        writeln!(self.stdin, "{snapshot}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Did the node send a request of `kind` (`CDS`...) with an error containing `text`?
    fn saw_nack(&self, kind: &str, text: &str) -> bool {
        self.events
            .lock()
            .iter()
            .any(|e| e["type"] == kind && e["error"].as_str().is_some_and(|m| m.contains(text)))
    }

    /// Did the node ACK `version` of `kind` (SotW: version_info echoes it)?
    fn saw_ack(&self, kind: &str, version: &str) -> bool {
        self.events.lock().iter().any(|e| {
            e["type"] == kind && e["version"] == version && e["error"] == "" && e["nonce"] != ""
        })
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for GoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

fn snapshot(version: &str, port: u16, routes: Value, clusters: Value, endpoints: Value) -> Value {
    json!({
        "version": version,
        "listeners": [ { "name": "web", "port": port, "rds": "web-routes" } ],
        "routes": [ { "name": "web-routes", "vhosts": [ { "name": "all", "domains": ["*"], "routes": routes } ] } ],
        "clusters": clusters,
        "endpoints": endpoints,
    })
}

fn body(addr: SocketAddr, path: &str) -> Option<String> {
    get(addr, "svc.local", path).map(|(status, body)| format!("{status} {body}"))
}

fn scenario(protocol: Protocol) {
    let a = Backend::start("A");
    let b = Backend::start("B");
    let c = Backend::start("C");
    let node_id = format!("node-{protocol:?}");
    let mut server = GoServer::start("127.0.0.1:0", &node_id);
    let port = free_port();
    let web: SocketAddr = ([127, 0, 0, 1], port).into();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut base = flatmesh_xds::bootstrap::empty_config();
    base.admin = "127.0.0.1:0".parse().unwrap();
    base.workers = Some(1);
    let (apply, node) = common::node_apply();
    let options = Options {
        server: server.addr.clone(),
        node_id: node_id.clone(),
        node_cluster: "test".into(),
        protocol,
        security: Default::default(),
        sds_dir: None,
        load_reports: None,
    };
    let client = rt.block_on(async { Client::spawn(options, base, apply) });

    // 1. Routes, clusters and endpoints appear.
    server.push(snapshot(
        "1",
        port,
        json!([ { "prefix": "/a", "cluster": "a" }, { "prefix": "/", "cluster": "b" } ]),
        json!([ { "name": "a" }, { "name": "b", "lb": "LEAST_REQUEST" } ]),
        json!([ { "cluster": "a", "addrs": [a.addr.to_string()] }, { "cluster": "b", "addrs": [b.addr.to_string()] } ]),
    ));
    wait_for("v1: /a -> A and / -> B", || {
        body(web, "/a/x").as_deref() == Some("200 A")
            && body(web, "/other").as_deref() == Some("200 B")
    });
    if protocol == Protocol::Sotw {
        wait_for("CDS v1 ACKed", || {
            server.saw_ack("CDS", "1") && server.saw_ack("LDS", "1")
        });
    }

    // 2. Endpoints change (EDS), a cluster and a route appear, a split and a direct response.
    server.push(snapshot(
        "2",
        port,
        json!([
            { "prefix": "/a", "cluster": "a" },
            { "prefix": "/c", "cluster": "c" },
            { "prefix": "/gone", "status": 410 },
            { "prefix": "/", "weighted": { "b": 1, "c": 1 } }
        ]),
        json!([ { "name": "a" }, { "name": "b" }, { "name": "c", "static": [c.addr.to_string()] } ]),
        json!([ { "cluster": "a", "addrs": [b.addr.to_string()] }, { "cluster": "b", "addrs": [b.addr.to_string()] } ]),
    ));
    wait_for("v2: /a now -> B, /c -> C, /gone -> 410", || {
        body(web, "/a").as_deref() == Some("200 B")
            && body(web, "/c").as_deref() == Some("200 C")
            && body(web, "/gone").map(|b| b.starts_with("410")) == Some(true)
    });
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        seen.insert(body(web, "/split").unwrap());
    }
    assert_eq!(
        seen,
        ["200 B", "200 C"].iter().map(|s| s.to_string()).collect(),
        "a 1:1 split sends to both"
    );

    // 3. An unsupported field is NACKed with its name; the last good config keeps serving.
    // (Each type is ACKed on its own, as in Envoy: only the refused CDS update is left out, so
    // the other types repeat v2 here.)
    let v2_routes = json!([
        { "prefix": "/a", "cluster": "a" },
        { "prefix": "/c", "cluster": "c" },
        { "prefix": "/gone", "status": 410 },
        { "prefix": "/", "weighted": { "b": 1, "c": 1 } }
    ]);
    let v2_endpoints = json!([ { "cluster": "a", "addrs": [b.addr.to_string()] }, { "cluster": "b", "addrs": [b.addr.to_string()] } ]);
    server.push(snapshot(
        "3",
        port,
        v2_routes.clone(),
        json!([ { "name": "a", "unsupported": true }, { "name": "b" }, { "name": "c", "static": [c.addr.to_string()] } ]),
        v2_endpoints.clone(),
    ));
    wait_for("CDS v3 NACKed naming upstream_connection_options", || {
        server.saw_nack("CDS", "upstream_connection_options")
    });
    let nack = client.status().nacks.join("\n");
    assert!(
        nack.contains("Cluster \"a\"") && nack.contains("upstream_connection_options"),
        "{nack}"
    );
    assert_eq!(
        body(web, "/c").as_deref(),
        Some("200 C"),
        "v2 still serves after the NACK"
    );
    assert_eq!(
        body(web, "/a").as_deref(),
        Some("200 B"),
        "v2 still serves after the NACK"
    );

    // An unsupported lb policy is NACKed too, naming lb_policy.
    server.push(snapshot(
        "4",
        port,
        v2_routes,
        json!([ { "name": "a", "lb": "CLUSTER_PROVIDED" }, { "name": "b" }, { "name": "c", "static": [c.addr.to_string()] } ]),
        v2_endpoints,
    ));
    wait_for("CDS v4 NACKed naming lb_policy", || {
        server.saw_nack("CDS", "lb_policy")
    });
    assert_eq!(
        body(web, "/c").as_deref(),
        Some("200 C"),
        "v2 still serves after the NACK"
    );

    // 4. Resources disappear: cluster c and its routes go; / goes to A only.
    server.push(snapshot(
        "5",
        port,
        json!([ { "prefix": "/", "cluster": "a" } ]),
        json!([ { "name": "a" } ]),
        json!([ { "cluster": "a", "addrs": [a.addr.to_string()] } ]),
    ));
    wait_for("v5: everything -> A", || {
        body(web, "/c").as_deref() == Some("200 A")
            && body(web, "/gone").as_deref() == Some("200 A")
    });

    // 5. The control plane goes away: the node keeps serving its last good config.
    let addr = server.addr.clone();
    server.kill();
    wait_for("client notices the outage", || !client.status().connected);
    for _ in 0..5 {
        assert_eq!(
            body(web, "/x").as_deref(),
            Some("200 A"),
            "served during the outage"
        );
    }

    // 6. It comes back on the same address with a new config; the node reconnects and follows.
    let mut server = GoServer::start(&addr, &node_id);
    server.push(snapshot(
        "6",
        port,
        json!([ { "prefix": "/", "cluster": "b" } ]),
        json!([ { "name": "b" } ]),
        json!([ { "cluster": "b", "addrs": [b.addr.to_string()] } ]),
    ));
    wait_for("v6 after the restart: / -> B", || {
        body(web, "/x").as_deref() == Some("200 B")
    });
    assert!(client.status().streams >= 2, "{:?}", client.status());

    // 7. The listener disappears: its port closes.
    server.push(
        json!({ "version": "7", "listeners": [], "routes": [], "clusters": [], "endpoints": [] }),
    );
    wait_for("v7: the listener is gone", || {
        get(web, "svc.local", "/").is_none()
    });

    rt.block_on(client.stop());
    let running = node.lock().take();
    if let Some(node) = running {
        node.shutdown();
    }
}

#[test]
fn go_control_plane_drives_the_node_sotw() {
    scenario(Protocol::Sotw);
}

#[test]
fn go_control_plane_drives_the_node_delta() {
    scenario(Protocol::Delta);
}
