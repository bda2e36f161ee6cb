//! Kubernetes objects in, each node's snapshot out. Pure: the same objects always give the same
//! snapshots, so the controller can recompute everything on any change and the xDS server's
//! content-hashed versions make an unchanged node's push a no-op.
//!
//! The mapping (docs/kubernetes.md):
//! - every port of a Service with a ClusterIP is a cluster `NS/NAME:PORT` (an EDS cluster on
//!   the wire) whose endpoints are the ready addresses of the Service's EndpointSlices, at the
//!   slice port of the same name;
//! - and a listener of the same name at `CLUSTER_IP:PORT`, the address workloads dial: `tcp`
//!   to the cluster, or `http` when the port speaks HTTP (its `appProtocol` or name) or a mesh
//!   route is attached; an `http` listener's routes are the attached HTTPRoutes' and
//!   GRPCRoutes' rules, or, with none, one route to its own cluster;
//! - a node (a `spec.nodeName` of a live pod) gets every Service (there is no per-workload
//!   scope yet), and the identities `spiffe://TD/ns/NS/sa/SA` of its own pods only;
//! - except where the scheduler says which node runs a server's node proxy (the
//!   `flatmesh.io/node-proxy` labels on a host and on the DPU nodes that name it in
//!   `flatmesh.io/host`): one proxy serves the whole server, so that node is given the
//!   identities of every pod of the server, and the server's other nodes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use flatmesh_config::Config;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service, ServicePort};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};

use crate::routes::{MeshRoute, PathMatch, RouteKind, Rule, ValueMatch};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Everything the translation reads, as the watchers hold it.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    pub namespaces: Vec<Arc<Namespace>>,
    pub services: Vec<Arc<Service>>,
    pub slices: Vec<Arc<EndpointSlice>>,
    pub pods: Vec<Arc<Pod>>,
    pub nodes: Vec<Arc<Node>>,
    pub routes: Vec<MeshRoute>,
}

/// What one node is given.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSnapshot {
    /// Its listeners (one per Service port, at the ClusterIP), routes, clusters and endpoints:
    /// today the same for every node, shared.
    pub config: std::sync::Arc<Config>,
    /// The SPIFFE IDs of the pods scheduled on it.
    pub identities: BTreeSet<String>,
}

/// Every node's snapshot, and what was left out and why.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Translation {
    pub nodes: BTreeMap<String, NodeSnapshot>,
    /// One line per object or reference that could not be mapped (logged by the controller).
    pub warnings: Vec<String>,
}

/// The name of a Service port's cluster and listener.
pub fn service_port_name(namespace: &str, name: &str, port: u16) -> String {
    format!("{namespace}/{name}:{port}")
}

/// A pod's SPIFFE ID under `trust_domain`, Istio's form.
pub fn pod_identity(trust_domain: &str, pod: &Pod) -> String {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let account = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .filter(|a| !a.is_empty())
        .unwrap_or("default");
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{account}")
}

