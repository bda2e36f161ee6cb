//! 1,000 clusters / 10,000 endpoints / 1,000 routes pushed in one go from flatmesh's xDS server to
//! a real node, state of the world and delta: everything is applied and ACKed, traffic reaches
//! clusters across the range, and a one-cluster EDS change afterwards is applied alone.
//! (The time to apply is measured by `cargo run --release -p flatmesh-xds --example push_bench`;
//! here it is only printed and bounded generously.)
#![allow(clippy::unwrap_used)]

mod common;
mod large_config;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{free_port, get, wait_for, Backend, XdsServer};
use flatmesh_config as model;
use flatmesh_xds::client::{Client, Options, Protocol};
use flatmesh_xds::server::Store;
use large_config::{large_config, unused_endpoints, CLUSTERS, PER_CLUSTER};

/// Clusters whose endpoints are real backends (the others are loopback addresses nobody uses).
const LIVE: [usize; 3] = [0, 500, 999];

fn config(port: u16, live: &[SocketAddr]) -> model::Config {
    large_config(port, |i| {
        if LIVE.contains(&i) {
            live.to_vec()
        } else {
            unused_endpoints(i, 1)
        }
    })
}

fn scenario(protocol: Protocol) {
    let backends: Vec<Backend> = (0..PER_CLUSTER).map(|_| Backend::start("live")).collect();
    let live: Vec<SocketAddr> = backends.iter().map(|b| b.addr).collect();
    let port = free_port();
    let web: SocketAddr = ([127, 0, 0, 1], port).into();
    let store = Store::new();
    let server = XdsServer::start(&store, "127.0.0.1:0".parse().unwrap());
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
        node_id: "scale".into(),
        node_cluster: "test".into(),
        protocol,
        security: Default::default(),
        sds_dir: None,
        load_reports: None,
    };
    let client = rt.block_on(async { Client::spawn(options, base, apply) });
    wait_for("connected", || client.status().connected);

    let config = config(port, &live);
    let endpoints: usize = config.clusters.iter().map(|c| c.endpoints.len()).sum();
    assert_eq!(
        (config.clusters.len(), endpoints),
        (CLUSTERS, CLUSTERS * PER_CLUSTER)
    );
    let start = Instant::now();
    store.publish_config(&config);
    let deadline = Duration::from_secs(120);
    while body_of(web, 999).as_deref() != Some("200 live") {
        assert!(
            start.elapsed() < deadline,
            "not applied in {deadline:?}: {:?}",
            client.status()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!(
        "{protocol:?}: 1,000 clusters / 10,000 endpoints applied in {:?}",
        start.elapsed()
    );
    for i in LIVE {
        assert_eq!(body_of(web, i).as_deref(), Some("200 live"), "svc-{i}");
    }
    assert_eq!(
        body_of(web, 1).map(|b| b.starts_with("503")),
        Some(true),
        "svc-1's endpoints are not there: 503"
    );

    // Every type was ACKed (SotW echoes the version; delta the system version).
    let published = store.resources();
    assert_eq!(published.clusters.len(), CLUSTERS);
    let status = client.status();
    assert!(status.nacks.is_empty(), "{:?}", status.nacks);
    for kind in [
        flatmesh_xds::resources::CLUSTER,
        flatmesh_xds::resources::ENDPOINT,
    ] {
        assert!(status.acked.contains_key(kind), "{kind} ACKed: {status:?}");
    }

    // One cluster's endpoints change: applied, and only that cluster moves. The big push may
    // still be arriving in pieces (delta sends EDS after CDS, in several responses), so count
    // from where the node's applies have settled: the same for half a second.
    let mut applied = client.status().applied;
    let mut steady_since = Instant::now();
    while steady_since.elapsed() < Duration::from_millis(500) {
        assert!(start.elapsed() < deadline, "applies never settled");
        std::thread::sleep(Duration::from_millis(20));
        let now = client.status().applied;
        if now != applied {
            (applied, steady_since) = (now, Instant::now());
        }
    }
    let start = Instant::now();
    store.set_endpoints("svc-1", &live);
    wait_for("the EDS change", || {
        body_of(web, 1).as_deref() == Some("200 live")
    });
    eprintln!(
        "{protocol:?}: one EDS change applied in {:?}",
        start.elapsed()
    );
    // The client counts an apply just after handing it to the node, so the count may lag the
    // traffic by a moment: wait for it, then check it is exactly one.
    wait_for("the apply to be counted", || {
        client.status().applied > applied
    });
    assert_eq!(client.status().applied, applied + 1, "one push, one apply");
    assert_eq!(body_of(web, 999).as_deref(), Some("200 live"));

    rt.block_on(client.stop());
    let running = node.lock().take();
    if let Some(node) = running {
        node.shutdown();
    }
    server.stop();
}

fn body_of(web: SocketAddr, i: usize) -> Option<String> {
    get(web, "svc.local", &format!("/svc-{i}/x")).map(|(status, body)| format!("{status} {body}"))
}

#[test]
fn a_thousand_clusters_in_one_push_sotw() {
    scenario(Protocol::Sotw);
}

#[test]
fn a_thousand_clusters_in_one_push_delta() {
    scenario(Protocol::Delta);
}
