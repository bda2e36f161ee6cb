//! The control plane against a real API server (issue 20, items 1 and 4): a kube-apiserver
//! and etcd started by `testenv` (../shared/k8s/testenv, or $FLATMESH_K8S_TESTENV), objects
//! created through the API, the controller and the xDS server of `flatmesh control
//! --kubeconfig` in this process, and xDS clients as nodes.
//!
//! Needs go, etcd (installed by testenv), openssl and kubectl; the first run builds
//! kube-apiserver (minutes). Missing testenv or a failed build fails the test: it never skips.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use flatmesh_config::Config;
use flatmesh_k8s::Controller;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::watch;

use common::{api_server, create};

/// The configs an xDS client hands its node, latest last.
struct Applied(watch::Sender<Option<Config>>);

impl flatmesh_xds::client::Apply for Applied {
    fn apply(&mut self, config: Config) -> Result<(), String> {
        self.0.send_replace(Some(config));
        Ok(())
    }
}

fn node(
    server: SocketAddr,
    id: &str,
) -> (
    flatmesh_xds::client::Client,
    watch::Receiver<Option<Config>>,
) {
    let (tx, rx) = watch::channel(None);
    let client = flatmesh_xds::client::Client::spawn(
        flatmesh_xds::client::Options {
            server: server.to_string(),
            node_id: id.into(),
            node_cluster: id.into(),
            protocol: flatmesh_xds::client::Protocol::Delta,
            security: Default::default(),
            sds_dir: None,
            load_reports: None,
        },
        flatmesh_xds::bootstrap::empty_config(),
        Applied(tx),
    );
    (client, rx)
}

/// Waits (up to `within`) for the node's config to satisfy `ok`; returns how long it took.
async fn until(
    rx: &mut watch::Receiver<Option<Config>>,
    within: Duration,
    what: &str,
    ok: impl Fn(&Config) -> bool,
) -> Duration {
    let start = Instant::now();
    let arrived = tokio::time::timeout(within, rx.wait_for(|c| c.as_ref().is_some_and(&ok)))
        .await
        .is_ok();
    let last = rx.borrow().clone();
    assert!(
        arrived,
        "{what}: not within {within:?}; the node's config: {last:#?}"
    );
    start.elapsed()
}

fn endpoints(config: &Config, cluster: &str) -> Vec<String> {
    config
        .cluster(cluster)
        .map(|c| c.endpoints.iter().map(|e| e.to_string()).collect())
        .unwrap_or_default()
}

/// The shop's part of a node's snapshot: its listeners and clusters, and the identities.
fn shop_of(
    snapshot: &flatmesh_k8s::NodeSnapshot,
) -> (
    Vec<flatmesh_config::Listener>,
    Vec<flatmesh_config::Cluster>,
    Vec<String>,
) {
    let config = &snapshot.config;
    (
        config
            .listeners
            .iter()
            .filter(|l| l.name.starts_with("shop/"))
            .cloned()
            .collect(),
        config
            .clusters
            .iter()
            .filter(|c| c.name.starts_with("shop/"))
            .cloned()
            .collect(),
        snapshot.identities.iter().cloned().collect(),
    )
}

