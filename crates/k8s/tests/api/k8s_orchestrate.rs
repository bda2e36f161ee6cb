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

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use flatmesh_control::agent::unix_now_us;
use flatmesh_control::heartbeat::{Heartbeat, HeartbeatKey, NO_SAMPLE, SLOTS_PER_HEARTBEAT};
use flatmesh_control::orchestrator::LogEntry;
use flatmesh_control::serve::heartbeat_keys::HeartbeatKeys;
use flatmesh_k8s::schedule::{Options, Orchestrator, OrchestratorOptions, Scheduler};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, ListParams};
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

    // Two servers: a 2-core host with a LiquidIO of 12 wimpy cores (E3's Type1-SmartNIC),
    // and a 12-core host without one. Their agents send from loopback addresses of their own.
    let node_api: Api<Node> = Api::all(client.clone());
    for (name, pu, host, cpu, memory, ip) in [
        ("host-a", "host", None, "2", "64Gi", "127.0.0.1"),
        (
            "a-nic",
            "smartnic",
            Some("host-a"),
            "12",
            "4Gi",
            "127.0.0.2",
        ),
        ("host-b", "host", None, "12", "64Gi", "127.0.0.3"),
    ] {
        create(&node_api, node(name, pu, host, cpu, memory, ip)).await;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    create(&accounts, json!({ "metadata": { "name": "default" } })).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    // A gateway, Count and KVS (two shards each), no backups, at 200,000 requests/s: E3 fills
    // host-a with the gateway and Count and puts the KVS on its SmartNIC (`flatmesh place`
    // gives the same for this cluster as a file).
    let names = ["gw-0", "count-0", "count-1", "kvs-0", "kvs-1"];
    for (name, stage, microservice, calls) in [
        ("gw-0", "gw", "API gw", "count,kvs"),
        ("count-0", "count", "Count", "kvs"),
        ("count-1", "count", "Count", "kvs"),
        ("kvs-0", "kvs", "KVS", ""),
        ("kvs-1", "kvs", "KVS", ""),
    ] {
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

    let scheduler = Scheduler::spawn(
        client.clone(),
        Options {
            debounce: Duration::from_millis(300),
            resync: Duration::from_secs(1),
        },
    );
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
            socket,
            keys,
            // What `flatmesh control` runs.
            detector: flatmesh_k8s::schedule::orchestrate::detector(),
            observer: Some(log_tx),
        },
    )
    .unwrap();

    // Every pod bound, the KVS on the SmartNIC.
    let deadline = Instant::now() + Duration::from_secs(30);
    let bound: BTreeMap<String, Pod> = loop {
        let list = pods.list(&ListParams::default()).await.unwrap().items;
        if list.len() == names.len() && list.iter().all(|p| node_of(p).is_some()) {
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
    let on_nic: Vec<&String> = bound
        .keys()
        .filter(|name| placed[name] == "a-nic")
        .collect();
    assert_eq!(on_nic, ["kvs-0", "kvs-1"], "{placed:?}");
    let uid = |name: &str| bound[name].metadata.uid.clone();

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

    // The moved pod was re-created on host-a: a new pod of the same name; the others stay.
    let list = pods.list(&ListParams::default()).await.unwrap().items;
    let now: BTreeMap<String, &Pod> = list
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap(), p))
        .collect();
    let recreated: Vec<&String> = on_nic
        .iter()
        .copied()
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
    drop(scheduler);
}
