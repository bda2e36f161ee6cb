//! Interop with real Envoy 1.40 as an HBONE client: Envoy's `tcp_proxy` with a
//! `tunneling_config` sends each accepted connection as an HTTP/2 CONNECT over a mutual-TLS
//! HTTP/2 cluster (certificates from flatmesh's CA) into a flatmesh `hbone` listener, which
//! delivers it to a TCP echo backend. A tunnel to a destination outside the listener's
//! `hbone.destinations` is refused, and counted with its reason.
//!
//! The same over xDS: `flatmesh control`'s rendering of tunnel clusters and hbone listeners
//! drives a real Envoy (both ways: Envoy originates into a flatmesh hbone listener, flatmesh
//! originates into Envoy's hbone listener), and a flatmesh node that follows it over ADS.
//!
//! The nodes run in the test process; Envoy is a child process, killed when the test ends.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use common::pki::{Control, Pki};
use common::{envoy, free_port, get, wait_for, XdsServer};
use flatmesh_config as model;

const NODE: &str = "spiffe://td/ns/mesh/sa/node";
const ENVOY: &str = "spiffe://td/ns/edge/sa/envoy";

/// A TCP backend on a loopback port that echoes every connection's bytes until its EOF.
fn echo_backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if conn.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

/// Sends `message` through `addr` and reads as many bytes back (None: closed or silent first).
fn echo_through(addr: SocketAddr, message: &[u8]) -> Option<Vec<u8>> {
    let mut conn = TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    conn.write_all(message).ok()?;
    let mut back = vec![0u8; message.len()];
    conn.read_exact(&mut back).ok()?;
    Some(back)
}

/// The sum of the samples of Prometheus metric `name` whose labels include every one of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One Envoy listener: a tcp_proxy that tunnels to `authority` through cluster `hbone`.
fn tunnel_listener(name: &str, port: u16, authority: &str) -> String {
    format!(
        r#"
  - name: {name}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: {name}
          cluster: hbone
          tunneling_config: {{ hostname: "{authority}" }}"#
    )
}

#[test]
fn envoy_tunnels_into_a_flatmesh_hbone_listener() {
    let pki = Pki::new("hbone");
    let (node_cert, envoy_cert) = (pki.issue("node", NODE), pki.issue("envoy", ENVOY));
    let ca = pki.ca_file();
    let echo = echo_backend();
    let node_admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let tunnel: SocketAddr = ([127, 0, 0, 1], free_port()).into();

    let config = model::parse(
        &format!(
            r#"
admin: {node_admin}
listeners:
  - name: tunnel
    address: {tunnel}
    protocol: hbone
    tls: {{ cert: {node_cert}.pem, key: {node_cert}.key, client_ca: {ca}, allow: [ {ENVOY} ] }}
    hbone: {{ destinations: [ {echo} ] }}
"#
        ),
        "node.yaml",
    )
    .unwrap();
    let _node = flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline).unwrap();

    let (good, denied, envoy_admin) = (free_port(), free_port(), free_port());
    let bootstrap = format!(
        r#"
admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {envoy_admin} }} }} }}
static_resources:
  listeners:{good_listener}{denied_listener}
  clusters:
  - name: hbone
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: hbone
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {tunnel_port} }} }} }} }} ] }} ]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          tls_certificates:
          - certificate_chain: {{ filename: {envoy_cert}.pem }}
            private_key: {{ filename: {envoy_cert}.key }}
          validation_context:
            trusted_ca: {{ filename: {ca} }}
            match_typed_subject_alt_names: [ {{ san_type: URI, matcher: {{ exact: "{NODE}" }} }} ]
          alpn_protocols: [ h2 ]