fn slice(addresses: &[&str]) -> serde_json::Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": "web-1", "namespace": "shop",
                      "labels": { "kubernetes.io/service-name": "web" } },
        "addressType": "IPv4",
        "ports": [ { "name": "http", "port": 8080, "protocol": "TCP" } ],
        "endpoints": addresses.iter().map(|a| json!({ "addresses": [a], "conditions": { "ready": true } })).collect::<Vec<_>>(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_follow_the_api_server_and_keep_their_config_through_its_restart() {
    let (env, client) = api_server().await;

    // The cluster: a namespace, a Service with a mesh route, its endpoints, pods on two nodes.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    for account in ["web", "db"] {
        create(&accounts, json!({ "metadata": { "name": account } })).await;
    }
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    let mut cluster_ips = BTreeMap::new();
    for name in ["web", "web-v2"] {
        let s = create(
            &services,
            json!({ "metadata": { "name": name },
            "spec": { "ports": [ { "name": "http", "port": 80, "targetPort": 8080 } ] } }),
        )
        .await;
        cluster_ips.insert(name, s.spec.unwrap().cluster_ip.unwrap());
    }
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
    create(&slices, slice(&["10.1.0.1", "10.1.0.2"])).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    for (name, node, account) in [("web-a", "node-a", "web"), ("db-b", "node-b", "db")] {
        create(
            &pods,
            json!({ "metadata": { "name": name },
            "spec": { "nodeName": node, "serviceAccountName": account,
                      "containers": [ { "name": "app", "image": "example.invalid/app" } ] } }),
        )
        .await;
    }
    let routes: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "shop",
        &flatmesh_k8s::routes::http_route_resource(),
    );
    routes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                "metadata": { "name": "v2", "namespace": "shop" },
                "spec": {
                    "parentRefs": [ { "group": "", "kind": "Service", "name": "web", "port": 80 } ],
                    "rules": [
                        { "matches": [ { "path": { "type": "PathPrefix", "value": "/v2" } } ],
                          "backendRefs": [ { "name": "web-v2", "port": 80 } ] },
                        { "backendRefs": [ { "name": "web", "port": 80 } ] } ] },
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    // The control plane, as `flatmesh control --kubeconfig` runs it: the controller publishes
    // into the store the xDS server serves.
    let store = flatmesh_xds::server::Store::new();
    let controller = Controller::spawn(client.clone(), store.clone(), Default::default());
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(flatmesh_xds::server::serve(
        "127.0.0.1:0".parse().unwrap(),
        store,
        Some(bound_tx),
        async {
            let _ = stop_rx.await;
        },
    ));
    let xds = bound_rx.await.unwrap();
    let (node_a, mut a) = node(xds, "node-a");
    let (node_c, c) = node(xds, "node-c");

    // Node A sees the Service: its cluster, endpoints, VIP listener and the route.
    let web_vip: SocketAddr = format!("{}:80", cluster_ips["web"]).parse().unwrap();
    until(
        &mut a,
        Duration::from_secs(30),
        "node-a gets shop/web",
        |config| {
            endpoints(config, "shop/web:80") == ["10.1.0.1:8080", "10.1.0.2:8080"]
                && config
                    .listeners
                    .iter()
                    .any(|l| l.name == "shop/web:80" && l.address == web_vip)
        },
    )
    .await;
    let config = a.borrow().clone().unwrap();
    let listener = config
        .listeners
        .iter()
        .find(|l| l.name == "shop/web:80")
        .unwrap();
    assert_eq!(listener.routes.len(), 2, "{:#?}", listener.routes);
    assert_eq!(
        listener.routes[0].matches.path,
        Some(flatmesh_config::PathMatch::Prefix("/v2".into()))
    );
    assert_eq!(
        listener.routes[0].cluster.as_deref(),
        Some("shop/web-v2:80")
    );
    assert_eq!(listener.routes[1].cluster.as_deref(), Some("shop/web:80"));
    assert!(config.listeners.iter().any(|l| l.name == "shop/web-v2:80"
        && l.address == format!("{}:80", cluster_ips["web-v2"]).parse().unwrap()));

    // Each node holds its own pods' identities only; a node without pods is served nothing.
    // Node A's config can arrive before the controller has seen node B's pod, so wait (bounded)
    // until the translation covers both nodes before reading it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let translation = loop {
        let translation = controller.translation();
        if ["node-a", "node-b"].iter().all(|n| {
            translation
                .nodes
                .get(*n)
                .is_some_and(|node| !node.identities.is_empty())
        }) {
            break translation;
        }
        assert!(
            Instant::now() < deadline,
            "the controller's translation did not cover node-a and node-b within 10 s: {:?}",
            translation.nodes.keys().collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ids = |n: &str| {
        translation.nodes[n]
            .identities
            .iter()
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(ids("node-a"), ["spiffe://cluster.local/ns/shop/sa/web"]);
    assert_eq!(ids("node-b"), ["spiffe://cluster.local/ns/shop/sa/db"]);
    assert!(!translation.nodes.contains_key("node-c"));
    let status = node_c.status();
    assert!(status.connected, "node-c: {status:?}");
    assert!(
        c.borrow()
            .as_ref()
            .is_none_or(|c| c.listeners.is_empty() && c.clusters.is_empty()),
        "node-c runs no pod, so it gets nothing: {:#?}",
        c.borrow()
    );

    // An EndpointSlice change reaches the node within a second.
    let replace = |addresses: &'static [&'static str]| {
        let slices = slices.clone();
        async move {
            slices
                .patch(
                    "web-1",
                    &PatchParams::apply("flatmesh-test").force(),
                    &Patch::Apply(slice(addresses)),
                )
                .await
                .unwrap();
        }
    };
    replace(&["10.1.0.3"]).await;
    let took = until(
        &mut a,
        Duration::from_secs(5),
        "the moved endpoint",
        |config| endpoints(config, "shop/web:80") == ["10.1.0.3:8080"],
    )
    .await;
    assert!(
        took < Duration::from_secs(1),
        "an EndpointSlice change took {took:?} to reach the node"
    );

    // The API server goes away: nodes keep their config, nothing empty is published.
    let before = controller.translation();
    let argv = tokio::task::block_in_place(|| env.stop_apiserver());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        endpoints(a.borrow().as_ref().unwrap(), "shop/web:80"),
        ["10.1.0.3:8080"]
    );
    assert!(
        node_a.status().connected,
        "the xDS server serves on while the API server is away"
    );
    // (A stopping kube-apiserver takes itself out of `default/kubernetes` first: that is a
    // real change. The shop's objects did not change.)
    let after = controller.translation();
    for node in ["node-a", "node-b"] {
        assert_eq!(
            shop_of(&after.nodes[node]),
            shop_of(&before.nodes[node]),
            "{node}: the last snapshot stays published"
        );
    }
    let served = a.borrow().clone().unwrap();
    assert!(
        served.listeners.iter().any(|l| l.name == "shop/web:80"),
        "node-a keeps its listeners"
    );

    // It comes back on the same etcd data; later changes arrive again.
    env.start_apiserver(&argv);
    let deadline = Instant::now() + Duration::from_secs(60);
    while client.apiserver_version().await.is_err() {
        assert!(
            Instant::now() < deadline,
            "kube-apiserver did not come back; see {}/apiserver.log",
            env.dir.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let back = Instant::now();
    replace(&["10.1.0.4", "10.1.0.5"]).await;
    until(
        &mut a,
        Duration::from_secs(10),
        "a change after the restart",
        |config| endpoints(config, "shop/web:80") == ["10.1.0.4:8080", "10.1.0.5:8080"],
    )
    .await;
    eprintln!(
        "after the restart, a change reached the node {:?} after the API server was back",
        back.elapsed()
    );
    // And once the watches are back, within a second again.
    replace(&["10.1.0.6"]).await;
    let took = until(
        &mut a,
        Duration::from_secs(5),
        "a second change after the restart",
        |config| endpoints(config, "shop/web:80") == ["10.1.0.6:8080"],
    )
    .await;
    assert!(
        took < Duration::from_secs(1),
        "after the restart a change took {took:?}"
    );

    // A pod deleted: its node loses the mesh, the other keeps it.
    // (No kubelet confirms a graceful deletion, so it is immediate.)
    pods.delete("web-a", &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let mut b_translation = controller.subscribe();
    tokio::time::timeout(
        Duration::from_secs(5),
        b_translation
            .wait_for(|t| !t.nodes.contains_key("node-a") && t.nodes.contains_key("node-b")),
    )
    .await
    .expect("node-a leaves the published nodes when its last pod is deleted")
    .unwrap();
    until(
        &mut a,
        Duration::from_secs(5),
        "node-a without pods",
        |config| config.listeners.is_empty(),
    )
    .await;

    node_a.stop().await;
    node_c.stop().await;
    drop(controller);
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    drop(env);
}
