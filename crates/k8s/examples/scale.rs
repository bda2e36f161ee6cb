//! The Kubernetes control plane at scale (issue 20, item 5): a real kube-apiserver (testenv)
//! holding NODES nodes' worth of pods, SERVICES Services with their EndpointSlices, the real
//! `flatmesh control --kubeconfig` binary serving every node over delta xDS, and NODES
//! simulated nodes: xDS clients that subscribe as a node does (clusters and listeners, then the
//! endpoints and routes those name), decode everything they get and ACK it, but run no proxy.
//! It measures the time from an EndpointSlice change (the PATCH sent) to every node's ACK of
//! the new endpoints, and the control plane's memory and CPU.
//!
//!   cargo build --release -p flatmesh
//!   cargo run --release -p flatmesh-k8s --example scale -- [--nodes 1000] [--pods 10000]
//!       [--services 2000] [--changes 5] [--perf FILE]
//!
//! `--perf FILE` records the control plane with `perf record -g` during the changes.
//!
//! Needs what crates/k8s/tests need (testenv: go, etcd, openssl, kubectl). Prints a Markdown
//! table for BENCHMARKS.md.
#![allow(clippy::unwrap_used)]

#[path = "../tests/api/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait_ready, wait_service_ips, TestEnv};
use envoy_types::pb::envoy::config::core::v3::Node as XdsNode;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use flatmesh_xds::resources::{Resource, Resources, CLUSTER, ENDPOINT, LISTENER, ROUTE};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

struct Args {
    nodes: usize,
    pods: usize,
    services: usize,
    changes: usize,
    /// `perf record -g` of the control plane during the changes, into this file.
    perf: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        nodes: 1000,
        pods: 10_000,
        services: 2000,
        changes: 5,
        perf: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        if pair[0] == "--perf" {
            a.perf = Some(pair.get(1).expect("--perf needs a file").clone());
            continue;
        }
        let value = pair.get(1).and_then(|v| v.parse().ok());
        let slot = match pair[0].as_str() {
            "--nodes" => &mut a.nodes,
            "--pods" => &mut a.pods,
            "--services" => &mut a.services,
            "--changes" => &mut a.changes,
            other => panic!(
                "unknown argument {other}: use --nodes, --pods, --services, --changes, --perf FILE"
            ),
        };
        *slot = value.unwrap_or_else(|| panic!("{} needs a number", pair[0]));
    }
    a
}

/// The pod IPs of service `s`: five per Service, in 10.128.0.0/9.
fn pod_ip(s: usize, k: usize) -> String {
    let n = s * 5 + k + 1;
    format!("10.{}.{}.{}", 128 + n / 65536, (n / 256) % 256, n % 256)
}

fn slice(s: usize, extra: Option<&str>) -> serde_json::Value {
    let mut addresses: Vec<String> = (0..5).map(|k| pod_ip(s, k)).collect();
    addresses.extend(extra.map(str::to_string));
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": format!("svc-{s}-1"), "namespace": "scale",
                      "labels": { "kubernetes.io/service-name": format!("svc-{s}") } },
        "addressType": "IPv4",
        "ports": [ { "name": "http", "port": 8080, "protocol": "TCP" } ],
        "endpoints": addresses.iter().map(|a| json!({ "addresses": [a], "conditions": { "ready": true } })).collect::<Vec<_>>(),
    })
}

/// Runs `count` creations, `parallel` at a time, with a progress line.
async fn create_all<F, Fut>(what: &str, count: usize, parallel: usize, make: F)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let bar = indicatif::ProgressBar::new(count as u64).with_message(what.to_string());
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>16} [{bar:40}] {pos}/{len} {per_sec}")
            .unwrap(),
    );
    futures::stream::iter(0..count)
        .map(|i| {
            let bar = &bar;
            let fut = make(i);
            async move {
                fut.await;
                bar.inc(1);
            }
        })
        .buffer_unordered(parallel)
        .collect::<Vec<()>>()
        .await;
    bar.finish();
}

/// The control plane's process: resident memory now and at its peak (KiB), CPU seconds.
fn proc_usage(pid: u32) -> (u64, u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|v| v.parse::<f64>().ok()))
        .sum();
    (kib("VmRSS:"), kib("VmHWM:"), ticks / 100.0)
}

