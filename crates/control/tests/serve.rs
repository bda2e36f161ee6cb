//! The control center of `flatmesh control`, in-process: HCM places an app on hosts and
//! SmartNICs, the xDS server serves the placed endpoints, a real xDS client (the one
//! `flatmesh node --xds` runs) receives them, heartbeats that show the SmartNIC overloaded make
//! the orchestrator migrate the instance (the step program sees the five cold-migration steps)
//! and the client receives the new endpoint; edits of the state file are served, a broken edit
//! is refused; shutdown ends the server. (The command line itself is tested in
//! crates/flatmesh/tests/xds_control.rs, with a real node and traffic.)
#![allow(clippy::unwrap_used)]

mod common;
use common::{console_state, Scratch, ADDRESSES, APP, CLUSTER};

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flatmesh_config::Config;
use flatmesh_control::agent::GateCounts;
use flatmesh_control::heartbeat::{Heartbeat, HeartbeatKey, KEY_LEN, NO_SAMPLE};
use flatmesh_control::placement::Algorithm;
use flatmesh_control::serve::{ControlCenter, Options, OrchestratorOptions, PlacementOptions};
use flatmesh_xds::client::{Apply, Client, Protocol};
use parking_lot::Mutex;

fn state(listener: &str) -> String {
    format!("listeners:\n  - name: {listener}\n    address: 127.0.0.1:8080\n    protocol: http\n    routes: [ {{ match: {{ path: {{ prefix: /kvs/ }} }}, cluster: shop/kvs }} ]\nclusters:\n  - {{ name: shop/kvs, lb: least_request, endpoints: [] }}\n")
}

/// Node `i`'s heartbeat key.
fn key(node: u32) -> HeartbeatKey {
    HeartbeatKey::from_bytes([node as u8 + 1; KEY_LEN])
}

fn keys_file(dir: &Scratch) -> PathBuf {
    let text: String = ["r0-s0/host", "r0-s0/nic0", "r0-s1/host", "r0-s1/nic0"]
        .iter()
        .enumerate()
        .map(|(i, id)| format!("{id}: {}\n", key(i as u32).to_hex()))
        .collect();
    let path = dir.write("heartbeat-keys.yaml", &text);
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn options(dir: &Scratch, addresses: &str, step_command: Option<PathBuf>) -> Options {
    Options {
        listen: "127.0.0.1:0".parse().unwrap(),
        ca: None,
        metrics: None,
        ui: None,
        state: Some(dir.write("state.yaml", &state("web"))),
        placement: Some(PlacementOptions {
            cluster: dir.write("cluster.yaml", CLUSTER).display().to_string(),
            apps: vec![dir.write("app.yaml", APP).display().to_string()],
            algorithm: Algorithm::Hcm,
            seed: 1,
            addresses: dir.write("addresses.yaml", addresses),
            orchestrator: Some(OrchestratorOptions {
                heartbeats: "127.0.0.1:0".parse().unwrap(),
                heartbeat_keys: keys_file(dir),
                step_command,
            }),
        }),
    }
}

/// The client's node: records every config it is given.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Config>>>);

impl Apply for Recorder {
    fn apply(&mut self, config: Config) -> Result<(), String> {
        self.0.lock().push(config);
        Ok(())
    }
}

impl Recorder {
    fn last(&self) -> Option<Config> {
        self.0.lock().last().cloned()
    }
}

fn endpoints(config: &Config) -> Vec<SocketAddr> {
    config
        .cluster("shop/kvs")
        .map(|c| c.endpoints.to_vec())
        .unwrap_or_default()
}

fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out after 20 s waiting for: {what}");
}

fn report(node: u32, exec_us: u16) -> Heartbeat {
    Heartbeat {
        node,
        queue_len: 0,
        bw_util_pct: 10,
        slot_base: 0,
        exec_us: [exec_us, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE],
    }
}

/// A strictly increasing sequence number near this clock, as an agent's.
fn seq() -> u64 {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = flatmesh_control::agent::unix_now_us();
    let prev = LAST.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
    if prev >= now {
        LAST.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    } else {
        now
    }
}

/// Sends node `node`'s heartbeat, sealed with its key; returns the datagram.
fn beat(socket: &UdpSocket, to: SocketAddr, node: u32, exec_us: u16) -> Vec<u8> {
    let wire = report(node, exec_us).seal(seq(), &key(node)).to_vec();
    socket.send_to(&wire, to).unwrap();
    wire
}

