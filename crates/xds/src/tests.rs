//! Unit tests: the Envoy import, the NACK reasons, and model -> xDS -> model round trips.
#![allow(clippy::unwrap_used)]

use flatmesh_config as model;

use crate::bootstrap;
use crate::error::XdsError;

fn example() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/envoy-bootstrap.yaml"
    ))
    .unwrap()
}

fn import_error(text: &str) -> String {
    match bootstrap::parse(text, "envoy.yaml") {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn example_bootstrap_imports() {
    let config = bootstrap::parse(&example(), "envoy.yaml").unwrap();
    assert_eq!(config.admin, "127.0.0.1:15000".parse().unwrap());
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(web.protocol, model::ListenerProtocol::Http);
    // api.local's routes come first, then its 404 fence, then the `*` routes.
    let hosts: Vec<Option<&str>> = web
        .routes
        .iter()
        .map(|r| r.matches.host.as_deref())
        .collect();
    assert_eq!(
        hosts,
        [
            Some("api.local"),
            Some("api.local"),
            Some("api.local"),
            None,
            None,
            None
        ]
    );
    assert_eq!(web.routes[2].direct_response.as_ref().unwrap().status, 404);
    let split = web.routes[0].split.as_ref().unwrap();
    assert_eq!((split[0].weight, split[1].weight), (90, 10));
    let fallback = &web.routes[1];
    assert_eq!(fallback.timeout, Some(std::time::Duration::from_secs(2)));
    let retries = fallback.retries.as_ref().unwrap();
    assert_eq!(retries.attempts, 2);
    assert_eq!(
        retries.on,
        [model::RetryOn::ConnectFailure, model::RetryOn::Status5xx]
    );
    assert_eq!(
        web.routes[3].matches.path,
        Some(model::PathMatch::Exact("/healthz".into()))
    );
    assert_eq!(
        web.routes[4].matches.headers[0].exact.as_deref(),
        Some("alice")
    );
    let tcp = config.listeners.iter().find(|l| l.name == "echo").unwrap();
    assert_eq!(tcp.cluster.as_deref(), Some("echo"));
    let v1 = config.cluster("api-v1").unwrap();
    assert_eq!(v1.lb, model::LbPolicy::LeastRequest);
    assert_eq!(v1.endpoints.len(), 2);
    assert_eq!(
        v1.connect_timeout,
        Some(std::time::Duration::from_millis(250))
    );
    assert_eq!(
        config.cluster("api-v2").unwrap().protocol,
        model::UpstreamProtocol::Http2
    );
    let sticky = config.cluster("sticky").unwrap();
    assert_eq!(sticky.lb, model::LbPolicy::Maglev);
    assert_eq!(sticky.hash_on.as_ref().unwrap().header, "x-user");
}

#[test]
fn envoy_connection_limits_become_flatmesh_limits() {
    let text = example()
        .replace(
            "    address: { socket_address: { address: 127.0.0.1, port_value: 8080 } }\n",
            "    address: { socket_address: { address: 127.0.0.1, port_value: 8080 } }\n    per_connection_buffer_limit_bytes: 32768\n",
        )
        .replace(
            "          codec_type: AUTO\n",
            "          codec_type: AUTO\n          http2_protocol_options: { max_concurrent_streams: 50, initial_stream_window_size: 131072, initial_connection_window_size: 2097152 }\n",
        )
        .replace(
            "          cluster: echo\n",
            "          cluster: echo\n          idle_timeout: 600s\n",
        )
        + "overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.global_downstream_max_connections\n    typed_config:\n      \"@type\": type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig\n      max_active_downstream_connections: 5000\n";
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    assert_eq!(config.limits.max_connections, 5000);
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(
        web.limits,
        model::ListenerLimits {
            per_connection_buffer_bytes: Some(32768),
            http2_max_concurrent_streams: Some(50),
            http2_stream_window: Some(131072),
            http2_connection_window: Some(2097152),
            ..Default::default()
        }
    );
    let echo = config.listeners.iter().find(|l| l.name == "echo").unwrap();
    assert_eq!(
        echo.limits.tcp_idle_timeout,
        Some(std::time::Duration::from_secs(600))
    );
    // What flatmesh cannot do is named, not dropped.
    let e = import_error(&text.replace("idle_timeout: 600s", "idle_timeout: 0s"));
    assert!(
        e.contains("idle_timeout") && e.contains("turns the idle timeout off"),
        "{e}"
    );
    let e = import_error(&text.replace(
        "max_concurrent_streams: 50,",
        "max_concurrent_streams: 50, hpack_table_size: 0,",
    ));
    assert!(e.contains("http2_protocol_options.hpack_table_size"), "{e}");
    let e = import_error(&text.replace("global_downstream_max_connections", "fixed_heap"));
    assert!(e.contains("overload_manager.resource_monitors[0]"), "{e}");
    // Out of flatmesh's ranges: refused by the config's own validation.
    let e = import_error(&text.replace(
        "initial_stream_window_size: 131072",
        "initial_stream_window_size: 100",
    ));
    assert!(e.contains("http2_stream_window is 100"), "{e}");
}

#[test]
fn unknown_bootstrap_fields_are_named() {
    let text = example().replace(
        "    lb_policy: MAGLEV\n",
        "    lb_policy: MAGLEV\n    common_lb_config: {}\n",
    );
    let e = import_error(&text);
    assert!(
        e.contains("static_resources.clusters[2] (\"sticky\").common_lb_config"),
        "{e}"
    );
    assert!(e.contains("not supported"), "{e}");

    let e = import_error("static_resources: {}\nlayered_runtime: {}\n");
    assert!(e.starts_with("envoy.yaml: layered_runtime"), "{e}");
}

#[test]
fn unsupported_values_are_named() {
    let e = import_error(&example().replace("lb_policy: MAGLEV", "lb_policy: CLUSTER_PROVIDED"));
    assert!(
        e.contains("Cluster \"sticky\": lb_policy") && e.contains("CLUSTER_PROVIDED"),
        "{e}"
    );

    let e = import_error(&example().replace(
        "type: STATIC\n    lb_policy: MAGLEV",
        "type: ORIGINAL_DST\n    lb_policy: MAGLEV",
    ));
    assert!(
        e.contains("Cluster \"sticky\": load_assignment")
            && e.contains(
                "an ORIGINAL_DST cluster sends each connection where its client was going"
            ),
        "{e}"
    );

    // A DNS cluster is fine with IP addresses, and names the address it cannot resolve.
    let dns = example().replace(
        "type: STATIC\n    lb_policy: MAGLEV",
        "type: STRICT_DNS\n    dns_lookup_family: V4_ONLY\n    dns_refresh_rate: 5s\n    lb_policy: MAGLEV",
    );
    let config = bootstrap::parse(&dns, "envoy.yaml").unwrap();
    assert_eq!(config.cluster("sticky").unwrap().endpoints.len(), 2);
    let e = import_error(&dns.replace(
        "address: 127.0.0.1, port_value: 9102 } } }\n  - name: echo",
        "address: sticky.local, port_value: 9102 } } }\n  - name: echo",
    ));
    assert!(
        e.contains("Cluster \"sticky\": load_assignment.endpoints[0].lb_endpoints[1].endpoint.address.socket_address.address")
            && e.contains("not an IP address"),
        "{e}"
    );
    let e = import_error(&example().replace(
        "type: STATIC\n    lb_policy: MAGLEV",
        "type: LOGICAL_DNS\n    lb_policy: MAGLEV",
    ));
    assert!(
        e.contains("LOGICAL_DNS cluster has exactly one endpoint"),
        "{e}"
    );

    // EDS needs a control plane, which a static import does not have.
    let e = import_error(&example().replace(
        "type: STATIC\n    lb_policy: MAGLEV",
        "type: EDS\n    lb_policy: MAGLEV",
    ));
    assert!(
        e.contains("static_resources.clusters[2] (\"sticky\").type") && e.contains("--xds"),
        "{e}"
    );

    let e = import_error(&example().replace(
        "address: 127.0.0.1, port_value: 9200",
        "address: echo.local, port_value: 9200",
    ));
    assert!(
        e.contains("socket_address.address") && e.contains("not an IP address"),
        "{e}"
    );

    let e = import_error(&example().replace(
        "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
        "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors",
    ));
    assert!(
        e.contains("http_filters[0].typed_config.@type") && e.contains("Cors"),
        "{e}"
    );

    let e = import_error(&example().replace("domains: [\"api.local\"]", "domains: [\"api.*\"]"));
    assert!(e.contains("domains") && e.contains("api.*"), "{e}");

    let e = import_error(&example().replace("timeout: 2s", "timeout: soon"));
    assert!(
        e.contains("route.timeout") && e.contains("`soon` is not a duration"),
        "{e}"
    );
}

#[test]
fn invalid_model_is_reported_by_name() {
    let e = import_error(&example().replace("prefix: /v2", "prefix: v2"));
    assert!(
        e.contains("listener \"web\"") && e.contains("does not start with `/`"),
        "{e}"
    );
}

#[test]
fn bad_documents_fail_cleanly() {
    for text in [
        "[1, 2",
        "- a\n- b\n",
        "static_resources: 7\n",
        "static_resources: { listeners: 3 }\n",
        "admin: { address: {} }\n",
    ] {
        let e = bootstrap::parse(text, "x.yaml").unwrap_err();
        assert!(
            matches!(e, XdsError::Syntax { .. } | XdsError::Resource { .. }),
            "{text}: {e}"
        );
    }
}

#[test]
fn model_round_trips_through_xds() {
    let text = r#"
listeners:
  - name: web
    address: 127.0.0.1:8080
    protocol: http
    normalize_path: false
    merge_slashes: true
    path_with_escaped_slashes_action: unescape_and_redirect
    routes:
      - name: exact
        match: { path: { exact: /x }, method: GET, headers: [ { name: x-a, prefix: p }, { name: x-b, present: true } ], query: [ { name: q, regex: "a+" } ] }
        cluster: one
        timeout: 3s
        upgrades: [ websocket ]
        retries: { attempts: 3, on: [ reset, gateway-error, unavailable, deadline-exceeded ], per_try_timeout: 1s, backoff: { base: 10ms, max: 1s } }
        request_headers_to_add: { x-added: "1" }
        request_headers_to_remove: [ x-secret ]
        response_headers_to_add: { x-served-by: flatmesh }
      - match: { path: { regex: "^/r/[0-9]+$" } }
        split: [ { cluster: one, weight: 3 }, { cluster: two, weight: 1 } ]
      - name: by-message
        match: { path: { prefix: /pkg.Svc/ }, grpc_field: { number: 3, prefix: vip- } }
        cluster: two
      - direct_response: { status: 404, body: nope }
    limits: { per_connection_buffer_bytes: 65536, http2_max_concurrent_streams: 10, http2_stream_window: 32768, http2_connection_window: 131072 }
    tls: { cert: /pki/node.pem, key: /pki/node.key, client_ca: /pki/ca.pem, allow: [ spiffe://td/ns/shop/sa/web, "spiffe://td/ns/ops/*", "spiffe://partner/*" ] }
    authorization:
      default: deny
      policies:
        - name: no-admin
          action: deny
          from: { principals: [ spiffe://td/ns/shop/sa/web, "spiffe://partner/*" ], namespaces: [ ops, "a.b+c" ] }
          to: { methods: [ POST, DELETE ], paths: [ /admin, "/admin/*", "*.php", "*" ], hosts: [ admin.example.org, "*.internal", "api.*", "*" ] }
          when: [ { header: x-debug, values: [ "1", "on*", "*yes", "*" ] }, { header: x-tenant, values: [ acme ] } ]
        - { name: no-delete, action: deny, to: { methods: [ DELETE ] } }
        - { name: anyone-ready, action: allow, to: { paths: [ /ready ] } }
        - name: shop-reads
          action: allow
          from: { namespaces: [ shop ] }
          to: { methods: [ GET, HEAD ], paths: [ "/api/*" ], hosts: [ "*.example.org" ] }
          when: [ { header: x-tenant, values: [ "acme", "beta-*" ] } ]
  - name: tcp
    address: 127.0.0.1:9000
    protocol: tcp
    cluster: two
    limits: { tcp_idle_timeout: 10m }
    tls: { cert: /pki/node.pem, key: /pki/node.key }
    authorization: { default: deny }
  - name: mtcp
    address: 127.0.0.1:9001
    protocol: tcp
    cluster: three
    tls: { cert: /pki/node.pem, key: /pki/node.key, client_ca: /pki/ca.pem, allow: [ "spiffe://td/ns/data/*" ] }
    authorization:
      policies:
        - { name: no-batch, action: deny, from: { namespaces: [ batch ] } }
        - { name: no-old-db, action: deny, from: { principals: [ spiffe://td/ns/data/sa/old, "spiffe://td/ns/data/tmp/*" ] } }
  - name: mtcp-allow
    address: 127.0.0.1:9003
    protocol: tcp
    cluster: three
    tls: { cert: /pki/node.pem, key: /pki/node.key, client_ca: /pki/ca.pem, allow: [ "spiffe://td/*" ] }
    authorization:
      default: deny
      policies:
        - { name: z-not-plaintext, action: deny, from: { namespaces: [ plain ] } }
        - { name: db-clients, action: allow, from: { principals: [ "spiffe://td/ns/data/*" ], namespaces: [ data ] } }
        - { name: ops, action: allow, from: { namespaces: [ ops ] } }
  - { name: plain, address: 127.0.0.1:9002, protocol: tcp, cluster: three }
clusters:
  - name: one
    lb: ring_hash
    hash_on: { header: x-user }
    endpoints: [ 127.0.0.1:1, 127.0.0.1:2 ]
    protocol: http2
    connect_timeout: 1s
    tls: { ca: /pki/ca.pem, cert: /pki/node.pem, key: /pki/node.key, server_ids: [ spiffe://td/ns/shop/sa/api, "spiffe://td/ns/api/*" ], sni: api.shop.svc }
  - { name: two, lb: random, endpoints: [ "[::1]:3" ], tls: { ca: /pki/ca.pem, server_ids: [ spiffe://td/ns/data/sa/db ] } }
  - { name: three, endpoints: [ 127.0.0.1:4 ], connect_timeout: 1s, health_check: { grpc: { service: db } } }
  - name: guarded
    endpoints: [ 127.0.0.1:5, 127.0.0.1:6 ]
    circuit_breaker: { max_connections: 10, max_pending: 20, max_requests: 30, max_retries: 0 }
    outlier_detection: { consecutive_5xx: 0, consecutive_gateway_errors: 4, consecutive_connect_failures: 2, interval: 5s, base_ejection_time: 1500ms, max_ejection_percent: 50 }
    health_check: { http: { path: /healthz, expect: [ 200, "300-302" ] }, interval: 2s, timeout: 500ms, unhealthy_threshold: 4, healthy_threshold: 1 }
  - name: guarded-defaults
    endpoints: [ 127.0.0.1:7 ]
    circuit_breaker: {}
    outlier_detection: { consecutive_connect_failures: 0 }
    health_check: { tcp: {} }
  - name: weighted
    lb: least_request
    endpoints: [ 127.0.0.1:8, { address: 127.0.0.1:9, weight: 3, locality: us/a }, { address: 127.0.0.1:10, priority: 1, locality: us/b/r1 } ]
    slow_start: { window: 30s, aggression: 2.0, min_weight_percent: 5 }
    overprovisioning_factor: 120
  - { name: weighted-rr, endpoints: [ { address: 127.0.0.1:11, weight: 2 } ], slow_start: { window: 1s } }
"#;
    let config = model::parse(text, "t.yaml").unwrap();
    // Every TLS shape is in it: http and tcp listeners with and without client certificates,
    // exact IDs and `/*` patterns; clusters with and without a client certificate and SNI.
    assert_eq!(
        config.listeners.iter().filter(|l| l.tls.is_some()).count(),
        4
    );
    assert_eq!(
        config.clusters.iter().filter(|c| c.tls.is_some()).count(),
        2
    );
    // Every authorization shape is in it too: http and tcp listeners, both defaults, deny and
    // allow layers, every field of `from`, `to` and `when`, every kind of pattern. (Policies
    // are listed as they read back: deny before allow, each by name; see
    // `authorization_reads_back_in_envoys_terms`.)
    assert_eq!(
        config
            .listeners
            .iter()
            .filter(|l| l.authorization.is_some())
            .count(),
        4
    );
    let resources = crate::from_model::resources(&config);
    let mut back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    // The server states every cluster's connect timeout explicitly.
    for c in &mut back.clusters {
        if [
            "two",
            "guarded",
            "guarded-defaults",
            "weighted",
            "weighted-rr",
        ]
        .contains(&c.name.as_str())
        {
            assert_eq!(c.connect_timeout, Some(config.limits.connect_timeout));
            c.connect_timeout = None;
        }
    }
    let sorted = |mut c: model::Config| {
        c.listeners.sort_by(|a, b| a.name.cmp(&b.name));
        c.clusters.sort_by(|a, b| a.name.cmp(&b.name));
        c
    };
    assert_eq!(sorted(back), sorted(config));
}

#[test]
fn missing_clusters_answer_503_and_empty_eds_is_allowed() {
    use crate::resources::Resources;
    let config = model::parse(
        "listeners: [ { name: t, address: 127.0.0.1:9000, protocol: tcp, cluster: c } ]\nclusters: [ { name: c, endpoints: [ 127.0.0.1:1 ] } ]\n",
        "t.yaml",
    )
    .unwrap();
    let mut resources: Resources = crate::from_model::resources(&config);
    resources.clusters.clear();
    resources.endpoints.clear();
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    assert!(back.cluster("c").unwrap().endpoints.is_empty());
}

/// A qnp listener dispatches to the node's own workers by QingNiao rules, which no Envoy
/// listener can say: it is not served over xDS; the node's other listeners are.
#[test]
fn qnp_listeners_stay_in_the_node_s_own_config() {
    let config = model::parse(
        "listeners:\n  - { name: t, address: 127.0.0.1:9000, protocol: tcp, cluster: c }\n  - { name: kv, address: 127.0.0.1:7000, protocol: qnp, qnp: { workers: [ 127.0.0.1:7001 ], rules: \"default 1 0 -> 0\" } }\nclusters: [ { name: c, endpoints: [ 127.0.0.1:1 ] } ]\n",
        "t.yaml",
    )
    .unwrap();
    let resources = crate::from_model::resources(&config);
    assert_eq!(
        resources.listeners.keys().collect::<Vec<_>>(),
        vec!["t"],
        "only the tcp listener is served"
    );
}

/// A bootstrap with `admin.address` written as `admin_address` and one tcp listener.
fn with_admin(admin_address: &str) -> String {
    format!(
        r#"
admin: {{ address: {admin_address} }}
static_resources:
  listeners:
  - name: db
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 7000 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: db
          cluster: db
  clusters:
  - name: db
    load_assignment:
      cluster_name: db
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 5432 }} }} }} }} ] }} ]
"#
    )
}

#[test]
fn admin_pipe_imports_as_a_unix_socket_with_its_mode() {
    let config = bootstrap::parse(
        &with_admin("{ pipe: { path: /run/envoy/admin.sock, mode: 0o660 } }"),
        "envoy.yaml",
    )
    .unwrap();
    assert_eq!(
        config.admin.address,
        model::AdminAddress::Unix("/run/envoy/admin.sock".into())
    );
    assert_eq!(config.admin.unix_mode(), 0o660);
    let e = import_error(&with_admin("{ pipe: { path: \"@admin\" } }"));
    assert!(e.contains("abstract socket"), "{e}");
    // Envoy's habit of an admin on every address is not taken silently.
    let e = import_error(&with_admin(
        "{ socket_address: { address: 0.0.0.0, port_value: 9901 } }",
    ));
    assert!(e.contains("can be reached from other hosts"), "{e}");
}

#[test]
fn durations_past_365_days_are_refused_by_name() {
    // Issue 23 item 9: `i64::MAX` seconds from a bootstrap (or xDS) was accepted and panicked
    // every request on that route.
    let e = import_error(&example().replace("timeout: 2s", "timeout: 9223372036854775807s"));
    assert!(
        e.contains(".timeout") && e.contains("longer than 365 days"),
        "{e}"
    );
    let e =
        import_error(&example().replace("connect_timeout: 0.25s", "connect_timeout: 31536001s"));
    assert!(
        e.contains("connect_timeout") && e.contains("365 days"),
        "{e}"
    );
    // 365 days itself is fine.
    let config = bootstrap::parse(
        &example().replace("timeout: 2s", "timeout: 31536000s"),
        "envoy.yaml",
    )
    .unwrap();
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(web.routes[1].timeout, Some(flatmesh_config::duration::MAX));
    // Straight from xDS: the same check, and nanos of a second or more are not a Duration.
    let at = "RouteAction.timeout";
    let huge = envoy_types::pb::google::protobuf::Duration {
        seconds: i64::MAX,
        nanos: 0,
    };
    let e = crate::to_model::duration(&huge, at)
        .unwrap_err()
        .to_string();
    assert!(e.contains("365 days"), "{e}");
    let bad = envoy_types::pb::google::protobuf::Duration {
        seconds: 1,
        nanos: 1_000_000_000,
    };
    assert!(crate::to_model::duration(&bad, at).is_err());
}

#[test]
fn path_normalisation_and_upgrades_import_from_envoy() {
    let text = example().replace(
        "          codec_type: AUTO\n",
        "          codec_type: AUTO\n          normalize_path: true\n          merge_slashes: true\n          path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT\n          upgrade_configs: [ { upgrade_type: websocket }, { upgrade_type: spdy/3.1, enabled: false } ]\n",
    ).replace(
        "route: { cluster: api-v1, timeout: 2s,",
        "route: { cluster: api-v1, upgrade_configs: [ { upgrade_type: websocket, enabled: false }, { upgrade_type: spdy/3.1 } ], timeout: 2s,",
    );
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(
        (
            web.normalize_path,
            web.merge_slashes,
            web.path_with_escaped_slashes_action
        ),
        (
            Some(true),
            Some(true),
            Some(model::EscapedSlashesAction::UnescapeAndRedirect)
        )
    );
    // Envoy's rule: the route's own upgrade_configs win type by type; the connection
    // manager's enabled types apply to every other forwarding route.
    assert_eq!(web.routes[1].upgrades, ["spdy/3.1"]);
    assert_eq!(web.routes[0].upgrades, ["websocket"]);
    assert!(
        web.routes[2].upgrades.is_empty(),
        "a direct response takes no upgrade"
    );
    // Unset keys stay unset: the listener's own defaults apply.
    let plain = bootstrap::parse(&example(), "envoy.yaml").unwrap();
    let web = plain.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(
        (
            web.normalize_path,
            web.merge_slashes,
            web.path_with_escaped_slashes_action
        ),
        (None, None, None)
    );
    assert!(web.routes.iter().all(|r| r.upgrades.is_empty()));
    let e = import_error(&text.replace("UNESCAPE_AND_REDIRECT", "REDIRECT"));
    assert!(e.contains("path_with_escaped_slashes_action"), "{e}");
}

/// An Envoy bootstrap with every TLS shape flatmesh takes: an mTLS http listener admitting an
/// ID and a namespace, a TLS-only tcp listener, and clusters originating TLS with and without a
/// client certificate. It is also the bootstrap fuzz target's seed for TLS.
const TLS_BOOTSTRAP: &str = include_str!("../fuzz/seeds/bootstrap/tls.yaml");

#[test]
fn tls_contexts_import_from_envoy() {
    let config = bootstrap::parse(TLS_BOOTSTRAP, "envoy.yaml").unwrap();
    let listener = |name: &str| config.listeners.iter().find(|l| l.name == name).unwrap();
    assert_eq!(
        listener("mtls").tls,
        Some(model::ListenerTls {
            cert: "/pki/node.pem".into(),
            key: "/pki/node.key".into(),
            client_ca: Some("/pki/ca.pem".into()),
            allow: vec![
                "spiffe://td/ns/shop/sa/web".into(),
                "spiffe://td/ns/ops/*".into()
            ],
            crl: None,
        })
    );
    assert_eq!(
        listener("tls").tls,
        Some(model::ListenerTls {
            cert: "/pki/node.pem".into(),
            key: "/pki/node.key".into(),
            client_ca: None,
            allow: Vec::new(),
            crl: None,
        })
    );
    assert_eq!(
        config.cluster("api").unwrap().tls,
        Some(model::ClusterTls {
            ca: "/pki/ca.pem".into(),
            cert: Some("/pki/node.pem".into()),
            key: Some("/pki/node.key".into()),
            server_ids: vec!["spiffe://td/ns/api/*".into()],
            sni: Some("api.shop.svc".into()),
            crl: None,
        })
    );
    assert_eq!(
        config.cluster("db").unwrap().tls,
        Some(model::ClusterTls {
            ca: "/pki/ca.pem".into(),
            cert: None,
            key: None,
            server_ids: vec!["spiffe://td/ns/data/sa/db".into()],
            sni: None,
            crl: None,
        })
    );
    // Envoy's plaintext transport socket is no TLS at all.
    let plain = TLS_BOOTSTRAP.replacen(
        "        typed_config:\n          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext\n          common_tls_context:\n            tls_certificates:\n            - certificate_chain: { filename: /pki/node.pem }\n              private_key: { filename: /pki/node.key }\n",
        "        typed_config: { \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer }\n",
        1,
    );
    assert_ne!(plain, TLS_BOOTSTRAP);
    let config = bootstrap::parse(&plain, "envoy.yaml").unwrap();
    let tls = config.listeners.iter().find(|l| l.name == "tls").unwrap();
    assert_eq!(tls.tls, None);
}

/// A `crl` is Envoy's `validation_context.crl` (a file name), both ways.
#[test]
fn a_crl_maps_to_envoys_validation_context_crl() {
    let listener = model::ListenerTls {
        cert: "/pki/node.pem".into(),
        key: "/pki/node.key".into(),
        client_ca: Some("/pki/ca.pem".into()),
        allow: vec!["spiffe://td/*".into()],
        crl: Some("/pki/crl.pem".into()),
    };
    let socket = crate::tls::downstream(&listener, model::ListenerProtocol::Http);
    let back = crate::tls::listener_tls(&socket, model::ListenerProtocol::Http, "l").unwrap();
    assert_eq!(back, Some(listener));
    let cluster = model::ClusterTls {
        ca: "/pki/ca.pem".into(),
        cert: None,
        key: None,
        server_ids: vec!["spiffe://td/ns/api/*".into()],
        sni: None,
        crl: Some("/pki/crl.pem".into()),
    };
    let socket = crate::tls::upstream(&cluster, model::UpstreamProtocol::Http1);
    let back = crate::tls::cluster_tls(&socket, model::UpstreamProtocol::Http1, "c").unwrap();
    assert_eq!(back, Some(cluster));
    // Written where Envoy reads it: `validation_context.crl` as a file name.
    use envoy_types::pb::envoy::config::core::v3::{data_source, transport_socket};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        common_tls_context::ValidationContextType, UpstreamTlsContext,
    };
    use prost::Message;
    let Some(transport_socket::ConfigType::TypedConfig(any)) = socket.config_type else {
        panic!("no typed config")
    };
    let context = UpstreamTlsContext::decode(any.value.as_slice()).unwrap();
    let Some(ValidationContextType::ValidationContext(validation)) =
        context.common_tls_context.unwrap().validation_context_type
    else {
        panic!("no validation context")
    };
    assert_eq!(
        validation.crl.unwrap().specifier,
        Some(data_source::Specifier::Filename("/pki/crl.pem".into()))
    );
}

/// What the server sends Envoy is the shape the import takes, field for field: the listener's
/// and the clusters' transport sockets written from the model equal the hand-written Envoy ones
/// (but for the `tls_params` and the plain defaults the hand-written file adds).
#[test]
fn the_served_tls_shape_is_envoys() {
    let config = bootstrap::parse(TLS_BOOTSTRAP, "envoy.yaml").unwrap();
    let served = crate::from_model::resources(&config);
    let value: serde_json::Value = serde_norway::from_str(TLS_BOOTSTRAP).unwrap();
    let (written, _) = bootstrap::bootstrap(value).unwrap();
    for name in ["mtls", "tls"] {
        assert_eq!(
            served.listeners[name].filter_chains[0].transport_socket,
            written.listeners[name].filter_chains[0].transport_socket,
            "listener {name}"
        );
    }
    let served_api = served.clusters["api"].transport_socket.clone().unwrap();
    let written_api = written.clusters["api"].transport_socket.clone().unwrap();
    let unpack = |socket: envoy_types::pb::envoy::config::core::v3::TransportSocket| {
        use prost::Message;
        let Some(
            envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
                any,
            ),
        ) = socket.config_type
        else {
            panic!("no typed_config")
        };
        envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext::decode(
            any.value.as_slice(),
        )
        .unwrap()
    };
    let mut written_api = unpack(written_api);
    written_api.common_tls_context.as_mut().unwrap().tls_params = None;
    assert_eq!(unpack(served_api), written_api);
    // The db cluster offers its protocol's ALPN (http/1.1) where the file leaves it out.
    let mut served_db = unpack(served.clusters["db"].transport_socket.clone().unwrap());
    assert_eq!(
        served_db
            .common_tls_context
            .as_ref()
            .unwrap()
            .alpn_protocols,
        ["http/1.1"]
    );
    served_db
        .common_tls_context
        .as_mut()
        .unwrap()
        .alpn_protocols = Vec::new();
    assert_eq!(
        served_db,
        unpack(written.clusters["db"].transport_socket.clone().unwrap())
    );
}