"#,
        good_listener = tunnel_listener("good", good, &echo.to_string()),
        denied_listener = tunnel_listener("denied", denied, "10.9.8.7:80"),
        tunnel_port = tunnel.port(),
    );
    let path = pki.dir.join("envoy-hbone.yaml");
    std::fs::write(&path, &bootstrap).unwrap();
    if let Err(why) = envoy::validate(&path) {
        panic!("Envoy refuses the HBONE client bootstrap:\n{why}");
    }
    let _envoy = envoy::run(&pki.dir, "envoy-hbone", &bootstrap);
    let good: SocketAddr = ([127, 0, 0, 1], good).into();
    wait_for(
        "Envoy's tunnel reaches the echo backend through the node's hbone listener",
        || echo_through(good, b"ping") == Some(b"ping".to_vec()),
    );
    // Many connections, each its own CONNECT stream, bytes both ways.
    for i in 0..20u8 {
        let message = vec![i; 10_000 + usize::from(i) * 333];
        assert_eq!(
            echo_through(good, &message).as_deref(),
            Some(&message[..]),
            "connection {i}"
        );
    }
    let metrics = get(node_admin, "localhost", "/metrics").unwrap().1;
    assert!(
        metric(
            &metrics,
            "flatmesh_hbone_streams_total",
            &["listener=\"tunnel\""]
        ) >= 21.0,
        "the node counts Envoy's CONNECT streams:\n{metrics}"
    );
    // Outside hbone.destinations: Envoy gets 403 and closes its client's connection.
    let denied: SocketAddr = ([127, 0, 0, 1], denied).into();
    assert_eq!(echo_through(denied, b"x"), None);
    wait_for("the node counts the refused destination", || {
        let metrics = get(node_admin, "localhost", "/metrics").unwrap().1;
        metric(
            &metrics,
            "flatmesh_hbone_streams_refused_total",
            &["listener=\"tunnel\"", "reason=\"destination_not_allowed\""],
        ) >= 1.0
    });
}

/// A node serving an hbone listener at `tunnel` (admitting `peer`, delivering to `echo`) and a
/// tcp listener at `out` that tunnels to `echo` through `via`'s hbone port, presenting
/// `cert`. Returns the node's admin address.
fn hbone_node(
    pki: &Pki,
    cert: &str,
    peer: &str,
    tunnel: SocketAddr,
    echo: SocketAddr,
    out: SocketAddr,
    via: u16,
) -> (flatmesh_proxy::Node, SocketAddr) {
    let ca = pki.ca_file();
    let admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let config = model::parse(
        &format!(
            r#"
admin: {admin}
listeners:
  - name: tunnel
    address: {tunnel}
    protocol: hbone
    tls: {{ cert: {cert}.pem, key: {cert}.key, client_ca: {ca}, allow: [ {peer} ] }}
    hbone: {{ destinations: [ {echo} ] }}
  - {{ name: out, address: {out}, protocol: tcp, cluster: via }}
clusters:
  - name: via
    endpoints: [ {echo} ]
    tunnel: hbone
    tunnel_port: {via}
    tls: {{ ca: {ca}, cert: {cert}.pem, key: {cert}.key, server_ids: [ {peer} ] }}
"#
        ),
        "node.yaml",
    )
    .unwrap();
    let node = flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline).unwrap();
    (node, admin)
}

/// What `flatmesh control` serves: a tcp listener at `out` tunnelling to `echo` through the
/// hbone port `via`, and an hbone listener at `tunnel` delivering to `echo`; `cert` is the
/// served side's identity, `peer` the other side's.
fn served_hbone(
    pki: &Pki,
    cert: &str,
    peer: &str,
    tunnel: SocketAddr,
    echo: SocketAddr,
    out: SocketAddr,
    via: u16,
) -> model::Config {
    let ca = pki.ca_file();
    model::parse(
        &format!(
            r#"
listeners:
  - name: in
    address: {tunnel}
    protocol: hbone
    tls: {{ cert: {cert}.pem, key: {cert}.key, client_ca: {ca}, allow: [ {peer} ] }}
    hbone: {{ destinations: [ {echo} ] }}
  - {{ name: out, address: {out}, protocol: tcp, cluster: via }}
clusters:
  - name: via
    endpoints: [ {echo} ]
    tunnel: hbone
    tunnel_port: {via}
    tls: {{ ca: {ca}, cert: {cert}.pem, key: {cert}.key, server_ids: [ {peer} ] }}
"#
        ),
        "control.yaml",
    )
    .unwrap()
}

