#![allow(clippy::unwrap_used)]

use super::*;
use crate::routes::{MeshRoute, RouteKind};
use serde_json::json;

fn object<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Arc<T> {
    Arc::new(serde_json::from_value(value).unwrap())
}

fn service(ns: &str, name: &str, ip: &str, ports: serde_json::Value) -> Arc<Service> {
    object(json!({
        "metadata": { "name": name, "namespace": ns },
        "spec": { "clusterIP": ip, "ports": ports },
    }))
}

fn slice(
    ns: &str,
    service: &str,
    name: &str,
    ports: serde_json::Value,
    endpoints: serde_json::Value,
) -> Arc<EndpointSlice> {
    object(json!({
        "metadata": { "name": name, "namespace": ns, "labels": { SERVICE_NAME_LABEL: service } },
        "addressType": "IPv4", "ports": ports, "endpoints": endpoints,
    }))
}

fn pod(ns: &str, name: &str, node: &str, account: &str) -> Arc<Pod> {
    object(json!({
        "metadata": { "name": name, "namespace": ns },
        "spec": { "nodeName": node, "serviceAccountName": account, "containers": [ { "name": "c" } ] },
        "status": { "phase": "Running", "podIP": "10.1.0.9" },
    }))
}

fn http_route(ns: &str, name: &str, spec: serde_json::Value) -> MeshRoute {
    let o: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": { "name": name, "namespace": ns }, "spec": spec,
    }))
    .unwrap();
    MeshRoute::from_object(RouteKind::Http, &o).unwrap()
}

/// A shop: `web` (HTTP, two ready endpoints and one not ready), `db` (TCP), a headless
/// Service, and pods on two nodes.
fn shop() -> Objects {
    Objects {
        namespaces: vec![object(json!({ "metadata": { "name": "shop" } }))],
        services: vec![
            service(
                "shop",
                "web",
                "10.96.0.10",
                json!([ { "name": "http", "port": 80, "targetPort": 8080 } ]),
            ),
            service("shop", "db", "10.96.0.11", json!([ { "port": 5432 } ])),
            service("shop", "headless", "None", json!([ { "port": 1 } ])),
        ],
        slices: vec![
            slice(
                "shop",
                "web",
                "web-1",
                json!([ { "name": "http", "port": 8080 } ]),
                json!([
                    { "addresses": ["10.1.0.1"], "conditions": { "ready": true } },
                    { "addresses": ["10.1.0.2"] },
                    { "addresses": ["10.1.0.3"], "conditions": { "ready": false } },
                ]),
            ),
            slice(
                "shop",
                "db",
                "db-1",
                json!([ { "port": 5432 } ]),
                json!([ { "addresses": ["10.1.0.5"] } ]),
            ),
            // Another namespace's Service of the same name is not `shop/web`.
            slice(
                "other",
                "web",
                "web-x",
                json!([ { "name": "http", "port": 8080 } ]),
                json!([ { "addresses": ["10.9.9.9"] } ]),
            ),
        ],
        pods: vec![
            pod("shop", "web-a", "node-a", "web"),
            pod("shop", "db-b", "node-b", "db"),
            object(
                json!({ "metadata": { "name": "pending", "namespace": "shop" }, "spec": { "containers": [] } }),
            ),
        ],
        nodes: Vec::new(),
        routes: Vec::new(),
    }
}

/// A node of processing unit `pu`, on server `host` when it is a DPU, with its node-proxy
/// label.
fn node(name: &str, pu: &str, host: Option<&str>, proxy: Option<&str>) -> Arc<Node> {
    let mut labels = json!({ "flatmesh.io/pu": pu });
    if let Some(proxy) = proxy {
        labels["flatmesh.io/node-proxy"] = json!(proxy);
    }
    let annotations = host.map_or(json!({}), |h| json!({ "flatmesh.io/host": h }));
    object(json!({ "metadata": { "name": name, "labels": labels, "annotations": annotations } }))
}

#[test]
fn a_server_whose_proxy_runs_on_its_dpu_is_served_there() {
    let mut objects = shop();
    // node-a's proxy is offloaded to a-dpu; node-b has a DPU whose label says off.
    objects.nodes = vec![
        node("node-a", "host", None, Some("off")),
        node("a-dpu", "dpu", Some("node-a"), Some("on")),
        node("node-b", "host", None, Some("on")),
        node("b-dpu", "dpu", Some("node-b"), Some("off")),
    ];
    let t = translate(&objects, "td.example");
    assert_eq!(
        t.nodes.keys().collect::<Vec<_>>(),
        ["a-dpu", "node-b"],
        "node-a's snapshot goes to its DPU"
    );
    let dpu: Vec<_> = t.nodes["a-dpu"].identities.iter().cloned().collect();
    assert_eq!(dpu, ["spiffe://td.example/ns/shop/sa/web"]);
    assert!(!t.nodes["a-dpu"].config.listeners.is_empty());
    // Pods on a DPU whose label is off are the host's proxy's to serve.
    objects.pods.push(pod("shop", "cache", "b-dpu", "cache"));
    let t = translate(&objects, "td.example");
    let b: Vec<_> = t.nodes["node-b"].identities.iter().cloned().collect();
    assert_eq!(
        b,
        [
            "spiffe://td.example/ns/shop/sa/cache",
            "spiffe://td.example/ns/shop/sa/db"
        ]
    );
    assert!(!t.nodes.contains_key("b-dpu"));
    // Nodes the scheduler has not labelled keep their own proxies and snapshots.
    objects.nodes.truncate(0);
    let t = translate(&objects, "td.example");
    assert_eq!(
        t.nodes.keys().collect::<Vec<_>>(),
        ["b-dpu", "node-a", "node-b"]
    );
}