/// A simulated node: one delta ADS stream, subscribed as `flatmesh node --xds --xds-delta`
/// subscribes; it decodes and ACKs every response and reports when `watched`'s endpoints
/// hold `want`.
struct SimNode {
    acked: watch::Receiver<Option<Instant>>,
}

struct Watch {
    cluster: String,
    address: String,
}

async fn sim_node(
    channel: tonic::transport::Channel,
    id: String,
    watched: Arc<watch::Receiver<Option<Watch>>>,
    ready: mpsc::Sender<()>,
) -> SimNode {
    let (acked_tx, acked) = watch::channel(None);
    tokio::spawn(async move {
        let mut client =
            AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(256 << 20);
        let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(16);
        let node = XdsNode {
            id: id.clone(),
            cluster: id.clone(),
            ..Default::default()
        };
        for type_url in [CLUSTER, LISTENER] {
            let _ = tx
                .send(DeltaDiscoveryRequest {
                    node: Some(node.clone()),
                    type_url: type_url.into(),
                    ..Default::default()
                })
                .await;
        }
        let mut responses = match client
            .delta_aggregated_resources(ReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(e) => panic!("{id}: cannot open the xDS stream: {e}"),
        };
        // Only what a node needs to subscribe and to know it is complete: the EDS and RDS
        // names each cluster and listener asks for, and the names of the assignments it
        // holds. (A real node holds the decoded resources; a thousand of them in one process
        // would hold a thousand copies.)
        let mut wants: [BTreeMap<String, BTreeSet<String>>; 2] = Default::default();
        let mut endpoints_held: BTreeSet<String> = BTreeSet::new();
        let mut subscribed: [(&str, BTreeSet<String>); 2] =
            [(ENDPOINT, BTreeSet::new()), (ROUTE, BTreeSet::new())];
        let mut told_ready = false;
        while let Some(Ok(response)) = responses.next().await {
            let response: DeltaDiscoveryResponse = response;
            let mut hit = false;
            for r in &response.resources {
                let Some(any) = &r.resource else { continue };
                let resource = Resource::decode(any, &response.type_url)
                    .unwrap_or_else(|e| panic!("{id}: undecodable resource: {e}"));
                if let (Resource::Endpoint(cla), Some(w)) = (&resource, &*watched.borrow()) {
                    if cla.cluster_name == w.cluster && holds(cla, &w.address) {
                        hit = true;
                    }
                }
                let name = resource.name().to_string();
                let mut one = Resources::default();
                one.put(resource);
                match response.type_url.as_str() {
                    CLUSTER => {
                        wants[0].insert(name, one.wanted_endpoints());
                    }
                    LISTENER => {
                        wants[1].insert(name, one.wanted_routes());
                    }
                    ENDPOINT => {
                        endpoints_held.insert(name);
                    }
                    _ => {}
                }
            }
            for name in &response.removed_resources {
                match response.type_url.as_str() {
                    CLUSTER => wants[0].remove(name).map(drop),
                    LISTENER => wants[1].remove(name).map(drop),
                    ENDPOINT => endpoints_held.remove(name).then_some(()),
                    _ => None,
                };
            }
            let _ = tx
                .send(DeltaDiscoveryRequest {
                    type_url: response.type_url.clone(),
                    response_nonce: response.nonce.clone(),
                    ..Default::default()
                })
                .await;
            if hit {
                acked_tx.send_replace(Some(Instant::now()));
            }
            // Only clusters and listeners change what the node subscribes to. (Recomputing
            // it on every endpoint push would cost this one process, which runs a thousand
            // nodes on the control plane's cores, more than the control plane's push.)
            let reshaped = matches!(response.type_url.as_str(), CLUSTER | LISTENER);
            for (type_url, held) in subscribed.iter_mut().filter(|_| reshaped) {
                let wanted: BTreeSet<String> = if *type_url == ENDPOINT {
                    wants[0].values().flatten().cloned().collect()
                } else {
                    wants[1].values().flatten().cloned().collect()
                };
                if wanted != *held {
                    let _ = tx
                        .send(DeltaDiscoveryRequest {
                            node: Some(node.clone()),
                            type_url: type_url.to_string(),
                            resource_names_subscribe: wanted.difference(held).cloned().collect(),
                            resource_names_unsubscribe: held.difference(&wanted).cloned().collect(),
                            ..Default::default()
                        })
                        .await;
                    *held = wanted;
                }
            }
            let complete =
                !endpoints_held.is_empty() && subscribed[0].1.len() == endpoints_held.len();
            if complete && !told_ready {
                told_ready = true;
                let _ = ready.send(()).await;
            }
        }
    });
    SimNode { acked }
}