/// Everything in a TLS context that flatmesh cannot honour is refused with the field's path,
/// in the Envoy import and over xDS alike (the import walks into the same messages).
#[test]
fn unsupported_tls_is_refused_by_name() {
    let listener_ctx = "Listener \"mtls\": filter_chains[0].transport_socket.typed_config";
    let cluster_ctx = "Cluster \"api\": transport_socket.typed_config";
    let l = |field: &str| format!("{listener_ctx}.{field}");
    let c = |field: &str| format!("{cluster_ctx}.{field}");
    let cases: Vec<(&str, &str, String, &str)> = vec![
        (
            "certificate_chain: { filename: /pki/node.pem }\n              private_key",
            "certificate_chain: { inline_string: \"-----BEGIN CERTIFICATE-----\" }\n              private_key",
            l("common_tls_context.tls_certificates[0].certificate_chain"),
            "inline certificates and keys are not supported",
        ),
        (
            "private_key: { filename: /pki/node.key }\n            validation_context",
            "private_key: { environment_variable: KEY }\n            validation_context",
            l("common_tls_context.tls_certificates[0].private_key"),
            "environment_variable is not supported",
        ),
        (
            "            tls_certificates:\n            - certificate_chain: { filename: /pki/node.pem }\n              private_key: { filename: /pki/node.key }\n            validation_context:",
            "            tls_certificate_sds_secret_configs: [ { name: node, sds_config: { ads: {} } } ]\n            validation_context:",
            "Listener \"mtls\"".to_string(),
            "names the SDS secret `node`, which is not given: add it to static_resources.secrets",
        ),
        (
            "            tls_certificates:\n            - certificate_chain: { filename: /pki/node.pem }\n              private_key: { filename: /pki/node.key }\n            validation_context:",
            "            tls_certificate_sds_secret_configs: [ { name: node, sds_config: { path_config_source: { path: /sds.yaml } } } ]\n            validation_context:",
            "static_resources.listeners[0] (\"mtls\").filter_chains[0].transport_socket.typed_config.common_tls_context.tls_certificate_sds_secret_configs[0].sds_config".to_string(),
            "only `ads: {}` is supported",
        ),
        (
            "            tls_certificates:\n            - certificate_chain: { filename: /pki/node.pem }\n              private_key: { filename: /pki/node.key }\n            validation_context:",
            "            tls_certificate_sds_secret_configs: [ { name: a }, { name: b } ]\n            validation_context:",
            l("common_tls_context.tls_certificates"),
            "flatmesh presents one",
        ),
        (
            "            validation_context:\n              trusted_ca: { filename: /pki/ca.pem }\n              match_typed_subject_alt_names:\n              - san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n              - san_type: URI\n                matcher: { prefix: \"spiffe://td/ns/ops/\" }\n",
            "            validation_context_sds_secret_config: { name: bundle, sds_config: { ads: {} } }\n",
            l("common_tls_context.validation_context_sds_secret_config"),
            "is not supported alone: flatmesh takes the SPIFFE IDs a peer must present from the config",
        ),
        (
            "            validation_context:\n              trusted_ca: { filename: /pki/ca.pem }\n              match_typed_subject_alt_names:\n              - san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n              - san_type: URI\n                matcher: { prefix: \"spiffe://td/ns/ops/\" }\n",
            "            combined_validation_context:\n              default_validation_context: { match_typed_subject_alt_names: [ { san_type: URI, matcher: { exact: \"spiffe://td/ns/shop/sa/web\" } } ] }\n",
            l("common_tls_context.combined_validation_context.validation_context_sds_secret_config"),
            "is missing; it names the secret holding the roots",
        ),
        (
            "            validation_context:\n              trusted_ca: { filename: /pki/ca.pem }\n              match_typed_subject_alt_names:\n              - san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n              - san_type: URI\n                matcher: { prefix: \"spiffe://td/ns/ops/\" }\n",
            "            combined_validation_context:\n              default_validation_context: { trusted_ca: { filename: /pki/ca.pem }, match_typed_subject_alt_names: [ { san_type: URI, matcher: { exact: \"spiffe://td/ns/shop/sa/web\" } } ] }\n              validation_context_sds_secret_config: { name: ROOTCA, sds_config: { ads: {} } }\n",
            l("common_tls_context.combined_validation_context.default_validation_context.trusted_ca"),
            "is given besides the roots secret",
        ),
        (
            "- san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }",
            "- san_type: DNS\n                matcher: { exact: web.shop.svc }",
            l("common_tls_context.validation_context.match_typed_subject_alt_names[0].san_type"),
            "DNS is not supported: flatmesh checks peers by SPIFFE ID",
        ),
        (
            "matcher: { prefix: \"spiffe://td/ns/ops/\" }",
            "matcher: { prefix: \"spiffe://td/ns/op\" }",
            l("common_tls_context.validation_context.match_typed_subject_alt_names[1].matcher.prefix"),
            "does not end with `/`",
        ),
        (
            "matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }",
            "matcher: { exact: \"spiffe://td/ns/shop/*\" }",
            l("common_tls_context.validation_context.match_typed_subject_alt_names[0].matcher.exact"),
            "is not a SPIFFE ID",
        ),
        (
            "matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }",
            "matcher: { exact: \"https://web.shop\" }",
            l("common_tls_context.validation_context.match_typed_subject_alt_names[0].matcher.exact"),
            "is not a SPIFFE ID",
        ),
        (
            "matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }",
            "matcher: { safe_regex: { regex: \"spiffe://td/.*\" } }",
            l("common_tls_context.validation_context.match_typed_subject_alt_names[0].matcher"),
            "only exact (one SPIFFE ID) and prefix",
        ),
        (
            "matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }",
            "matcher: { exact: \"spiffe://td/ns/shop/sa/web\", ignore_case: true }",
            l("common_tls_context.validation_context.match_typed_subject_alt_names[0].matcher.ignore_case"),
            "compared exactly",
        ),
        (
            "              match_typed_subject_alt_names:\n              - san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n              - san_type: URI\n                matcher: { prefix: \"spiffe://td/ns/ops/\" }\n",
            "",
            l("common_tls_context.validation_context.match_typed_subject_alt_names"),
            "Envoy would accept any peer the CA signed",
        ),
        (
            "require_client_certificate: true",
            "require_client_certificate: false",
            l("require_client_certificate"),
            "flatmesh requires every client certificate it verifies",
        ),
        (
            "            validation_context:\n              trusted_ca: { filename: /pki/ca.pem }\n              match_typed_subject_alt_names:\n              - san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n              - san_type: URI\n                matcher: { prefix: \"spiffe://td/ns/ops/\" }\n",
            "",
            l("common_tls_context.validation_context"),
            "require_client_certificate needs the CA",
        ),
        (
            "              trusted_ca: { filename: /pki/ca.pem }\n              match_typed_subject_alt_names:",
            "              match_typed_subject_alt_names:",
            l("common_tls_context.validation_context.trusted_ca"),
            "is missing; give the PEM file",
        ),
        (
            "            alpn_protocols: [ h2, http/1.1 ]",
            "            alpn_protocols: [ h3 ]",
            l("common_tls_context.alpn_protocols"),
            "`h3` is not supported: flatmesh's http listeners speak h2 and http/1.1",
        ),
        (
            "          require_client_certificate: true",
            "          require_client_certificate: true\n          require_sni: true",
            "static_resources.listeners[0] (\"mtls\").filter_chains[0].transport_socket.typed_config.require_sni".to_string(),
            "not supported by flatmesh's Envoy import",
        ),
        (
            "tls_minimum_protocol_version: TLSv1_2",
            "tls_minimum_protocol_version: TLSv1_0",
            c("common_tls_context.tls_params.tls_minimum_protocol_version"),
            "TLSv1_0 is not supported: flatmesh speaks TLS 1.2 and 1.3",
        ),
        (
            "tls_maximum_protocol_version: TLSv1_3",
            "tls_maximum_protocol_version: TLSv1_2",
            c("common_tls_context.tls_params.tls_maximum_protocol_version"),
            "TLSv1_2 is not supported",
        ),
        (
            "tls_maximum_protocol_version: TLSv1_3 }",
            "tls_maximum_protocol_version: TLSv1_3, cipher_suites: [ ECDHE-RSA-AES128-SHA ] }",
            c("common_tls_context.tls_params.cipher_suites"),
            "flatmesh negotiates its own AEAD suites",
        ),
        (
            "          alpn_protocols: [ h2 ]",
            "          alpn_protocols: [ http/1.1 ]",
            "Cluster \"api\": transport_socket.typed_config.common_tls_context.alpn_protocols".to_string(),
            "flatmesh offers the cluster's own protocol, `h2`",
        ),
        (
            "        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: api.shop.svc",
            "        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "Cluster \"api\": transport_socket.typed_config".to_string(),
            "is not supported here; flatmesh speaks TLS (type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext)",
        ),
        (
            "        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: api.shop.svc",
            "        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.alts.v3.Alts",
            "static_resources.clusters[0] (\"api\").transport_socket.typed_config.@type".to_string(),
            "is not supported; flatmesh's transport sockets are TLS",
        ),
        (
            "            match_typed_subject_alt_names:\n            - { san_type: URI, matcher: { prefix: \"spiffe://td/ns/api/\" } }\n          alpn_protocols",
            "          alpn_protocols",
            "Cluster \"api\": transport_socket.typed_config.common_tls_context.validation_context.match_typed_subject_alt_names".to_string(),
            "is empty",
        ),
        (
            "          validation_context:\n            trusted_ca: { filename: /pki/ca.pem }\n            match_typed_subject_alt_names:\n            - { san_type: URI, matcher: { exact: \"spiffe://td/ns/data/sa/db\" } }\n",
            "          alpn_protocols: [ http/1.1 ]\n",
            "Cluster \"db\": transport_socket.typed_config.common_tls_context.validation_context".to_string(),
            "flatmesh verifies every TLS endpoint",
        ),
    ];
    for (from, to, at, why) in cases {
        assert!(
            TLS_BOOTSTRAP.contains(from),
            "the case does not apply: {from}"
        );
        let e = import_error(&TLS_BOOTSTRAP.replacen(from, to, 1));
        assert!(
            e.starts_with(&format!("envoy.yaml: {at}: ")),
            "{to}: the error does not name `{at}`: {e}"
        );
        assert!(e.contains(why), "{to}: the error does not say `{why}`: {e}");
    }
}

