//! Interop with real Envoy 1.40 over mutual TLS, with certificates from flatmesh's CA
//! (`flatmesh_identity::Authority`, what `flatmesh ca issue` writes), both ways:
//!
//! - Envoy calls a flatmesh mTLS listener and is admitted when its SPIFFE ID is allowed (exactly
//!   or by a `/*` pattern) and refused when it is not. The node's listener comes from an Envoy
//!   bootstrap (`--envoy-config`'s import, a `DownstreamTlsContext`) that Envoy itself validates;
//!   Envoy's clusters come from flatmesh control over ADS (the server's `UpstreamTlsContext`).
//! - flatmesh originates mTLS to an Envoy listener that requires client certificates and matches
//!   the node's SPIFFE URI SAN; a node that presents another identity is refused by Envoy, and a
//!   cluster whose `server_ids` do not name Envoy's certificate answers 503. Envoy's listener
//!   comes from flatmesh control over ADS (the server's `DownstreamTlsContext`); the node's
//!   clusters go through the xDS translation both ways (`ClusterTls` -> xDS -> `ClusterTls`).
//!
//! The node runs in the test process; Envoy is a child process, killed when the test ends.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;

use common::pki::{Control, Pki};
use common::{envoy, free_port, get, wait_for, Backend};
use flatmesh_config as model;

const NODE: &str = "spiffe://td/ns/mesh/sa/node";
const ENVOY: &str = "spiffe://td/ns/edge/sa/envoy";
const WEB: &str = "spiffe://td/ns/shop/sa/web";
const ONCALL: &str = "spiffe://td/ns/ops/sa/oncall";
const CART: &str = "spiffe://td/ns/shop/sa/cart";

fn start_node(config: model::Config) -> flatmesh_proxy::Node {
    flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline).unwrap()
}

fn status(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    get(addr, "svc.local", path)
}

