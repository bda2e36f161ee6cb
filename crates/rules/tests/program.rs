//! The compiled program end to end: the issue's example config, every match kind through the
//! executor, order semantics, errors, explain and JSON.

// Test helpers may unwrap: the workspace allows it in tests (clippy.toml), helpers included.
#![allow(clippy::unwrap_used)]

use flatmesh_config::Config;
use flatmesh_rules::lower::kernel::Protocols;
use flatmesh_rules::lower::Lowering;
use flatmesh_rules::{compile, Reason, Request, RouteAction, RulesError, Tier, Verdict};
use http::{HeaderMap, HeaderName, HeaderValue, Method};

const EXAMPLE: &str = r#"
listeners:
  - name: web
    address: 127.0.0.1:8080
    protocol: http
    routes:
      - match: { path: { prefix: /api }, headers: [ { name: x-canary, exact: "1" } ] }
        cluster: api-canary
      - match: { path: { regex: "^/v[0-9]+/items" }, method: GET }
        split: [ { cluster: api, weight: 90 }, { cluster: api-canary, weight: 10 } ]
        timeout: 2s
      - match: { path: { exact: /healthz } }
        direct_response: { status: 200, body: "ok" }
      - match: { host: "*.example.com", path: { prefix: / } }
        cluster: api
        request_headers_to_add: { x-via: flatmesh }
  - name: db
    address: 127.0.0.1:8081
    protocol: tcp
    cluster: db
clusters:
  - name: api
    lb: round_robin
    endpoints: [ 127.0.0.1:9001, 127.0.0.1:9002 ]
  - name: api-canary
    endpoints: [ 127.0.0.1:9003 ]
    protocol: http2
  - name: db
    endpoints: [ 127.0.0.1:5432 ]
"#;

fn cfg(yaml: &str) -> Config {
    serde_norway::from_str(yaml).unwrap()
}

/// A one-listener http config with the given route list (YAML lines, indented by 6).
fn routes(list: &str) -> Config {
    cfg(&format!(
        "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    routes:\n{list}\
         clusters:\n  - {{ name: a, endpoints: [127.0.0.1:2] }}\n  - {{ name: b, endpoints: [127.0.0.1:3] }}\n"
    ))
}

struct Req {
    method: Method,
    host: Option<String>,
    path: String,
    query: Option<String>,
    headers: HeaderMap,
}

impl Req {
    fn get(path: &str) -> Req {
        let (path, query) = match path.split_once('?') {
            Some((p, q)) => (p.to_string(), Some(q.to_string())),
            None => (path.to_string(), None),
        };
        Req {
            method: Method::GET,
            host: None,
            path,
            query,
            headers: HeaderMap::new(),
        }
    }
    fn method(mut self, m: Method) -> Req {
        self.method = m;
        self
    }
    fn host(mut self, h: &str) -> Req {
        self.host = Some(h.to_string());
        self
    }
    fn header(mut self, k: &str, v: &str) -> Req {
        self.headers.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
        self
    }
    fn view(&self) -> Request<'_> {
        Request {
            method: &self.method,
            host: self.host.as_deref(),
            path: &self.path,
            query: self.query.as_deref(),
            headers: (&self.headers).into(),
            message: None,
        }
    }
}

/// The winning route's id under both executors (they must agree).
fn hit(program: &flatmesh_rules::RuleProgram, req: &Req) -> Option<usize> {
    let fast = program.route(0, &req.view()).map(|r| r.id);
    let linear = program.route_linear(0, &req.view()).map(|r| r.id);
    assert_eq!(
        fast, linear,
        "index and linear executor disagree on {}",
        req.path
    );
    fast
}

#[test]
fn issue_example_compiles_and_routes() {
    let p = compile(&cfg(EXAMPLE)).unwrap();
    let web = p.listener_id("web").unwrap();
    let db = p.listener_id("db").unwrap();
    assert_eq!((web, db), (0, 1));
    assert_eq!(p.listener_id("nope"), None);
    let api = p.cluster_id("api").unwrap();
    let canary = p.cluster_id("api-canary").unwrap();
    assert_eq!(p.cluster_name(canary), "api-canary");
    assert_eq!(p.cluster_name(99), "");
    assert_eq!(p.tcp_cluster(db), p.cluster_id("db"));
    assert_eq!(p.tcp_cluster(web), None);
    assert!(
        p.route(db, &Req::get("/").view()).is_none(),
        "tcp listener has no http routes"
    );
    assert!(
        p.route(7, &Req::get("/").view()).is_none(),
        "unknown listener"
    );

    let r = p
        .route(web, &Req::get("/api/x").header("X-Canary", "1").view())
        .unwrap();
    assert_eq!((r.id, r.name.as_str()), (0, "web/0"));
    assert_eq!(r.action, RouteAction::Forward(canary));

    let r = p.route(web, &Req::get("/v2/items").view()).unwrap();
    assert_eq!(r.id, 1);
    assert_eq!(r.timeout, Some(std::time::Duration::from_secs(2)));
    let RouteAction::Split(split) = &r.action else {
        panic!("expected a split")
    };
    assert_eq!(split.entries(), &[(api, 90), (canary, 10)]);
    // Full-path regex: a tail after /items does not match, and POST does not either.
    assert_eq!(hit(&p, &Req::get("/v2/items/7")), None);
    assert_eq!(hit(&p, &Req::get("/v2/items").method(Method::POST)), None);

    let r = p.route(web, &Req::get("/healthz").view()).unwrap();
    assert_eq!(
        r.action,
        RouteAction::DirectResponse {
            status: http::StatusCode::OK,
            body: "ok".into()
        }
    );

    let r = p
        .route(
            web,
            &Req::get("/anything").host("Shop.Example.com:8080").view(),
        )
        .unwrap();
    assert_eq!(r.id, 3);
    assert_eq!(
        r.request_headers_to_add,
        vec![(
            HeaderName::from_static("x-via"),
            HeaderValue::from_static("flatmesh")
        )]
    );
    assert_eq!(hit(&p, &Req::get("/anything").host("example.com")), None);
    assert_eq!(
        hit(&p, &Req::get("/api/x")),
        None,
        "canary header missing and no host"
    );
}

