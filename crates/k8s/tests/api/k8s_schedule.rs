//! E3 as a Kubernetes scheduler against a real API server (issue 20, items 3 and 4): Nodes
//! labelled with their processing unit and pods of `schedulerName: flatmesh` are created
//! through the API of a kube-apiserver started by `testenv`; the scheduler binds every pod,
//! and its bindings are what `flatmesh place` gives for the same cluster and app written by
//! hand (E3's Table 4 server types); a pod that cannot be placed stays pending with an event;
//! a migration re-creates a pod on its new node; each server's node proxy is where its pods ask
//! (the `flatmesh.io/node-proxy` labels), and moves back to the host when they stop asking or
//! go. There is no kubelet: bound pods never run.
//!
//! Missing testenv or a failed build fails the test: it never skips.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use flatmesh_control::model::{parse_app, parse_cluster};
use flatmesh_control::orchestrator::{Runtime as _, Step};
use flatmesh_control::placement::{place, Algorithm};
use flatmesh_control::topology::Topology;
use flatmesh_control::workload::Workload;
use flatmesh_k8s::schedule::proxy::ProxyPu;
use flatmesh_k8s::schedule::proxy_labels::FIELD_MANAGER;
use flatmesh_k8s::schedule::NODE_PROXY_LABEL;
use flatmesh_k8s::schedule::{Migrator, PodKey, Scheduler};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;

use common::{api_server, create};

/// The cluster as nodes: two servers of E3's Type1-SmartNIC (a 12-core host and a LiquidIO
/// with 12 wimpy cores and 4 GB; the first one's is a DPU), a Beefy in another rack, and a
/// node that is not the scheduler's.
fn nodes() -> Vec<serde_json::Value> {
    let node = |name: &str,
                labels: serde_json::Value,
                annotations: serde_json::Value,
                cpu: &str,
                memory: &str| {
        json!({ "metadata": { "name": name, "labels": labels, "annotations": annotations },
                "status": { "allocatable": { "cpu": cpu, "memory": memory, "pods": "110" },
                            "capacity": { "cpu": cpu, "memory": memory, "pods": "110" } } })
    };
    vec![
        node(
            "host-a",
            json!({ "flatmesh.io/pu": "host" }),
            json!({}),
            "12",
            "64Gi",
        ),
        node(
            "a-dpu",
            json!({ "flatmesh.io/pu": "dpu" }),
            json!({ "flatmesh.io/host": "host-a" }),
            "12",
            "4Gi",
        ),
        node(
            "host-b",
            json!({ "flatmesh.io/pu": "host" }),
            json!({}),
            "12",
            "64Gi",
        ),
        node(
            "b-nic",
            json!({ "flatmesh.io/pu": "smartnic" }),
            json!({ "flatmesh.io/host": "host-b" }),
            "12",
            "4Gi",
        ),
        node(
            "host-c",
            json!({ "flatmesh.io/pu": "host", "flatmesh.io/rack": "r1" }),
            json!({}),
            "12",
            "64Gi",
        ),
        node("plain", json!({}), json!({}), "4", "8Gi"),
    ]
}

/// The same cluster as `flatmesh place` reads it, by hand: racks in name order, servers by
/// host name, from Table 4's types.
const CLUSTER_YAML: &str = "
name: by-hand
racks:
  - name: r1
    servers: [{type: Beefy}]
  - name: rack0
    servers: [{type: Type1-SmartNIC, count: 2}]
";
/// E3 node id -> Kubernetes node, by the documented naming.
const NODE_NAMES: &[(&str, &str)] = &[
    ("r1-s0/host", "host-c"),
    ("rack0-s0/host", "host-a"),
    ("rack0-s0/nic0", "a-dpu"),
    ("rack0-s1/host", "host-b"),
    ("rack0-s1/nic0", "b-nic"),
];