/// The snapshots of every node that runs a pod.
pub fn translate(objects: &Objects, trust_domain: &str) -> Translation {
    let mut warnings = Vec::new();
    let terminating: BTreeSet<&str> = objects
        .namespaces
        .iter()
        .filter(|n| n.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Terminating"))
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    let live = |namespace: Option<&str>| !terminating.contains(namespace.unwrap_or("default"));

    let ports = service_ports(objects, &live);
    let known: BTreeSet<String> = ports.iter().map(|p| p.name.clone()).collect();
    let slices = slices_by_service(objects);
    let parents = routes_by_parent(objects);
    let mut clusters = Vec::new();
    let mut listeners = Vec::new();
    for port in &ports {
        let routes = attached_routes(&parents, port);
        let grpc = port.grpc || routes.iter().any(|r| r.kind == RouteKind::Grpc);
        let owned = slices
            .get(&(port.namespace.as_str(), port.service.as_str()))
            .map_or(&[][..], Vec::as_slice);
        let endpoints: Vec<String> = endpoints_of(owned, port)
            .into_iter()
            .map(|a| a.to_string())
            .collect();
        clusters.push(json!({
            "name": port.name,
            "endpoints": endpoints,
            "protocol": if grpc { "http2" } else { "http1" },
            "circuit_breaker": translated_breaker(),
        }));
        let address = SocketAddr::new(port.cluster_ip, port.port).to_string();
        if routes.is_empty() && !port.http && !grpc {
            listeners.push(json!({
                "name": port.name, "address": address, "protocol": "tcp", "cluster": port.name,
            }));
            continue;
        }
        let mut served = Vec::new();
        for route in &routes {
            for rule in &route.rules {
                served.extend(rule_routes(route, rule, &known, &mut warnings));
            }
        }
        order_by_precedence(&mut served);
        let mut served: Vec<Value> = served.into_iter().map(|(_, r)| r).collect();
        if routes.is_empty() {
            served.push(json!({ "cluster": port.name }));
        }
        for route in &mut served {
            if route.get("direct_response").is_none() {
                route["retries"] = default_retries();
            }
        }
        listeners.push(json!({
            "name": port.name, "address": address, "protocol": "http", "routes": served,
        }));
    }
    let config: Config =
        match serde_json::from_value(json!({ "listeners": listeners, "clusters": clusters })) {
            Ok(config) => config,
            Err(e) => {
                // Every value above is built from checked parts; this would be a bug here.
                warnings.push(format!("the translated config does not parse: {e}"));
                flatmesh_xds::bootstrap::empty_config()
            }
        };

    let config = std::sync::Arc::new(config);
    let proxy_of = server_proxies(&objects.nodes);
    let mut nodes: BTreeMap<String, NodeSnapshot> = BTreeMap::new();
    for pod in &objects.pods {
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            continue; // not scheduled yet
        };
        let node = proxy_of.get(node).map_or(node, String::as_str);
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded") | Some("Failed"))
            || !live(pod.metadata.namespace.as_deref())
        {
            continue;
        }
        nodes
            .entry(node.to_string())
            .or_insert_with(|| NodeSnapshot {
                config: config.clone(),
                identities: BTreeSet::new(),
            })
            .identities
            .insert(pod_identity(trust_domain, pod));
    }
    Translation { nodes, warnings }
}

/// Node -> the node that runs its server's proxy, where that is another node: for a server
/// (a host and the SmartNIC/DPU nodes that name it in `flatmesh.io/host`) whose DPU the
/// scheduler labelled `flatmesh.io/node-proxy=on`, the host and its other DPUs map to that
/// DPU; for one whose DPU is labelled `off` and whose host is not, the DPU maps to the host.
/// Nodes the scheduler has not labelled keep their own proxy.
fn server_proxies(nodes: &[Arc<Node>]) -> BTreeMap<String, String> {
    use crate::schedule::cluster::Pu;
    use crate::schedule::proxy_labels::{label_of, pu_of, server_of, OFF, ON};
    let by_name: BTreeMap<&str, &Node> = nodes
        .iter()
        .filter_map(|n| Some((n.metadata.name.as_deref()?, &**n)))
        .collect();
    // Server (host name) -> its DPU nodes, by name.
    let mut servers: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (name, node) in &by_name {
        if matches!(pu_of(node), Some(Pu::Smartnic | Pu::Dpu)) {
            if let Some(host) = server_of(node) {
                servers.entry(host).or_default().push(name);
            }
        }
    }
    let mut out = BTreeMap::new();
    for (host, dpus) in &servers {
        let offloaded_to = dpus
            .iter()
            .find(|d| label_of(by_name[*d]).as_deref() == Some(ON));
        let host_runs_one = by_name
            .get(host.as_str())
            .is_some_and(|h| label_of(h).as_deref() != Some(OFF));
        let proxy = match offloaded_to {
            Some(dpu) => *dpu,
            None if host_runs_one => host.as_str(),
            None => continue,
        };
        for node in dpus.iter().copied().chain([host.as_str()]) {
            if node != proxy {
                out.insert(node.to_string(), proxy.to_string());
            }
        }
    }
    out
}

/// Every forwarding route's retry policy, Istio's default: two more tries when the endpoint
/// cannot be reached (a pod that died before its endpoint was removed) or a gRPC endpoint
/// answers UNAVAILABLE or CANCELLED (a connect failure's retry spends no retry budget).
fn default_retries() -> Value {
    json!({ "attempts": 2, "on": ["connect-failure", "unavailable", "cancelled"] })
}

/// Every translated cluster's circuit breaker: as many retries outstanding as requests. Envoy's
/// default of 3 retries at once (ours too) refuses the retries a pod that died under load
/// needs (half the requests of a two-pod Service fail at once); Istio lifts it the same way
/// (its `maxRetries` defaults to 2^32-1). The route's `attempts` and the retry budget still
/// bound retries.
fn translated_breaker() -> Value {
    let requests = flatmesh_config::CircuitBreaker::default().max_requests;
    json!({ "max_retries": requests })
}