#[test]
fn first_match_wins_in_route_order_across_index_buckets() {
    let p = compile(&routes(
        "      - match: { path: { regex: \"/a/.*\" }, method: POST }\n        cluster: a\n\
         \x20     - match: { path: { prefix: /a/b } }\n        cluster: a\n\
         \x20     - match: { path: { exact: /a/b/c } }\n        cluster: b\n\
         \x20     - match: { path: { prefix: /a } }\n        cluster: b\n\
         \x20     - match: { path: { regex: \"/a/b/c\" } }\n        cluster: b\n\
         \x20     - match: {}\n        cluster: b\n",
    ))
    .unwrap();
    assert_eq!(hit(&p, &Req::get("/a/b/c").method(Method::POST)), Some(0));
    assert_eq!(
        hit(&p, &Req::get("/a/b/c")),
        Some(1),
        "prefix /a/b comes before exact /a/b/c"
    );
    assert_eq!(hit(&p, &Req::get("/a/x")), Some(3));
    assert_eq!(
        hit(&p, &Req::get("/zzz")),
        Some(5),
        "the empty match catches everything"
    );
    assert_eq!(hit(&p, &Req::get("")), Some(5));
}

#[test]
fn every_match_kind() {
    let p = compile(&routes(
        r#"      - match: { host: api.local, path: { exact: /h } }
        cluster: a
      - match: { path: { prefix: /p }, method: DELETE }
        cluster: a
      - match: { path: { exact: /hdr }, headers: [ { name: X-Exact, exact: "v" } ] }
        cluster: a
      - match: { path: { exact: /hdr }, headers: [ { name: x-prefix, prefix: "pre" } ] }
        cluster: a
      - match: { path: { exact: /hdr }, headers: [ { name: x-present, present: true } ] }
        cluster: a
      - match: { path: { exact: /hdr }, headers: [ { name: x-absent, present: false }, { name: x-re, regex: "[0-9]{3}" } ] }
        cluster: a
      - match: { path: { exact: /q }, query: [ { name: user, exact: "jo ann" } ] }
        cluster: a
      - match: { path: { exact: /q }, query: [ { name: tag, prefix: "beta" } ] }
        cluster: a
      - match: { path: { exact: /q }, query: [ { name: debug, present: true } ] }
        cluster: a
      - match: { path: { exact: /q }, query: [ { name: id, regex: "[a-f0-9]+" }, { name: off, present: false } ] }
        cluster: a
      - match: { path: { regex: "/items/[0-9]+" } }
        cluster: b
"#,
    ))
    .unwrap();
    assert_eq!(hit(&p, &Req::get("/h").host("API.local:80")), Some(0));
    assert_eq!(hit(&p, &Req::get("/h").host("other.local")), None);
    assert_eq!(hit(&p, &Req::get("/h")), None);
    assert_eq!(hit(&p, &Req::get("/pxyz").method(Method::DELETE)), Some(1));
    assert_eq!(hit(&p, &Req::get("/pxyz")), None);
    assert_eq!(hit(&p, &Req::get("/hdr").header("x-exact", "v")), Some(2));
    assert_eq!(
        hit(
            &p,
            &Req::get("/hdr")
                .header("x-exact", "v")
                .header("x-exact", "w")
        ),
        None,
        "joined as v,w"
    );
    assert_eq!(
        hit(&p, &Req::get("/hdr").header("x-prefix", "prefix")),
        Some(3)
    );
    assert_eq!(hit(&p, &Req::get("/hdr").header("x-present", "")), Some(4));
    assert_eq!(hit(&p, &Req::get("/hdr").header("x-re", "123")), Some(5));
    assert_eq!(
        hit(&p, &Req::get("/hdr").header("x-re", "1234")),
        None,
        "regex must match the whole value"
    );
    assert_eq!(
        hit(
            &p,
            &Req::get("/hdr")
                .header("x-re", "123")
                .header("x-absent", "1")
        ),
        None
    );
    assert_eq!(hit(&p, &Req::get("/q?user=jo%20ann")), Some(6));
    assert_eq!(hit(&p, &Req::get("/q?user=jo+ann")), Some(6));
    assert_eq!(hit(&p, &Req::get("/q?user=jo")), None);
    assert_eq!(hit(&p, &Req::get("/q?x=1&tag=beta2")), Some(7));
    assert_eq!(
        hit(&p, &Req::get("/q?tag=alpha&tag=beta")),
        None,
        "first occurrence counts"
    );
    assert_eq!(hit(&p, &Req::get("/q?debug")), Some(8));
    assert_eq!(
        hit(&p, &Req::get("/q?id=%61%62%63")),
        Some(9),
        "decoded abc matches [a-f0-9]+"
    );
    assert_eq!(hit(&p, &Req::get("/q?id=abc&off=1")), None);
    assert_eq!(hit(&p, &Req::get("/q?id=xyz")), None);
    assert_eq!(hit(&p, &Req::get("/items/42")), Some(10));
    assert_eq!(hit(&p, &Req::get("/items/42/")), None);
    assert_eq!(hit(&p, &Req::get("/items/")), None);
}

