//! Compile arbitrary routes, then route arbitrary requests: never panic, the indexed
//! executor must give the same answer as the linear one, path normalisation must be
//! idempotent, and wherever a lower tier's lowering (the kernel's table, the NIC image)
//! decides a request as received, its answer is the user tier's on the normalised path.
#![no_main]

use flatmesh_config::{
    Config, DirectResponse, EscapedSlashesAction, NamedMatch, PathMatch, Route, RouteMatch,
    WeightedCluster,
};
use flatmesh_rules::{compile, Normalized, Request, RouteAction};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use std::sync::LazyLock;

#[derive(Arbitrary, Debug)]
struct Named {
    name: String,
    kind: u8,
    value: String,
    present: bool,
}

#[derive(Arbitrary, Debug)]
struct FRoute {
    host: Option<String>,
    path: Option<(u8, String)>,
    method: Option<String>,
    headers: Vec<Named>,
    query: Vec<Named>,
    action: u8,
    weights: Vec<u32>,
    status: u16,
    add: Vec<(String, String)>,
}

#[derive(Arbitrary, Debug)]
struct FRequest {
    method: String,
    host: Option<String>,
    path: String,
    query: Option<String>,
    headers: Vec<(String, Vec<u8>)>,
    random: u32,
}

#[derive(Arbitrary, Debug)]
struct Case {
    routes: Vec<FRoute>,
    requests: Vec<FRequest>,
    /// The listener's path keys: each unset (the default), false or true.
    normalize_path: Option<bool>,
    merge_slashes: Option<bool>,
    escaped_slashes: Option<u8>,
}

/// A config and a route parsed once from YAML, so fields the config model gains later take
/// their defaults (parsing per input would also halve the exec rate).
static BASE: LazyLock<Option<(Config, Route)>> = LazyLock::new(|| {
    let cfg = serde_norway::from_str(
        "listeners: [ { name: web, address: 127.0.0.1:1, protocol: http } ]\n\
         clusters: [ { name: a, endpoints: [] }, { name: b, endpoints: [] } ]\n\
         kernel: { l7_dispatch: true }",
    );
    Some((cfg.ok()?, serde_norway::from_str("{}").ok()?))
});

fn named(n: &Named) -> NamedMatch {
    let mut m = NamedMatch {
        name: n.name.clone(),
        exact: None,
        prefix: None,
        present: None,
        regex: None,
    };
    match n.kind % 6 {
        0 => m.exact = Some(n.value.clone()),
        1 => m.prefix = Some(n.value.clone()),
        2 => m.present = Some(n.present),
        3 => m.regex = Some(n.value.clone()),
        4 => {}
        _ => {
            m.exact = Some(n.value.clone());
            m.present = Some(n.present);
        }
    }
    m
}

fn route(r: &FRoute) -> Option<Route> {
    let path = r.path.as_ref().map(|(k, p)| match k % 3 {
        0 => PathMatch::Exact(p.clone()),
        1 => PathMatch::Prefix(p.clone()),
        _ => PathMatch::Regex(p.clone()),
    });
    let clusters = ["a", "b", "missing"];
    let mut route = BASE.as_ref()?.1.clone();
    route.matches = RouteMatch {
        host: r.host.clone(),
        path,
        method: r.method.clone(),
        headers: r.headers.iter().take(4).map(named).collect(),
        query: r.query.iter().take(4).map(named).collect(),
        grpc_field: None,
    };
    route.request_headers_to_add = r.add.iter().take(4).cloned().collect();
    match r.action % 4 {
        0 => route.cluster = Some(clusters[(r.status % 3) as usize].into()),
        1 => {
            route.split = Some(
                r.weights
                    .iter()
                    .take(4)
                    .enumerate()
                    .map(|(i, w)| WeightedCluster {
                        cluster: clusters[i % 2].into(),
                        weight: *w,
                    })
                    .collect(),
            )
        }
        2 => {
            route.direct_response = Some(DirectResponse {
                status: r.status,
                body: "x".into(),
            })
        }
        _ => {}
    }
    Some(route)
}

fuzz_target!(|case: Case| {
    let Some((mut cfg, _)) = BASE.clone() else {
        return;
    };
    cfg.listeners[0].routes = case.routes.iter().take(16).filter_map(route).collect();
    cfg.listeners[0].normalize_path = case.normalize_path;
    cfg.listeners[0].merge_slashes = case.merge_slashes;
    cfg.listeners[0].path_with_escaped_slashes_action = case.escaped_slashes.map(|a| match a % 4 {
        0 => EscapedSlashesAction::KeepUnchanged,
        1 => EscapedSlashesAction::RejectRequest,
        2 => EscapedSlashesAction::UnescapeAndRedirect,
        _ => EscapedSlashesAction::UnescapeAndForward,
    });
    let Ok(program) = compile(&cfg) else { return };
    let paths = program.paths(0);
    let _ = program.explain();
    let _ = program.to_json();
    for r in case.requests.iter().take(8) {
        let method = http::Method::from_bytes(r.method.as_bytes()).unwrap_or(http::Method::GET);
        let mut headers = http::HeaderMap::new();
        for (k, v) in &r.headers {
            if let (Ok(k), Ok(v)) = (
                http::HeaderName::from_bytes(k.as_bytes()),
                http::HeaderValue::from_bytes(v),
            ) {
                headers.append(k, v);
            }
        }
        let raw = Request {
            method: &method,
            host: r.host.as_deref(),
            path: &r.path,
            query: r.query.as_deref(),
            headers: (&headers).into(),
            message: None,
        };
        // The user tier's path: normalised as the listener asks (idempotently); a refused or
        // redirected path is routed nowhere.
        let normalized = paths.apply(&r.path);
        let path = match &normalized {
            Ok(Normalized::Path(p)) => Some(p.to_string()),
            Ok(Normalized::Redirect(p)) => {
                assert!(paths.is_normal(p), "redirect target {p:?} is not normal");
                None
            }
            Err(_) => None,
        };
        if let Some(p) = &path {
            assert!(
                paths.is_normal(p),
                "{:?} normalises to {p:?}, which is not normal",
                r.path
            );
        }
        let req = Request {
            path: path.as_deref().unwrap_or(&r.path),
            ..raw
        };
        let fast = path.as_ref().and(program.route(0, &req)).map(|c| c.id);
        let linear = path
            .as_ref()
            .and(program.route_linear(0, &req))
            .map(|c| c.id);
        assert_eq!(fast, linear, "indexed and linear executors disagree");
        // Only a path a request can have: `/...` without `?`, space, CR or LF.
        if r.path.starts_with('/') && !r.path.contains(['?', ' ', '\r', '\n']) {
            for lowering in program.lowerings() {
                if let Some(got) = lowering.decide(0, &raw) {
                    assert_eq!(
                        Some(got),
                        fast,
                        "tier {} decides another route than the user tier",
                        lowering.tier()
                    );
                }
            }
        }
        if let Some(c) = program.route(0, &req) {
            if let RouteAction::Split(s) = &c.action {
                let picked = s.pick(r.random);
                assert!(program.cluster_name(picked) == "a" || program.cluster_name(picked) == "b");
            }
        }
    }
});