#[test]
fn control_center_serves_the_placement_and_the_orchestrator_moves_it() {
    let dir = Scratch::new("serve");
    let steps = dir.0.join("steps.log");
    let step_command = dir.write(
        "step.sh",
        &format!("#!/bin/sh\necho \"$@\" >> {}\n", steps.display()),
    );
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&step_command, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut options = options(&dir, ADDRESSES, Some(step_command));
    options.ui = Some("127.0.0.1:0".parse().unwrap());

    let center = ControlCenter::new(&options).unwrap();
    let ui = center.ui_addr().unwrap();
    let feed = center.feed().clone();
    let heartbeats = center.heartbeats_addr().unwrap();
    let center_stats = center.heartbeat_stats().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let served = rt.spawn(center.run(
        async {
            let _ = stop_rx.await;
        },
        Some(bound_tx),
    ));
    let xds = rt.block_on(bound_rx).unwrap();

    // A node's xDS client receives HCM's placement: the KVS on the first SmartNIC.
    let node = Recorder::default();
    let client = rt.block_on(async {
        Client::spawn(
            flatmesh_xds::client::Options {
                server: xds.to_string(),
                node_id: "node-1".into(),
                node_cluster: "node-1".into(),
                protocol: Protocol::Sotw,
                security: Default::default(),
                sds_dir: None,
                load_reports: None,
            },
            flatmesh_xds::bootstrap::empty_config(),
            node.clone(),
        )
    });
    let nic0: SocketAddr = "127.0.0.2:9100".parse().unwrap();
    wait_for("the client has the placed endpoint on r0-s0/nic0", || {
        node.last().is_some_and(|c| endpoints(&c) == [nic0])
    });
    assert_eq!(endpoints(&feed.served()), [nic0]);
    let lb = node.last().unwrap().cluster("shop/kvs").unwrap().lb;
    assert_eq!(
        lb,
        flatmesh_config::LbPolicy::LeastRequest,
        "the state file's cluster settings stay"
    );

    // Regression (issue 23, item 10): anyone who could send a datagram could make the
    // orchestrator migrate. The same overload story, told by an attacker, moves nothing: in the
    // old unauthenticated format, sealed with another node's key, and sealed right but sent
    // from another address than the SmartNIC's (127.0.0.2).
    let nic_addr = UdpSocket::bind("127.0.0.2:0").unwrap();
    let elsewhere = UdpSocket::bind("127.0.0.9:0").unwrap();
    for exec_us in [100, 100, 100, 100, 100, 100, 200] {
        let hb = report(1, exec_us);
        nic_addr.send_to(&hb.encode(), heartbeats).unwrap();
        nic_addr
            .send_to(&hb.seal(seq(), &key(3)), heartbeats)
            .unwrap();
        beat(&elsewhere, heartbeats, 1, exec_us);
        std::thread::sleep(Duration::from_millis(20));
    }
    let stats = center_stats.clone();
    wait_for("the forged heartbeats are counted", || {
        stats.read().refused() == 21
    });
    assert_eq!(
        stats.read(),
        GateCounts {
            length: 7,
            bad_tag: 7,
            wrong_source: 7,
            ..GateCounts::default()
        }
    );
    std::thread::sleep(Duration::from_millis(200));
    assert!(!steps.exists(), "no migration step ran");
    assert_eq!(endpoints(&node.last().unwrap()), [nic0], "nothing moved");

    // The SmartNIC itself reports a slot 2x slower than its average: overload. The orchestrator
    // runs the five cold-migration steps and the endpoint moves to the server's host.
    for _ in 0..6 {
        beat(&nic_addr, heartbeats, 1, 100);
        std::thread::sleep(Duration::from_millis(20));
    }
    let overload = beat(&nic_addr, heartbeats, 1, 200);
    let host: SocketAddr = "127.0.0.1:9100".parse().unwrap();
    wait_for("the client has the migrated endpoint on r0-s0/host", || {
        node.last().is_some_and(|c| endpoints(&c) == [host])
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
        log.lines().collect::<Vec<_>>(),
        expected,
        "the steps, in order"
    );
    // The web console shows the move: the placement, the migration on the timeline, the
    // SmartNIC alive (its heartbeats), the other nodes down (none sent one).
    wait_for("the console shows the migration", || {
        console_state(ui)["timeline"]
            .as_array()
            .is_some_and(|t| t.iter().any(|e| e["kind"] == "migrated"))
    });
    let shown = console_state(ui);
    let placed = shown["placement"].as_array().unwrap();
    assert!(
        placed.iter().any(|p| p["instance"] == "shop/kvs-0"
            && p["node"] == "r0-s0/host"
            && p["kind"] == "host"),
        "{placed:?}"
    );
    let migrated = shown["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "migrated")
        .unwrap();
    assert_eq!(migrated["from"], "r0-s0/nic0");
    assert_eq!(migrated["to"], "r0-s0/host");
    let nodes = shown["nodes"].as_array().unwrap();
    let nic = nodes.iter().find(|n| n["id"] == "r0-s0/nic0").unwrap();
    assert_eq!(nic["kind"], "smartnic");
    assert_eq!(nic["up"], true, "{nic}");
    assert!(nodes.iter().any(|n| n["up"] == false), "{nodes:?}");
    assert!(shown["services"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["name"] == "shop/kvs"));

    // Played back, the overload heartbeat is refused as a replay.
    nic_addr.send_to(&overload, heartbeats).unwrap();
    wait_for("the replay is counted", || stats.read().replayed == 1);
    assert_eq!(stats.read().accepted, 7);

    // A new state file is served with the placement kept; a broken one is refused.
    std::thread::sleep(Duration::from_millis(20)); // a new modification time
    dir.write("state.yaml", &state("web2"));
    wait_for("the client has the edited state file", || {
        node.last().is_some_and(|c| {
            c.listeners.iter().any(|l| l.name == "web2") && endpoints(&c) == [host]
        })
    });
    let configs = node.0.lock().len();
    dir.write("state.yaml", "listeners: [ {");
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(node.0.lock().len(), configs, "nothing new was pushed");
    assert!(feed.served().listeners.iter().any(|l| l.name == "web2"));

    drop(client);
    stop_tx.send(()).unwrap();
    let result = rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), served).await });
    result.unwrap().unwrap().unwrap();
}