#[test]
fn compile_errors_say_what_to_fix() {
    let err = |list: &str| compile(&routes(list)).unwrap_err();
    let e = err("      - match: {}\n        cluster: nope\n");
    assert!(
        matches!(&e, RulesError::UnknownCluster { cluster, .. } if cluster == "nope"),
        "{e}"
    );
    assert!(e.to_string().contains("add it under `clusters:`"));
    let e = err("      - match: { path: { regex: \"(\" } }\n        cluster: a\n");
    assert!(matches!(e, RulesError::BadRegex { .. }), "{e}");
    let e = err("      - match: { method: \"G T\" }\n        cluster: a\n");
    assert!(matches!(e, RulesError::BadMethod { .. }), "{e}");
    let e = err("      - match: {}\n");
    assert!(e.to_string().contains("none of them"), "{e}");
    let e =
        err("      - match: {}\n        cluster: a\n        direct_response: { status: 200 }\n");
    assert!(
        e.to_string().contains("`cluster` and `direct_response`"),
        "{e}"
    );
    let e = err("      - match: {}\n        split: [ { cluster: a, weight: 0 } ]\n");
    assert!(
        matches!(e, RulesError::SplitWeights { total: 0, .. }),
        "{e}"
    );
    let e = err("      - match: {}\n        direct_response: { status: 1000 }\n");
    assert!(
        matches!(e, RulesError::BadStatus { status: 1000, .. }),
        "{e}"
    );
    let e = err("      - match: { headers: [ { name: \"bad name\", present: true } ] }\n        cluster: a\n");
    assert!(matches!(e, RulesError::BadHeaderName { .. }), "{e}");
    let e = err(
        "      - match: { headers: [ { name: x, exact: a, prefix: b } ] }\n        cluster: a\n",
    );
    assert!(matches!(e, RulesError::MatcherKind { count: 2, .. }), "{e}");
    let e = err("      - match: { query: [ { name: x } ] }\n        cluster: a\n");
    assert!(matches!(e, RulesError::MatcherKind { count: 0, .. }), "{e}");
    let e = err("      - match: { host: \"a.*.b\" }\n        cluster: a\n");
    assert!(matches!(e, RulesError::BadHost { .. }), "{e}");
    let e = err("      - match: {}\n        cluster: a\n        request_headers_to_add: { x-a: \"bad\\nvalue\" }\n");
    assert!(matches!(e, RulesError::BadHeaderValue { .. }), "{e}");
    let e = err("      - match: { headers: [ { name: x, regex: \"[\" } ] }\n        cluster: a\n");
    assert!(e.to_string().contains("header `x` regex `[`"), "{e}");

    let e = compile(&cfg(
        "listeners:\n  - { name: t, address: 127.0.0.1:1, protocol: tcp }\n",
    ))
    .unwrap_err();
    assert!(matches!(e, RulesError::TcpWithoutCluster { .. }), "{e}");
    let e = compile(&cfg(
        "listeners:\n  - { name: t, address: 127.0.0.1:1, protocol: tcp, cluster: x }\n",
    ))
    .unwrap_err();
    assert!(matches!(e, RulesError::UnknownTcpCluster { .. }), "{e}");
    let e = compile(&cfg(
        "clusters:\n  - { name: a, endpoints: [] }\n  - { name: a, endpoints: [] }\n",
    ))
    .unwrap_err();
    assert!(
        matches!(
            e,
            RulesError::DuplicateName {
                what: "cluster",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn tiers_are_read_from_the_lowerings_in_route_order() {
    let list = "      - match: { path: { prefix: /a }, method: GET }\n        cluster: a\n\
         \x20     - match: { path: { exact: /b } }\n        cluster: a\n\
         \x20     - match: { path: { exact: /c }, headers: [ { name: x, present: true } ] }\n        cluster: a\n\
         \x20     - match: { path: { exact: /d } }\n        cluster: a\n";
    // Without a kernel section nothing runs in the kernel, whatever a route is eligible for.
    let p = compile(&routes(list)).unwrap();
    let r = p.route(0, &Req::get("/d").view()).unwrap();
    assert_eq!(r.tier, Tier::UserL7);
    assert_eq!(r.placement.reason, Reason::NoKernelSection);
    assert_eq!(r.placement.eligible.label(), "N|K|U7");
    assert!(p.kernel().entries.is_empty());

    // With kernel.l7_dispatch the kernel's table holds every route in order: route 2 becomes
    // a punt entry for its own method and path only (the table's first match for /d is
    // route 3's entry). But a spliced connection could carry route 2's requests, so the
    // table is not installed and every route runs in the user tier, saying why.
    let mut with_kernel = routes(list);
    with_kernel.kernel = Some(serde_norway::from_str("{ l7_dispatch: true }").unwrap());
    let p = compile(&with_kernel).unwrap();
    let tiers: Vec<_> = match &p.listeners()[0].kind {
        flatmesh_rules::TableKind::Http(t) => t.routes.iter().map(|r| r.tier).collect(),
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(
        tiers,
        [Tier::UserL7, Tier::UserL7, Tier::UserL7, Tier::UserL7],
        "route 2 needs the user tier: no connection of the listener is spliced"
    );
    let k = p.kernel();
    assert_eq!(k.splice, Err(Reason::SpliceRoute { route: 2 }));
    assert_eq!(k.entries.len(), 4);
    assert_eq!(
        k.first_match("GET", "/d")
            .map(|e| (e.route, e.cluster_for(Protocols::HTTP1))),
        Some((3, Some(0)))
    );
    assert_eq!(
        k.first_match("GET", "/c")
            .map(|e| (e.route, e.cluster_for(Protocols::HTTP1))),
        Some((2, None)),
        "the header route's entry punts"
    );
    let r2 = p.route(0, &Req::get("/c").header("x", "").view()).unwrap();
    assert_eq!(r2.placement.reason, Reason::HeaderMatch);
    assert_eq!(r2.placement.eligible.label(), "U7");
    let r0 = p.route(0, &Req::get("/a").view()).unwrap();
    assert_eq!(r0.placement.eligible.label(), "N|K|U7");
    assert_eq!(r0.placement.reason, Reason::SpliceRoute { route: 2 });
    // Without route 2, and with a route for every request, every route is the kernel's.
    let uniform = list.replace(
        "exact: /c }, headers: [ { name: x, present: true } ] }",
        "exact: /c } }",
    ) + "      - match: {}\n        cluster: a\n";
    let mut with_kernel = routes(&uniform);
    with_kernel.kernel = Some(serde_norway::from_str("{ l7_dispatch: true }").unwrap());
    let p = compile(&with_kernel).unwrap();
    let placed: Vec<_> = match &p.listeners()[0].kind {
        flatmesh_rules::TableKind::Http(t) => t
            .routes
            .iter()
            .map(|r| (r.tier, r.placement.reason))
            .collect(),
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(placed, [(Tier::Kernel, Reason::KernelDecides); 5]);
    assert_eq!(p.kernel().l7_listener(), Some(0));

    let ex = compile(&cfg(EXAMPLE)).unwrap();
    match &ex.listeners()[1].kind {
        flatmesh_rules::TableKind::Tcp(rule) => {
            assert_eq!(rule.placement.tier, Tier::UserL4);
            assert_eq!(
                rule.placement.eligible.label(),
                "K|U4",
                "no NIC image for tcp"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        ex.kernel().tcp_verdict(1),
        Some(Verdict::Host(Reason::NoKernelSection))
    );
    assert_eq!(ex.kernel().tcp_verdict(0), None, "listener 0 is http");
    assert_eq!(ex.kernel().verdict(9, 0), None);
}

#[test]
fn hash_on_clusters_and_long_paths_are_punted_not_shown_as_kernel() {
    let long = format!("/{}", "x".repeat(70));
    let mut config = cfg(&format!(
        "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    routes:\n\
         \x20     - match: {{ path: {{ prefix: /h }} }}\n        cluster: hashed\n\
         \x20     - match: {{ path: {{ exact: \"{long}\" }} }}\n        cluster: a\n\
         \x20     - match: {{ path: {{ prefix: /ok }} }}\n        cluster: a\n\
         clusters:\n  - {{ name: a, endpoints: [127.0.0.1:2] }}\n\
         \x20 - {{ name: hashed, lb: ring_hash, hash_on: {{ header: x-user }}, endpoints: [127.0.0.1:3] }}\n\
         kernel: {{ l7_dispatch: true }}\n"
    ));
    let p = compile(&config).unwrap();
    let placed: Vec<_> = match &p.listeners()[0].kind {
        flatmesh_rules::TableKind::Http(t) => t
            .routes
            .iter()
            .map(|r| (r.tier, r.placement.reason))
            .collect(),
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(
        placed,
        [
            (Tier::UserL7, Reason::HashOn),
            (Tier::UserL7, Reason::PathTooLong { max: 64 }),
            (Tier::UserL7, Reason::SpliceRoute { route: 0 }),
        ]
    );
    // The kernel's own answer agrees: both punt.
    let k = p.kernel();
    assert_eq!(
        k.first_match("GET", "/h/1")
            .map(|e| e.cluster_for(Protocols::HTTP1)),
        Some(None)
    );
    assert_eq!(
        k.first_match("GET", &long)
            .map(|e| e.cluster_for(Protocols::HTTP1)),
        Some(None)
    );
    assert_eq!(k.first_match("GET", "/ok").map(|e| e.route), Some(2));
    // A long path's entry is its first 64 bytes, a superset: still a punt for a longer path.
    assert_eq!(k.entries[1].path.as_str().len(), 64);
    config.kernel = None;
    assert!(compile(&config).unwrap().kernel().entries.is_empty());
}

#[test]
fn tls_keeps_every_lower_tier_out_of_the_listener_and_the_cluster() {
    // The kernel and the NIC see ciphertext on a TLS listener, and cannot originate TLS to a
    // cluster: such rules stay in the user tier, and say why.
    let tls = "tls: { cert: n.pem, key: n.key }";
    let upstream = "tls: { ca: ca.pem, server_ids: [ spiffe://td/ns/a/sa/b ] }";
    let config = cfg(&format!(
        "listeners:\n\
         \x20 - {{ name: web, address: 127.0.0.1:1, protocol: http, routes: [ {{ match: {{ path: {{ exact: /a }} }}, cluster: plain }}, {{ match: {{ path: {{ exact: /b }} }}, cluster: secure }} ] }}\n\
         \x20 - {{ name: webs, address: 127.0.0.1:2, protocol: http, {tls}, routes: [ {{ match: {{ path: {{ exact: /a }} }}, cluster: plain }} ] }}\n\
         \x20 - {{ name: db, address: 127.0.0.1:3, protocol: tcp, cluster: plain, {tls} }}\n\
         \x20 - {{ name: dbs, address: 127.0.0.1:4, protocol: tcp, cluster: secure }}\n\
         \x20 - {{ name: raw, address: 127.0.0.1:5, protocol: tcp, cluster: plain }}\n\
         clusters:\n\
         \x20 - {{ name: plain, endpoints: [127.0.0.1:9] }}\n\
         \x20 - {{ name: secure, endpoints: [127.0.0.1:9], {upstream} }}\n\
         kernel: {{ l7_dispatch: true, l7_listener: web, tcp_splice: true }}\n"
    ));
    let p = compile(&config).unwrap();
    let k = p.kernel();
    assert_eq!(
        k.verdict(0, 0),
        Some(Verdict::Host(Reason::SpliceRoute { route: 1 }))
    );
    assert_eq!(k.verdict(0, 1), Some(Verdict::Host(Reason::UpstreamTls)));
    assert_eq!(k.verdict(1, 0), Some(Verdict::Host(Reason::ListenerTls)));
    assert_eq!(k.tcp_verdict(2), Some(Verdict::Host(Reason::ListenerTls)));
    assert_eq!(k.tcp_verdict(3), Some(Verdict::Host(Reason::UpstreamTls)));
    assert_eq!(k.tcp_verdict(4), Some(Verdict::Decides));
    // The NIC image holds no rule of the TLS listener.
    assert_eq!(
        p.nic().verdict(1, 0),
        Some(Verdict::Host(Reason::ListenerTls))
    );
    // And a kernel.l7_listener that terminates TLS is refused with the fix.
    let mut bad = config.clone();
    bad.kernel = Some(serde_norway::from_str("{ l7_dispatch: true, l7_listener: webs }").unwrap());
    let problems = flatmesh_config::validate::validate(&bad);
    assert!(
        problems
            .iter()
            .any(|p| p.to_string().contains("terminates TLS")),
        "{problems:?}"
    );
}

#[test]
fn hbone_listeners_and_tunnel_clusters_stay_in_the_user_tier_and_say_why() {
    // HBONE is HTTP/2 CONNECT inside mutual TLS: neither the kernel nor the NIC reads it.
    let tls = "tls: { cert: n.pem, key: n.key, client_ca: ca.pem, allow: [ spiffe://td/* ] }";
    let upstream = "tls: { ca: ca.pem, server_ids: [ spiffe://td/ns/mesh/sa/node ] }";
    let config = cfg(&format!(
        "listeners:\n\
         \x20 - {{ name: in, address: 127.0.0.1:15008, protocol: hbone, {tls} }}\n\
         \x20 - {{ name: app, address: 127.0.0.1:2, protocol: tcp, cluster: remote }}\n\
         \x20 - {{ name: web, address: 127.0.0.1:3, protocol: http, routes: [ {{ match: {{ path: {{ exact: /a }} }}, cluster: remote }}, {{ cluster: plain }} ] }}\n\
         clusters:\n\
         \x20 - {{ name: remote, endpoints: [10.0.0.7:80], tunnel: hbone, {upstream} }}\n\
         \x20 - {{ name: plain, endpoints: [127.0.0.1:9] }}\n\
         kernel: {{ tcp_splice: true, l7_dispatch: true, l7_listener: web }}\n"
    ));
    let p = compile(&config).unwrap();
    let k = p.kernel();
    assert_eq!(k.tcp_verdict(0), Some(Verdict::Host(Reason::HboneListener)));
    assert_eq!(k.tcp_verdict(1), Some(Verdict::Host(Reason::Tunnel)));
    // An http route to the tunnel cluster: the kernel hands its requests to the user tier,
    // which alone speaks CONNECT inside TLS; a spliced connection could carry them, so the
    // route after it stays in the user tier too.
    assert_eq!(k.verdict(2, 0), Some(Verdict::Host(Reason::Tunnel)));
    assert_eq!(
        k.verdict(2, 1),
        Some(Verdict::Host(Reason::SpliceRoute { route: 0 }))
    );
    assert_eq!(
        k.first_match("GET", "/a")
            .map(|e| (e.route, e.cluster_for(Protocols::HTTP1))),
        Some((0, None)),
        "the tunnel route's entry punts"
    );
    assert_eq!(p.tcp_cluster(0), None);
    let text = p.explain();
    assert!(
        text.contains("listener 0 `in` hbone 127.0.0.1:15008"),
        "{text}"
    );
    assert!(text.contains("its cluster tunnels (HBONE"), "{text}");
    assert_eq!(
        text.matches("its cluster tunnels (HBONE").count(),
        2,
        "the tcp listener's row and the http route's: {text}"
    );
    assert!(
        text.contains("an hbone listener: its CONNECT streams"),
        "{text}"
    );
    let json = p.to_json();
    assert_eq!(json["listeners"][0]["protocol"], "hbone");
}

#[test]
fn explain_shows_every_table_rule_and_tier() {
    let text = compile(&cfg(EXAMPLE)).unwrap().explain();
    println!("{text}");
    let lines: Vec<&str> = text.lines().collect();
    let find = |needle: &str| -> &str {
        lines
            .iter()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in\n{text}"))
    };
    assert!(text.starts_with(
        "RuleProgram: 2 listeners, 3 clusters; tiers as the config asks (no running node consulted)\n"
    ));
    assert!(find("listener 0 `web` http 127.0.0.1:8080").contains("4 routes"));
    assert!(find("listener 0 `web`").contains("1 exact, 2 prefix, 1 regex, 0 any path"));
    let header = find("#  name");
    for col in ["match", "action", "eligible", "K", "N", "tier", "why"] {
        assert!(header.contains(col), "{header}");
    }
    // Columns are aligned: every row of the web table starts its action at the same offset.
    let action_col = header.find("action").unwrap();
    let r0 = find("forward api-canary");
    assert_eq!(r0.find("forward"), Some(action_col), "\n{header}\n{r0}");
    assert!(r0.contains(r#"path ^= /api, header x-canary = "1""#));
    let r1 = find("split api:90 api-canary:10; timeout 2s");
    assert_eq!(r1.find("split"), Some(action_col));
    assert!(r1.contains("path ~ ^/v[0-9]+/items, method GET"));
    assert!(r1.contains(" U7 ") && r1.contains("regex runs only in the user tier"));
    assert!(find("respond 200 (2 bytes)").contains("direct response is answered by the user tier"));
    assert!(find("forward api; set x-via").contains("host *.example.com"));
    let tcp = find("forward db");
    assert!(tcp.contains("K|U4") && tcp.contains(" U4 "), "{tcp}");
    assert!(find("listener 1 `db` tcp 127.0.0.1:8081").contains("1 rule"));
    assert!(find("127.0.0.1:9001, 127.0.0.1:9002").contains("round_robin"));
    let canary = find("127.0.0.1:9003");
    assert!(
        canary.contains("api-canary") && canary.contains("http2"),
        "{canary}"
    );
    // No kernel section: no kernel table. The NIC image decides the direct response (the host
    // then answers it) and says why the other routes stay on the host.
    assert!(!text.contains("tier K:"), "{text}");
    let n = find("tier N: app 1 type 0");
    assert!(n.contains("routes it decides: #2;"), "{n}");
    assert!(find("respond 200 (2 bytes)").contains(" q3 "));
    assert!(find("route 0 stays on the host").contains("header match needs the full request head"));
    assert!(find("route 1 stays on the host").contains("regex runs only in the user tier"));
    assert!(find("route 3 stays on the host").contains("host match needs the full request head"));
    assert!(text.contains("  (no match: 404)\n"));
}

#[test]
fn json_for_the_admin_endpoint() {
    let v = compile(&cfg(EXAMPLE)).unwrap().to_json();
    let web = &v["listeners"][0];
    assert_eq!(web["protocol"], "http");
    assert_eq!(web["index"]["regex"], 1);
    let r1 = &web["routes"][1];
    assert_eq!(r1["name"], "web/1");
    assert_eq!(r1["match"]["path"]["regex"], "^/v[0-9]+/items");
    assert_eq!(r1["match"]["method"], "GET");
    assert_eq!(r1["action"]["split"][1]["cluster"], "api-canary");
    assert_eq!(r1["action"]["split"][1]["weight"], 10);
    assert_eq!(r1["timeout"], "2s");
    assert_eq!(r1["tier"], "U7");
    assert_eq!(r1["eligible"], serde_json::json!(["U7"]));
    assert_eq!(
        web["routes"][0]["match"]["headers"][0],
        serde_json::json!({ "name": "x-canary", "exact": "1" })
    );
    assert_eq!(web["routes"][2]["action"]["direct_response"]["body"], "ok");
    assert_eq!(web["routes"][3]["match"]["host"]["suffix"], ".example.com");
    assert_eq!(
        web["routes"][3]["request_headers_to_add"]["x-via"],
        "flatmesh"
    );
    assert_eq!(r1["kernel"]["decides"], false);
    assert_eq!(r1["kernel"]["why"], "regex runs only in the user tier");
    assert_eq!(
        r1["nic"],
        serde_json::json!({ "decides": false, "why": "regex runs only in the user tier", "queue": null })
    );
    assert_eq!(web["routes"][2]["nic"]["queue"], 3);
    assert_eq!(web["nic"]["app_id"], 1);
    assert_eq!(v["node"]["kernel"]["state"], "as configured");
    let db = &v["listeners"][1];
    assert_eq!(db["rule"]["action"]["forward"], "db");
    assert_eq!(db["rule"]["eligible"], serde_json::json!(["K", "U4"]));
    assert_eq!(db["rule"]["tier"], "U4");
    assert_eq!(v["clusters"][1]["protocol"], "http2");
    assert_eq!(v["clusters"][0]["endpoints"][1], "127.0.0.1:9002");
}

#[test]
fn explain_counts_what_each_tier_decides_and_handles_an_empty_program() {
    let mut with_kernel = routes(
        "      - match: { path: { prefix: /a }, method: GET }\n        cluster: a\n\
         \x20     - match: { path: { exact: /b } }\n        cluster: b\n\
         \x20     - match: { path: { regex: /c } }\n        cluster: b\n",
    );
    with_kernel.kernel = Some(serde_norway::from_str("{ l7_dispatch: true }").unwrap());
    let p = compile(&with_kernel).unwrap();
    let text = p.explain();
    // Two clusters and a regex route: no connection of the listener is spliced, and the
    // table says so instead of counting entries that are never installed.
    assert!(
        text.contains("  tier K: its route table is not installed, no connection is spliced: the listener's routes lead to more than one cluster"),
        "{text}"
    );
    assert!(text.contains("routes it decides: #0, #1;"), "{text}");
    let row = text.lines().find(|l| l.contains("web/0")).unwrap();
    assert!(
        row.contains("N|K|U7")
            && row.contains(" - ")
            && row.contains(" q1 ")
            && row.contains(" U7 ")
            && row.contains("the kernel splices none"),
        "{row}"
    );
    // One cluster with one endpoint and a route for every request: the kernel's.
    let mut uniform = routes(
        "      - match: { path: { prefix: /a }, method: GET }\n        cluster: a\n\
         \x20     - match: { path: { exact: /b } }\n        cluster: a\n\
         \x20     - match: {}\n        cluster: a\n",
    );
    uniform.kernel = Some(serde_norway::from_str("{ l7_dispatch: true }").unwrap());
    let text = compile(&uniform).unwrap().explain();
    assert!(
        text.contains("  tier K: 3 of 64 route table entries, 3 decide, 0 punt;"),
        "{text}"
    );
    let row = text.lines().find(|l| l.contains("web/0")).unwrap();
    assert!(
        row.contains("N|K|U7")
            && row.contains(" h1 e0 ")
            && row.contains(" K ")
            && row.contains("decided in the kernel (sk_skb) on the first request"),
        "{row}"
    );

    let empty = compile(&cfg("{}")).unwrap();
    assert_eq!(empty.listener_id("web"), None);
    assert!(empty
        .explain()
        .starts_with("RuleProgram: 0 listeners, 0 clusters"));
    assert_eq!(
        empty.to_json(),
        serde_json::json!({
            "node": { "kernel": { "state": "as configured" } },
            "listeners": [],
            "clusters": []
        })
    );
}

#[test]
fn an_http_listener_without_routes_answers_404_for_everything() {
    let p = compile(&routes("      []\n")).unwrap();
    assert_eq!(hit(&p, &Req::get("/")), None);
}

#[test]
fn explain_shows_each_cluster_s_circuit_breaker_and_outlier_detection() {
    let yaml = r#"
listeners:
  - { name: web, address: 127.0.0.1:8080, protocol: http, routes: [ { match: { path: { prefix: / } }, cluster: api } ] }
clusters:
  - name: api
    endpoints: [ 127.0.0.1:9001 ]
    circuit_breaker: { max_requests: 50 }
    outlier_detection: { consecutive_5xx: 3, consecutive_connect_failures: 0, base_ejection_time: 10s, max_ejection_percent: 50 }
    health_check: { http: { path: /healthz, expect: [200, "300-302"] }, interval: 2s }
  - { name: plain, endpoints: [ 127.0.0.1:9002 ] }
  - name: weighted
    endpoints: [ 127.0.0.1:9003, { address: 127.0.0.1:9004, weight: 3, locality: us/a }, { address: 127.0.0.1:9005, priority: 1 } ]
    slow_start: { window: 30s }
node: { locality: us/a }
"#;
    let program = compile(&cfg(yaml)).unwrap();
    let text = program.explain();
    // A cluster's row is the one with its endpoint.
    let row = |endpoint: &str| {
        text.lines()
            .find(|l| l.contains(endpoint))
            .unwrap_or_else(|| panic!("no row for {endpoint} in\n{text}"))
            .to_owned()
    };
    let header = text
        .lines()
        .find(|l| l.contains("circuit breaker"))
        .unwrap();
    assert!(header.contains("outlier detection"), "{header}");
    assert!(header.contains("health check"), "{header}");
    let api = row("127.0.0.1:9001");
    assert!(
        api.contains("connections 1024, pending 1024, requests 50, retries 3"),
        "{api}"
    );
    assert!(
        api.contains("eject after 3 5xx in a row or a success rate 1.9 stdev below the mean (of >= 5 endpoints with >= 100 requests per 10s) for 10s x times ejected; at most 50% out"),
        "{api}"
    );
    assert!(
        api.contains("http GET /healthz expects 200,300-302 every 2s (timeout 1s); out after 3 failures, back after 2 passes"),
        "{api}"
    );
    let plain = row("127.0.0.1:9002");
    // Outlier detection and health check off, plain endpoints weighed equally.
    assert!(
        plain.contains("retries 3")
            && plain.matches("off").count() == 2
            && plain.trim_end().ends_with("equal"),
        "{plain}"
    );
    assert!(header.contains("weights, priorities, locality"), "{header}");
    let weighted = row("127.0.0.1:9004 w3");
    assert!(
        weighted.contains("P0: 127.0.0.1:9003 w1, 127.0.0.1:9004 w3 us/a (local); P1: 127.0.0.1:9005 w1; failover at healthy x 140% < 100%; node locality us/a first; slow start 30s (aggression 1, min 10%)"),
        "{weighted}"
    );
    assert_eq!(
        program.to_json()["clusters"][2]["endpoint_weights"][1]["weight"],
        3
    );
    let json = program.to_json();
    assert_eq!(json["clusters"][0]["circuit_breaker"]["max_requests"], 50);
    assert_eq!(
        json["clusters"][0]["outlier_detection"]["base_ejection_time"],
        "10s"
    );
    assert_eq!(
        json["clusters"][1]["outlier_detection"],
        serde_json::Value::Null
    );
    assert_eq!(
        json["clusters"][0]["health_check"]["http"]["path"],
        "/healthz"
    );
    assert_eq!(json["clusters"][0]["health_check"]["interval"], "2s");
    assert_eq!(json["clusters"][1]["health_check"], serde_json::Value::Null);
}

#[test]
fn fault_and_mirror_routes_run_in_the_user_tier_and_say_why() {
    let list = "      - match: { path: { prefix: /f } }\n        cluster: a\n        fault: { abort: { status: 503, percent: 10 }, delay: { duration: 2s, percent: 50 } }\n\
         \x20     - match: { path: { prefix: /g } }\n        cluster: a\n        fault: { abort: { grpc_status: 14 } }\n\
         \x20     - match: { path: { prefix: /m } }\n        cluster: a\n        mirror: { cluster: b, percent: 25 }\n\
         \x20     - match: { path: { prefix: /ok } }\n        cluster: a\n";
    let mut config = routes(list);
    config.kernel = Some(serde_norway::from_str("{ l7_dispatch: true }").unwrap());
    let p = compile(&config).unwrap();
    let table = match &p.listeners()[0].kind {
        flatmesh_rules::TableKind::Http(t) => &t.routes,
        other => panic!("unexpected {other:?}"),
    };
    let placed: Vec<_> = table
        .iter()
        .map(|r| (r.tier, r.placement.reason, r.placement.eligible.label()))
        .collect();
    // The NIC image only picks the core: the host runs the route's actions, faults included.
    assert_eq!(
        placed,
        [
            (Tier::UserL7, Reason::Fault, "N|U7".to_string()),
            (Tier::UserL7, Reason::Fault, "N|U7".to_string()),
            (Tier::UserL7, Reason::Mirror, "N|U7".to_string()),
            (
                Tier::UserL7,
                Reason::SpliceRoute { route: 0 },
                "N|K|U7".to_string()
            ),
        ]
    );
    // The kernel's table punts the fault and mirror routes to the user tier.
    let k = p.kernel();
    for path in ["/f", "/g", "/m"] {
        assert_eq!(
            k.first_match("GET", path)
                .map(|e| e.cluster_for(Protocols::HTTP1)),
            Some(None),
            "{path}"
        );
    }
    let f = table[0].fault.unwrap();
    assert_eq!(
        f.abort,
        Some((
            flatmesh_rules::AbortStatus::Http(http::StatusCode::SERVICE_UNAVAILABLE),
            flatmesh_rules::Share::of_percent(10.0)
        ))
    );
    assert_eq!(table[2].mirror.map(|m| m.cluster), p.cluster_id("b"));

    let text = p.explain();
    assert!(
        text.contains("fault abort 503 (10%), delay 2s (50%)"),
        "{text}"
    );
    assert!(text.contains("fault abort grpc-status 14 (100%)"), "{text}");
    assert!(text.contains("mirror b (25%)"), "{text}");
    assert!(
        text.contains("fault injection runs in the user tier"),
        "{text}"
    );
    assert!(text.contains("mirroring runs in the user tier"), "{text}");
    let json = p.to_json();
    let r0 = &json["listeners"][0]["routes"][0];
    assert_eq!(r0["fault"]["abort"]["status"], 503);
    assert_eq!(r0["fault"]["delay"]["duration"], "2s");
    assert_eq!(json["listeners"][0]["routes"][2]["mirror"]["cluster"], "b");
    assert_eq!(
        json["listeners"][0]["routes"][2]["reason"],
        "mirroring runs in the user tier (it copies the request to another cluster)"
    );

    // A mirror to a cluster that does not exist is refused (a config built in code).
    let mut bad = routes("      - cluster: a\n        mirror: { cluster: nope }\n");
    bad.kernel = None;
    assert!(matches!(
        compile(&bad),
        Err(RulesError::UnknownCluster { cluster, .. }) if cluster == "nope"
    ));
}

#[test]
fn rate_limited_routes_and_listeners_stay_in_the_user_tier_and_explain_shows_the_limits() {
    let placed = |listener_limit: &str| {
        let config = cfg(&format!(
            "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n{listener_limit}    routes:\n\
             \x20     - match: {{ path: {{ prefix: /limited }} }}\n        cluster: a\n        rate_limit: {{ requests_per_s: 10, burst: 20, key: {{ header: x-user }} }}\n\
             \x20     - match: {{ path: {{ prefix: /ok }} }}\n        cluster: a\n\
             \x20 - name: db\n    address: 127.0.0.1:3\n    protocol: tcp\n    cluster: a\n    connection_rate_limit: {{ connections_per_s: 50 }}\n\
             clusters:\n  - {{ name: a, endpoints: [127.0.0.1:2] }}\n\
             kernel: {{ l7_dispatch: true }}\n"
        ));
        let p = compile(&config).unwrap();
        let tiers: Vec<_> = match &p.listeners()[0].kind {
            flatmesh_rules::TableKind::Http(t) => t
                .routes
                .iter()
                .map(|r| (r.tier, r.placement.reason))
                .collect(),
            other => panic!("unexpected {other:?}"),
        };
        (p, tiers)
    };
    let (p, tiers) = placed("");
    assert_eq!(
        tiers,
        [
            (Tier::UserL7, Reason::RateLimit),
            (Tier::UserL7, Reason::SpliceRoute { route: 0 }),
        ]
    );
    let text = p.explain();
    assert!(
        text.contains("forward a; rate limit 10 requests/s, burst 20, per header x-user"),
        "{text}"
    );
    assert!(
        text.contains("rate limit 50 connections/s, burst 50 (node-wide;"),
        "{text}"
    );
    // The config has `kernel:`: the kernel enforces the connection limit where tier K
    // attaches; a running node says which tier does.
    assert!(
        text.contains("each new connection, in the kernel (socket filter on the listening sockets: a SYN over the limit is dropped unanswered")
            && text.contains("when tier K is attached, else in user space (accepted, then reset when over)"),
        "{text}"
    );
    let on_node = |kernel_conn_limits: &[&str], kernel| flatmesh_rules::NodeTiers {
        kernel,
        kernel_conn_limits: kernel_conn_limits.iter().map(|s| s.to_string()).collect(),
    };
    let attached = on_node(
        &["db"],
        flatmesh_rules::KernelRuntime::Attached {
            verdict: true,
            table_error: None,
        },
    );
    let text = p.explain_on(&attached);
    assert!(
        text.contains("each new connection, in the kernel (socket filter on the listening sockets")
            && !text.contains("reset when over"),
        "{text}"
    );
    assert_eq!(
        p.to_json_on(&attached)["listeners"][1]["rate_limit_tier"],
        "kernel"
    );
    let off = on_node(&[], flatmesh_rules::KernelRuntime::Off("not root".into()));
    let text = p.explain_on(&off);
    assert!(
        text.contains("each new connection, in user space (accepted, then reset when over)")
            && !text.contains("socket filter"),
        "{text}"
    );
    assert_eq!(
        p.to_json_on(&off)["listeners"][1]["rate_limit_tier"],
        "user"
    );
    assert_eq!(
        p.to_json()["listeners"][0]["routes"][0]["rate_limit"]["requests_per_s"],
        10
    );
    // A listener-wide limit counts every request: no route of it is decided below.
    let (p, tiers) = placed("    rate_limit: { requests_per_s: 100, key: client_address }\n");
    assert!(
        tiers
            .iter()
            .all(|t| *t == (Tier::UserL7, Reason::ListenerRateLimit)),
        "{tiers:?}"
    );
    assert!(
        p.explain()
            .contains("rate limit 100 requests/s, burst 100, per client address (node-wide; every request before routing"),
        "{}",
        p.explain()
    );
}

#[test]
fn route_tiers_on_a_node_are_the_tiers_rules_shows() {
    // What the node labels its request metrics with (`tier`): each route's tier on the node,
    // from the same placement as `/rules`.
    let config_text = String::from(
        "listeners:\n  - name: web\n    address: 127.0.0.1:1\n    protocol: http\n    routes:\n\
         \x20     - name: limited\n        match: { path: { prefix: /limited } }\n        cluster: a\n        rate_limit: { requests_per_s: 10 }\n\
         \x20     - name: fast\n        match: {}\n        cluster: a\n\
         clusters:\n  - { name: a, endpoints: [127.0.0.1:2] }\n\
         kernel: { l7_dispatch: true }\n",
    );
    let config = cfg(&config_text);
    let p = compile(&config).unwrap();
    let attached = flatmesh_rules::NodeTiers {
        kernel: flatmesh_rules::KernelRuntime::Attached {
            verdict: true,
            table_error: None,
        },
        ..Default::default()
    };
    let off = flatmesh_rules::NodeTiers {
        kernel: flatmesh_rules::KernelRuntime::Off("not root".into()),
        ..Default::default()
    };
    // The rate-limited route keeps the whole listener in the user tier (a spliced connection
    // could carry its requests); without its limit, both are the kernel's where it runs.
    let unlimited = compile(&cfg(
        &config_text.replace("        rate_limit: { requests_per_s: 10 }\n", "")
    ))
    .unwrap();
    for (p, node, tier) in [
        (&p, &attached, Tier::UserL7),
        (&p, &off, Tier::UserL7),
        (&unlimited, &attached, Tier::Kernel),
        (&unlimited, &off, Tier::UserL7),
    ] {
        let tiers = p.route_tiers_on(node);
        assert_eq!(tiers, [("web", "limited", tier), ("web", "fast", tier)]);
        let json = p.to_json_on(node);
        for (i, (_, _, tier)) in tiers.iter().enumerate() {
            assert_eq!(
                json["listeners"][0]["routes"][i]["tier"],
                tier.as_str(),
                "{json}"
            );
        }
    }
}