#[test]
fn services_become_clusters_endpoints_and_listeners_at_their_cluster_ip() {
    let t = translate(&shop(), "cluster.local");
    assert!(t.warnings.is_empty(), "{:?}", t.warnings);
    assert_eq!(
        t.nodes.keys().collect::<Vec<_>>(),
        ["node-a", "node-b"],
        "a pending pod has no node"
    );
    let config = &t.nodes["node-a"].config;
    let web = config.cluster("shop/web:80").unwrap();
    let endpoints: Vec<String> = web.endpoints.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        endpoints,
        ["10.1.0.1:8080", "10.1.0.2:8080"],
        "ready or unknown, by the slice port of the same name"
    );
    let listener = config
        .listeners
        .iter()
        .find(|l| l.name == "shop/web:80")
        .unwrap();
    assert_eq!(
        listener.address,
        "10.96.0.10:80".parse().unwrap(),
        "workloads dial the ClusterIP"
    );
    assert_eq!(
        listener.protocol,
        flatmesh_config::ListenerProtocol::Http,
        "a port named http speaks HTTP"
    );
    assert_eq!(listener.routes.len(), 1);
    assert_eq!(listener.routes[0].cluster.as_deref(), Some("shop/web:80"));
    let db = config
        .listeners
        .iter()
        .find(|l| l.name == "shop/db:5432")
        .unwrap();
    assert_eq!(db.protocol, flatmesh_config::ListenerProtocol::Tcp);
    assert_eq!(db.cluster.as_deref(), Some("shop/db:5432"));
    assert_eq!(
        config.listeners.len(),
        2,
        "a headless Service has no address to serve"
    );
    // What a node would be sent is valid xDS that a node accepts.
    let resources = flatmesh_xds::from_model::resources(config);
    assert_eq!(
        resources.endpoints["shop/web:80"].endpoints[0]
            .lb_endpoints
            .len(),
        2
    );
    assert!(resources.listeners.contains_key("shop/web:80"));
}

#[test]
fn a_node_holds_the_identities_of_its_own_pods_only() {
    let mut objects = shop();
    objects.pods.push(pod("shop", "web-b", "node-a", ""));
    let t = translate(&objects, "td.example");
    let a: Vec<_> = t.nodes["node-a"].identities.iter().cloned().collect();
    assert_eq!(
        a,
        [
            "spiffe://td.example/ns/shop/sa/default",
            "spiffe://td.example/ns/shop/sa/web"
        ]
    );
    let b: Vec<_> = t.nodes["node-b"].identities.iter().cloned().collect();
    assert_eq!(b, ["spiffe://td.example/ns/shop/sa/db"]);
}

#[test]
fn finished_pods_and_terminating_namespaces_are_left_out() {
    let mut objects = shop();
    objects.pods.push(object(json!({
        "metadata": { "name": "job", "namespace": "shop" },
        "spec": { "nodeName": "node-c", "containers": [] }, "status": { "phase": "Succeeded" },
    })));
    objects.namespaces = vec![object(
        json!({ "metadata": { "name": "shop" }, "status": { "phase": "Terminating" } }),
    )];
    let t = translate(&objects, "cluster.local");
    assert!(t.nodes.is_empty(), "{:?}", t.nodes.keys());
    objects.namespaces.clear();
    let t = translate(&objects, "cluster.local");
    assert!(
        !t.nodes.contains_key("node-c"),
        "a finished pod holds no identity"
    );
}