/// The sum of the samples of Prometheus metric `name` whose labels include every one of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// An Envoy counter from its admin page (`/stats`), 0 when it is not there yet.
fn envoy_counter(admin: SocketAddr, name: &str) -> u64 {
    let Some((200, text)) = get(admin, "localhost", &format!("/stats?filter=^{name}$")) else {
        return 0;
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: "))?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn envoy_is_admitted_or_refused_by_spiffe_id_at_a_flatmesh_mtls_listener() {
    let pki = Pki::new("inbound");
    let node_cert = pki.issue("node", NODE);
    let (web, oncall, cart) = (
        pki.issue("web", WEB),
        pki.issue("oncall", ONCALL),
        pki.issue("cart", CART),
    );
    let ca = pki.ca_file();
    let app = Backend::start("app");
    let node_admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mesh: SocketAddr = ([127, 0, 0, 1], free_port()).into();

    // The node's listener, written as an Envoy bootstrap: Envoy's own validation accepts it and
    // flatmesh imports it.
    let bootstrap = format!(
        r#"
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }} }} }}
static_resources:
  listeners:
  - name: mesh
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {mesh_port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: mesh
          route_config: {{ virtual_hosts: [ {{ name: any, domains: ["*"], routes: [ {{ match: {{ prefix: / }}, route: {{ cluster: app }} }} ] }} ] }}
          http_filters: [ {{ name: envoy.filters.http.router, typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }} }} ]
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{ filename: {node_cert}.pem }}
              private_key: {{ filename: {node_cert}.key }}
            validation_context:
              trusted_ca: {{ filename: {ca} }}
              match_typed_subject_alt_names:
              - {{ san_type: URI, matcher: {{ exact: "{WEB}" }} }}
              - {{ san_type: URI, matcher: {{ prefix: "spiffe://td/ns/ops/" }} }}
            alpn_protocols: [ h2, http/1.1 ]
  clusters:
  - name: app
    type: STATIC
    load_assignment:
      cluster_name: app
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {app_port} }} }} }} }} ] }} ]
"#,
        admin_port = node_admin.port(),
        mesh_port = mesh.port(),
        app_port = app.addr.port(),
    );
    let path = pki.dir.join("node-bootstrap.yaml");
    std::fs::write(&path, &bootstrap).unwrap();
    if let Err(why) = envoy::validate(&path) {
        panic!("Envoy refuses the bootstrap the node imports:\n{why}");
    }
    let config = flatmesh_xds::bootstrap::load(&path).unwrap();
    assert_eq!(
        config.listeners[0].tls.as_ref().unwrap().allow,
        [WEB, "spiffe://td/ns/ops/*"]
    );
    let _node = start_node(config);

    // Envoy: one plaintext listener, one route per identity it calls the node as.
    let front: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut clusters = String::new();
    for (name, prefix) in [("as-web", &web), ("as-oncall", &oncall), ("as-cart", &cart)] {
        clusters.push_str(&format!(
            "  - {{ name: {name}, endpoints: [ {mesh} ], tls: {{ ca: {ca}, cert: {prefix}.pem, key: {prefix}.key, server_ids: [ {NODE} ] }} }}\n"
        ));
    }
    let envoy_config = model::parse(
        &format!(
            "listeners:\n  - name: front\n    address: {front}\n    protocol: http\n    routes:\n      - {{ match: {{ path: {{ prefix: /web }} }}, cluster: as-web }}\n      - {{ match: {{ path: {{ prefix: /oncall }} }}, cluster: as-oncall }}\n      - {{ match: {{ path: {{ prefix: /cart }} }}, cluster: as-cart }}\nclusters:\n{clusters}"
        ),
        "envoy.yaml",
    )
    .unwrap();
    let control = Control::start(&envoy_config, "127.0.0.1:0".parse().unwrap(), &pki.dir);

    wait_for(
        "Envoy, as web (an allowed ID), reaches the app through the node",
        || status(front, "/web/1") == Some((200, "app".into())),
    );
    assert_eq!(
        status(front, "/oncall/1"),
        Some((200, "app".into())),
        "an ID under an allowed `/*` pattern is admitted"
    );
    let (refused, body) = status(front, "/cart/1").unwrap();
    assert_eq!(refused, 503, "cart is not allowed: {body}");
    let metrics = get(node_admin, "localhost", "/metrics").unwrap().1;
    let not_allowed = metric(
        &metrics,
        "flatmesh_tls_handshake_failures_total",
        &["listener=\"mesh\"", "reason=\"not_allowed\""],
    );
    assert!(
        not_allowed >= 1.0,
        "the node counts the refusal as not_allowed:\n{metrics}"
    );
    assert!(
        metric(
            &metrics,
            "flatmesh_tls_handshakes_total",
            &["listener=\"mesh\""]
        ) >= 2.0,
        "the node counts the admitted handshakes:\n{metrics}"
    );
    control.assert_no_nacks();
}

