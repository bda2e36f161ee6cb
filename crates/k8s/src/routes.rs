//! The Gateway API's mesh routes, `HTTPRoute` and `GRPCRoute` of
//! `gateway.networking.k8s.io/v1`, hand-mapped: only the fields flatmesh acts on. They are
//! watched as dynamic objects ([`http_route_resource`], [`grpc_route_resource`]) and read with
//! [`MeshRoute::from_object`]; unknown fields are ignored, as a client of a newer API must.
//!
//! Under the GAMMA convention (Istio, Linkerd, Cilium) a route is a mesh route when a
//! `parentRef` names a Service (`kind: Service`, core group): it then decides requests sent to
//! that Service's address.

use kube::api::{ApiResource, DynamicObject};
use serde::Deserialize;

pub const GROUP: &str = "gateway.networking.k8s.io";
pub const VERSION: &str = "v1";

/// `HTTPRoute` of `gateway.networking.k8s.io/v1`.
pub fn http_route_resource() -> ApiResource {
    resource("HTTPRoute", "httproutes")
}

/// `GRPCRoute` of `gateway.networking.k8s.io/v1`.
pub fn grpc_route_resource() -> ApiResource {
    resource("GRPCRoute", "grpcroutes")
}

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Which of the two route kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKind {
    Http,
    Grpc,
}

/// One route, either kind, in the terms flatmesh maps.
#[derive(Debug, Clone, PartialEq)]
pub struct MeshRoute {
    pub kind: RouteKind,
    pub namespace: String,
    pub name: String,
    pub parents: Vec<ParentRef>,
    pub rules: Vec<Rule>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
    pub name: String,
    #[serde(default)]
    pub port: Option<i32>,
}

impl ParentRef {
    /// The Service this parent names (namespace, name), if it names one (GAMMA).
    pub fn service(&self, route_namespace: &str) -> Option<(String, String)> {
        let core = matches!(self.group.as_deref(), Some("") | Some("core"));
        (core && self.kind.as_deref() == Some("Service")).then(|| {
            (
                self.namespace
                    .clone()
                    .unwrap_or_else(|| route_namespace.to_string()),
                self.name.clone(),
            )
        })
    }
}

/// One rule: requests that match any of `matches` go to `backends` (by weight).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rule {
    /// No match at all matches every request.
    pub matches: Vec<Match>,
    pub backends: Vec<BackendRef>,
}

/// One match of a rule, both kinds in HTTP terms (a gRPC method is a path).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Match {
    pub path: Option<PathMatch>,
    pub method: Option<String>,
    pub headers: Vec<ValueMatch>,
    pub query: Vec<ValueMatch>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
    Regex(String),
}

/// A header or query parameter: `value` exactly, or matching the regular expression.
#[derive(Debug, Clone, PartialEq)]
pub struct ValueMatch {
    pub name: String,
    pub value: String,
    pub regex: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
    #[serde(default)]
    pub weight: Option<i32>,
}

impl BackendRef {
    /// The Service port this backend names (namespace, name, port); `None` for other kinds
    /// and for a Service without a port (the Gateway API requires one).
    pub fn service_port(&self, route_namespace: &str) -> Option<(String, String, u16)> {
        let core = matches!(self.group.as_deref(), None | Some("") | Some("core"));
        let service = matches!(self.kind.as_deref(), None | Some("Service"));
        let port = u16::try_from(self.port?).ok()?;
        (core && service).then(|| {
            (
                self.namespace
                    .clone()
                    .unwrap_or_else(|| route_namespace.to_string()),
                self.name.clone(),
                port,
            )
        })
    }

    /// The weight, 1 by default; a negative one counts as 0.
    pub fn weight(&self) -> u32 {
        u32::try_from(self.weight.unwrap_or(1)).unwrap_or(0)
    }
}