/// Over xDS the messages arrive whole: what the import cannot even write is refused too.
#[test]
fn unsupported_tls_over_xds_is_refused_by_name() {
    use envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        common_tls_context::ValidationContextType, DownstreamTlsContext,
    };
    use prost::Message;
    let config = bootstrap::parse(TLS_BOOTSTRAP, "envoy.yaml").unwrap();
    let edit = |change: &dyn Fn(&mut DownstreamTlsContext)| {
        let mut resources = crate::from_model::resources(&config);
        let listener = resources.listeners.get_mut("mtls").unwrap();
        let socket = listener.filter_chains[0].transport_socket.as_mut().unwrap();
        let Some(ConfigType::TypedConfig(any)) = &mut socket.config_type else {
            panic!("no typed_config")
        };
        let mut context = DownstreamTlsContext::decode(any.value.as_slice()).unwrap();
        change(&mut context);
        any.value = context.encode_to_vec();
        crate::to_model::translate(&resources, &bootstrap::empty_config())
            .unwrap_err()
            .to_string()
    };
    let at = "Listener \"mtls\": filter_chains[0].transport_socket.typed_config";
    let e = edit(&|c| {
        c.session_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 60,
            nanos: 0,
        })
    });
    assert!(
        e.contains(&format!("{at}: session_timeout is not supported")),
        "{e}"
    );
    let e = edit(&|c| {
        let common = c.common_tls_context.as_mut().unwrap();
        let second = common.tls_certificates[0].clone();
        common.tls_certificates.push(second);
    });
    assert!(
        e.contains("tls_certificates") && e.contains("has 2 certificates"),
        "{e}"
    );
    let e = edit(&|c| {
        c.common_tls_context
            .as_mut()
            .unwrap()
            .validation_context_type = Some(ValidationContextType::CombinedValidationContext(
            Default::default(),
        ))
    });
    assert!(
        e.contains("combined_validation_context.validation_context_sds_secret_config: is missing"),
        "{e}"
    );
    let e = edit(&|c| {
        c.common_tls_context
            .as_mut()
            .unwrap()
            .tls_certificate_provider_instance = Some(Default::default())
    });
    assert!(
        e.contains("tls_certificate_provider_instance: certificate providers are not supported"),
        "{e}"
    );
    let e = edit(&|c| {
        let common = c.common_tls_context.as_mut().unwrap();
        common.tls_certificates[0].password = Some(Default::default());
    });
    assert!(
        e.contains(&format!(
            "{at}.common_tls_context.tls_certificates[0]: password is not supported"
        )),
        "{e}"
    );
    let e = edit(&|c| {
        let Some(ValidationContextType::ValidationContext(v)) = &mut c
            .common_tls_context
            .as_mut()
            .unwrap()
            .validation_context_type
        else {
            panic!("no validation context")
        };
        v.allow_expired_certificate = true;
    });
    assert!(
        e.contains("validation_context: allow_expired_certificate is not supported"),
        "{e}"
    );
    let e = edit(&|c| {
        c.common_tls_context.as_mut().unwrap().tls_certificates[0].private_key = None;
    });
    assert!(
        e.contains("tls_certificates[0].private_key: is missing"),
        "{e}"
    );
    let e = edit(&|c| c.common_tls_context = None);
    assert!(e.contains("common_tls_context: is missing"), "{e}");
}

/// The `resources` fuzz target's TLS seed: every resource of [`TLS_BOOTSTRAP`] as the server
/// sends it, in the target's records ([type index in ORDER][length, 2 bytes big-endian][protobuf]),
/// so the fuzzer starts inside the TLS translation. `FLATMESH_WRITE_SEEDS=1` rewrites the file
/// after a change of shape.
#[test]
fn the_resources_fuzz_seed_holds_every_tls_shape() {
    let config = bootstrap::parse(TLS_BOOTSTRAP, "envoy.yaml").unwrap();
    let resources = crate::from_model::resources(&config);
    check_resources_seed(&resources, "tls", "TLS_BOOTSTRAP");
    // What the records hold translates back to the same TLS settings.
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    for l in &config.listeners {
        let found = back.listeners.iter().find(|b| b.name == l.name).unwrap();
        assert!(l.tls.is_some() && found.tls == l.tls, "listener {}", l.name);
    }
    for c in &config.clusters {
        assert!(
            c.tls.is_some() && back.cluster(&c.name).unwrap().tls == c.tls,
            "cluster {}",
            c.name
        );
    }
}