/// The app: an API gateway calls Count and KVS, Count calls KVS; one backup per shard.
const APP_YAML: &str = "
name: shop/shop
rps: 2000
replicas: 1
stages:
  - {name: gw, microservice: API gw, shards: 1}
  - {name: count, microservice: Count, shards: 2, after: [gw]}
  - {name: kvs, microservice: KVS, shards: 2, after: [count, gw]}
";

/// The app as pods: (name, stage, microservice, calls). Pods of a stage in name order are
/// shard 0's primary, its backup, shard 1's primary, ...
const PODS: &[(&str, &str, &str, &str)] = &[
    ("gw-0", "gw", "API gw", "count,kvs"),
    ("gw-1", "gw", "API gw", "count,kvs"),
    ("count-0", "count", "Count", "kvs"),
    ("count-1", "count", "Count", "kvs"),
    ("count-2", "count", "Count", "kvs"),
    ("count-3", "count", "Count", "kvs"),
    ("kvs-0", "kvs", "KVS", ""),
    ("kvs-1", "kvs", "KVS", ""),
    ("kvs-2", "kvs", "KVS", ""),
    ("kvs-3", "kvs", "KVS", ""),
];

fn pod(name: &str, annotations: serde_json::Value) -> serde_json::Value {
    json!({ "metadata": { "name": name, "labels": { "app": "shop", "pod": name }, "annotations": annotations },
            "spec": { "schedulerName": "flatmesh",
                      "containers": [ { "name": "app", "image": "example.invalid/app" } ] } })
}

/// Instance -> (pod, node) as `flatmesh place --algo hcm` places the hand-written app.
fn flatmesh_place() -> BTreeMap<String, String> {
    let topo = Topology::build(&parse_cluster("cluster.yaml", CLUSTER_YAML).unwrap()).unwrap();
    let wl = Workload::from_apps(&[parse_app("app.yaml", APP_YAML).unwrap()]).unwrap();
    let placement = place(&topo, &wl, Algorithm::Hcm, 1).unwrap();
    let node_names: BTreeMap<&str, &str> = NODE_NAMES.iter().copied().collect();
    wl.instances
        .iter()
        .zip(&placement.assign)
        .map(|(inst, &n)| {
            // shop/shop/STAGE-SHARD[-r1] -> the pod of that stage at index 2 * SHARD + replica.
            let rest = inst.id.strip_prefix("shop/shop/").unwrap();
            let (stage, shard) = rest.split_once('-').unwrap();
            let (shard, replica) = match shard.split_once("-r") {
                Some((s, r)) => (s.parse::<usize>().unwrap(), r.parse::<usize>().unwrap()),
                None => (shard.parse::<usize>().unwrap(), 0),
            };
            let pod = format!("{stage}-{}", 2 * shard + replica);
            (pod, node_names[topo.nodes[n].id.as_str()].to_string())
        })
        .collect()
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref().and_then(|s| s.node_name.clone())
}

/// Until `ok` holds for the pods of the namespace (30 s at most); returns them by name.
async fn until_pods(
    api: &Api<Pod>,
    what: &str,
    ok: impl Fn(&BTreeMap<String, Pod>) -> bool,
) -> BTreeMap<String, Pod> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pods: BTreeMap<String, Pod> = api
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|p| (p.metadata.name.clone().unwrap(), p))
            .collect();
        if ok(&pods) {
            return pods;
        }
        let nodes: BTreeMap<&String, Option<String>> =
            pods.iter().map(|(n, p)| (n, node_of(p))).collect();
        assert!(
            Instant::now() < deadline,
            "{what}: not within 30 s; pods and their nodes: {nodes:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Node -> its `flatmesh.io/node-proxy` label.
async fn node_proxy_labels(api: &Api<Node>) -> BTreeMap<String, Option<String>> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| {
            let label = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(NODE_PROXY_LABEL))
                .cloned();
            (n.metadata.name.unwrap(), label)
        })
        .collect()
}

