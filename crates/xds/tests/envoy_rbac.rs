//! Interop with real Envoy 1.40: a listener's `authorization`, served by flatmesh control over
//! ADS as Envoy RBAC (a DENY layer, then an ALLOW layer), is enforced by Envoy by the caller's
//! SPIFFE ID, method and path. The callers are a flatmesh node in the test process that
//! originates mTLS to Envoy with a different certificate per route (from flatmesh's CA).
//! Envoy accepting the resources (no NACK) shows the served RBAC is valid Envoy config; the
//! 200s and 403s show it means what the policies say, on an http and a tcp listener.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;

use common::pki::{Control, Pki};
use common::{free_port, request, wait_for, Backend};
use flatmesh_config as model;

const ENVOY: &str = "spiffe://td/ns/edge/sa/envoy";
const WEB: &str = "spiffe://td/ns/shop/sa/web";
const CART: &str = "spiffe://td/ns/shop/sa/cart";
const ONCALL: &str = "spiffe://td/ns/ops/sa/oncall";
const BATCH: &str = "spiffe://td/ns/batch/sa/job";

#[test]
fn envoy_enforces_flatmesh_policies_served_over_xds() {
    let pki = Pki::new("rbac");
    let envoy_cert = pki.issue("envoy", ENVOY);
    let callers = [
        ("web", pki.issue("web", WEB)),
        ("cart", pki.issue("cart", CART)),
        ("oncall", pki.issue("oncall", ONCALL)),
        ("batch", pki.issue("batch", BATCH)),
    ];
    let ca = pki.ca_file();
    let app = Backend::start("app");

    // Envoy: an mTLS http listener and an mTLS tcp listener, each with policies; every caller
    // of the CA's trust domain passes the TLS check, so the policies decide.
    let edge: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let edge_tcp: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let tls = format!(
        "{{ cert: {envoy_cert}.pem, key: {envoy_cert}.key, client_ca: {ca}, allow: [ \"spiffe://td/*\" ] }}"
    );
    let envoy_config = model::parse(
        &format!(
            r#"
listeners:
  - name: edge
    address: {edge}
    protocol: http
    tls: {tls}
    routes: [ {{ cluster: app }} ]
    authorization:
      default: deny
      policies:
        - {{ name: no-cart, action: deny, from: {{ principals: [ {CART} ] }} }}
        - {{ name: no-admin, action: deny, to: {{ paths: [ "*/admin" ] }} }}
        - {{ name: shop, action: allow, from: {{ namespaces: [ shop ] }} }}
        - {{ name: ops-reads, action: allow, from: {{ principals: [ "spiffe://td/ns/ops/*" ] }}, to: {{ methods: [ GET ] }} }}
  - name: edge-tcp
    address: {edge_tcp}
    protocol: tcp
    cluster: app
    tls: {tls}
    authorization:
      policies:
        - {{ name: no-batch, action: deny, from: {{ namespaces: [ batch ] }} }}
clusters:
  - {{ name: app, endpoints: [ {app} ] }}
"#,
            app = app.addr
        ),
        "envoy.yaml",
    )
    .unwrap();
    let control = Control::start(&envoy_config, "127.0.0.1:0".parse().unwrap(), &pki.dir);

    // The node: `/NAME/...` goes to Envoy's http listener as NAME, `/tcp-NAME/...` to its tcp
    // listener.
    let out: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut routes = String::new();
    let mut clusters = String::new();
    for (name, cert) in &callers {
        for (kind, target) in [("", edge), ("tcp-", edge_tcp)] {
            routes.push_str(&format!(
                "      - {{ match: {{ path: {{ prefix: /{kind}{name}/ }} }}, cluster: {kind}{name} }}\n"
            ));
            clusters.push_str(&format!(
                "  - {{ name: {kind}{name}, endpoints: [ {target} ], tls: {{ ca: {ca}, cert: {cert}.pem, key: {cert}.key, server_ids: [ {ENVOY} ] }} }}\n"
            ));
        }
    }
    let node_config = model::parse(
        &format!(
            "listeners:\n  - name: out\n    address: {out}\n    protocol: http\n    routes:\n{routes}clusters:\n{clusters}"
        ),
        "node.yaml",
    )
    .unwrap();
    let _node =
        flatmesh_proxy::Node::start(node_config, flatmesh_proxy::ConfigSource::Inline).unwrap();
    let call = |method: &str, path: &str| {
        request(out, method, "svc.local", path)
            .map(|(status, body)| (status, body.trim().to_string()))
    };

    wait_for(
        "Envoy admits web (namespace shop) through its policies",
        || call("GET", "/web/1") == Some((200, "app".into())),
    );
    control.assert_no_nacks();
    let denied = |method: &str, path: &str, why: &str| {
        let (status, body) = call(method, path).unwrap();
        assert_eq!(status, 403, "{method} {path}: {why}: {body}");
        assert!(
            body.contains("RBAC: access denied"),
            "{method} {path}: {body}"
        );
    };
    assert_eq!(
        call("POST", "/web/1"),
        Some((200, "app".into())),
        "shop may POST"
    );
    denied(
        "GET",
        "/web/admin",
        "the no-admin deny policy wins over the shop allow",
    );
    denied("GET", "/cart/1", "cart is in shop, but no-cart denies it");
    assert_eq!(
        call("GET", "/oncall/1"),
        Some((200, "app".into())),
        "ops-reads admits an ops ID's GET"
    );
    denied("POST", "/oncall/1", "ops-reads admits only GET");
    denied(
        "GET",
        "/batch/1",
        "no allow policy matches batch and the default is deny",
    );

    // The tcp listener: only a deny policy, so everyone else is relayed.
    assert_eq!(call("GET", "/tcp-web/1"), Some((200, "app".into())));
    assert_eq!(call("GET", "/tcp-cart/1"), Some((200, "app".into())));
    let refused = call("GET", "/tcp-batch/1");
    assert!(
        matches!(refused, Some((502 | 503, _))),
        "Envoy closes batch's connection, the node answers 502/503: {refused:?}"
    );
    control.assert_no_nacks();
}