#[test]
fn envoy_runs_the_hbone_flatmesh_control_renders() {
    let pki = Pki::new("hbone-xds-envoy");
    let (node_cert, envoy_cert) = (pki.issue("node", NODE), pki.issue("envoy", ENVOY));
    let echo = echo_backend();
    let local = |port: u16| -> SocketAddr { ([127, 0, 0, 1], port).into() };
    let (node_tunnel, node_out) = (local(free_port()), local(free_port()));
    let (envoy_tunnel, envoy_out) = (local(free_port()), local(free_port()));
    let (_node, node_admin) = hbone_node(
        &pki,
        &node_cert,
        ENVOY,
        node_tunnel,
        echo,
        node_out,
        envoy_tunnel.port(),
    );
    let served = served_hbone(
        &pki,
        &envoy_cert,
        NODE,
        envoy_tunnel,
        echo,
        envoy_out,
        node_tunnel.port(),
    );
    let envoy_admin = local(free_port());
    let control = Control::start(&served, envoy_admin, &pki.dir);
    // Envoy originates (tcp_proxy tunneling_config over its HTTP/2 mTLS cluster) into the
    // node's hbone listener.
    wait_for("Envoy tunnels into the node's hbone listener", || {
        echo_through(envoy_out, b"ping") == Some(b"ping".to_vec())
    });
    for i in 0..5u8 {
        let message = vec![i; 20_000];
        assert_eq!(
            echo_through(envoy_out, &message).as_deref(),
            Some(&message[..])
        );
    }
    // The node originates into Envoy's hbone listener, which terminates CONNECT by :authority.
    wait_for("the node tunnels into Envoy's hbone listener", || {
        echo_through(node_out, b"pong") == Some(b"pong".to_vec())
    });
    let stats = get(envoy_admin, "localhost", "/stats").unwrap().1;
    assert!(
        stats.contains("http.in.downstream_rq_total"),
        "Envoy's hbone listener served the node's CONNECT:\n{stats}"
    );
    let metrics = get(node_admin, "localhost", "/metrics").unwrap().1;
    assert!(
        metric(
            &metrics,
            "flatmesh_hbone_streams_total",
            &["listener=\"tunnel\""]
        ) >= 6.0,
        "the node counts Envoy's CONNECT streams:\n{metrics}"
    );
    control.assert_no_nacks();
}

#[test]
fn a_node_over_xds_tunnels_into_a_flatmesh_hbone_listener() {
    use flatmesh_xds::client::{Client, Options, Protocol};
    const CLIENT: &str = "spiffe://td/ns/edge/sa/client";
    let pki = Pki::new("hbone-xds-node");
    let (server_cert, client_cert) = (pki.issue("server", NODE), pki.issue("client", CLIENT));
    let echo = echo_backend();
    let local = |port: u16| -> SocketAddr { ([127, 0, 0, 1], port).into() };
    let (tunnel, unused_out, out) = (local(free_port()), local(free_port()), local(free_port()));
    // The server node: an hbone listener delivering to the echo backend.
    let (_server, server_admin) =
        hbone_node(&pki, &server_cert, CLIENT, tunnel, echo, unused_out, 1);
    // The client node follows flatmesh control, which serves it a tcp listener that tunnels.
    let served = served_hbone(
        &pki,
        &client_cert,
        NODE,
        local(free_port()),
        echo,
        out,
        tunnel.port(),
    );
    let store = flatmesh_xds::server::Store::new();
    store.publish_config(&served);
    let xds = XdsServer::start(&store, "127.0.0.1:0".parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut base = flatmesh_xds::bootstrap::empty_config();
    let client_admin = local(free_port());
    base.admin = client_admin.into();
    base.workers = Some(1);
    let (apply, node) = common::node_apply();
    let options = Options {
        server: xds.addr.to_string(),
        node_id: "client".into(),
        node_cluster: "test".into(),
        protocol: Protocol::Delta,
        security: Default::default(),
        sds_dir: None,
        load_reports: None,
    };
    let _client = rt.block_on(async { Client::spawn(options, base, apply) });
    wait_for("the node over xDS tunnels to the echo backend", || {
        echo_through(out, b"ping") == Some(b"ping".to_vec())
    });
    let message = vec![7u8; 100_000];
    assert_eq!(echo_through(out, &message).as_deref(), Some(&message[..]));
    // What the node runs is the tunnel flatmesh control was given.
    assert!(node.lock().is_some());
    let running = get(client_admin, "localhost", "/config").unwrap().1;
    assert!(
        running.contains("hbone") && running.contains(&tunnel.port().to_string()),
        "{running}"
    );
    let metrics = get(server_admin, "localhost", "/metrics").unwrap().1;
    assert!(
        metric(
            &metrics,
            "flatmesh_hbone_streams_total",
            &["listener=\"tunnel\""]
        ) >= 2.0,
        "{metrics}"
    );
    assert!(store.nacks().is_empty(), "{:?}", store.nacks());
}