/// Until the controller serves server a's pods (all of their identities) to `proxy` and
/// nothing to `other` (10 s at most).
async fn until_served_by(controller: &flatmesh_k8s::Controller, proxy: &str, other: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = controller.translation();
        let served = t.nodes.get(proxy).map(|s| s.identities.len());
        if served.is_some_and(|n| n > 0) && !t.nodes.contains_key(other) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "server a's pods are not served by {proxy} alone: {:?}",
            t.nodes.keys().collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Until the nodes carry the `expected` node-proxy labels (30 s at most).
async fn until_labels(api: &Api<Node>, what: &str, expected: &[(&str, Option<&str>)]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = node_proxy_labels(api).await;
        if expected
            .iter()
            .all(|(node, label)| got.get(*node).map(Option::as_deref) == Some(*label))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 30 s; expected {expected:?}, the nodes' labels: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The live pods of the namespace on `nodes`, by name.
async fn pods_on(api: &Api<Pod>, nodes: &[&str]) -> Vec<String> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| node_of(p).is_some_and(|n| nodes.contains(&n.as_str())))
        .map(|p| p.metadata.name.unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_binds_what_flatmesh_place_gives_and_migrates_by_recreation() {
    let (_env, client) = api_server().await;

    let node_api: Api<Node> = Api::all(client.clone());
    for node in nodes() {
        let created: Node = create(&node_api, node).await;
        // No kubelet reports a status: the one given at creation must have been kept.
        assert!(
            created.status.and_then(|s| s.allocatable).is_some(),
            "the API server dropped the node's status"
        );
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    // No controller-manager creates a namespace's default ServiceAccount here.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    create(&accounts, json!({ "metadata": { "name": "default" } })).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    for (name, stage, microservice, calls) in PODS {
        let mut annotations = json!({
            "flatmesh.io/app": "shop", "flatmesh.io/stage": stage,
            "flatmesh.io/microservice": microservice, "flatmesh.io/calls": calls,
            "flatmesh.io/proxy-pu": "dpu",
        });
        if *stage == "gw" {
            annotations["flatmesh.io/rps"] = json!("2000");
            annotations["flatmesh.io/replicas"] = json!("1");
        }
        create(&pods, pod(name, annotations)).await;
    }
    // A pod no profile describes: it must stay pending, with an event that says why.
    create(
        &pods,
        pod(
            "broken-0",
            json!({ "flatmesh.io/app": "broken", "flatmesh.io/stage": "b",
                                "flatmesh.io/microservice": "Cuont", "flatmesh.io/rps": "10" }),
        ),
    )
    .await;
    // A pod of the default scheduler is none of ours.
    create(
        &pods,
        json!({ "metadata": { "name": "theirs" },
                "spec": { "containers": [ { "name": "app", "image": "example.invalid/app" } ] } }),
    )
    .await;

    let scheduler = Scheduler::spawn(client.clone(), common::fast_scheduler());
    // The control plane's controller beside it: it serves each server's pods to the node
    // that runs the server's proxy.
    let controller = flatmesh_k8s::Controller::spawn(
        client.clone(),
        flatmesh_xds::server::Store::new(),
        Default::default(),
    );
    let mut rounds = scheduler.subscribe();

    // Every pod of the app is bound, on the node `flatmesh place` gives.
    let bound = until_pods(&pods, "every pod of the shop bound", |p| {
        PODS.iter()
            .all(|(name, ..)| p.get(*name).and_then(node_of).is_some())
    })
    .await;
    let got: BTreeMap<String, String> = PODS
        .iter()
        .map(|(name, ..)| (name.to_string(), node_of(&bound[*name]).unwrap()))
        .collect();
    let expected = flatmesh_place();
    assert_eq!(
        got, expected,
        "the scheduler's bindings differ from flatmesh place"
    );
    // The binding went through the Binding API: the API server set PodScheduled.
    let scheduled = bound["gw-0"]
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .unwrap();
    assert!(
        scheduled
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.status == "True"),
        "{scheduled:?}"
    );
    // Some pods went to a SmartNIC/DPU, the gateway to a host (Table 1: it is no cheaper there).
    assert!(
        got.values().any(|n| n == "a-dpu" || n == "b-nic"),
        "{got:?}"
    );
    assert!(got["gw-0"].starts_with("host-"), "{got:?}");
    assert_eq!(node_of(&bound["broken-0"]), None);
    assert_eq!(node_of(&bound["theirs"]), None);

    // Bound pods are not bound again: a later round binds nothing and fails nothing, and the
    // broken pod is reported with what to do.
    let round = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            rounds.changed().await.unwrap();
            let round = rounds.borrow_and_update().clone().unwrap();
            let all_seen = PODS.iter().all(|(name, ..)| {
                round
                    .plan
                    .apps
                    .iter()
                    .any(|a| a.pods.values().any(|k| k.name == *name))
            });
            if all_seen && round.bound.is_empty() && round.plan.bindings.is_empty() {
                return round;
            }
        }
    })
    .await
    .expect("a round that binds nothing once every pod is bound");
    assert!(round.failed.is_empty(), "{:?}", round.failed);
    let (_, why) = round
        .plan
        .unplaced
        .iter()
        .find(|(k, _)| k.name == "broken-0")
        .unwrap();
    assert!(why.contains("did you mean \"Count\""), "{why}");
    assert!(round.plan.cluster.node_id("plain").is_none());
    let events: Api<Event> = Api::namespaced(client.clone(), "shop");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = events.list(&ListParams::default()).await.unwrap().items;
        let found = list.iter().find(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("broken-0")
                && e.reason.as_deref() == Some("FailedScheduling")
        });
        if let Some(e) = found {
            assert!(
                e.note.as_deref().unwrap_or_default().contains("Cuont"),
                "{e:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no FailedScheduling event for broken-0: {list:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // HeteroK8s-Mesh: the pods ask for the DPU; a server with one runs its node proxy there,
    // the Beefy (no DPU) on its host CPU.
    for choice in &round.plan.proxies {
        match choice.host.as_str() {
            "host-a" => assert_eq!(
                (choice.pu, choice.dpu.as_deref()),
                (ProxyPu::Dpu, Some("a-dpu")),
                "{choice:?}"
            ),
            "host-b" => assert_eq!(
                (choice.pu, choice.dpu.as_deref()),
                (ProxyPu::Dpu, Some("b-nic")),
                "{choice:?}"
            ),
            "host-c" => assert_eq!(choice.pu, ProxyPu::Host, "{choice:?}"),
            other => panic!("a proxy choice for {other}: {choice:?}"),
        }
    }
    // ... and the scheduler applies it: the DaemonSets follow the node's `flatmesh.io/node-proxy`
    // label, `on` where the server's proxy runs, `off` on its other nodes.
    assert!(
        got.values().any(|n| n == "host-a" || n == "a-dpu"),
        "server a runs no pod of the app: {got:?}"
    );
    let b_offloaded = got.values().any(|n| n == "host-b" || n == "b-nic");
    let (host_b, b_nic) = if b_offloaded {
        (Some("off"), Some("on"))
    } else {
        (Some("on"), Some("off"))
    };
    until_labels(
        &node_api,
        "the node proxies where the pods ask",
        &[
            ("host-a", Some("off")),
            ("a-dpu", Some("on")),
            ("host-b", host_b),
            ("b-nic", b_nic),
            ("host-c", Some("on")),
            ("plain", None),
        ],
    )
    .await;
    // Written by the scheduler's field manager, and not again once the nodes show it.
    let a_dpu = node_api.get("a-dpu").await.unwrap();
    let managers: Vec<&str> = a_dpu
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|f| f.manager.as_deref())
        .collect();
    assert!(managers.contains(&FIELD_MANAGER), "{managers:?}");
    let round = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            rounds.changed().await.unwrap();
            let round = rounds.borrow_and_update().clone().unwrap();
            if round.labelled.is_empty() {
                return round;
            }
        }
    })
    .await
    .expect("a round that labels nothing once the nodes are labelled");
    assert!(
        round.label_failures.is_empty(),
        "{:?}",
        round.label_failures
    );

    // A migration, as the orchestrator asks its runtime: count-0 restarts on another node.
    // Kubernetes cannot move a pod: it is deleted and re-created there.
    let before = bound["count-0"].clone();
    let from = node_of(&before).unwrap();
    let to = if from == "host-b" { "host-a" } else { "host-b" };
    let id = |node: &str| NODE_NAMES.iter().find(|(_, n)| *n == node).unwrap().0;
    let migrator = Migrator {
        client: client.clone(),
        pods: BTreeMap::from([("shop/shop/count-0".to_string(), PodKey::of(&before))]),
        nodes: NODE_NAMES
            .iter()
            .map(|(i, n)| (i.to_string(), n.to_string()))
            .collect(),
    };
    for step in [
        Step::PushBinary,
        Step::Remove,
        Step::Cleanup,
        Step::MigrateState,
        Step::Restart,
    ] {
        migrator
            .step(step, "shop/shop/count-0", id(&from), id(to))
            .await
            .unwrap();
    }
    let after = pods.get("count-0").await.unwrap();
    assert_eq!(node_of(&after).as_deref(), Some(to));
    assert_ne!(after.metadata.uid, before.metadata.uid, "not a new pod");
    assert_eq!(after.metadata.labels, before.metadata.labels);
    assert_eq!(after.metadata.annotations, before.metadata.annotations);
    let (mut a, mut b) = (after.spec.clone().unwrap(), before.spec.clone().unwrap());
    (a.node_name, b.node_name) = (None, None);
    assert_eq!(a, b, "the copy's spec differs beyond its node");
    // An unknown instance is a clear error, not a panic.
    let err = migrator
        .step(Step::Restart, "shop/shop/nope-0", id(&from), id(to))
        .await
        .unwrap_err();
    assert!(err.contains("not a pod this scheduler knows"), "{err}");

    // The scheduler leaves the re-created pod where it is.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        node_of(&pods.get("count-0").await.unwrap()).as_deref(),
        Some(to)
    );

    // The pods of server a stop asking for the DPU: its proxy moves back to the host.
    let on_a = pods_on(&pods, &["host-a", "a-dpu"]).await;
    assert!(!on_a.is_empty());
    let ask = |pu: &str| {
        Patch::Merge(json!({ "metadata": { "annotations": { "flatmesh.io/proxy-pu": pu } } }))
    };
    for name in &on_a {
        pods.patch(name, &PatchParams::default(), &ask("host"))
            .await
            .unwrap();
    }
    until_labels(
        &node_api,
        "server a's proxy back on its host once its pods ask for the host",
        &[("host-a", Some("on")), ("a-dpu", Some("off"))],
    )
    .await;
    until_served_by(&controller, "host-a", "a-dpu").await;
    // They ask for the DPU again: it moves there again.
    for name in &on_a {
        pods.patch(name, &PatchParams::default(), &ask("dpu"))
            .await
            .unwrap();
    }
    until_labels(
        &node_api,
        "server a's proxy on its DPU again",
        &[("host-a", Some("off")), ("a-dpu", Some("on"))],
    )
    .await;
    until_served_by(&controller, "a-dpu", "host-a").await;
    // The pods of server b go: no pod asks for its SmartNIC, the proxy returns to the host CPU.
    let on_b = pods_on(&pods, &["host-b", "b-nic"]).await;
    assert!(!on_b.is_empty(), "no pod on server b");
    until_labels(
        &node_api,
        "server b's proxy on its SmartNIC",
        &[("host-b", Some("off")), ("b-nic", Some("on"))],
    )
    .await;
    for name in &on_b {
        pods.delete(
            name,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    until_labels(
        &node_api,
        "server b's proxy back on its host once its pods are gone",
        &[
            ("host-b", Some("on")),
            ("b-nic", Some("off")),
            ("host-a", Some("off")),
            ("a-dpu", Some("on")),
            ("host-c", Some("on")),
            ("plain", None),
        ],
    )
    .await;
    drop(scheduler);
}