/// One port of a Service that has a ClusterIP.
struct ServicePortInfo {
    namespace: String,
    service: String,
    /// `NS/NAME:PORT`.
    name: String,
    cluster_ip: IpAddr,
    port: u16,
    /// The port's name: the EndpointSlice port of the same name carries its endpoints.
    port_name: String,
    http: bool,
    grpc: bool,
}

fn service_ports(objects: &Objects, live: &dyn Fn(Option<&str>) -> bool) -> Vec<ServicePortInfo> {
    let mut out = Vec::new();
    for service in &objects.services {
        let Some(spec) = &service.spec else { continue };
        // Headless Services ("None") and ExternalName ones have no address to capture.
        let Some(cluster_ip) = spec.cluster_ip.as_deref().and_then(|ip| ip.parse().ok()) else {
            continue;
        };
        if !live(service.metadata.namespace.as_deref()) {
            continue;
        }
        let namespace = service
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = service.metadata.name.clone().unwrap_or_default();
        for p in spec.ports.iter().flatten() {
            if p.protocol.as_deref().is_some_and(|proto| proto != "TCP") {
                continue; // UDP and SCTP are not proxied
            }
            let Ok(port) = u16::try_from(p.port) else {
                continue;
            };
            let (http, grpc) = speaks(p);
            out.push(ServicePortInfo {
                name: service_port_name(&namespace, &name, port),
                namespace: namespace.clone(),
                service: name.clone(),
                cluster_ip,
                port,
                port_name: p.name.clone().unwrap_or_default(),
                http,
                grpc,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Whether a Service port speaks HTTP, and HTTP/2 (gRPC): its `appProtocol`, or Istio's
/// port-name convention (`http`, `http-*`, `grpc`, `grpc-*`, `http2`, `http2-*`).
fn speaks(port: &ServicePort) -> (bool, bool) {
    let named = |prefix: &str| {
        port.name
            .as_deref()
            .is_some_and(|n| n == prefix || n.starts_with(&format!("{prefix}-")))
    };
    let app = port.app_protocol.as_deref().unwrap_or("");
    let grpc = matches!(app, "grpc" | "h2c" | "http2" | "kubernetes.io/h2c")
        || named("grpc")
        || named("http2");
    let http = grpc || matches!(app, "http" | "HTTP") || named("http");
    (http, grpc)
}

/// The EndpointSlices of each Service (by namespace and name), FQDN ones left out: looked up per
/// Service port, so the translation is linear in the cluster's size, not quadratic.
fn slices_by_service(objects: &Objects) -> BTreeMap<(&str, &str), Vec<&EndpointSlice>> {
    let mut out: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in &objects.slices {
        let Some(owner) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        else {
            continue;
        };
        if slice.address_type == "FQDN" {
            continue;
        }
        let namespace = slice.metadata.namespace.as_deref().unwrap_or("default");
        out.entry((namespace, owner.as_str()))
            .or_default()
            .push(slice);
    }
    out
}

/// The ready endpoints of a Service port (from its Service's slices), in address order.
fn endpoints_of(slices: &[&EndpointSlice], port: &ServicePortInfo) -> BTreeSet<SocketAddr> {
    let mut out = BTreeSet::new();
    for slice in slices {
        let Some(target) = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.clone().unwrap_or_default() == port.port_name)
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for endpoint in &slice.endpoints {
            // Unknown readiness counts as ready (the API's rule for consumers).
            if endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for address in &endpoint.addresses {
                if let Ok(ip) = address.parse::<IpAddr>() {
                    out.insert(SocketAddr::new(ip, target));
                }
            }
        }
    }
    out
}

/// The mesh routes whose parents name each Service (by namespace and name), with the port the
/// parent names, if any.
type RoutesByParent<'a> = BTreeMap<(String, String), Vec<(&'a MeshRoute, Option<i32>)>>;

fn routes_by_parent(objects: &Objects) -> RoutesByParent<'_> {
    let mut out: RoutesByParent<'_> = BTreeMap::new();
    for route in &objects.routes {
        for (namespace, name, port) in route.services() {
            out.entry((namespace, name))
                .or_default()
                .push((route, port));
        }
    }
    out
}

/// The mesh routes attached to a Service port, by namespace and name.
fn attached_routes<'a>(parents: &RoutesByParent<'a>, port: &ServicePortInfo) -> Vec<&'a MeshRoute> {
    let key = (port.namespace.clone(), port.service.clone());
    let mut out: Vec<&MeshRoute> = parents
        .get(&key)
        .into_iter()
        .flatten()
        .filter(|(_, p)| p.is_none_or(|p| p == i32::from(port.port)))
        .map(|(route, _)| *route)
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    // A route with two parents on this port is attached once.
    out.dedup_by(|a, b| std::ptr::eq(*a, *b));
    out
}

