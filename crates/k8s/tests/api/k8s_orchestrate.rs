//! E3's orchestrator live on Kubernetes (issue 20, item 3), against a real API server: the
//! scheduler binds an app's pods, some to a SmartNIC; that SmartNIC's agent reports its slots'
//! execution times in sealed heartbeats, as `flatmesh control --kubeconfig --schedule
//! --heartbeats` receives them; when they jump, the orchestrator migrates the hottest pod to
//! the host, which on Kubernetes is its re-creation there. Heartbeats from another address
//! or with another node's key move nothing.
//!
//! There is no kubelet, so no agent measures a running pod: the test sends what one would.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::k8s_traffic::{self, netns};

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use flatmesh_control::agent::unix_now_us;
use flatmesh_control::heartbeat::{Heartbeat, HeartbeatKey, NO_SAMPLE, SLOTS_PER_HEARTBEAT};
use flatmesh_control::orchestrator::LogEntry;
use flatmesh_control::serve::heartbeat_keys::HeartbeatKeys;
use flatmesh_k8s::schedule::orchestrate::Beats;
use flatmesh_k8s::schedule::{Orchestrator, OrchestratorOptions, Scheduler};
use flatmesh_k8s::Controller;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use common::{api_server, create};

const NIC_KEY: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const HOST_KEY: &str = "2222222222222222222222222222222222222222222222222222222222222222";