#[test]
fn an_http_route_of_a_service_decides_its_requests() {
    let mut objects = shop();
    objects.services.push(service(
        "shop",
        "web-v2",
        "10.96.0.12",
        json!([ { "name": "http", "port": 80 } ]),
    ));
    objects.routes.push(http_route("shop", "canary", json!({
        "parentRefs": [ { "group": "", "kind": "Service", "name": "web", "port": 80 } ],
        "rules": [
            { "backendRefs": [ { "name": "web", "port": 80, "weight": 90 }, { "name": "web-v2", "port": 80, "weight": 10 } ] },
            { "matches": [ { "path": { "type": "Exact", "value": "/v2" } } ],
              "backendRefs": [ { "name": "web-v2", "port": 80 } ] },
            { "matches": [ { "path": { "type": "PathPrefix", "value": "/gone" } } ],
              "backendRefs": [ { "name": "nowhere", "port": 80 } ] },
        ],
    })));
    let t = translate(&objects, "cluster.local");
    assert_eq!(t.warnings.len(), 1, "{:?}", t.warnings);
    assert!(
        t.warnings[0].contains("HTTPRoute shop/canary: backend nowhere:80"),
        "{}",
        t.warnings[0]
    );
    let config = &t.nodes["node-a"].config;
    let web = config
        .listeners
        .iter()
        .find(|l| l.name == "shop/web:80")
        .unwrap();
    // Exact path first, then the longest prefix; a route without matches is a prefix `/`.
    assert_eq!(web.routes.len(), 3, "{:#?}", web.routes);
    assert_eq!(
        web.routes[0].matches.path,
        Some(flatmesh_config::PathMatch::Exact("/v2".into()))
    );
    assert_eq!(web.routes[0].cluster.as_deref(), Some("shop/web-v2:80"));
    assert_eq!(
        web.routes[1].matches.path,
        Some(flatmesh_config::PathMatch::Prefix("/gone".into()))
    );
    assert_eq!(
        web.routes[1].direct_response.as_ref().unwrap().status,
        500,
        "no valid backend: 500"
    );
    let split = web.routes[2].split.as_ref().unwrap();
    assert_eq!(
        (split[0].cluster.as_str(), split[0].weight),
        ("shop/web:80", 90)
    );
    assert_eq!(
        (split[1].cluster.as_str(), split[1].weight),
        ("shop/web-v2:80", 10)
    );
    // The route's own Service keeps no catch-all of its own; others are untouched.
    let v2 = config
        .listeners
        .iter()
        .find(|l| l.name == "shop/web-v2:80")
        .unwrap();
    assert_eq!(v2.routes.len(), 1);
    flatmesh_xds::to_model::check(config).unwrap();
}

#[test]
fn a_route_on_a_tcp_port_makes_it_http_and_a_grpc_route_makes_its_cluster_http2() {
    let mut objects = shop();
    let o: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute",
        "metadata": { "name": "g", "namespace": "shop" },
        "spec": { "parentRefs": [ { "group": "", "kind": "Service", "name": "db" } ],
                  "rules": [ { "backendRefs": [ { "name": "db", "port": 5432 } ] } ] },
    }))
    .unwrap();
    objects
        .routes
        .push(MeshRoute::from_object(RouteKind::Grpc, &o).unwrap());
    let t = translate(&objects, "cluster.local");
    let config = &t.nodes["node-b"].config;
    let db = config
        .listeners
        .iter()
        .find(|l| l.name == "shop/db:5432")
        .unwrap();
    assert_eq!(db.protocol, flatmesh_config::ListenerProtocol::Http);
    assert_eq!(
        config.cluster("shop/db:5432").unwrap().protocol,
        flatmesh_config::UpstreamProtocol::Http2
    );
}

#[test]
fn a_route_for_another_port_or_parent_is_not_attached() {
    let mut objects = shop();
    objects.routes.push(http_route("shop", "p", json!({
        "parentRefs": [ { "group": "", "kind": "Service", "name": "web", "port": 81 },
                        { "kind": "Gateway", "name": "web" },
                        { "group": "", "kind": "Service", "name": "web", "namespace": "other" } ],
        "rules": [ { "backendRefs": [ { "name": "db", "port": 5432 } ] } ],
    })));
    let web = web_listener(&objects);
    assert_eq!(web.routes.len(), 1);
    assert_eq!(web.routes[0].cluster.as_deref(), Some("shop/web:80"));
}

#[test]
fn the_same_objects_give_the_same_snapshot_whatever_their_order() {
    let objects = shop();
    let mut reversed = objects.clone();
    reversed.services.reverse();
    reversed.slices.reverse();
    reversed.pods.reverse();
    assert_eq!(translate(&objects, "td"), translate(&reversed, "td"));
}

#[test]
fn a_route_naming_its_service_twice_is_attached_once() {
    let mut objects = shop();
    objects.routes.push(http_route(
        "shop",
        "twice",
        json!({
            "parentRefs": [ { "group": "", "kind": "Service", "name": "web" },
                            { "group": "", "kind": "Service", "name": "web", "port": 80 } ],
            "rules": [ { "backendRefs": [ { "name": "db", "port": 5432 } ] } ],
        }),
    ));
    let web = web_listener(&objects);
    assert_eq!(web.routes.len(), 1, "{:?}", web.routes);
    assert_eq!(web.routes[0].cluster.as_deref(), Some("shop/db:5432"));
}

/// The listener of shop/web:80 on node-a, translated from `objects`.
fn web_listener(objects: &Objects) -> flatmesh_config::Listener {
    translate(objects, "cluster.local").nodes["node-a"]
        .config
        .listeners
        .iter()
        .find(|l| l.name == "shop/web:80")
        .unwrap()
        .clone()
}