/// `resources` as the `resources` fuzz target's records ([type index in ORDER][length, 2 bytes
/// big-endian][protobuf]) must be the seed file `name`; `FLATMESH_WRITE_SEEDS=1` rewrites it.
fn check_resources_seed(resources: &crate::resources::Resources, name: &str, source: &str) {
    use crate::resources::ORDER;
    let mut seed = Vec::new();
    for (index, type_url) in ORDER.iter().enumerate() {
        for resource in resources.of_type(type_url) {
            let value = resource.to_any().value;
            seed.push(u8::try_from(index).unwrap());
            seed.extend(u16::try_from(value.len()).unwrap().to_be_bytes());
            seed.extend(value);
        }
    }
    let path = format!("{}/fuzz/seeds/resources/{name}", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("FLATMESH_WRITE_SEEDS").is_some() {
        std::fs::write(&path, &seed).unwrap();
    }
    assert!(
        std::fs::read(&path).ok() == Some(seed),
        "{path} is not the encoding of {source}'s resources; rerun this test with FLATMESH_WRITE_SEEDS=1"
    );
}

/// Envoy RBAC in the canonical shape `flatmesh control` serves (also the bootstrap fuzz seed).
const RBAC_BOOTSTRAP: &str = include_str!("../fuzz/seeds/bootstrap/rbac.yaml");

fn authorization(yaml: &str) -> Option<model::Authorization> {
    Some(serde_norway::from_str(yaml).unwrap())
}

fn authorization_of(config: &model::Config, listener: &str) -> Option<model::Authorization> {
    let l = config
        .listeners
        .iter()
        .find(|l| l.name == listener)
        .unwrap();
    l.authorization.clone()
}

#[test]
fn rbac_filters_import_from_envoy() {
    let config = bootstrap::parse(RBAC_BOOTSTRAP, "envoy.yaml").unwrap();
    assert_eq!(
        authorization_of(&config, "web"),
        authorization(
            r#"
default: deny
policies:
  - name: no-admin
    action: deny
    from: { principals: [ spiffe://td/ns/shop/sa/web, "spiffe://partner/*" ], namespaces: [ ops ] }
    to: { methods: [ POST ], paths: [ "/admin*", "*.php", "*" ], hosts: [ admin.example.org, "*" ] }
    when: [ { header: x-debug, values: [ "1", "*" ] } ]
  - { name: no-delete, action: deny, to: { methods: [ DELETE ] } }
  - name: shop-reads
    action: allow
    from: { namespaces: [ shop ] }
    to: { methods: [ GET, HEAD ], paths: [ "/api/*" ], hosts: [ "*.example.org" ] }
    when: [ { header: x-tenant, values: [ acme, "beta-*" ] } ]
"#
        )
    );
    assert_eq!(
        authorization_of(&config, "db"),
        authorization(
            r#"
default: deny
policies:
  - { name: no-batch, action: deny, from: { namespaces: [ batch ] } }
  - { name: db-clients, action: allow, from: { principals: [ "spiffe://td/ns/data/*", spiffe://td/ns/ops/sa/dba ] } }
"#
        )
    );
    // An ALLOW RBAC without policies admits nobody.
    assert_eq!(
        authorization_of(&config, "closed"),
        authorization("default: deny")
    );
    // Written back, the import is what the file says, filter for filter.
    let served = crate::from_model::resources(&config);
    let value: serde_json::Value = serde_norway::from_str(RBAC_BOOTSTRAP).unwrap();
    let (written, _) = bootstrap::bootstrap(value).unwrap();
    for name in ["db", "closed"] {
        assert_eq!(
            served.listeners[name].filter_chains[0].filters,
            written.listeners[name].filter_chains[0].filters,
            "listener {name}"
        );
    }
    let http_filters = |l: &envoy_types::pb::envoy::config::listener::v3::Listener| {
        use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
        use prost::Message;
        let Some(ConfigType::TypedConfig(any)) = &l.filter_chains[0].filters[0].config_type else {
            panic!("no typed_config")
        };
        envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager::decode(any.value.as_slice())
            .unwrap()
            .http_filters
    };
    assert_eq!(
        http_filters(&served.listeners["web"]),
        http_filters(&written.listeners["web"])
    );
}

/// Envoy's RBAC is a map and an ALLOW layer makes the default moot, so an authorization reads
/// back in Envoy's terms: deny policies, then allow policies, each by name; `default: deny`
/// wherever an ALLOW layer is. Every decision stays the same.
#[test]
fn authorization_reads_back_in_envoys_terms() {
    let round_trip = |yaml: &str| {
        let text = format!(
            "listeners:\n  - name: web\n    address: 127.0.0.1:8080\n    protocol: http\n    routes: [ {{ cluster: one }} ]\n    authorization: {yaml}\nclusters: [ {{ name: one, endpoints: [ 127.0.0.1:1 ] }} ]\n"
        );
        let config = model::parse(&text, "t.yaml").unwrap();
        let resources = crate::from_model::resources(&config);
        let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
        authorization_of(&back, "web")
    };
    assert_eq!(
        round_trip("{ policies: [ { name: b, action: allow, from: { namespaces: [ x ] } }, { name: z, action: deny, to: { paths: [ /z ] } }, { name: a, action: allow, to: { paths: [ /a ] } } ] }"),
        authorization("{ default: deny, policies: [ { name: z, action: deny, to: { paths: [ /z ] } }, { name: a, action: allow, to: { paths: [ /a ] } }, { name: b, action: allow, from: { namespaces: [ x ] } } ] }")
    );
    // Nothing to enforce: no RBAC is written, and none is read.
    assert_eq!(round_trip("{ default: allow }"), None);
    assert_eq!(
        round_trip("{ default: deny }"),
        authorization("{ default: deny }")
    );
}

/// The served resources of [`RBAC_BOOTSTRAP`] with one edit, translated back: the error.
fn rbac_edit(
    listener: &str,
    change: &dyn Fn(&mut Vec<envoy_types::pb::envoy::config::listener::v3::Filter>),
) -> String {
    let config = bootstrap::parse(RBAC_BOOTSTRAP, "envoy.yaml").unwrap();
    let mut resources = crate::from_model::resources(&config);
    let chain = &mut resources.listeners.get_mut(listener).unwrap().filter_chains[0];
    change(&mut chain.filters);
    crate::to_model::translate(&resources, &bootstrap::empty_config())
        .unwrap_err()
        .to_string()
}

/// Edits the served `web` listener's HTTP RBAC filter number `index` (0: DENY, 1: ALLOW).
fn http_rbac_edit(
    index: usize,
    change: &dyn Fn(&mut envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac),
) -> String {
    use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
    use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::Rbac;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
        http_filter, HttpConnectionManager,
    };
    use prost::Message;
    rbac_edit("web", &|filters| {
        let Some(ConfigType::TypedConfig(any)) = &mut filters[0].config_type else {
            panic!("no typed_config")
        };
        let mut hcm = HttpConnectionManager::decode(any.value.as_slice()).unwrap();
        let Some(http_filter::ConfigType::TypedConfig(rbac_any)) =
            &mut hcm.http_filters[index].config_type
        else {
            panic!("no typed_config")
        };
        let mut rbac = Rbac::decode(rbac_any.value.as_slice()).unwrap();
        change(&mut rbac);
        rbac_any.value = rbac.encode_to_vec();
        any.value = hcm.encode_to_vec();
    })
}

/// Everything in an RBAC config that flatmesh's policies cannot say is refused with the
/// field's path, so a policy never checks less than Envoy's would.
#[test]
fn unsupported_rbac_over_xds_is_refused_by_name() {
    use envoy_types::pb::envoy::config::rbac::v3::{
        permission, principal, rbac, Permission, Principal,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    let at =
        "Listener \"web\": filter_chains[0].filters[0].typed_config.http_filters[0].typed_config";
    let e = http_rbac_edit(0, &|r| r.shadow_rules = r.rules.clone());
    assert!(
        e.contains(&format!(
            "{at}.shadow_rules: shadow rules are not supported"
        )),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| r.shadow_rules_stat_prefix = "shadow".into());
    assert!(
        e.contains(&format!(
            "{at}.shadow_rules: shadow rules are not supported"
        )),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| r.matcher = Some(Default::default()));
    assert!(
        e.contains(&format!("{at}.matcher: the unified matcher API")),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        r.rules.as_mut().unwrap().action = rbac::Action::Log as i32
    });
    assert!(
        e.contains(&format!("{at}.rules.action: only ALLOW and DENY")),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        r.rules.as_mut().unwrap().audit_logging_options = Some(Default::default())
    });
    assert!(
        e.contains(&format!(
            "{at}.rules: audit_logging_options is not supported"
        )),
        "{e}"
    );
    let policy = format!("{at}.rules.policies[\"no-admin\"]");
    let e = http_rbac_edit(0, &|r| {
        r.rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-admin")
            .unwrap()
            .condition = Some(Default::default());
    });
    assert!(
        e.contains(&format!("{policy}: condition is not supported")),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        r.rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-admin")
            .unwrap()
            .principals = vec![Principal {
            identifier: Some(principal::Identifier::SourceIp(Default::default())),
        }];
    });
    assert!(
        e.contains(&format!("{policy}.principals[0]: only `authenticated`")),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        r.rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-admin")
            .unwrap()
            .permissions = vec![Permission {
            rule: Some(permission::Rule::DestinationPort(80)),
        }];
    });
    assert!(
        e.contains(&format!("{policy}.permissions[0]: only header")),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        let p = r
            .rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-admin")
            .unwrap();
        let Some(principal::Identifier::AndIds(set)) = &mut p.principals[0].identifier else {
            panic!()
        };
        let Some(principal::Identifier::OrIds(ns)) = &mut set.ids[1].identifier else {
            panic!()
        };
        let Some(principal::Identifier::Authenticated(a)) = &mut ns.ids[0].identifier else {
            panic!()
        };
        let Some(MatchPattern::SafeRegex(re)) =
            &mut a.principal_name.as_mut().unwrap().match_pattern
        else {
            panic!()
        };
        re.regex = "spiffe://td/ns/ops/.*".into();
    });
    assert!(
        e.contains(&format!("{policy}.principals[0].and_ids.ids[1].or_ids.ids[0].authenticated.principal_name.safe_regex.regex: `spiffe://td/ns/ops/.*` is not a namespace pattern")),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        let p = r
            .rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-admin")
            .unwrap();
        let Some(permission::Rule::AndRules(set)) = &mut p.permissions[0].rule else {
            panic!()
        };
        let Some(permission::Rule::OrRules(hosts)) = &mut set.rules[2].rule else {
            panic!()
        };
        let Some(permission::Rule::Header(h)) = &mut hosts.rules[0].rule else {
            panic!()
        };
        let Some(envoy_types::pb::envoy::config::route::v3::header_matcher::HeaderMatchSpecifier::StringMatch(m)) = &mut h.header_match_specifier else { panic!() };
        m.ignore_case = false;
    });
    assert!(
        e.contains(
            "and_rules.rules[2].or_rules.rules[0].header.string_match.ignore_case: must be true"
        ),
        "{e}"
    );
    let e = http_rbac_edit(0, &|r| {
        let p = r
            .rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-admin")
            .unwrap();
        let Some(permission::Rule::AndRules(set)) = &mut p.permissions[0].rule else {
            panic!()
        };
        // A method and a path in one `or`: flatmesh ANDs the kinds a policy lists.
        let Some(permission::Rule::OrRules(paths)) = set.rules.remove(1).rule else {
            panic!()
        };
        let Some(permission::Rule::OrRules(methods)) = &mut set.rules[0].rule else {
            panic!()
        };
        methods.rules.push(paths.rules[0].clone());
    });
    assert!(e.contains("mixes kinds in one `or`"), "{e}");
    // A second ALLOW layer would need a match in each.
    let e = http_rbac_edit(0, &|r| {
        r.rules.as_mut().unwrap().action = rbac::Action::Allow as i32
    });
    assert!(e.contains("is a second ALLOW RBAC"), "{e}");
}

/// Where RBAC filters may stand, over xDS: before the router, before tcp_proxy, and with only
/// principals on a tcp listener.
#[test]
fn rbac_out_of_place_is_refused_by_name() {
    use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
    use envoy_types::pb::envoy::config::rbac::v3::{permission, Permission};
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
    use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac;
    use prost::Message;
    let e = rbac_edit("web", &|filters| {
        let Some(ConfigType::TypedConfig(any)) = &mut filters[0].config_type else {
            panic!("no typed_config")
        };
        let mut hcm = HttpConnectionManager::decode(any.value.as_slice()).unwrap();
        hcm.http_filters.swap(1, 2); // the ALLOW layer after the router
        any.value = hcm.encode_to_vec();
    });
    assert!(
        e.contains("http_filters[2]: envoy.filters.http.rbac after the router never runs"),
        "{e}"
    );
    // The db listener's DENY layer put in front of the web listener's HCM.
    let config = bootstrap::parse(RBAC_BOOTSTRAP, "envoy.yaml").unwrap();
    let db_deny =
        crate::from_model::resources(&config).listeners["db"].filter_chains[0].filters[0].clone();
    let e = rbac_edit("web", &|filters| filters.insert(0, db_deny.clone()));
    assert!(
        e.contains("Listener \"web\": filter_chains[0].filters[0]: envoy.filters.network.rbac on an http listener is not supported"),
        "{e}"
    );
    let e = rbac_edit("db", &|filters| {
        let Some(ConfigType::TypedConfig(any)) = &mut filters[0].config_type else {
            panic!("no typed_config")
        };
        let mut rbac = Rbac::decode(any.value.as_slice()).unwrap();
        let p = rbac
            .rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-batch")
            .unwrap();
        p.permissions = vec![Permission {
            rule: Some(permission::Rule::DestinationPort(5432)),
        }];
        any.value = rbac.encode_to_vec();
    });
    assert!(
        e.contains("policies[\"no-batch\"].permissions[0]: only header"),
        "{e}"
    );
    let e = rbac_edit("db", &|filters| {
        let Some(ConfigType::TypedConfig(any)) = &mut filters[0].config_type else {
            panic!("no typed_config")
        };
        let mut rbac = Rbac::decode(any.value.as_slice()).unwrap();
        let p = rbac
            .rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-batch")
            .unwrap();
        p.permissions = vec![Permission {
            rule: Some(permission::Rule::UrlPath(Default::default())),
        }];
        any.value = rbac.encode_to_vec();
    });
    assert!(e.contains("url_path.path: is missing"), "{e}");
    let e = rbac_edit("db", &|filters| {
        let Some(ConfigType::TypedConfig(any)) = &mut filters[0].config_type else {
            panic!("no typed_config")
        };
        let mut rbac = Rbac::decode(any.value.as_slice()).unwrap();
        let p = rbac
            .rules
            .as_mut()
            .unwrap()
            .policies
            .get_mut("no-batch")
            .unwrap();
        p.permissions = vec![Permission {
            rule: Some(permission::Rule::Header(
                envoy_types::pb::envoy::config::route::v3::HeaderMatcher {
                    name: "x-a".into(),
                    header_match_specifier: Some(envoy_types::pb::envoy::config::route::v3::header_matcher::HeaderMatchSpecifier::PresentMatch(true)),
                    ..Default::default()
                },
            )),
        }];
        any.value = rbac.encode_to_vec();
    });
    assert!(
        e.contains(
            "policies[\"no-batch\"].permissions: a tcp listener sees connections, not requests"
        ),
        "{e}"
    );
}

/// The Envoy import walks RBAC field by field: what it does not take is named.
#[test]
fn unsupported_rbac_in_a_bootstrap_is_refused_by_name() {
    let e = import_error(&RBAC_BOOTSTRAP.replacen(
        "          stat_prefix: db\n          rules:",
        "          stat_prefix: db\n          shadow_rules: {}\n          rules:",
        1,
    ));
    assert!(
        e.contains("filters[0].typed_config.shadow_rules: is not supported"),
        "{e}"
    );
    let e = import_error(&RBAC_BOOTSTRAP.replacen(
        "permissions: [ { any: true } ]",
        "permissions: [ { destination_port: 80 } ]",
        1,
    ));
    assert!(
        e.contains("policies.no-batch.permissions[0].destination_port: is not supported"),
        "{e}"
    );
    let e = import_error(&RBAC_BOOTSTRAP.replacen("action: DENY", "action: LOG", 1));
    assert!(e.contains("rules.action: only ALLOW and DENY"), "{e}");
    let e = import_error(&RBAC_BOOTSTRAP.replacen("action: DENY", "action: MAYBE", 1));
    assert!(e.contains("`MAYBE` is not an RBAC action"), "{e}");
}

/// The same policies always encode to the same bytes (the server's versions hash them),
/// although Envoy's policies are a map and prost writes maps in their hasher's order.
#[test]
fn served_rbac_encodes_the_same_every_time() {
    let config = bootstrap::parse(RBAC_BOOTSTRAP, "envoy.yaml").unwrap();
    let first = crate::from_model::resources(&config);
    for _ in 0..20 {
        assert_eq!(
            crate::from_model::resources(&config).listeners["web"],
            first.listeners["web"]
        );
    }
}