#[test]
fn flatmesh_originates_mtls_to_envoy_which_checks_its_spiffe_id() {
    let pki = Pki::new("outbound");
    let (node_cert, envoy_cert, cart) = (
        pki.issue("node", NODE),
        pki.issue("envoy", ENVOY),
        pki.issue("cart", CART),
    );
    let ca = pki.ca_file();
    let app = Backend::start("app");

    // Envoy: a listener that requires a client certificate and admits only the node's ID.
    let edge: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let envoy_admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let envoy_config = model::parse(
        &format!(
            "listeners:\n  - name: edge\n    address: {edge}\n    protocol: http\n    tls: {{ cert: {envoy_cert}.pem, key: {envoy_cert}.key, client_ca: {ca}, allow: [ {NODE} ] }}\n    routes:\n      - {{ cluster: app }}\nclusters:\n  - {{ name: app, endpoints: [ {} ] }}\n",
            app.addr
        ),
        "envoy.yaml",
    )
    .unwrap();
    let control = Control::start(&envoy_config, envoy_admin, &pki.dir);

    // The node: a plaintext listener whose routes originate mTLS to Envoy, each a different way.
    let out: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let node_admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let tls = |cert: &str, server: &str| {
        format!("{{ ca: {ca}, cert: {cert}.pem, key: {cert}.key, server_ids: [ {server} ] }}")
    };
    let node_config = model::parse(
        &format!(
            r#"
admin: {node_admin}
listeners:
  - name: out
    address: {out}
    protocol: http
    routes:
      - {{ match: {{ path: {{ prefix: /h1 }} }}, cluster: edge-h1 }}
      - {{ match: {{ path: {{ prefix: /h2 }} }}, cluster: edge-h2 }}
      - {{ match: {{ path: {{ prefix: /impostor }} }}, cluster: edge-wrong-id }}
      - {{ match: {{ path: {{ prefix: /as-cart }} }}, cluster: edge-as-cart }}
clusters:
  - {{ name: edge-h1, endpoints: [ {edge} ], tls: {h1} }}
  - {{ name: edge-h2, protocol: http2, endpoints: [ {edge} ], tls: {h2} }}
  - {{ name: edge-wrong-id, endpoints: [ {edge} ], tls: {wrong} }}
  - {{ name: edge-as-cart, endpoints: [ {edge} ], tls: {as_cart} }}
"#,
            h1 = tls(&node_cert, "\"spiffe://td/ns/edge/*\""),
            h2 = tls(&node_cert, ENVOY),
            wrong = tls(&node_cert, "spiffe://td/ns/edge/sa/impostor"),
            as_cart = tls(&cart, ENVOY),
        ),
        "node.yaml",
    )
    .unwrap();
    // Through xDS and back, as `flatmesh node --xds` would receive it.
    let resources = flatmesh_xds::from_model::resources(&node_config);
    let translated =
        flatmesh_xds::to_model::translate(&resources, &flatmesh_xds::bootstrap::empty_config())
            .unwrap();
    let mut node_config = node_config;
    node_config.listeners = translated.listeners;
    node_config.clusters = translated.clusters;
    let _node = start_node(node_config);

    wait_for(
        "the node reaches the app through Envoy over mTLS (HTTP/1.1)",
        || status(out, "/h1") == Some((200, "app".into())),
    );
    assert_eq!(
        status(out, "/h2"),
        Some((200, "app".into())),
        "HTTP/2 over mTLS (ALPN h2)"
    );

    // The node does not take Envoy for the impostor it expects: 503, counted by reason.
    let (impostor, body) = status(out, "/impostor").unwrap();
    assert_eq!(impostor, 503, "{body}");
    let metrics = get(node_admin, "localhost", "/metrics").unwrap().1;
    assert!(
        metric(
            &metrics,
            "flatmesh_upstream_tls_handshake_failures_total",
            &["cluster=\"edge-wrong-id\"", "reason=\"not_allowed\""],
        ) >= 1.0,
        "the node counts Envoy's certificate as not allowed:\n{metrics}"
    );

    // Envoy does not take cart for the node: its SAN check fails and the request gets nowhere
    // (under TLS 1.3 the refusal is an alert after the client's half of the handshake, so the
    // node sees a reset, 502; under TLS 1.2 it would fail the handshake, 503).
    let before = envoy_counter(
        envoy_admin,
        &format!("listener.127.0.0.1_{}.ssl.fail_verify_san", edge.port()),
    );
    let (as_cart, body) = status(out, "/as-cart").unwrap();
    assert!(
        matches!(as_cart, 502 | 503),
        "Envoy must refuse the cart identity: {as_cart} {body}"
    );
    wait_for("Envoy counts a failed SAN check", || {
        envoy_counter(
            envoy_admin,
            &format!("listener.127.0.0.1_{}.ssl.fail_verify_san", edge.port()),
        ) > before
    });
    // And the node's own identity still passes.
    assert_eq!(status(out, "/h1"), Some((200, "app".into())));
    control.assert_no_nacks();
}
