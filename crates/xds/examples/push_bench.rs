//! How long a flatmesh node takes to apply 1,000 clusters / 10,000 endpoints pushed in one go
//! over ADS (state of the world and delta), then one EDS change, side by side in one run.
//!
//!   cargo run --release -p flatmesh-xds --example push_bench [-- ROUNDS]
//!
//! Time = from `Store::publish` to the node having swapped in the translated config (real node
//! proxy, real gRPC on loopback, 1 worker). Output is a Markdown table. Run it on a quiet machine,
//! pinned: `taskset -c 1 cargo run --release -p flatmesh-xds --example push_bench -- 5`.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use flatmesh_config as model;
use flatmesh_xds::apply::StartThenReload;
use flatmesh_xds::client::{Client, Options, Protocol};
use flatmesh_xds::server::Store;

#[path = "../tests/large_config/mod.rs"]
mod large_config;
use large_config::{large_config, unused_endpoints};

fn config(port_base: u16, shift: u8) -> model::Config {
    let mut c = large_config(port_base, |i| unused_endpoints(i, shift));
    c.admin = "127.0.0.1:0".parse().unwrap();
    c.workers = Some(1);
    c
}

fn wait_applied(client: &Client, count: u64) -> Duration {
    let start = Instant::now();
    while client.status().applied < count {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "push not applied: {:?}",
            client.status()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    start.elapsed()
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3)
        .max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = Store::new();
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    rt.spawn(flatmesh_xds::server::serve(
        "127.0.0.1:0".parse().unwrap(),
        store.clone(),
        Some(bound_tx),
        std::future::pending(),
    ));
    let xds = rt.block_on(bound_rx).unwrap();

    // Translation alone (no network, no node), for reference: everything from scratch, then one
    // cluster's endpoints changed through the client's caching translator.
    let full = config(0, 1);
    let resources = flatmesh_xds::from_model::resources(&full);
    let empty = flatmesh_xds::bootstrap::empty_config();
    let t = Instant::now();
    let _ = flatmesh_xds::to_model::translate(&resources, &empty).unwrap();
    let translate = t.elapsed();
    let mut translator = flatmesh_xds::to_model::Translator::default();
    let _ = translator.translate(&resources, &empty).unwrap();
    let mut changed = resources.clone();
    changed.endpoints.insert(
        "svc-7".into(),
        flatmesh_xds::from_model::assignment("svc-7", &["127.9.9.9:80".parse().unwrap()]),
    );
    let t = Instant::now();
    let _ = translator.translate(&changed, &empty).unwrap();
    let translate_eds = t.elapsed();

    println!("| protocol | full push: 1,000 clusters, 10,000 endpoints, 1,000 routes (median of {rounds}) | one EDS change (median of {rounds}) |");
    println!("|---|---|---|");
    for protocol in [Protocol::Sotw, Protocol::Delta] {
        let mut full_times = Vec::new();
        let mut eds_times = Vec::new();
        for round in 0..rounds {
            store.publish(Default::default());
            let (apply, node) = StartThenReload::new(
                |config| {
                    flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline)
                        .map_err(|e| e.to_string())
                },
                |node: &flatmesh_proxy::Node, config| {
                    node.reload(config).map_err(|e| e.to_string())
                },
            );
            let options = Options {
                server: xds.to_string(),
                node_id: "bench".into(),
                node_cluster: "bench".into(),
                protocol,
                security: Default::default(),
                sds_dir: None,
                load_reports: None,
            };
            let mut base = flatmesh_xds::bootstrap::empty_config();
            base.admin = "127.0.0.1:0".parse().unwrap();
            base.workers = Some(1);
            let client = rt.block_on(async { Client::spawn(options, base, apply) });
            while !client.status().connected {
                std::thread::sleep(Duration::from_millis(5));
            }
            std::thread::sleep(Duration::from_millis(300)); // the initial empty responses settle
            let before = client.status().applied;
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let cfg = config(port, 1 + round as u8);
            let t = Instant::now();
            store.publish_config(&cfg);
            // The node is done when the listener (the last piece, via RDS) is in.
            let start = Instant::now();
            loop {
                let done = node
                    .lock()
                    .as_ref()
                    .and_then(|n| n.listener_addr("web"))
                    .is_some()
                    && client.status().applied > before;
                if done {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(120),
                    "push not applied"
                );
                std::thread::sleep(Duration::from_micros(200));
            }
            full_times.push(t.elapsed());
            let applied = client.status().applied;
            let t = Instant::now();
            store.set_endpoints("svc-7", &["127.9.9.9:80".parse().unwrap()]);
            wait_applied(&client, applied + 1);
            eds_times.push(t.elapsed());
            rt.block_on(client.stop());
            let running = node.lock().take();
            if let Some(n) = running {
                n.shutdown();
            }
        }
        full_times.sort();
        eds_times.sort();
        println!(
            "| {protocol:?} | {:.0} ms (min {:.0}, max {:.0}) | {:.1} ms (min {:.1}, max {:.1}) |",
            ms(full_times[rounds / 2]),
            ms(full_times[0]),
            ms(full_times[rounds - 1]),
            ms(eds_times[rounds / 2]),
            ms(eds_times[0]),
            ms(eds_times[rounds - 1])
        );
    }
    println!(
        "\nTranslation alone (xDS resources -> validated flatmesh config, no network): {:.1} ms from scratch, {:.1} ms for one EDS change (cached translator)",
        ms(translate),
        ms(translate_eds)
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