/// A node at `ip`: its InternalIP is where its agent's heartbeats come from.
fn node(
    name: &str,
    pu: &str,
    host: Option<&str>,
    cpu: &str,
    memory: &str,
    ip: &str,
) -> serde_json::Value {
    let annotations = match host {
        Some(host) => json!({ "flatmesh.io/host": host }),
        None => json!({}),
    };
    json!({ "metadata": { "name": name, "labels": { "flatmesh.io/pu": pu }, "annotations": annotations },
            "status": { "allocatable": { "cpu": cpu, "memory": memory, "pods": "110" },
                        "capacity": { "cpu": cpu, "memory": memory, "pods": "110" },
                        "addresses": [ { "type": "InternalIP", "address": ip } ] } })
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

/// One agent: its node's number in the keys file, its key, and its sequence numbers.
struct Agent {
    socket: UdpSocket,
    to: SocketAddr,
    node: u32,
    key: HeartbeatKey,
    last_seq: u64,
}

impl Agent {
    fn new(from: Ipv4Addr, to: SocketAddr, node: u32, key: &str) -> Agent {
        Agent {
            socket: UdpSocket::bind((from, 0)).unwrap(),
            to,
            node,
            key: HeartbeatKey::from_hex(key).unwrap(),
            last_seq: 0,
        }
    }

    /// Reports `exec_us` for the node's first slots (at most four).
    fn beat(&mut self, exec_us: &[u16]) {
        let mut slots = [NO_SAMPLE; SLOTS_PER_HEARTBEAT];
        for (slot, us) in slots.iter_mut().zip(exec_us) {
            *slot = *us;
        }
        let beat = Heartbeat {
            node: self.node,
            queue_len: 0,
            bw_util_pct: 10,
            slot_base: 0,
            exec_us: slots,
        };
        self.last_seq = unix_now_us().max(self.last_seq + 1);
        self.socket
            .send_to(&beat.seal(self.last_seq, &self.key), self.to)
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_smartnic_sheds_its_hottest_pod_to_the_host_by_recreation() {
    let (_env, client) = api_server().await;

    create_shop(&client, ["127.0.0.1", "127.0.0.2", "127.0.0.3"]).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");

    let scheduler = Scheduler::spawn(client.clone(), common::fast_scheduler());
    // Node numbers are positions in the keys file, by name: a-nic is 0, host-a 1.
    let keys =
        HeartbeatKeys::parse(&format!("host-a: {HOST_KEY}\na-nic: {NIC_KEY}\n"), "test").unwrap();
    assert_eq!(keys.names().collect::<Vec<_>>(), ["a-nic", "host-a"]);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let at = socket.local_addr().unwrap();
    let (log_tx, mut log) = tokio::sync::mpsc::unbounded_channel();
    let _orchestrator = Orchestrator::spawn(
        client.clone(),
        scheduler.subscribe(),
        OrchestratorOptions {
            beats: Beats::Sealed { socket, keys },
            // What `flatmesh control` runs.
            detector: flatmesh_k8s::schedule::orchestrate::detector(),
            observer: Some(log_tx),
        },
    )
    .unwrap();

    // Every pod bound, the KVS on the SmartNIC.
    let (bound, on_nic) = bound_with_kvs_on_the_nic(&pods).await;

    // Forged heartbeats first: overload claimed with the host's key, and from the host's
    // address with the SmartNIC's key. Neither may move anything.
    let mut forged_key = Agent::new(Ipv4Addr::new(127, 0, 0, 2), at, 0, HOST_KEY);
    let mut wrong_address = Agent::new(Ipv4Addr::new(127, 0, 0, 1), at, 0, NIC_KEY);
    for k in 0..40 {
        let us = if k < 20 { 100 } else { 1000 };
        forged_key.beat(&[us; 4]);
        wrong_address.beat(&[us; 4]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    if let Ok(entry) = log.try_recv() {
        panic!("forged heartbeats moved the orchestrator: {entry:?}");
    }

    // The SmartNIC's agent: steady execution times, then a jump (E3: 20% above the average).
    let mut agent = Agent::new(Ipv4Addr::new(127, 0, 0, 2), at, 0, NIC_KEY);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut beats = 0u32;
    let (moved, to) = loop {
        let us = if beats < 20 { 100 } else { 400 };
        agent.beat(&vec![us; on_nic.len()]);
        beats += 1;
        if let Ok(LogEntry::Migrated { instance, to, .. }) = log.try_recv() {
            break (instance, to);
        }
        assert!(
            Instant::now() < deadline,
            "no migration within 30 s of heartbeats ({beats} sent)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // host-a has no room left for a KVS shard: the nearest host with room is host-b.
    assert_eq!(to, "rack0-s1/host", "{moved} moved to {to}, not host-b");

    one_kvs_recreated_on_host_b(&pods, &bound, &on_nic).await;
    drop(scheduler);
}

/// Two servers: a 2-core host with a LiquidIO of 12 wimpy cores (E3's Type1-SmartNIC), and a
/// 12-core host without one, with InternalIPs `ips` (host-a, a-nic, host-b). A gateway, Count
/// and KVS (two shards each), no backups, at 200,000 requests/s, in namespace `shop`: E3 fills
/// host-a with the gateway and Count and puts the KVS on its SmartNIC (`flatmesh place` gives
/// the same for this cluster as a file).
async fn create_shop(client: &kube::Client, ips: [&str; 3]) {
    let node_api: Api<Node> = Api::all(client.clone());
    for ((name, pu, host, cpu, memory), ip) in [
        ("host-a", "host", None, "2", "64Gi"),
        ("a-nic", "smartnic", Some("host-a"), "12", "4Gi"),
        ("host-b", "host", None, "12", "64Gi"),
    ]
    .into_iter()
    .zip(ips)
    {
        create(&node_api, node(name, pu, host, cpu, memory, ip)).await;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    create(&accounts, json!({ "metadata": { "name": "default" } })).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    for (name, stage, microservice, calls) in SHOP {
        let mut annotations = json!({
            "flatmesh.io/app": "shop", "flatmesh.io/stage": stage,
            "flatmesh.io/microservice": microservice, "flatmesh.io/calls": calls,
        });
        if stage == "gw" {
            annotations["flatmesh.io/rps"] = json!("200000");
            annotations["flatmesh.io/replicas"] = json!("0");
        }
        create(
            &pods,
            json!({ "metadata": { "name": name, "annotations": annotations },
                    "spec": { "schedulerName": "flatmesh",
                              "containers": [ { "name": "app", "image": "example.invalid/app" } ] } }),
        )
        .await;
    }
}

/// The shop's pods: name, stage, microservice, the stages it calls.
const SHOP: [(&str, &str, &str, &str); 5] = [
    ("gw-0", "gw", "API gw", "count,kvs"),
    ("count-0", "count", "Count", "kvs"),
    ("count-1", "count", "Count", "kvs"),
    ("kvs-0", "kvs", "KVS", ""),
    ("kvs-1", "kvs", "KVS", ""),
];

/// Waits until every pod of the shop is bound (30 s at most) and checks that the KVS shards
/// are on the SmartNIC: every pod by name, and the names of those on the SmartNIC.
async fn bound_with_kvs_on_the_nic(pods: &Api<Pod>) -> (BTreeMap<String, Pod>, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let bound: BTreeMap<String, Pod> = loop {
        let list = pods.list(&ListParams::default()).await.unwrap().items;
        if list.len() == SHOP.len() && list.iter().all(|p| node_of(p).is_some()) {
            break list
                .into_iter()
                .map(|p| (p.metadata.name.clone().unwrap(), p))
                .collect();
        }
        let nodes: Vec<_> = list
            .iter()
            .map(|p| (&p.metadata.name, node_of(p)))
            .collect();
        assert!(
            Instant::now() < deadline,
            "pods not bound within 30 s: {nodes:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let placed: BTreeMap<&String, String> = bound
        .iter()
        .map(|(name, p)| (name, node_of(p).unwrap()))
        .collect();
    let on_nic: Vec<String> = bound
        .keys()
        .filter(|name| placed[name] == "a-nic")
        .cloned()
        .collect();
    assert_eq!(on_nic, ["kvs-0", "kvs-1"], "{placed:?}");
    (bound, on_nic)
}

/// One pod of `on_nic` was re-created on host-b (host-a has no room left for a KVS shard):
/// a new pod of the same name there; every other pod is the one `bound` had.
async fn one_kvs_recreated_on_host_b(
    pods: &Api<Pod>,
    bound: &BTreeMap<String, Pod>,
    on_nic: &[String],
) {
    let uid = |name: &str| bound[name].metadata.uid.clone();
    let list = pods.list(&ListParams::default()).await.unwrap().items;
    let now: BTreeMap<String, &Pod> = list
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap(), p))
        .collect();
    let recreated: Vec<&String> = on_nic
        .iter()
        .filter(|name| now[name.as_str()].metadata.uid != uid(name))
        .collect();
    assert_eq!(recreated.len(), 1, "one pod moves: {now:?}");
    let name = recreated[0];
    assert_eq!(node_of(now[name.as_str()]).as_deref(), Some("host-b"));
    for other in bound.keys().filter(|n| *n != name) {
        assert_eq!(
            now[other.as_str()].metadata.uid,
            uid(other),
            "{other} was touched"
        );
    }
}

/// The same move, learnt from a real node proxy's load reports (`flatmesh control
/// --kubeconfig --schedule --load-reports 500ms`): the gateway's node proxy on host-a sends
/// requests to the KVS Service; its pods answer in 2 ms, then in 10 ms; the orchestrator,
/// reading the node's LRS reports, migrates one KVS pod to host-b by re-creation.
#[test]
fn a_slow_pod_seen_in_the_node_proxies_load_reports_is_moved() {
    assert!(
        k8s_traffic::nix_is_root(),
        "this test needs root (it makes a network namespace); run the tests as root"
    );
    let _turn = (!netns::inside()).then(common::Turn::take);
    netns::in_netns(
        "k8s_orchestrate::a_slow_pod_seen_in_the_node_proxies_load_reports_is_moved",
        Duration::from_secs(300),
        slow_pod_moved,
    );
}

async fn slow_pod_moved() {
    use k8s_traffic::{set_slice, Backend, Load, POD_PORT};
    const KVS_0: &str = "10.244.1.1";
    const KVS_1: &str = "10.244.1.2";
    const PERIOD: Duration = Duration::from_millis(500);
    k8s_traffic::cluster_network(&[KVS_0, KVS_1]);

    let (_env, client) = api_server().await;
    create_shop(&client, ["10.250.0.11", "10.250.0.12", "10.250.0.13"]).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    let scheduler = Scheduler::spawn(client.clone(), common::fast_scheduler());
    let (bound, on_nic) = bound_with_kvs_on_the_nic(&pods).await;
    // What the kubelet would do: the KVS pods run, at their IPs.
    let backends = [
        Backend::start(KVS_0, "kvs").await,
        Backend::start(KVS_1, "kvs").await,
    ];
    for (name, ip) in [("kvs-0", KVS_0), ("kvs-1", KVS_1)] {
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Running", "podIP": ip, "podIPs": [ { "ip": ip } ] } })),
        )
        .await
        .unwrap();
    }
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    let kvs = create(
        &services,
        json!({ "metadata": { "name": "kvs" },
                "spec": { "ports": [ { "name": "http", "port": 80, "targetPort": POD_PORT } ] } }),
    )
    .await;
    let kvs = SocketAddr::new(kvs.spec.unwrap().cluster_ip.unwrap().parse().unwrap(), 80);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
    set_slice(&slices, "kvs-1", "kvs", &[KVS_0, KVS_1]).await;

    // The control plane: the controller's xDS and LRS beside it, and the orchestrator on the
    // reports; then host-a's node proxy.
    let store = flatmesh_xds::server::Store::new();
    let _controller = Controller::spawn(client.clone(), store.clone(), Default::default());
    let (reports_tx, reports) = tokio::sync::mpsc::channel(64);
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(flatmesh_xds::server::serve_with(
        "127.0.0.1:0".parse().unwrap(),
        store,
        flatmesh_xds::server::ServeOptions {
            load_reports: Some(flatmesh_xds::lrs::LoadReportServer::new(PERIOD, reports_tx)),
            ..Default::default()
        },
        Some(bound_tx),
        async {
            let _ = stop_rx.await;
        },
    ));
    let (log_tx, mut log) = tokio::sync::mpsc::unbounded_channel();
    let _orchestrator = Orchestrator::spawn(
        client.clone(),
        scheduler.subscribe(),
        OrchestratorOptions {
            beats: Beats::LoadReports {
                reports,
                period: PERIOD,
            },
            detector: flatmesh_k8s::schedule::orchestrate::load_report_detector(PERIOD),
            observer: Some(log_tx),
        },
    )
    .unwrap();
    let (xds_client, node) = k8s_traffic::node_on_xds(bound_rx.await.unwrap(), "host-a");
    k8s_traffic::until_served(kvs, "/", "kvs", Duration::from_secs(20)).await;

    // Steady: 2 ms an answer, for long enough to learn it (5 periods) and more. Nothing moves.
    for b in &backends {
        b.set_delay(Duration::from_millis(2));
    }
    let (load, tasks) = Load::start(kvs, 4);
    tokio::time::sleep(PERIOD * 10).await;
    if let Ok(entry) = log.try_recv() {
        panic!("the orchestrator acted on steady load: {entry:?}");
    }
    // The KVS slows down to 10 ms an answer.
    for b in &backends {
        b.set_delay(Duration::from_millis(10));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let to = loop {
        match tokio::time::timeout(Duration::from_secs(1), log.recv()).await {
            Ok(Some(LogEntry::Migrated { to, .. })) => break to,
            Ok(Some(other)) => eprintln!("orchestrator: {other:?}"),
            Ok(None) => panic!("the orchestrator stopped"),
            Err(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "no migration within 30 s of the KVS slowing down"
        );
    };
    let (done, failures) = Load::finish(load, tasks).await;
    eprintln!(
        "{done} requests through host-a's node proxy, {} failed",
        failures.len()
    );
    assert_eq!(to, "rack0-s1/host", "a KVS pod moved to {to}, not host-b");
    one_kvs_recreated_on_host_b(&pods, &bound, &on_nic).await;

    xds_client.stop().await;
    if let Some(n) = node.lock().take() {
        std::thread::spawn(move || n.shutdown());
    }
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    drop(scheduler);
}