// The wire shapes of the two specs (only what is mapped).

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct HttpRouteSpec {
    #[serde(default)]
    parent_refs: Vec<ParentRef>,
    #[serde(default)]
    rules: Vec<HttpRule>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct HttpRule {
    #[serde(default)]
    matches: Vec<HttpMatch>,
    #[serde(default)]
    backend_refs: Vec<BackendRef>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct HttpMatch {
    #[serde(default)]
    path: Option<HttpPath>,
    #[serde(default)]
    headers: Vec<NamedValue>,
    #[serde(default)]
    query_params: Vec<NamedValue>,
    #[serde(default)]
    method: Option<String>,
}

#[derive(Deserialize)]
struct HttpPath {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    value: Option<String>,
}

#[derive(Deserialize)]
struct NamedValue {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    name: String,
    value: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct GrpcRouteSpec {
    #[serde(default)]
    parent_refs: Vec<ParentRef>,
    #[serde(default)]
    rules: Vec<GrpcRule>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct GrpcRule {
    #[serde(default)]
    matches: Vec<GrpcMatch>,
    #[serde(default)]
    backend_refs: Vec<BackendRef>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct GrpcMatch {
    #[serde(default)]
    method: Option<GrpcMethod>,
    #[serde(default)]
    headers: Vec<NamedValue>,
}

#[derive(Deserialize)]
struct GrpcMethod {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    service: Option<String>,
    #[serde(default)]
    method: Option<String>,
}

fn value_match(v: NamedValue) -> ValueMatch {
    ValueMatch {
        name: v.name,
        value: v.value,
        regex: v.kind.as_deref() == Some("RegularExpression"),
    }
}

impl MeshRoute {
    /// Read a watched `HTTPRoute` or `GRPCRoute`; the error says which field does not parse
    /// (the API server validates routes against the CRD's schema, so this is rare).
    pub fn from_object(
        kind: RouteKind,
        object: &DynamicObject,
    ) -> std::result::Result<MeshRoute, String> {
        let namespace = object.metadata.namespace.clone().unwrap_or_default();
        let name = object.metadata.name.clone().unwrap_or_default();
        let spec = object
            .data
            .get("spec")
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let (parents, rules) = match kind {
            RouteKind::Http => {
                let spec: HttpRouteSpec = serde_json::from_value(spec)
                    .map_err(|e| format!("HTTPRoute {namespace}/{name}: spec: {e}"))?;
                (
                    spec.parent_refs,
                    spec.rules.into_iter().map(http_rule).collect(),
                )
            }
            RouteKind::Grpc => {
                let spec: GrpcRouteSpec = serde_json::from_value(spec)
                    .map_err(|e| format!("GRPCRoute {namespace}/{name}: spec: {e}"))?;
                (
                    spec.parent_refs,
                    spec.rules.into_iter().map(grpc_rule).collect(),
                )
            }
        };
        Ok(MeshRoute {
            kind,
            namespace,
            name,
            parents,
            rules,
        })
    }

    /// The Services (namespace, name, port or every port) this route is a mesh route of.
    pub fn services(&self) -> impl Iterator<Item = (String, String, Option<i32>)> + '_ {
        self.parents.iter().filter_map(|p| {
            p.service(&self.namespace)
                .map(|(namespace, name)| (namespace, name, p.port))
        })
    }
}

fn http_rule(rule: HttpRule) -> Rule {
    let matches = rule
        .matches
        .into_iter()
        .map(|m| Match {
            path: m.path.map(|p| {
                // The Gateway API's default is a prefix match on `/`.
                let value = p.value.unwrap_or_else(|| "/".into());
                match p.kind.as_deref() {
                    Some("Exact") => PathMatch::Exact(value),
                    Some("RegularExpression") => PathMatch::Regex(value),
                    _ => PathMatch::Prefix(value),
                }
            }),
            method: m.method,
            headers: m.headers.into_iter().map(value_match).collect(),
            query: m.query_params.into_iter().map(value_match).collect(),
        })
        .collect();
    Rule {
        matches,
        backends: rule.backend_refs,
    }
}

/// A gRPC method match is a match on the request path `/SERVICE/METHOD`.
fn grpc_rule(rule: GrpcRule) -> Rule {
    let matches = rule
        .matches
        .into_iter()
        .map(|m| {
            let regex =
                m.method.as_ref().and_then(|m| m.kind.as_deref()) == Some("RegularExpression");
            let path = m.method.and_then(|m| match (m.service, m.method) {
                (Some(s), Some(me)) if regex => Some(PathMatch::Regex(format!("/{s}/{me}"))),
                (Some(s), None) if regex => Some(PathMatch::Regex(format!("/{s}/.+"))),
                (None, Some(me)) if regex => Some(PathMatch::Regex(format!("/[^/]+/{me}"))),
                (Some(s), Some(me)) => Some(PathMatch::Exact(format!("/{s}/{me}"))),
                (Some(s), None) => Some(PathMatch::Prefix(format!("/{s}/"))),
                (None, Some(me)) => Some(PathMatch::Regex(format!("/[^/]+/{}", regex_escape(&me)))),
                (None, None) => None,
            });
            Match {
                path,
                method: None,
                headers: m.headers.into_iter().map(value_match).collect(),
                query: Vec::new(),
            }
        })
        .collect();
    Rule {
        matches,
        backends: rule.backend_refs,
    }
}

/// `text` as a regular expression that matches exactly it.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn object(kind: &str, spec: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": kind,
            "metadata": { "name": "r", "namespace": "shop" }, "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn an_http_route_of_a_service_is_read_with_its_matches_and_backends() {
        let route = MeshRoute::from_object(
            RouteKind::Http,
            &object(
                "HTTPRoute",
                serde_json::json!({
                    "parentRefs": [ { "group": "", "kind": "Service", "name": "web", "port": 80 },
                                    { "name": "gw" } ],
                    "rules": [ {
                        "matches": [ { "path": { "type": "Exact", "value": "/a" },
                                       "headers": [ { "name": "x-v", "value": "2" } ],
                                       "method": "GET" },
                                     { "path": { "type": "PathPrefix", "value": "/b" } } ],
                        "backendRefs": [ { "name": "web-v2", "port": 8080, "weight": 3 },
                                         { "name": "web", "port": 80 } ] } ],
                    "somethingNewer": true,
                }),
            ),
        )
        .unwrap();
        let services: Vec<_> = route.services().collect();
        assert_eq!(
            services,
            vec![("shop".into(), "web".into(), Some(80))],
            "a Gateway parent is not a mesh parent"
        );
        let rule = &route.rules[0];
        assert_eq!(rule.matches[0].path, Some(PathMatch::Exact("/a".into())));
        assert_eq!(rule.matches[0].method.as_deref(), Some("GET"));
        assert_eq!(rule.matches[0].headers[0].value, "2");
        assert_eq!(rule.matches[1].path, Some(PathMatch::Prefix("/b".into())));
        assert_eq!(
            rule.backends[0].service_port("shop"),
            Some(("shop".into(), "web-v2".into(), 8080))
        );
        assert_eq!(rule.backends[0].weight(), 3);
        assert_eq!(rule.backends[1].weight(), 1);
    }

    #[test]
    fn a_grpc_method_becomes_a_path() {
        let route = MeshRoute::from_object(
            RouteKind::Grpc,
            &object(
                "GRPCRoute",
                serde_json::json!({
                    "parentRefs": [ { "group": "", "kind": "Service", "name": "greeter" } ],
                    "rules": [ { "matches": [ { "method": { "service": "hello.Greeter", "method": "Say" } },
                                             { "method": { "service": "hello.Other" } },
                                             { "method": { "method": "Do.It" } } ],
                                 "backendRefs": [ { "name": "greeter", "port": 50051 } ] } ],
                }),
            ),
        )
        .unwrap();
        let paths: Vec<_> = route.rules[0]
            .matches
            .iter()
            .map(|m| m.path.clone().unwrap())
            .collect();
        assert_eq!(
            paths,
            vec![
                PathMatch::Exact("/hello.Greeter/Say".into()),
                PathMatch::Prefix("/hello.Other/".into()),
                PathMatch::Regex("/[^/]+/Do\\.It".into()),
            ]
        );
    }

    #[test]
    fn a_spec_of_the_wrong_shape_is_an_error_naming_the_route() {
        let e = MeshRoute::from_object(
            RouteKind::Http,
            &object("HTTPRoute", serde_json::json!({ "rules": "not a list" })),
        )
        .unwrap_err();
        assert!(e.starts_with("HTTPRoute shop/r: spec:"), "{e}");
    }
}