#[test]
fn bad_inputs_fail_before_anything_serves_and_say_what_is_wrong() {
    let dir = Scratch::new("bad");
    let incomplete = ADDRESSES.replace(", r0-s1/nic0: 127.0.0.4", "");
    let e = ControlCenter::new(&options(&dir, &incomplete, None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("addresses.yaml: node `r0-s1/nic0` has no address"),
        "{e}"
    );

    // The heartbeat address is taken.
    let taken = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut opts = options(&dir, ADDRESSES, None);
    if let Some(p) = opts.placement.as_mut() {
        p.orchestrator = Some(OrchestratorOptions {
            heartbeats: taken.local_addr().unwrap(),
            heartbeat_keys: keys_file(&dir),
            step_command: None,
        });
    }
    let e = ControlCenter::new(&opts).err().unwrap().to_string();
    assert!(e.contains("pick a free address with --heartbeats"), "{e}");

    // A heartbeat keys file that others may read, or that leaves a node out.
    let opts = options(&dir, ADDRESSES, None);
    let keys = keys_file(&dir);
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o640)).unwrap();
    let e = ControlCenter::new(&opts).err().unwrap().to_string();
    assert!(e.contains("chmod 600"), "{e}");
    let text = std::fs::read_to_string(&keys).unwrap();
    std::fs::write(&keys, text.lines().take(3).collect::<Vec<_>>().join("\n")).unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let e = ControlCenter::new(&opts).err().unwrap().to_string();
    assert!(e.contains("node `r0-s1/nic0` has no key"), "{e}");

    // A state file that is no config, and one that is missing.
    let mut opts = options(&dir, ADDRESSES, None);
    opts.state = Some(dir.write("broken.yaml", "listeners: [ {"));
    let e = ControlCenter::new(&opts).err().unwrap().to_string();
    assert!(e.contains("broken.yaml"), "{e}");
    opts.state = Some(Path::new("/nonexistent/state.yaml").to_path_buf());
    let e = ControlCenter::new(&opts).err().unwrap().to_string();
    assert!(e.contains("/nonexistent/state.yaml"), "{e}");
}
