//! A flatmesh node driven by flatmesh's own xDS server (`flatmesh control`), state of the world
//! and delta: every NACK path refuses the update with the exact `error_detail` (the same text
//! reaches the server) while the last good config keeps serving; EDS changes swap with no failed
//! request; removed resources go; the control plane restarts and the node reconnects without
//! re-applying what it already holds.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{free_port, get, wait_for, Backend, XdsServer};
use envoy_types::pb::envoy::config::cluster::v3::{cluster, UpstreamConnectionOptions};
use envoy_types::pb::envoy::config::listener::v3::FilterChain;
use envoy_types::pb::envoy::config::route::v3::{header_matcher, route_match, HeaderMatcher};
use flatmesh_config as model;
use flatmesh_xds::client::{Client, Options, Protocol};
use flatmesh_xds::resources::Resources;
use flatmesh_xds::server::Store;

fn state(port: u16, routes: &str, clusters: &str) -> model::Config {
    let text = format!(
        "listeners:\n  - name: web\n    address: 127.0.0.1:{port}\n    protocol: http\n    routes:\n{routes}\nclusters:\n{clusters}"
    );
    model::parse(&text, "state.yaml").unwrap()
}

fn body(addr: SocketAddr, path: &str) -> Option<String> {
    get(addr, "svc.local", path).map(|(status, body)| format!("{status} {body}"))
}

/// Publish `bad`; the client must NACK it with exactly `detail`, the server must receive that
/// text, and `still` must keep answering `expect`.
fn refused(
    store: &Store,
    client: &Client,
    node_id: &str,
    bad: Resources,
    detail: &str,
    check: impl Fn() -> bool,
) {
    let before = client.status().nacks.len();
    store.publish(bad);
    wait_for(&format!("a NACK saying: {detail}"), || {
        client.status().nacks.len() > before
    });
    let got = client.status().nacks.last().cloned().unwrap();
    assert_eq!(got, detail, "the NACK's error_detail");
    wait_for("the server receives the same error_detail", || {
        store.nacks().last() == Some(&format!("{node_id}: {detail}"))
    });
    assert!(check(), "the last good config still serves after: {detail}");
}