/// The `resources` fuzz target's RBAC seed: [`RBAC_BOOTSTRAP`]'s resources as served (its
/// byte-for-byte check across processes also holds the encoding stable).
#[test]
fn the_resources_fuzz_seed_holds_every_rbac_shape() {
    let config = bootstrap::parse(RBAC_BOOTSTRAP, "envoy.yaml").unwrap();
    let resources = crate::from_model::resources(&config);
    check_resources_seed(&resources, "rbac", "RBAC_BOOTSTRAP");
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    for l in &config.listeners {
        assert!(l.authorization.is_some(), "listener {}", l.name);
        assert_eq!(
            authorization_of(&back, &l.name),
            l.authorization,
            "listener {}",
            l.name
        );
    }
}

#[test]
fn weights_priorities_localities_and_slow_start_import_from_envoy() {
    let text = example()
        .replace(
            "    lb_policy: MAGLEV\n",
            "    lb_policy: ROUND_ROBIN\n    round_robin_lb_config: { slow_start_config: { slow_start_window: 20s, aggression: { default_value: 1.5, runtime_key: \"\" }, min_weight_percent: { value: 25 } } }\n",
        )
        .replace(
            "      cluster_name: sticky\n      endpoints:\n      - lb_endpoints:\n        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9101 } } }\n        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9102 } } }\n",
            "      cluster_name: sticky\n      policy: { overprovisioning_factor: 150 }\n      endpoints:\n      - locality: { region: us, zone: a }\n        load_balancing_weight: 7\n        lb_endpoints:\n        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9101 } } }\n          load_balancing_weight: 3\n      - priority: 1\n        lb_endpoints:\n        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9102 } } }\n",
        )
        .replace(
            "admin:\n",
            "node: { id: n1, cluster: c, locality: { region: us, zone: a } }\nadmin:\n",
        );
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    assert_eq!(
        config.node.as_ref().and_then(|n| n.locality.as_deref()),
        Some("us/a")
    );
    let sticky = config.cluster("sticky").unwrap();
    assert_eq!(
        sticky.endpoints.entries(),
        &[
            model::Endpoint {
                address: "127.0.0.1:9101".parse().unwrap(),
                weight: 3,
                priority: 0,
                locality: Some("us/a".into()),
            },
            model::Endpoint {
                address: "127.0.0.1:9102".parse().unwrap(),
                weight: 1,
                priority: 1,
                locality: None,
            },
        ]
    );
    assert_eq!(sticky.overprovisioning_factor, Some(150));
    assert_eq!(
        sticky.slow_start,
        Some(model::SlowStart {
            window: std::time::Duration::from_secs(20),
            aggression: 1.5,
            min_weight_percent: 25,
        })
    );
    // Out of flatmesh's bounds: named.
    let e = import_error(&text.replace("load_balancing_weight: 3", "load_balancing_weight: 500"));
    assert!(
        e.contains("lb_endpoints[0].load_balancing_weight") && e.contains("from 1 to 128"),
        "{e}"
    );
    let e = import_error(&text.replace(
        "{ region: us, zone: a }\n        load",
        "{ zone: a }\n        load",
    ));
    assert!(
        e.contains("endpoints[0].locality") && e.contains("region first"),
        "{e}"
    );
    let e = import_error(&text.replace("runtime_key: \"\"", "runtime_key: k"));
    assert!(e.contains("aggression.runtime_key"), "{e}");
}

#[test]
fn circuit_breakers_and_outlier_detection_import_from_envoy() {
    let text = example().replace(
        "    lb_policy: MAGLEV\n",
        "    lb_policy: MAGLEV\n    circuit_breakers: { thresholds: [ { priority: HIGH, max_requests: 1 }, { max_connections: 100, max_pending_requests: 10, max_requests: 200, track_remaining: true } ] }\n    outlier_detection: { consecutive_5xx: 7, consecutive_gateway_failure: 3, enforcing_consecutive_gateway_failure: 100, interval: 2s, base_ejection_time: 0.5s, max_ejection_percent: 40, enforcing_success_rate: 0 }\n",
    );
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    let sticky = config.cluster("sticky").unwrap();
    // The DEFAULT priority's thresholds; Envoy's default (3) for the retries left out.
    assert_eq!(
        sticky.circuit_breaker,
        Some(model::CircuitBreaker {
            max_connections: 100,
            max_pending: 10,
            max_requests: 200,
            max_retries: 3,
        })
    );
    // Envoy's meaning: gateway failures only when enforced; local-origin failures only when
    // split from the rest.
    assert_eq!(
        sticky.outlier_detection,
        Some(model::OutlierDetection {
            consecutive_5xx: 7,
            consecutive_gateway_errors: 3,
            consecutive_connect_failures: 0,
            interval: std::time::Duration::from_secs(2),
            base_ejection_time: std::time::Duration::from_millis(500),
            max_ejection_percent: 40,
            success_rate: model::SuccessRate {
                enforcing: false,
                ..Default::default()
            },
            failure_percentage: model::FailurePercentage::default(),
        })
    );
    // Success rate and failure percentage with their parameters.
    let interval_kinds = example().replace(
        "    lb_policy: MAGLEV\n",
        "    lb_policy: MAGLEV\n    outlier_detection: { success_rate_minimum_hosts: 3, success_rate_request_volume: 20, success_rate_stdev_factor: 1000, enforcing_failure_percentage: 100, failure_percentage_threshold: 60, failure_percentage_minimum_hosts: 2, failure_percentage_request_volume: 10 }\n",
    );
    let config = bootstrap::parse(&interval_kinds, "envoy.yaml").unwrap();
    let od = config
        .cluster("sticky")
        .unwrap()
        .outlier_detection
        .clone()
        .unwrap();
    assert_eq!(
        (od.success_rate, od.failure_percentage),
        (
            model::SuccessRate {
                enforcing: true,
                minimum_hosts: 3,
                request_volume: 20,
                stdev_factor: 1000,
            },
            model::FailurePercentage {
                enforcing: true,
                threshold: 60,
                minimum_hosts: 2,
                request_volume: 10,
            }
        )
    );
    // Envoy's defaults for an empty block.
    let empty = example().replace(
        "    lb_policy: MAGLEV\n",
        "    lb_policy: MAGLEV\n    outlier_detection: { split_external_local_origin_errors: true }\n    circuit_breakers: {}\n",
    );
    let config = bootstrap::parse(&empty, "envoy.yaml").unwrap();
    let sticky = config.cluster("sticky").unwrap();
    assert_eq!(
        sticky.outlier_detection,
        Some(model::OutlierDetection {
            consecutive_gateway_errors: 0,
            ..Default::default()
        })
    );
    assert_eq!(sticky.circuit_breaker, None, "no thresholds: the defaults");

    // What flatmesh does not do is named.
    let refused = |block: &str| {
        import_error(&example().replace(
            "    lb_policy: MAGLEV\n",
            &format!("    lb_policy: MAGLEV\n{block}\n"),
        ))
    };
    let e = refused("    outlier_detection: { enforcing_consecutive_5xx: 50 }");
    assert!(
        e.contains("outlier_detection.enforcing_consecutive_5xx")
            && e.contains("neither 0 nor 100"),
        "{e}"
    );
    let e = refused("    outlier_detection: { enforcing_success_rate: 50 }");
    assert!(
        e.contains("enforcing_success_rate") && e.contains("neither 0 nor 100"),
        "{e}"
    );
    let e = refused("    outlier_detection: { enforcing_local_origin_success_rate: 100 }");
    assert!(e.contains("enforcing_local_origin_success_rate"), "{e}");
    let e = refused("    outlier_detection: { failure_percentage_threshold: 120 }");
    assert!(e.contains("cannot pass 100"), "{e}");
    let e = refused("    outlier_detection: { max_ejection_time: 10s }");
    assert!(e.contains("max_ejection_time") && e.contains("300s"), "{e}");
    let e = refused("    outlier_detection: { always_eject_one_host: true }");
    assert!(e.contains("always_eject_one_host"), "{e}");
    let e = refused("    circuit_breakers: { thresholds: [ {}, { max_requests: 5 } ] }");
    assert!(
        e.contains("thresholds[1]") && e.contains("second threshold"),
        "{e}"
    );
    let e = refused("    circuit_breakers: { thresholds: [ { max_connection_pools: 5 } ] }");
    assert!(e.contains("max_connection_pools"), "{e}");
    let e = refused("    circuit_breakers: { per_host_thresholds: [ { max_connections: 5 } ] }");
    assert!(e.contains("per_host_thresholds"), "{e}");
    // Out of flatmesh's ranges: refused by the config's own validation.
    let e = refused("    circuit_breakers: { thresholds: [ { max_requests: 0 } ] }");
    assert!(e.contains("max_requests is 0"), "{e}");
}

#[test]
fn circuit_breakers_and_outlier_detection_map_over_xds() {
    use envoy_types::pb::envoy::config::cluster::v3::{circuit_breakers, CircuitBreakers};
    use envoy_types::pb::google::protobuf::UInt32Value;
    let config = model::parse(
        r#"
listeners:
  - { name: web, address: 127.0.0.1:8080, protocol: http, routes: [ { match: { path: { prefix: / } }, cluster: api } ] }
clusters:
  - name: api
    endpoints: [ 127.0.0.1:1 ]
    circuit_breaker: { max_requests: 7 }
    outlier_detection: { consecutive_connect_failures: 3 }
"#,
        "t.yaml",
    )
    .unwrap();
    let mut resources = crate::from_model::resources(&config);
    // The served cluster states the thresholds of the default priority, in Envoy's terms.
    let served = &resources.clusters["api"];
    let thresholds = &served.circuit_breakers.as_ref().unwrap().thresholds;
    assert_eq!(thresholds.len(), 1);
    assert_eq!(thresholds[0].priority, 0);
    assert_eq!(thresholds[0].max_requests, Some(UInt32Value { value: 7 }));
    assert_eq!(
        thresholds[0].max_connections,
        Some(UInt32Value { value: 1024 })
    );
    let od = served.outlier_detection.as_ref().unwrap();
    assert!(od.split_external_local_origin_errors);
    assert_eq!(
        od.consecutive_local_origin_failure,
        Some(UInt32Value { value: 3 })
    );
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    let api = back.cluster("api").unwrap();
    assert_eq!(api.circuit_breaker, config.clusters[0].circuit_breaker);
    assert_eq!(api.outlier_detection, config.clusters[0].outlier_detection);
    // An unsupported field is NACKed by name, not dropped.
    resources.clusters.get_mut("api").unwrap().circuit_breakers = Some(CircuitBreakers {
        thresholds: vec![circuit_breakers::Thresholds {
            retry_budget: Some(Default::default()),
            ..Default::default()
        }],
        ..Default::default()
    });
    let e = crate::to_model::translate(&resources, &bootstrap::empty_config())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("circuit_breakers.thresholds[0].retry_budget") && e.contains("retries.budget"),
        "{e}"
    );
}

#[test]
fn health_checks_import_from_envoy() {
    let with = |block: &str| {
        example().replace(
            "    lb_policy: MAGLEV\n",
            &format!("    lb_policy: MAGLEV\n{block}\n"),
        )
    };
    let config = bootstrap::parse(
        &with("    health_checks: [ { timeout: 0.5s, interval: 2s, unhealthy_threshold: 4, healthy_threshold: 1, http_health_check: { path: /healthz, expected_statuses: [ { start: 200, end: 201 }, { start: 300, end: 303 } ] } } ]"),
        "envoy.yaml",
    )
    .unwrap();
    assert_eq!(
        config.cluster("sticky").unwrap().health_check,
        Some(model::HealthCheck {
            interval: std::time::Duration::from_secs(2),
            timeout: std::time::Duration::from_millis(500),
            unhealthy_threshold: 4,
            healthy_threshold: 1,
            ..model::HealthCheck::new(model::HealthCheckKind::Http(model::HttpHealthCheck {
                path: "/healthz".into(),
                expect: model::ExpectStatus(vec![(200, 200), (300, 302)]),
            }))
        })
    );
    let config = bootstrap::parse(
        &with("    health_checks: [ { timeout: 1s, interval: 5s, unhealthy_threshold: 3, healthy_threshold: 2, tcp_health_check: {} } ]"),
        "envoy.yaml",
    )
    .unwrap();
    assert_eq!(
        config.cluster("sticky").unwrap().health_check,
        Some(model::HealthCheck::new(model::HealthCheckKind::Tcp))
    );
    let config = bootstrap::parse(
        &with("    health_checks: [ { timeout: 1s, interval: 5s, grpc_health_check: { service_name: api } } ]"),
        "envoy.yaml",
    )
    .unwrap();
    assert_eq!(
        config.cluster("sticky").unwrap().health_check,
        Some(model::HealthCheck::new(model::HealthCheckKind::Grpc(
            model::GrpcHealthCheck {
                service: "api".into()
            }
        )))
    );

    // What would change the probe is named.
    let refused = |block: &str| import_error(&with(block));
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s, tcp_health_check: { send: { text: 00 } } } ]");
    assert!(e.contains("tcp_health_check.send"), "{e}");
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s, http_health_check: { path: /h, host: x } } ]");
    assert!(e.contains("http_health_check.host"), "{e}");
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s, no_traffic_interval: 60s, tcp_health_check: {} } ]");
    assert!(e.contains("no_traffic_interval"), "{e}");
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s, tcp_health_check: {} }, { interval: 1s, timeout: 1s, tcp_health_check: {} } ]");
    assert!(
        e.contains("health_checks[1]") && e.contains("second health check"),
        "{e}"
    );
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s, http_health_check: { path: /h, expected_statuses: [ { start: 200, end: 200 } ] } } ]");
    assert!(e.contains("expected_statuses[0]"), "{e}");
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s } ]");
    assert!(e.contains("but not how"), "{e}");
    // Out of flatmesh's ranges: refused by the config's own validation.
    let e = refused("    health_checks: [ { interval: 1s, timeout: 1s, unhealthy_threshold: 0, tcp_health_check: {} } ]");
    assert!(e.contains("unhealthy_threshold is 0"), "{e}");
}

#[test]
fn health_checks_map_over_xds() {
    use envoy_types::pb::envoy::config::core::v3::health_check::HealthChecker;
    let config = model::parse(
        r#"
listeners:
  - { name: web, address: 127.0.0.1:8080, protocol: http, routes: [ { match: { path: { prefix: / } }, cluster: api } ] }
clusters:
  - name: api
    endpoints: [ 127.0.0.1:1 ]
    health_check: { http: { path: /ready, expect: "200-299" }, interval: 3s }
"#,
        "t.yaml",
    )
    .unwrap();
    let mut resources = crate::from_model::resources(&config);
    let served = &resources.clusters["api"].health_checks;
    assert_eq!(served.len(), 1);
    let Some(HealthChecker::HttpHealthCheck(http)) = &served[0].health_checker else {
        panic!("not an http check: {served:?}");
    };
    assert_eq!(http.path, "/ready");
    assert_eq!(
        (
            http.expected_statuses[0].start,
            http.expected_statuses[0].end
        ),
        (200, 300),
        "Envoy's ranges end before their end"
    );
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    assert_eq!(
        back.cluster("api").unwrap().health_check,
        config.clusters[0].health_check
    );
    // An unsupported field is NACKed by name, not dropped.
    resources.clusters.get_mut("api").unwrap().health_checks[0].reuse_connection =
        Some(envoy_types::pb::google::protobuf::BoolValue { value: false });
    let e = crate::to_model::translate(&resources, &bootstrap::empty_config())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("health_checks[0]") && e.contains("reuse_connection"),
        "{e}"
    );
}