/// How specific a route's match is: Gateway API precedence, most specific first (exact path,
/// then the longest prefix, then a method, then the most headers, then the most query
/// parameters); ties keep their order (routes by name, rules and matches as written).
type Precedence = (u8, usize, bool, usize, usize);

fn rule_routes(
    route: &MeshRoute,
    rule: &Rule,
    known: &BTreeSet<String>,
    warnings: &mut Vec<String>,
) -> Vec<(Precedence, Value)> {
    let mut split = Vec::new();
    for backend in &rule.backends {
        match backend.service_port(&route.namespace) {
            Some((namespace, name, port)) if known.contains(&service_port_name(&namespace, &name, port)) => {
                split.push(json!({ "cluster": service_port_name(&namespace, &name, port), "weight": backend.weight() }))
            }
            _ => warnings.push(format!(
                "{} {}/{}: backend {}{} is not a port of a known Service; requests it would get are answered 500",
                kind_name(route.kind),
                route.namespace,
                route.name,
                backend.name,
                backend.port.map(|p| format!(":{p}")).unwrap_or_default(),
            )),
        }
    }
    split.retain(|b| b["weight"] != json!(0));
    let action = match split.len() {
        // The Gateway API answers 500 when a rule has no valid backend.
        0 => json!({ "direct_response": { "status": 500 } }),
        1 => json!({ "cluster": split[0]["cluster"] }),
        _ => json!({ "split": split }),
    };
    let everything = [crate::routes::Match::default()];
    let matches = if rule.matches.is_empty() {
        &everything[..]
    } else {
        &rule.matches[..]
    };
    matches
        .iter()
        .map(|m| {
            let mut out = action.clone();
            let mut matched = serde_json::Map::new();
            let precedence = match &m.path {
                Some(PathMatch::Exact(p)) => {
                    matched.insert("path".into(), json!({ "exact": p }));
                    (
                        0,
                        usize::MAX - p.len(),
                        m.method.is_none(),
                        usize::MAX - m.headers.len(),
                        usize::MAX - m.query.len(),
                    )
                }
                Some(PathMatch::Prefix(p)) => {
                    matched.insert("path".into(), json!({ "prefix": p }));
                    (
                        1,
                        usize::MAX - p.len(),
                        m.method.is_none(),
                        usize::MAX - m.headers.len(),
                        usize::MAX - m.query.len(),
                    )
                }
                Some(PathMatch::Regex(p)) => {
                    matched.insert("path".into(), json!({ "regex": p }));
                    (
                        2,
                        0,
                        m.method.is_none(),
                        usize::MAX - m.headers.len(),
                        usize::MAX - m.query.len(),
                    )
                }
                None => (
                    1,
                    usize::MAX - 1,
                    m.method.is_none(),
                    usize::MAX - m.headers.len(),
                    usize::MAX - m.query.len(),
                ),
            };
            if let Some(method) = &m.method {
                matched.insert("method".into(), json!(method));
            }
            if !m.headers.is_empty() {
                matched.insert("headers".into(), named(&m.headers));
            }
            if !m.query.is_empty() {
                matched.insert("query".into(), named(&m.query));
            }
            out["name"] = json!(format!("{}/{}", route.namespace, route.name));
            out["match"] = Value::Object(matched);
            (precedence, out)
        })
        .collect()
}

fn named(matches: &[ValueMatch]) -> Value {
    matches
        .iter()
        .map(|m| {
            if m.regex {
                json!({ "name": m.name, "regex": m.value })
            } else {
                json!({ "name": m.name, "exact": m.value })
            }
        })
        .collect()
}

fn order_by_precedence(routes: &mut [(Precedence, Value)]) {
    routes.sort_by_key(|r| r.0); // stable: ties keep their order
}

fn kind_name(kind: RouteKind) -> &'static str {
    match kind {
        RouteKind::Http => "HTTPRoute",
        RouteKind::Grpc => "GRPCRoute",
    }
}

#[cfg(test)]
mod tests;