/// Whether an assignment lists `address` among its endpoints.
fn holds(
    cla: &envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment,
    address: &str,
) -> bool {
    use envoy_types::pb::envoy::config::core::v3::{address, socket_address};
    use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
    cla.endpoints.iter().flat_map(|l| &l.lb_endpoints).any(|e| {
        let Some(HostIdentifier::Endpoint(endpoint)) = &e.host_identifier else {
            return false;
        };
        matches!(
            endpoint.address.as_ref().and_then(|a| a.address.as_ref()),
            Some(address::Address::SocketAddress(s))
                if s.address == address
                    && matches!(s.port_specifier, Some(socket_address::PortSpecifier::PortValue(_)))
        )
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(a));
}

async fn run(a: Args) {
    eprintln!("starting kube-apiserver and etcd (testenv)");
    let env = tokio::task::spawn_blocking(TestEnv::start).await.unwrap();
    // Interrupted (Ctrl-C, or a `timeout`'s SIGTERM), the run stops here and `env` and the
    // control plane's process are dropped: testenv stops kube-apiserver and etcd rather than
    // leaving them running. (SIGKILL cannot be caught: `testenv stop DIR` cleans up after it.)
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    tokio::select! {
        () = measure(a, &env) => {}
        _ = tokio::signal::ctrl_c() => eprintln!("interrupted; stopping testenv"),
        _ = terminate.recv() => eprintln!("terminated; stopping testenv"),
    }
}

async fn measure(a: Args, env: &TestEnv) {
    let binary = common::flatmesh_bin();
    let client = flatmesh_k8s::connect(Some(&env.kubeconfig()))
        .await
        .unwrap();
    wait_ready(&client, &env.dir).await;
    wait_service_ips(&client, &env.dir).await;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": "scale" } })).unwrap(),
        )
        .await
        .unwrap();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "scale");
    accounts
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": "app" } })).unwrap(),
        )
        .await
        .unwrap();
    let services: Api<Service> = Api::namespaced(client.clone(), "scale");
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "scale");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "scale");
    let t = Instant::now();
    create_all("services", a.services, 32, |s| {
        let services = services.clone();
        async move {
            let svc = json!({ "metadata": { "name": format!("svc-{s}") },
                "spec": { "ports": [ { "name": "http", "port": 80, "targetPort": 8080 } ] } });
            services
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(svc).unwrap(),
                )
                .await
                .unwrap();
        }
    })
    .await;
    create_all("endpointslices", a.services, 32, |s| {
        let slices = slices.clone();
        async move {
            slices
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(slice(s, None)).unwrap(),
                )
                .await
                .unwrap();
        }
    })
    .await;
    let nodes = a.nodes;
    create_all("pods", a.pods, 32, |p| {
        let pods = pods.clone();
        async move {
            let pod = json!({ "metadata": { "name": format!("pod-{p}") },
                "spec": { "nodeName": format!("node-{}", p % nodes), "serviceAccountName": "app",
                          "containers": [ { "name": "app", "image": "example.invalid/app" } ] } });
            pods.create(
                &PostParams::default(),
                &serde_json::from_value(pod).unwrap(),
            )
            .await
            .unwrap();
        }
    })
    .await;
    eprintln!(
        "created {} services, {} slices, {} pods in {:.1?}",
        a.services,
        a.services,
        a.pods,
        t.elapsed()
    );

    // The control plane: the real binary, its own process.
    let listen: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut control = tokio::process::Command::new(&binary)
        .args(["control", "--kubeconfig"])
        .arg(env.kubeconfig())
        .args(["--listen", &listen.to_string()])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = control.id().unwrap();
    let started = Instant::now();
    let channel = loop {
        match tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
            .unwrap()
            .connect()
            .await
        {
            Ok(c) => break c,
            Err(_) if started.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("flatmesh control did not listen on {listen}: {e}"),
        }
    };

    // The nodes: their streams over a few HTTP/2 connections, as 1,000 nodes would not share one.
    let (watch_tx, watch_rx) = watch::channel::<Option<Watch>>(None);
    let watch_rx = Arc::new(watch_rx);
    let (ready_tx, mut ready_rx) = mpsc::channel(a.nodes);
    let mut channels = vec![channel];
    for _ in 1..16 {
        channels.push(
            tonic::transport::Endpoint::from_shared(format!("http://{listen}"))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
    }
    let mut sims = Vec::with_capacity(a.nodes);
    for n in 0..a.nodes {
        sims.push(
            sim_node(
                channels[n % channels.len()].clone(),
                format!("node-{n}"),
                watch_rx.clone(),
                ready_tx.clone(),
            )
            .await,
        );
    }
    let bar = indicatif::ProgressBar::new(a.nodes as u64).with_message("nodes synced");
    for _ in 0..a.nodes {
        tokio::time::timeout(Duration::from_secs(600), ready_rx.recv())
            .await
            .expect("every node gets its full config within 10 minutes");
        bar.inc(1);
    }
    bar.finish();
    let synced = started.elapsed();
    let (rss_synced, peak_synced, cpu_synced) = proc_usage(pid);
    eprintln!(
        "all {} nodes synced {synced:.1?} after the control plane started: RSS {} MiB (peak {}), CPU {cpu_synced:.1} s",
        a.nodes,
        rss_synced / 1024,
        peak_synced / 1024
    );

    // Changes: one EndpointSlice gains an address; time to every node's ACK.
    // The profile covers the changes only, not the initial sync.
    let perf = a.perf.as_ref().map(|file| {
        std::process::Command::new("perf")
            .args([
                "record",
                "-F",
                "499",
                "-g",
                "-o",
                file,
                "-p",
                &pid.to_string(),
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("--perf: cannot run perf ({e}); install linux-perf"))
    });
    let mut rows = Vec::new();
    for c in 0..a.changes {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s = (c * 7919) % a.services;
        let address = format!("10.127.{}.{}", c / 256, c % 256 + 1);
        watch_tx.send_replace(Some(Watch {
            cluster: format!("scale/svc-{s}:80"),
            address: address.clone(),
        }));
        let (_, _, cpu_before) = proc_usage(pid);
        let sent = Instant::now();
        slices
            .patch(
                &format!("svc-{s}-1"),
                &PatchParams::apply("scale-bench").force(),
                &Patch::Apply(slice(s, Some(&address))),
            )
            .await
            .unwrap();
        let mut took = Vec::with_capacity(a.nodes);
        for sim in &mut sims {
            let at = tokio::time::timeout(
                Duration::from_secs(120),
                sim.acked.wait_for(|t| t.is_some_and(|t| t >= sent)),
            )
            .await
            .expect("every node ACKs the change within 2 minutes")
            .unwrap()
            .unwrap();
            took.push(at - sent);
        }
        took.sort();
        let (rss, peak, cpu) = proc_usage(pid);
        rows.push((
            percentile(&took, 0.5),
            percentile(&took, 0.99),
            *took.last().unwrap(),
            cpu - cpu_before,
            rss,
            peak,
        ));
        eprintln!(
            "change {c}: p50 {:.0?} p99 {:.0?} max {:.0?}",
            percentile(&took, 0.5),
            percentile(&took, 0.99),
            took.last().unwrap()
        );
    }
    if let Some(mut perf) = perf {
        // perf writes its file when interrupted.
        let _ = std::process::Command::new("kill")
            .args(["-INT", &perf.id().to_string()])
            .status();
        let _ = perf.wait();
        eprintln!(
            "profile in {} (perf report -i FILE --no-children)",
            a.perf.as_deref().unwrap_or_default()
        );
    }

    println!(
        "\n{} nodes (simulated xDS clients), {} pods, {} Services ({} endpoints each), on {} cores\n",
        a.nodes,
        a.pods,
        a.services,
        5,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| change | to every node's ACK: p50 | p99 | max | control CPU (s) | control RSS (MiB) | peak RSS (MiB) |");
    println!("|---|---|---|---|---|---|---|");
    for (i, (p50, p99, max, cpu, rss, peak)) in rows.iter().enumerate() {
        println!(
            "| {i} | {:.0?} | {:.0?} | {:.0?} | {cpu:.2} | {} | {} |",
            p50,
            p99,
            max,
            rss / 1024,
            peak / 1024
        );
    }
    println!(
        "\nInitial sync of all nodes: {synced:.1?}, control plane CPU {cpu_synced:.1} s, RSS {} MiB (peak {} MiB).",
        rss_synced / 1024,
        peak_synced / 1024
    );
    let _ = control.kill().await;
}