fn scenario(protocol: Protocol) {
    let a = Backend::start("A");
    let b = Backend::start("B");
    let port = free_port();
    let web: SocketAddr = ([127, 0, 0, 1], port).into();
    let good = state(
        port,
        "      - { name: a, match: { path: { prefix: /a } }, cluster: a }\n      - { name: rest, cluster: b }\n",
        &format!(
            "  - {{ name: a, endpoints: [ {} ] }}\n  - {{ name: b, lb: least_request, endpoints: [ {} ] }}\n",
            a.addr, b.addr
        ),
    );
    let store = Store::new();
    store.publish_config(&good);
    let server = XdsServer::start(&store, "127.0.0.1:0".parse().unwrap());
    let node_id = format!("node-{protocol:?}");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut base = flatmesh_xds::bootstrap::empty_config();
    base.admin = "127.0.0.1:0".parse().unwrap();
    base.workers = Some(1);
    let (apply, node) = common::node_apply();
    let options = Options {
        server: server.addr.to_string(),
        node_id: node_id.clone(),
        node_cluster: "test".into(),
        protocol,
        security: Default::default(),
        sds_dir: None,
        load_reports: None,
    };
    let client = rt.block_on(async { Client::spawn(options, base, apply) });
    let v1 = || {
        body(web, "/a/1").as_deref() == Some("200 A") && body(web, "/b").as_deref() == Some("200 B")
    };
    wait_for("v1: /a -> A, / -> B", v1);

    // 1. NACK paths, one per resource type and one for the assembled config.
    let good_resources = flatmesh_xds::from_model::resources(&good);

    let mut bad = good_resources.clone();
    bad.clusters
        .get_mut("a")
        .unwrap()
        .upstream_connection_options = Some(UpstreamConnectionOptions::default());
    refused(&store, &client, &node_id, bad, "Cluster \"a\": upstream_connection_options is not supported by flatmesh; remove it (docs/xds.md lists the supported subset)", v1);

    let mut bad = good_resources.clone();
    bad.clusters.get_mut("b").unwrap().lb_policy = cluster::LbPolicy::ClusterProvided as i32;
    refused(&store, &client, &node_id, bad, "Cluster \"b\": lb_policy: CLUSTER_PROVIDED is not supported; use ROUND_ROBIN, LEAST_REQUEST, RING_HASH, MAGLEV or RANDOM", v1);

    let mut bad = good_resources.clone();
    bad.endpoints.get_mut("a").unwrap().endpoints[0].priority = 1000;
    refused(&store, &client, &node_id, bad, "ClusterLoadAssignment \"a\".endpoints[0].priority: is 1000; flatmesh takes priorities 0 to 127", v1);

    let mut bad = good_resources.clone();
    let vh = &mut bad.routes.get_mut("web").unwrap().virtual_hosts[0];
    vh.routes[0]
        .r#match
        .as_mut()
        .unwrap()
        .headers
        .push(HeaderMatcher {
            name: ":authority".into(),
            header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::PresentMatch(true)),
            ..Default::default()
        });
    refused(&store, &client, &node_id, bad, "RouteConfiguration \"web\": virtual_hosts[0] (\"any\").routes[0].match.headers[0].name: pseudo-header `:authority` cannot be matched; match the path or method instead", v1);

    let mut bad = good_resources.clone();
    let l = bad.listeners.get_mut("web").unwrap();
    l.filter_chains.push(FilterChain::default());
    refused(&store, &client, &node_id, bad, "Listener \"web\": filter_chains: has 2 filter chains; flatmesh runs exactly one per listener (no filter_chain_match)", v1);

    // Each resource translates, but the config they form is invalid (a path without `/`).
    let mut bad = good_resources.clone();
    let vh = &mut bad.routes.get_mut("web").unwrap().virtual_hosts[0];
    vh.routes[0].r#match.as_mut().unwrap().path_specifier =
        Some(route_match::PathSpecifier::Prefix("a".into()));
    let before = client.status().nacks.len();
    store.publish(bad);
    wait_for("a NACK for the invalid config", || {
        client.status().nacks.len() > before
    });
    let detail = client.status().nacks.last().cloned().unwrap();
    assert!(
        detail.starts_with("the pushed resources do not form a valid flatmesh config: listener \"web\" routes[0].match.path"),
        "{detail}"
    );
    assert!(v1(), "still v1 after the invalid config");

    // 2. Back to good; then EDS flips between A and B under load: not one request fails.
    store.publish_config(&good);
    wait_for("v1 again", v1);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            while !stop.load(Ordering::Relaxed) {
                match body(web, "/a/x") {
                    Some(b) if b.starts_with("200 ") => {
                        seen.insert(b);
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            seen
        })
    };
    let applied = client.status().applied;
    for k in 0..20 {
        let to = if k % 2 == 0 { b.addr } else { a.addr };
        store.set_endpoints("a", &[to]);
        std::thread::sleep(Duration::from_millis(50));
    }
    // (Changes closer together than a push may be coalesced into one: count half of them.)
    wait_for("the EDS changes applied, ending on A", || {
        client.status().applied >= applied + 10 && body(web, "/a/x").as_deref() == Some("200 A")
    });
    stop.store(true, Ordering::Relaxed);
    let seen = load.join().unwrap();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    assert_eq!(failed, 0, "no request failed across 20 EDS swaps ({ok} ok)");
    assert_eq!(seen.len(), 2, "traffic followed the flips: {seen:?}");

    // 3. Resources are removed: cluster b and its route go, / now -> A.
    let v2 = state(
        port,
        "      - { cluster: a }\n",
        &format!("  - {{ name: a, endpoints: [ {} ] }}\n", a.addr),
    );
    store.publish_config(&v2);
    wait_for("v2: everything -> A", || {
        body(web, "/b").as_deref() == Some("200 A")
    });

    // 4. The control plane stops: the node keeps serving v2.
    let addr = server.addr;
    server.stop();
    wait_for("the client sees the outage", || !client.status().connected);
    for _ in 0..5 {
        assert_eq!(
            body(web, "/x").as_deref(),
            Some("200 A"),
            "served during the outage"
        );
    }
    // It comes back with the same state: the client reconnects and applies nothing new.
    let applied = client.status().applied;
    let streams = client.status().streams;
    let server = XdsServer::start(&store, addr);
    wait_for("the client reconnects", || {
        let s = client.status();
        s.connected && s.streams > streams
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        client.status().applied,
        applied,
        "a reconnect to the same state changes nothing: {:?}",
        client.status()
    );
    // And a change after the restart is followed.
    store.publish_config(&state(
        port,
        "      - { cluster: b }\n",
        &format!("  - {{ name: b, endpoints: [ {} ] }}\n", b.addr),
    ));
    wait_for("v3 after the restart: / -> B", || {
        body(web, "/x").as_deref() == Some("200 B")
    });

    // 5. The listener is removed: its port closes.
    store.publish(Resources::default());
    wait_for("the listener is gone", || {
        get(web, "svc.local", "/").is_none()
    });

    rt.block_on(client.stop());
    let running = node.lock().take();
    if let Some(node) = running {
        node.shutdown();
    }
    server.stop();
}

#[test]
fn flatmesh_control_drives_the_node_sotw() {
    scenario(Protocol::Sotw);
}

#[test]
fn flatmesh_control_drives_the_node_delta() {
    scenario(Protocol::Delta);
}

/// With no control plane at all, the client retries with backoff (not in a tight loop) and says why.
#[test]
fn unreachable_control_plane_is_retried_with_backoff() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let port = free_port(); // nothing listens there
    let (apply, _node) = common::node_apply();
    let options = Options {
        server: format!("127.0.0.1:{port}"),
        node_id: "lonely".into(),
        node_cluster: "test".into(),
        protocol: Protocol::Sotw,
        security: Default::default(),
        sds_dir: None,
        load_reports: None,
    };
    let client = rt
        .block_on(async { Client::spawn(options, flatmesh_xds::bootstrap::empty_config(), apply) });
    std::thread::sleep(Duration::from_millis(1600));
    let status = client.status();
    // Delays of 50-100, 100-200, 200-400, 400-800 ms: 4 or 5 attempts in 1.6 s, not hundreds.
    assert!(
        (3..=6).contains(&status.attempts),
        "attempts in 1.6 s: {status:?}"
    );
    let why = status.last_error.unwrap_or_default();
    assert!(
        why.contains(&format!("cannot reach the xDS server at 127.0.0.1:{port}"))
            && why.contains("check that the control plane runs"),
        "{why}"
    );
    assert_eq!(status.streams, 0);
    rt.block_on(client.stop());
}