/// The `web` listener's served connection manager, edited by `change`.
fn edit_hcm(
    resources: &mut crate::resources::Resources,
    change: &dyn Fn(
        &mut envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager,
    ),
) {
    use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
    use prost::Message;
    let chain = &mut resources.listeners.get_mut("web").unwrap().filter_chains[0];
    let Some(ConfigType::TypedConfig(any)) = &mut chain.filters[0].config_type else {
        panic!("no typed_config")
    };
    let mut hcm = HttpConnectionManager::decode(any.value.as_slice()).unwrap();
    change(&mut hcm);
    any.value = hcm.encode_to_vec();
}

#[test]
fn faults_and_mirrors_map_over_xds() {
    use envoy_types::pb::envoy::config::route::v3::route;
    use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
        fault_abort, FaultAbort, HttpFault,
    };
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter;
    use envoy_types::pb::envoy::r#type::v3::FractionalPercent;
    use prost::Name as _;
    let config = model::parse(
        r#"
listeners:
  - name: web
    address: 127.0.0.1:8080
    protocol: http
    routes:
      - match: { path: { prefix: /f } }
        cluster: api
        fault: { abort: { status: 503, percent: 12.5 }, delay: { duration: 1500ms, percent: 0.01 } }
      - match: { path: { prefix: /g } }
        cluster: api
        fault: { abort: { grpc_status: 14, percent: 100 } }
        mirror: { cluster: shadow, percent: 30 }
      - match: { path: { prefix: / } }
        cluster: api
        mirror: { cluster: shadow }
      - direct_response: { status: 404 }
clusters:
  - { name: api, endpoints: [ 127.0.0.1:1 ] }
  - { name: shadow, endpoints: [ 127.0.0.1:2 ] }
"#,
        "t.yaml",
    )
    .unwrap();
    let resources = crate::from_model::resources(&config);
    // Envoy's shape: the fault filter before the router, each route's fault its own config.
    let mut served = resources.clone();
    edit_hcm(&mut served, &|hcm| {
        let names: Vec<&str> = hcm.http_filters.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                crate::fault::FAULT_FILTER_NAME,
                crate::to_model::ROUTER_NAME
            ]
        );
    });
    let routes = &resources.routes["web"].virtual_hosts[0].routes;
    assert!(routes[0]
        .typed_per_filter_config
        .contains_key(crate::fault::FAULT_FILTER_NAME));
    let Some(route::Action::Route(a)) = &routes[1].action else {
        panic!("not a route action")
    };
    assert_eq!(a.request_mirror_policies[0].cluster, "shadow");
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    let routes = |c: &model::Config| -> Vec<(Option<model::Fault>, Option<model::Mirror>)> {
        c.listeners[0]
            .routes
            .iter()
            .map(|r| (r.fault.clone(), r.mirror.clone()))
            .collect()
    };
    assert_eq!(routes(&back), routes(&config));

    // The filter's own config is every route's fault unless the route has its own; a direct
    // response is answered before any fault.
    let mut with_default = resources.clone();
    edit_hcm(&mut with_default, &|hcm| {
        let http_filter::ConfigType::TypedConfig(any) =
            hcm.http_filters[0].config_type.as_mut().unwrap()
        else {
            panic!("no typed_config")
        };
        *any = crate::resources::pack(&HttpFault {
            abort: Some(FaultAbort {
                percentage: Some(FractionalPercent {
                    numerator: 25,
                    denominator: 0,
                }),
                error_type: Some(fault_abort::ErrorType::HttpStatus(500)),
                ..Default::default()
            }),
            abort_percent_runtime: "fault.http.abort.abort_percent".into(),
            ..Default::default()
        });
    });
    let back = crate::to_model::translate(&with_default, &bootstrap::empty_config()).unwrap();
    let faults: Vec<Option<(Option<u16>, f64)>> = back.listeners[0]
        .routes
        .iter()
        .map(|r| {
            r.fault
                .as_ref()
                .map(|f| f.abort.as_ref().map(|a| (a.status, a.percent)).unwrap())
        })
        .collect();
    assert_eq!(
        faults,
        [
            Some((Some(503), 12.5)),
            Some((None, 100.0)),
            Some((Some(500), 25.0)),
            None
        ]
    );

    // What flatmesh cannot run is NACKed by name.
    let nack = |change: &dyn Fn(&mut crate::resources::Resources)| {
        let mut r = resources.clone();
        change(&mut r);
        crate::to_model::translate(&r, &bootstrap::empty_config())
            .unwrap_err()
            .to_string()
    };
    let e = nack(&|r| {
        let route = &mut r.routes.get_mut("web").unwrap().virtual_hosts[0].routes[0];
        route.typed_per_filter_config.insert(
            crate::fault::FAULT_FILTER_NAME.into(),
            crate::resources::pack(&HttpFault {
                abort: Some(FaultAbort {
                    error_type: Some(fault_abort::ErrorType::HeaderAbort(Default::default())),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        );
    });
    assert!(
        e.contains("abort.header_abort") && e.contains("not supported"),
        "{e}"
    );
    let e = nack(&|r| {
        let route = &mut r.routes.get_mut("web").unwrap().virtual_hosts[0].routes[2];
        let Some(route::Action::Route(a)) = &mut route.action else {
            panic!()
        };
        a.request_mirror_policies
            .push(a.request_mirror_policies[0].clone());
    });
    assert!(
        e.contains("request_mirror_policies") && e.contains("one cluster"),
        "{e}"
    );
    let e = nack(&|r| {
        let route = &mut r.routes.get_mut("web").unwrap().virtual_hosts[0].routes[2];
        route.typed_per_filter_config.insert(
            "envoy.filters.http.cors".into(),
            envoy_types::pb::google::protobuf::Any {
                type_url: HttpFault::type_url(),
                value: Vec::new(),
            },
        );
    });
    assert!(
        e.contains("typed_per_filter_config[\"envoy.filters.http.cors\"]"),
        "{e}"
    );
    let e = nack(&|r| {
        edit_hcm(r, &|hcm| {
            let f = hcm.http_filters.remove(0);
            hcm.http_filters.push(f);
        })
    });
    assert!(e.contains("before envoy.filters.http.router"), "{e}");
}

#[test]
fn faults_and_mirrors_import_from_envoy() {
    let text = example()
        .replace(
            "          http_filters:\n",
            "          http_filters:\n          - name: envoy.filters.http.fault\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault\n              delay: { fixed_delay: 0.25s, percentage: { numerator: 5 } }\n",
        )
        .replace(
            "                route: { cluster: api-v1, timeout: 2s,",
            "                typed_per_filter_config:\n                  envoy.filters.http.fault:\n                    \"@type\": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault\n                    abort: { grpc_status: 14, percentage: { numerator: 2500, denominator: TEN_THOUSAND } }\n                route: { cluster: api-v1, request_mirror_policies: [ { cluster: api-v2, runtime_fraction: { default_value: { numerator: 50 }, runtime_key: mirror.v2 } } ], timeout: 2s,",
        );
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    let fallback = &web.routes[1];
    let abort = fallback.fault.as_ref().unwrap().abort.as_ref().unwrap();
    assert_eq!(
        (abort.status, abort.grpc_status, abort.percent),
        (None, Some(14), 25.0)
    );
    assert!(
        fallback.fault.as_ref().unwrap().delay.is_none(),
        "the route's own config wins"
    );
    let mirror = fallback.mirror.as_ref().unwrap();
    assert_eq!((mirror.cluster.as_str(), mirror.percent), ("api-v2", 50.0));
    // Every other forwarding route gets the filter's delay; the direct responses none.
    let delay = model::FaultDelay {
        duration: std::time::Duration::from_millis(250),
        percent: 5.0,
    };
    for r in web
        .routes
        .iter()
        .filter(|r| r.cluster.is_some() || r.split.is_some())
    {
        if r.mirror.is_none() {
            assert_eq!(r.fault.as_ref().unwrap().delay.as_ref(), Some(&delay));
        }
    }
    assert!(web
        .routes
        .iter()
        .filter(|r| r.direct_response.is_some())
        .all(|r| r.fault.is_none()));

    let e = import_error(&text.replace("abort: { grpc_status: 14,", "abort: { header_abort: {},"));
    assert!(
        e.contains("header_abort") && e.contains("not supported"),
        "{e}"
    );
    let e = import_error(&text.replace(
        "fixed_delay: 0.25s,",
        "fixed_delay: 0.25s, max_active_faults: 3,",
    ));
    assert!(e.contains("max_active_faults"), "{e}");
    let e = import_error(&text.replace(
        "{ numerator: 50 }",
        "{ numerator: 50, denominator: THOUSAND }",
    ));
    assert!(e.contains("THOUSAND"), "{e}");
}

#[test]
fn rate_limits_map_over_xds_as_envoy_s_local_rate_limits() {
    use envoy_types::pb::envoy::config::listener::v3::filter;
    let config = model::parse(
        r#"
listeners:
  - name: web
    address: 127.0.0.1:8080
    protocol: http
    rate_limit: { requests_per_s: 100, burst: 50 }
    routes:
      - { name: slow, match: { path: { prefix: /slow } }, cluster: api, rate_limit: { requests_per_s: 2 } }
      - { match: { path: { prefix: / } }, cluster: api }
  - name: free
    address: 127.0.0.1:8081
    protocol: http
    routes:
      - { name: one, match: { path: { prefix: / } }, cluster: api, rate_limit: { requests_per_s: 5, burst: 1 } }
  - { name: db, address: 127.0.0.1:9000, protocol: tcp, cluster: api, connection_rate_limit: { connections_per_s: 10, burst: 20 } }
clusters:
  - { name: api, endpoints: [ 127.0.0.1:1 ] }
"#,
        "t.yaml",
    )
    .unwrap();
    let mut resources = crate::from_model::resources(&config);
    // The tcp listener's limit is the network filter before tcp_proxy.
    let db = &resources.listeners["db"].filter_chains[0].filters;
    assert_eq!(db[0].name, crate::local_ratelimit::NETWORK_NAME);
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    for name in ["web", "free", "db"] {
        let find = |c: &model::Config| c.listeners.iter().find(|l| l.name == name).cloned();
        let (a, b) = (&find(&back).unwrap(), &find(&config).unwrap());
        assert_eq!(a.rate_limit, b.rate_limit, "{name}");
        assert_eq!(a.connection_rate_limit, b.connection_rate_limit, "{name}");
        let limits = |l: &model::Listener| -> Vec<_> {
            // Envoy states the burst: the default one comes back written out.
            l.routes
                .iter()
                .map(|r| {
                    r.rate_limit
                        .as_ref()
                        .map(|r| (r.requests_per_s, r.burst(), r.key.clone()))
                })
                .collect()
        };
        assert_eq!(limits(a)[..b.routes.len()], limits(b)[..], "{name}");
    }
    // A share other than all or nothing is NACKed, not rounded.
    let web = resources.listeners.get_mut("web").unwrap();
    let Some(filter::ConfigType::TypedConfig(any)) =
        &mut web.filter_chains[0].filters[0].config_type
    else {
        panic!("an inline connection manager")
    };
    let mut hcm: envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager =
        prost::Message::decode(any.value.as_slice()).unwrap();
    let envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter::ConfigType::TypedConfig(limit_any) =
        hcm.http_filters[0].config_type.clone().unwrap()
    else {
        panic!("a typed config")
    };
    let mut limit: envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit =
        prost::Message::decode(limit_any.value.as_slice()).unwrap();
    limit
        .filter_enforced
        .as_mut()
        .unwrap()
        .default_value
        .as_mut()
        .unwrap()
        .numerator = 50;
    limit.token_bucket.as_mut().unwrap().fill_interval =
        Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 3,
            nanos: 0,
        });
    hcm.http_filters[0].config_type = Some(envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter::ConfigType::TypedConfig(crate::resources::pack(&limit)));
    *any = crate::resources::pack(&hcm);
    let e = crate::to_model::translate(&resources, &bootstrap::empty_config())
        .unwrap_err()
        .to_string();
    assert!(e.contains("filter_enforced") && e.contains("100%"), "{e}");
}

#[test]
fn envoy_s_token_buckets_map_to_whole_rates_only() {
    use envoy_types::pb::envoy::extensions::filters::network::local_ratelimit::v3::LocalRateLimit;
    use envoy_types::pb::envoy::r#type::v3::TokenBucket;
    use envoy_types::pb::google::protobuf::{Duration, UInt32Value};
    let of = |per_fill: u32, seconds: i64, nanos: i32| {
        let any = crate::resources::pack(&LocalRateLimit {
            stat_prefix: "db".into(),
            token_bucket: Some(TokenBucket {
                max_tokens: 7,
                tokens_per_fill: Some(UInt32Value { value: per_fill }),
                fill_interval: Some(Duration { seconds, nanos }),
            }),
            ..Default::default()
        });
        crate::local_ratelimit::network(&any, "f")
    };
    let five = of(1, 0, 200_000_000).unwrap();
    assert_eq!((five.connections_per_s, five.burst), (5, Some(7)));
    assert_eq!(of(60, 60, 0).unwrap().connections_per_s, 1);
    let e = of(1, 2, 0).unwrap_err().to_string();
    assert!(
        e.contains("not a whole number of requests per second"),
        "{e}"
    );
}

#[test]
fn local_rate_limits_import_from_an_envoy_bootstrap() {
    const LRL: &str =
        "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit";
    let all = "{ default_value: { numerator: 100, denominator: HUNDRED } }";
    let text = example()
        .replace(
            "          http_filters:\n",
            &format!("          http_filters:\n          - name: envoy.filters.http.local_ratelimit\n            typed_config: {{ \"@type\": {LRL}, stat_prefix: web, token_bucket: {{ max_tokens: 40, tokens_per_fill: 20, fill_interval: 1s }}, filter_enabled: {all}, filter_enforced: {all} }}\n"),
        )
        .replace(
            "              - match: { prefix: /v2 }\n",
            &format!("              - match: {{ prefix: /v2 }}\n                typed_per_filter_config:\n                  envoy.filters.http.local_ratelimit: {{ \"@type\": {LRL}, stat_prefix: v2, token_bucket: {{ max_tokens: 3, fill_interval: 0.5s }}, filter_enabled: {all}, filter_enforced: {all} }}\n"),
        )
        .replace(
            "    - filters:\n      - name: envoy.filters.network.tcp_proxy\n",
            "    - filters:\n      - name: envoy.filters.network.local_ratelimit\n        typed_config: { \"@type\": type.googleapis.com/envoy.extensions.filters.network.local_ratelimit.v3.LocalRateLimit, stat_prefix: echo, token_bucket: { max_tokens: 9, tokens_per_fill: 3, fill_interval: 1s } }\n      - name: envoy.filters.network.tcp_proxy\n",
        );
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(
        web.rate_limit,
        Some(model::RateLimit {
            requests_per_s: 20,
            burst: Some(40),
            key: None
        })
    );
    assert_eq!(
        web.routes[0].rate_limit,
        Some(model::RateLimit {
            requests_per_s: 2,
            burst: Some(3),
            key: None
        })
    );
    assert!(web.routes[1..].iter().all(|r| r.rate_limit.is_none()));
    let echo = config.listeners.iter().find(|l| l.name == "echo").unwrap();
    assert_eq!(
        echo.connection_rate_limit,
        Some(model::ConnectionRateLimit {
            connections_per_s: 3,
            burst: Some(9)
        })
    );
    // Envoy's default share is 0%: a filter that does not say 100% enforces nothing.
    let counting = text.replace("filter_enforced: { default_value: { numerator: 100, denominator: HUNDRED } } }\n          - name: envoy.filters.http.router", "filter_enforced: { default_value: { numerator: 0 } } }\n          - name: envoy.filters.http.router");
    let config = bootstrap::parse(&counting, "envoy.yaml").unwrap();
    let web = config.listeners.iter().find(|l| l.name == "web").unwrap();
    assert_eq!(web.rate_limit, None);
    assert!(
        web.routes[0].rate_limit.is_some(),
        "the route's own still applies"
    );
    // Descriptors have no flatmesh counterpart: refused by name.
    let e = import_error(&text.replace(
        "stat_prefix: web, token_bucket",
        "stat_prefix: web, descriptors: [ {} ], token_bucket",
    ));
    assert!(e.contains("descriptors"), "{e}");
}

#[test]
fn retry_policies_import_from_envoy() {
    let text = example().replace(
        r#"retry_policy: { retry_on: "connect-failure,5xx", num_retries: 2 }"#,
        r#"retry_policy: { retry_on: "connect-failure,5xx,unavailable,resource-exhausted,cancelled,deadline-exceeded", num_retries: 2, per_try_timeout: 0.5s, retry_back_off: { base_interval: 0.1s, max_interval: 2s } }"#,
    );
    let config = bootstrap::parse(&text, "envoy.yaml").unwrap();
    let retries = config
        .listeners
        .iter()
        .flat_map(|l| &l.routes)
        .find_map(|r| r.retries.clone())
        .unwrap();
    assert_eq!(
        retries,
        model::RetryPolicy {
            attempts: 2,
            on: vec![
                model::RetryOn::ConnectFailure,
                model::RetryOn::Status5xx,
                model::RetryOn::Unavailable,
                model::RetryOn::ResourceExhausted,
                model::RetryOn::Cancelled,
                model::RetryOn::DeadlineExceeded,
            ],
            per_try_timeout: Some(std::time::Duration::from_millis(500)),
            backoff: Some(model::RetryBackoff {
                base: std::time::Duration::from_millis(100),
                max: Some(std::time::Duration::from_secs(2)),
            }),
            budget: None,
            max_replay_body: None,
        }
    );
    // Envoy's 0s per-try timeout is none; a backoff needs its base (Envoy's rule too).
    let zero = example().replace(
        r#"retry_policy: { retry_on: "connect-failure,5xx", num_retries: 2 }"#,
        r#"retry_policy: { retry_on: "5xx", per_try_timeout: 0s }"#,
    );
    let config = bootstrap::parse(&zero, "envoy.yaml").unwrap();
    let retries = config
        .listeners
        .iter()
        .flat_map(|l| &l.routes)
        .find_map(|r| r.retries.clone())
        .unwrap();
    assert_eq!(retries.per_try_timeout, None);
    let no_base = example().replace(
        r#"retry_policy: { retry_on: "connect-failure,5xx", num_retries: 2 }"#,
        r#"retry_policy: { retry_on: "5xx", retry_back_off: { max_interval: 1s } }"#,
    );
    assert!(
        import_error(&no_base).contains("base_interval"),
        "{}",
        import_error(&no_base)
    );
    let unknown = example().replace(
        r#"retry_policy: { retry_on: "connect-failure,5xx", num_retries: 2 }"#,
        r#"retry_policy: { retry_on: "5xx,retriable-4xx" }"#,
    );
    assert!(import_error(&unknown).contains("`retriable-4xx` is not supported"));
}

// ---- SDS -------------------------------------------------------------------------------------

/// [`TLS_BOOTSTRAP`] with the mtls listener's certificate and roots and the api cluster's
/// certificate named as SDS secrets, the roots through a combined validation context (Istio's
/// shape), and the secrets given as files in `static_resources.secrets`.
fn sds_bootstrap() -> String {
    let listener_files = "            tls_certificates:\n            - certificate_chain: { filename: /pki/node.pem }\n              private_key: { filename: /pki/node.key }\n            validation_context:\n              trusted_ca: { filename: /pki/ca.pem }\n              match_typed_subject_alt_names:\n              - san_type: URI\n                matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n              - san_type: URI\n                matcher: { prefix: \"spiffe://td/ns/ops/\" }\n";
    let listener_sds = "            tls_certificate_sds_secret_configs: [ { name: \"spiffe://td/ns/shop/sa/api\" } ]\n            combined_validation_context:\n              validation_context_sds_secret_config: { name: ROOTCA }\n              default_validation_context:\n                match_typed_subject_alt_names:\n                - san_type: URI\n                  matcher: { exact: \"spiffe://td/ns/shop/sa/web\" }\n                - san_type: URI\n                  matcher: { prefix: \"spiffe://td/ns/ops/\" }\n";
    let cluster_files = "          tls_certificates:\n          - certificate_chain: { filename: /pki/node.pem }\n            private_key: { filename: /pki/node.key }\n          validation_context:\n            trusted_ca: { filename: /pki/ca.pem }\n            match_typed_subject_alt_names:\n            - { san_type: URI, matcher: { prefix: \"spiffe://td/ns/api/\" } }";
    let cluster_sds = "          tls_certificate_sds_secret_configs: [ { name: \"spiffe://td/ns/shop/sa/api\", sds_config: { ads: {}, resource_api_version: V3 } } ]\n          combined_validation_context:\n            default_validation_context: { match_typed_subject_alt_names: [ { san_type: URI, matcher: { prefix: \"spiffe://td/ns/api/\" } } ] }\n            validation_context_sds_secret_config: { name: ROOTCA, sds_config: { ads: {} } }";
    assert!(TLS_BOOTSTRAP.contains(listener_files) && TLS_BOOTSTRAP.contains(cluster_files));
    let secrets = "  secrets:\n  - name: \"spiffe://td/ns/shop/sa/api\"\n    tls_certificate: { certificate_chain: { filename: /sds/api.pem }, private_key: { filename: /sds/api.key } }\n  - name: ROOTCA\n    validation_context: { trusted_ca: { filename: /sds/roots.pem } }\n";
    TLS_BOOTSTRAP
        .replacen(listener_files, listener_sds, 1)
        .replacen(cluster_files, cluster_sds, 1)
        .replacen("  clusters:\n", &format!("{secrets}  clusters:\n"), 1)
}

#[test]
fn sds_secrets_import_from_a_bootstrap() {
    let config = bootstrap::parse(&sds_bootstrap(), "envoy.yaml").unwrap();
    let mtls = config.listeners.iter().find(|l| l.name == "mtls").unwrap();
    assert_eq!(
        mtls.tls,
        Some(model::ListenerTls {
            cert: "/sds/api.pem".into(),
            key: "/sds/api.key".into(),
            client_ca: Some("/sds/roots.pem".into()),
            allow: vec![
                "spiffe://td/ns/shop/sa/web".into(),
                "spiffe://td/ns/ops/*".into()
            ],
            crl: None,
        })
    );
    assert_eq!(
        config.cluster("api").unwrap().tls,
        Some(model::ClusterTls {
            ca: "/sds/roots.pem".into(),
            cert: Some("/sds/api.pem".into()),
            key: Some("/sds/api.key".into()),
            server_ids: vec!["spiffe://td/ns/api/*".into()],
            sni: Some("api.shop.svc".into()),
            crl: None,
        })
    );
}

#[test]
fn bad_static_secrets_are_refused_by_name() {
    let text = sds_bootstrap();
    let cases = [
        (
            "private_key: { filename: /sds/api.key }",
            "private_key: { inline_string: KEY }",
            "static_resources.secrets[0].tls_certificate.private_key: only { filename: PATH } is supported",
        ),
        (
            "validation_context: { trusted_ca: { filename: /sds/roots.pem } }",
            "validation_context: { trusted_ca: { filename: /sds/roots.pem }, match_typed_subject_alt_names: [] }",
            "static_resources.secrets[1].validation_context.match_typed_subject_alt_names: is not taken from a secret",
        ),
        (
            "  - name: ROOTCA\n",
            "  - name: \"spiffe://td/ns/shop/sa/api\"\n",
            "static_resources.secrets[1].name: `spiffe://td/ns/shop/sa/api` is given twice",
        ),
        (
            "    validation_context: { trusted_ca: { filename: /sds/roots.pem } }",
            "    generic_secret: { secret: { filename: /sds/x } }",
            "static_resources.secrets[1]: has neither tls_certificate nor validation_context",
        ),
        (
            "  - name: ROOTCA\n",
            "  - name: OTHER\n",
            "Cluster \"api\": names the SDS secret `ROOTCA`, which is not given",
        ),
    ];
    for (from, to, why) in cases {
        assert!(text.contains(from), "the case does not apply: {from}");
        let e = import_error(&text.replacen(from, to, 1));
        assert!(e.contains(why), "{to}: the error does not say `{why}`: {e}");
    }
}

/// Over xDS a secret comes on the stream: a listener that names one not held yet is left out and
/// a cluster answers 503 (no endpoints, no half-configured TLS) until it is written; then both
/// read its files, the key with mode 0600.
#[test]
fn sds_secrets_over_xds_wait_then_resolve() {
    use crate::sds::{certificate_secret, roots_secret, SecretDir};
    use std::os::unix::fs::PermissionsExt;
    let config = bootstrap::parse(&sds_bootstrap(), "envoy.yaml").unwrap();
    // The pushed form of the bootstrap: its listeners and clusters name the secrets.
    let value: serde_json::Value = serde_norway::from_str(&sds_bootstrap()).unwrap();
    let (resources, _) = bootstrap::bootstrap(value).unwrap();
    assert_eq!(
        resources.wanted_secrets().into_iter().collect::<Vec<_>>(),
        ["ROOTCA", "spiffe://td/ns/shop/sa/api"]
    );
    let dir = std::env::temp_dir().join(format!("flatmesh-sds-unit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut secrets = SecretDir::new(dir.clone());
    let mut translator = crate::to_model::Translator::default();
    let base = bootstrap::empty_config();
    let (waiting_config, waiting) = translator
        .translate_with(&resources, &base, &secrets)
        .unwrap();
    assert!(waiting_config.listeners.iter().all(|l| l.name != "mtls"));
    let api = waiting_config.cluster("api").unwrap();
    assert_eq!((api.tls.as_ref(), api.endpoints.len()), (None, 0));
    assert_eq!(
        waiting["ROOTCA"].iter().cloned().collect::<Vec<_>>(),
        ["Cluster \"api\"", "Listener \"mtls\""]
    );
    // The one-off translation has no secrets at all: it refuses instead of waiting.
    let e = crate::to_model::translate(&resources, &base).unwrap_err();
    assert!(e.to_string().contains("names the SDS secret"), "{e}");

    let pem = "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n";
    secrets
        .write(&certificate_secret(
            "spiffe://td/ns/shop/sa/api",
            pem,
            "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n",
        ))
        .unwrap();
    secrets.write(&roots_secret("ROOTCA", pem, None)).unwrap();
    let (resolved, waiting) = translator
        .translate_with(&resources, &base, &secrets)
        .unwrap();
    assert!(waiting.is_empty(), "{waiting:?}");
    let mtls = resolved
        .listeners
        .iter()
        .find(|l| l.name == "mtls")
        .unwrap();
    let tls = mtls.tls.as_ref().unwrap();
    assert!(tls.cert.starts_with(&dir) && tls.key.starts_with(&dir));
    assert_eq!(
        std::fs::metadata(&tls.key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::read_to_string(tls.client_ca.as_ref().unwrap()).unwrap(),
        pem
    );
    let api = resolved.cluster("api").unwrap();
    assert_eq!(
        api.tls.as_ref().unwrap().ca,
        *tls.client_ca.as_ref().unwrap()
    );
    assert_eq!(api.endpoints.len(), 1);
    // Beside the files, the same as the bootstrap's static secrets give.
    assert_eq!(
        tls.allow,
        config
            .listeners
            .iter()
            .find(|l| l.name == "mtls")
            .unwrap()
            .tls
            .as_ref()
            .unwrap()
            .allow
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_pushed_secrets_are_refused_by_name() {
    use crate::sds::{certificate_secret, roots_secret, SecretDir};
    use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::secret;
    let dir = std::env::temp_dir().join(format!("flatmesh-sds-bad-{}", std::process::id()));
    let mut secrets = SecretDir::new(dir.clone());
    let pem = "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n";
    let mut by_file = certificate_secret("s", pem, pem);
    if let Some(secret::Type::TlsCertificate(t)) = &mut by_file.r#type {
        t.private_key = Some(DataSource {
            specifier: Some(data_source::Specifier::Filename("/etc/key".into())),
            ..Default::default()
        });
    }
    let e = secrets.write(&by_file).unwrap_err().to_string();
    assert!(
        e.contains("Secret \"s\": private_key: must be inline"),
        "{e}"
    );
    let mut with_ids = roots_secret("r", pem, None);
    if let Some(secret::Type::ValidationContext(v)) = &mut with_ids.r#type {
        v.allow_expired_certificate = true;
    }
    let e = secrets.write(&with_ids).unwrap_err().to_string();
    assert!(
        e.contains("allow_expired_certificate is not supported"),
        "{e}"
    );
    let e = secrets
        .write(&roots_secret("r", "not pem", None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("trusted_ca: holds no PEM block"), "{e}");
    // A CRL must be CRL PEM, and bounded.
    let e = secrets
        .write(&roots_secret("r", pem, Some(pem)))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Secret \"r\": crl: holds no `-----BEGIN X509 CRL-----`"),
        "{e}"
    );
    let huge = format!(
        "-----BEGIN X509 CRL-----\n{}\n-----END X509 CRL-----\n",
        "A".repeat(5 * 1024 * 1024)
    );
    let e = secrets
        .write(&roots_secret("r", pem, Some(&huge)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("crl: is 5242") && e.contains("at most"), "{e}");
    let e = secrets
        .write(&crate::sds::Secret {
            name: "g".into(),
            r#type: Some(secret::Type::GenericSecret(Default::default())),
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is neither a tls_certificate nor a validation_context"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A secret carries a private key: the server will not serve SDS in plaintext or to callers it
/// cannot name.
#[test]
fn sds_secrets_are_served_only_over_tls_to_token_holders() {
    struct Nothing(tokio::sync::watch::Sender<u64>);
    impl crate::sds::SecretSource for Nothing {
        fn secret(&self, _: &str, _: &str) -> std::result::Result<crate::sds::Secret, String> {
            Err("none".into())
        }
        fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
            self.0.subscribe()
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let options = crate::server::ServeOptions {
        secrets: Some(std::sync::Arc::new(Nothing(
            tokio::sync::watch::channel(0).0,
        ))),
        ..Default::default()
    };
    let e = rt
        .block_on(crate::server::serve_with(
            "127.0.0.1:0".parse().unwrap(),
            crate::server::Store::new(),
            options,
            None,
            std::future::pending(),
        ))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("SDS serves private keys, so only over TLS"),
        "{e}"
    );
}

/// Tunnel clusters (one endpoint, several, HTTP/2 inside) and an hbone listener, as
/// `flatmesh control` renders them and a node reads them back.
const HBONE_CONFIG: &str = r#"
listeners:
  - { name: to-db, address: 127.0.0.1:9000, protocol: tcp, cluster: db }
  - { name: to-web, address: 127.0.0.1:9001, protocol: tcp, cluster: web }
  - name: api
    address: 127.0.0.1:8080
    protocol: http
    routes: [ { cluster: api } ]
  - name: tunnel
    address: 0.0.0.0:15008
    protocol: hbone
    tls: { cert: /pki/node.pem, key: /pki/node.key, client_ca: /pki/ca.pem, allow: [ "spiffe://td/ns/shop/*" ] }
    hbone: { destinations: [ 10.0.0.0/8, 127.0.0.1:7000, "::1" ] }
    limits: { http2_max_concurrent_streams: 50, per_connection_buffer_bytes: 65536 }
    authorization:
      default: deny
      policies: [ { name: shop-only, action: allow, from: { namespaces: [ shop ] } } ]
  - name: tunnel-loopback
    address: 127.0.0.1:15009
    protocol: hbone
    tls: { cert: /pki/node.pem, key: /pki/node.key, client_ca: /pki/ca.pem, allow: [ spiffe://td/ns/shop/sa/web ] }
clusters:
  - name: db
    endpoints: [ 10.0.0.5:5432 ]
    tunnel: hbone
    tls: { ca: /pki/ca.pem, cert: /pki/node.pem, key: /pki/node.key, server_ids: [ spiffe://td/ns/data/sa/node ] }
  - name: web
    endpoints: [ 10.0.0.6:80, { address: "10.0.0.7:80", weight: 3 } ]
    tunnel: hbone
    tunnel_port: 15010
    tls: { ca: /pki/ca.pem, cert: /pki/node.pem, key: /pki/node.key, server_ids: [ "spiffe://td/ns/web/*" ] }
  - name: api
    protocol: http2
    endpoints: [ 10.0.0.8:8443 ]
    tunnel: hbone
    tls: { ca: /pki/ca.pem, server_ids: [ spiffe://td/ns/api/sa/node ] }
"#;

#[test]
fn hbone_round_trips_through_xds() {
    let config = model::parse(HBONE_CONFIG, "hbone.yaml").unwrap();
    let resources = crate::from_model::resources(&config);
    let mut back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    // The server states every cluster's connect timeout explicitly.
    for c in &mut back.clusters {
        assert_eq!(c.connect_timeout, Some(config.limits.connect_timeout));
        c.connect_timeout = None;
    }
    let sorted = |mut c: model::Config| {
        c.listeners.sort_by(|a, b| a.name.cmp(&b.name));
        c.clusters.sort_by(|a, b| a.name.cmp(&b.name));
        c
    };
    assert_eq!(sorted(back), sorted(config));
}

#[test]
fn hbone_is_rendered_in_envoys_terms() {
    use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
    use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
    let config = model::parse(HBONE_CONFIG, "hbone.yaml").unwrap();
    let resources = crate::from_model::resources(&config);
    let tcp_proxy = |listener: &str| -> TcpProxy {
        let filter = &resources.listeners[listener].filter_chains[0].filters[0];
        let Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(
            any,
        )) = &filter.config_type
        else {
            panic!("no typed config")
        };
        crate::to_model::unpack(any, "test").unwrap()
    };
    // One destination: a fixed CONNECT authority, which a plain Envoy runs as flatmesh does.
    assert_eq!(
        tcp_proxy("to-db").tunneling_config.unwrap().hostname,
        "10.0.0.5:5432"
    );
    // Several: each endpoint's own, from Istio's tunnel metadata.
    assert_eq!(
        tcp_proxy("to-web").tunneling_config.unwrap().hostname,
        "%DOWNSTREAM_LOCAL_ADDRESS%"
    );
    let web = &resources.endpoints["web"].endpoints[0].lb_endpoints;
    let Some(HostIdentifier::Endpoint(e)) = &web[1].host_identifier else {
        panic!("no endpoint")
    };
    assert_eq!(
        crate::to_model::socket_addr(e.address.as_ref(), "test").unwrap(),
        "10.0.0.7:15010".parse().unwrap(),
        "Envoy connects to the destination's own IP at the tunnel port"
    );
    let meta =
        &web[1].metadata.as_ref().unwrap().filter_metadata["envoy.filters.listener.original_dst"];
    assert_eq!(
        meta.fields["local"].kind,
        Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(
            "10.0.0.7:80".into()
        ))
    );
    // The hbone listener terminates CONNECT into an ORIGINAL_DST cluster by :authority.
    let termination = &resources.clusters["tunnel.hbone"];
    assert_eq!(
        termination.cluster_discovery_type,
        Some(
            envoy_types::pb::envoy::config::cluster::v3::cluster::ClusterDiscoveryType::Type(
                envoy_types::pb::envoy::config::cluster::v3::cluster::DiscoveryType::OriginalDst
                    as i32
            )
        )
    );
    // A plain (non-tunnel) tcp listener has no tunneling_config.
    let plain = model::parse(
        "listeners: [ { name: t, address: 127.0.0.1:9000, protocol: tcp, cluster: c } ]\nclusters: [ { name: c, endpoints: [ 127.0.0.1:1 ] } ]\n",
        "t.yaml",
    )
    .unwrap();
    let filter = &crate::from_model::resources(&plain).listeners["t"].filter_chains[0].filters[0];
    let Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any)) =
        &filter.config_type
    else {
        panic!("no typed config")
    };
    let t: TcpProxy = crate::to_model::unpack(any, "test").unwrap();
    assert!(t.tunneling_config.is_none());
}

/// An Envoy HBONE client and server as Envoy's own docs and Istio write them.
const HBONE_BOOTSTRAP: &str = r#"
static_resources:
  listeners:
  - name: out
    address: { socket_address: { address: 127.0.0.1, port_value: 9000 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: out
          cluster: hbone
          tunneling_config: { hostname: "10.1.2.3:8080" }
  - name: out-many
    address: { socket_address: { address: 127.0.0.1, port_value: 9001 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: out-many
          cluster: waypoint
          tunneling_config: { hostname: "%DOWNSTREAM_LOCAL_ADDRESS%" }
  - name: in
    address: { socket_address: { address: 0.0.0.0, port_value: 15008 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: in
          codec_type: HTTP2
          http2_protocol_options: { allow_connect: true }
          upgrade_configs: [ { upgrade_type: CONNECT } ]
          route_config:
            name: in
            virtual_hosts:
            - name: in
              domains: [ "*" ]
              routes:
              - match: { connect_matcher: {} }
                route:
                  cluster: deliver
                  upgrade_configs: [ { upgrade_type: CONNECT, connect_config: {} } ]
                metadata: { filter_metadata: { flatmesh.hbone: { destinations: [ 10.0.0.0/8 ] } } }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates: [ { certificate_chain: { filename: /pki/node.pem }, private_key: { filename: /pki/node.key } } ]
            validation_context:
              trusted_ca: { filename: /pki/ca.pem }
              match_typed_subject_alt_names: [ { san_type: URI, matcher: { prefix: "spiffe://td/ns/shop/" } } ]
            alpn_protocols: [ h2 ]
  clusters:
  - name: hbone
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: hbone
      endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 10.1.2.3, port_value: 15008 } } } } ] } ]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          validation_context:
            trusted_ca: { filename: /pki/ca.pem }
            match_typed_subject_alt_names: [ { san_type: URI, matcher: { exact: "spiffe://td/ns/db/sa/node" } } ]
          alpn_protocols: [ h2 ]
  - name: waypoint
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: waypoint
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 10.0.0.6, port_value: 15008 } } }
          metadata: { filter_metadata: { envoy.filters.listener.original_dst: { local: "10.0.0.6:80" } } }
        - endpoint: { address: { socket_address: { address: 10.0.0.7, port_value: 15008 } } }
          metadata: { filter_metadata: { envoy.filters.listener.original_dst: { local: "10.0.0.7:81" } } }
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          validation_context:
            trusted_ca: { filename: /pki/ca.pem }
            match_typed_subject_alt_names: [ { san_type: URI, matcher: { prefix: "spiffe://td/ns/web/" } } ]
  - name: deliver
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config: { use_http_header: true, http_header_name: ":authority" }
"#;

#[test]
fn hbone_imports_from_an_envoy_bootstrap() {
    let config = bootstrap::parse(HBONE_BOOTSTRAP, "envoy.yaml").unwrap();
    let hbone = config.cluster("hbone").unwrap();
    assert_eq!(hbone.tunnel, Some(model::Tunnel::Hbone));
    assert_eq!(hbone.tunnel_port, None, "15008 is the default");
    assert_eq!(
        hbone
            .endpoints
            .entries()
            .iter()
            .map(|e| e.address.to_string())
            .collect::<Vec<_>>(),
        ["10.1.2.3:8080"]
    );
    let waypoint = config.cluster("waypoint").unwrap();
    assert_eq!(waypoint.tunnel, Some(model::Tunnel::Hbone));
    assert_eq!(
        waypoint
            .endpoints
            .entries()
            .iter()
            .map(|e| e.address.to_string())
            .collect::<Vec<_>>(),
        ["10.0.0.6:80", "10.0.0.7:81"]
    );
    assert!(
        config.cluster("deliver").is_none(),
        "the ORIGINAL_DST cluster is the hbone listener's own delivery"
    );
    let inbound = config.listeners.iter().find(|l| l.name == "in").unwrap();
    assert_eq!(inbound.protocol, model::ListenerProtocol::Hbone);
    assert_eq!(inbound.hbone.as_ref().unwrap().destinations, ["10.0.0.0/8"]);
    assert!(inbound.tls.as_ref().unwrap().client_ca.is_some());
}

#[test]
fn unmappable_hbone_is_refused_by_name() {
    let cases: &[(&str, &str, &str)] = &[
        // A fixed authority whose IP is not the tunnel peer's.
        (
            "tunneling_config: { hostname: \"10.1.2.3:8080\" }",
            "tunneling_config: { hostname: \"10.9.9.9:8080\" }",
            "tunneling_config.hostname",
        ),
        // A hostname flatmesh does not resolve.
        (
            "tunneling_config: { hostname: \"10.1.2.3:8080\" }",
            "tunneling_config: { hostname: \"db.example:8080\" }",
            "not an IP:PORT",
        ),
        // Another command operator.
        (
            "tunneling_config: { hostname: \"10.1.2.3:8080\" }",
            "tunneling_config: { hostname: \"%REQUESTED_SERVER_NAME%:443\" }",
            "%REQUESTED_SERVER_NAME%",
        ),
        // POST instead of CONNECT.
        (
            "tunneling_config: { hostname: \"10.1.2.3:8080\" }",
            "tunneling_config: { hostname: \"10.1.2.3:8080\", use_post: true }",
            "use_post",
        ),
        // Per-endpoint destinations on a cluster whose endpoints carry none.
        (
            "cluster: waypoint\n          tunneling_config: { hostname: \"%DOWNSTREAM_LOCAL_ADDRESS%\" }",
            "cluster: hbone\n          tunneling_config: { hostname: \"%DOWNSTREAM_LOCAL_ADDRESS%\" }",
            "carry no destination",
        ),
        // A tunnel endpoint whose destination is not its own IP.
        (
            "local: \"10.0.0.7:81\"",
            "local: \"10.0.0.99:81\"",
            "original_dst\"].local",
        ),
        // A CONNECT route that does not terminate CONNECT.
        (
            "upgrade_configs: [ { upgrade_type: CONNECT, connect_config: {} } ]",
            "upgrade_configs: [ { upgrade_type: CONNECT } ]",
            "does not terminate CONNECT",
        ),
        // Terminating with POST.
        (
            "connect_config: {} }",
            "connect_config: { allow_post: true } }",
            "does not terminate CONNECT",
        ),
        // Destinations limited by virtual host domains.
        ("domains: [ \"*\" ]", "domains: [ \"10.0.0.1:80\" ]", "domains"),
        // An hbone listener offering http/1.1.
        ("alpn_protocols: [ h2 ]\n  clusters", "alpn_protocols: [ h2, http/1.1 ]\n  clusters", "alpn_protocols"),
    ];
    for (from, to, wanted) in cases {
        assert!(HBONE_BOOTSTRAP.contains(from), "{from}");
        let text = HBONE_BOOTSTRAP.replacen(from, to, 1);
        let e = bootstrap::parse(&text, "envoy.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains(wanted), "{to}: {e}");
    }
}

/// Envoy's ORIGINAL_DST cluster is flatmesh's `type: original_dst`: imported from a
/// bootstrap with Envoy's behaviour written out (every destination allowed), and served and
/// read back over xDS with flatmesh's allow-list intact.
#[test]
fn original_dst_clusters_import_and_round_trip() {
    let bootstrap = r#"
static_resources:
  listeners:
  - name: outbound
    address: { socket_address: { address: 127.0.0.1, port_value: 15001 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: outbound
          cluster: passthrough
  clusters:
  - name: passthrough
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    cleanup_interval: 5s
    connect_timeout: 1s
"#;
    let config = bootstrap::parse(bootstrap, "envoy.yaml").unwrap();
    let c = config.cluster("passthrough").unwrap();
    assert_eq!(c.kind, model::ClusterType::OriginalDst);
    let allow: Vec<String> = c.allow.iter().map(|a| a.to_string()).collect();
    assert_eq!(
        allow,
        ["0.0.0.0/0", "::/0"],
        "Envoy's behaviour, written out"
    );
    assert!(c.endpoints.is_empty());

    let e = import_error(&bootstrap.replace("CLUSTER_PROVIDED", "MAGLEV"));
    assert!(
        e.contains("Cluster \"passthrough\": lb_policy") && e.contains("write CLUSTER_PROVIDED"),
        "{e}"
    );

    let text = "listeners:\n  - { name: outbound, address: 127.0.0.1:15001, protocol: tcp, cluster: passthrough }\nclusters:\n  - { name: passthrough, type: original_dst, allow: [ 10.0.0.0/8, \"fd00::/8\" ], max_destinations: 64, connect_timeout: 2s }\n";
    let config = flatmesh_config::parse(text, "t.yaml").unwrap();
    let resources = crate::from_model::resources(&config);
    assert!(
        !resources.endpoints.contains_key("passthrough"),
        "no endpoints to assign"
    );
    let back = crate::to_model::translate(&resources, &bootstrap::empty_config()).unwrap();
    assert_eq!(back.cluster("passthrough"), config.cluster("passthrough"));
}

#[test]
fn a_type_a_publish_left_as_it_was_keeps_its_packed_set() {
    use crate::resources::{CLUSTER, ENDPOINT, LISTENER};
    let config = model::parse(
        "listeners: [ { name: t, address: 127.0.0.1:9000, protocol: tcp, cluster: c } ]\nclusters: [ { name: c, endpoints: [ 127.0.0.1:1 ] } ]\n",
        "t.yaml",
    )
    .unwrap();
    let store = crate::server::Store::new();
    store.publish_config(&config);
    let before = store.published();
    store.set_endpoints("c", &["127.0.0.1:2".parse().unwrap()]);
    let after = store.published();
    // Delta streams skip the types whose set is the same `Arc` as the one they diffed last.
    for same in [LISTENER, CLUSTER] {
        assert!(std::sync::Arc::ptr_eq(
            &before.by_type[same],
            &after.by_type[same]
        ));
    }
    assert!(!std::sync::Arc::ptr_eq(
        &before.by_type[ENDPOINT],
        &after.by_type[ENDPOINT]
    ));
    assert_ne!(before.versions[ENDPOINT], after.versions[ENDPOINT]);
}
