//! Traffic through a node run from the API server (issue 20, item 4): kube-apiserver and etcd
//! (testenv), the controller and xDS server of `flatmesh control --kubeconfig`, and a real
//! `flatmesh node` (its proxy, fed by its xDS client as `flatmesh node --xds` runs it), all
//! in this process, in a network namespace of the test's own. There is no kubelet, so the
//! "pods" are small HTTP servers of the test, on 10.244/16 addresses of the namespace's
//! loopback (the API server refuses 127/8 addresses in EndpointSlices). The Service range is routed to loopback as
//! `local`, so the node binds every ClusterIP it is given and clients dial ClusterIPs as in a
//! cluster (kube-proxy's IPVS mode holds ClusterIPs on a dummy device the same way).
//!
//! Checked, with requests flowing: a Service is reachable at its ClusterIP; an EndpointSlice
//! change moves traffic; an HTTPRoute added moves a path to another Service; a pod that dies
//! under load, then is deleted, costs no request (the node retries connect failures, as
//! Istio's default policy does); kube-apiserver stopped and started again costs no request,
//! and changes flow again after.
//!
//! Needs root (the namespace), iproute2, unshare, go, etcd, openssl and kubectl; it fails,
//! never skips, without them.
#![allow(clippy::unwrap_used)]

use crate::common;
#[path = "../../../proxy/tests/common/netns.rs"]
pub(crate) mod netns;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{api_server, create, wait_ready};
use flatmesh_k8s::Controller;
use flatmesh_proxy::{ConfigSource, Node};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const SERVICE_RANGE: &str = "10.96.0.0/16";
const POD_A: &str = "10.244.0.1";
const POD_B: &str = "10.244.0.2";
const POD_V2: &str = "10.244.0.3";
const POD_A2: &str = "10.244.0.4";
pub(crate) const POD_PORT: u16 = 8080;

fn ip(args: &str) {
    let status = std::process::Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .expect("run ip (iproute2)");
    assert!(status.success(), "ip {args} failed");
}

/// A pod's stand-in: answers every HTTP/1.1 request with its name, keep-alive, until stopped;
/// stopping closes its listener and every connection (the process died).
pub(crate) struct Backend {
    stop: watch::Sender<bool>,
    /// How long it takes to answer, in microseconds.
    delay_us: Arc<AtomicU64>,
}

impl Backend {
    pub(crate) async fn start(address: &str, name: &'static str) -> Backend {
        let listener = TcpListener::bind((address, POD_PORT))
            .await
            .unwrap_or_else(|e| panic!("bind {address}:{POD_PORT}: {e}"));
        let (stop, stopped) = watch::channel(false);
        let delay_us = Arc::new(AtomicU64::new(0));
        let delay = delay_us.clone();
        tokio::spawn(async move {
            let mut stopped_accept = stopped.clone();
            loop {
                let (conn, _) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(c) => c,
                        Err(_) => continue,
                    },
                    _ = stopped_accept.changed() => return,
                };
                let mut stopped = stopped.clone();
                let delay = delay.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = serve(conn, name, &delay) => {}
                        _ = stopped.changed() => {}
                    }
                });
            }
        });
        Backend { stop, delay_us }
    }

    fn kill(&self) {
        self.stop.send_replace(true);
    }

    /// From now on each answer takes `delay` (the pod slows down).
    pub(crate) fn set_delay(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::Relaxed);
    }
}

async fn serve(mut conn: TcpStream, name: &str, delay_us: &AtomicU64) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            if buf.len() > 64 * 1024 {
                return;
            }
        }
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        buf.drain(..end);
        let delay = delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{name}",
            name.len()
        );
        if conn.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// One GET to `address` on a connection of its own: the status and the body.
pub(crate) async fn get(address: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let exchange = async {
        let mut conn = TcpStream::connect(address)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let request = format!("GET {path} HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n");
        conn.write_all(request.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&answer).into_owned();
        let status = text
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("not an HTTP answer: {text:?}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| "no answer within 5 s".to_string())?
}

/// Asks until the answer is 200 with `body` (at most `within`); returns how long it took.
pub(crate) async fn until_served(
    address: SocketAddr,
    path: &str,
    body: &str,
    within: Duration,
) -> Duration {
    let start = Instant::now();
    let mut last = Err("nothing asked yet".to_string());
    while start.elapsed() < within {
        last = get(address, path).await;
        if matches!(&last, Ok((200, b)) if b == body) {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("GET {address}{path} did not answer 200 {body:?} within {within:?}; last: {last:?}");
}

/// Requests in a loop from `clients` tasks until stopped: how many, and every failure.
pub(crate) struct Load {
    stop: watch::Sender<bool>,
    done: AtomicU64,
    failures: parking_lot::Mutex<Vec<String>>,
}

impl Load {
    pub(crate) fn start(
        address: SocketAddr,
        clients: usize,
    ) -> (Arc<Load>, Vec<tokio::task::JoinHandle<()>>) {
        let load = Arc::new(Load {
            stop: watch::channel(false).0,
            done: AtomicU64::new(0),
            failures: Default::default(),
        });
        let tasks = (0..clients)
            .map(|_| {
                let load = load.clone();
                let stopped = load.stop.subscribe();
                tokio::spawn(async move {
                    // Bounded: at most 20,000 requests per client.
                    for _ in 0..20_000 {
                        if *stopped.borrow() {
                            return;
                        }
                        match get(address, "/").await {
                            Ok((200, _)) => {}
                            other => load.failures.lock().push(format!("{other:?}")),
                        }
                        load.done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        (load, tasks)
    }

    pub(crate) async fn finish(
        load: Arc<Load>,
        tasks: Vec<tokio::task::JoinHandle<()>>,
    ) -> (u64, Vec<String>) {
        load.stop.send_replace(true);
        for t in tasks {
            t.await.unwrap();
        }
        (
            load.done.load(Ordering::Relaxed),
            load.failures.lock().clone(),
        )
    }
}

/// A node proxy fed by the xDS server at `xds`, as `flatmesh node --xds ADDR --node-id ID`
/// runs one: its load reported over LRS when the server takes it.
pub(crate) fn node_on_xds(
    xds: SocketAddr,
    node_id: &str,
) -> (
    flatmesh_xds::client::Client,
    flatmesh_xds::apply::SharedNode<Node>,
) {
    let mut base = flatmesh_xds::bootstrap::empty_config();
    base.workers = Some(2);
    let (apply, node) = flatmesh_xds::apply::StartThenReload::new(
        |config| Node::start(config, ConfigSource::Inline).map_err(|e| e.to_string()),
        |node: &Node, config| node.reload(config).map_err(|e| e.to_string()),
    );
    let reported = node.clone();
    let client = flatmesh_xds::client::Client::spawn(
        flatmesh_xds::client::Options {
            server: xds.to_string(),
            node_id: node_id.into(),
            node_cluster: node_id.into(),
            protocol: flatmesh_xds::client::Protocol::Delta,
            security: Default::default(),
            sds_dir: None,
            load_reports: Some(flatmesh_xds::lrs::LoadSource(Arc::new(move || {
                reported
                    .lock()
                    .as_ref()
                    .map(Node::take_load_reports)
                    .unwrap_or_default()
            }))),
        },
        base,
        apply,
    );
    (client, node)
}

pub(crate) fn slice(name: &str, service: &str, addresses: &[&str]) -> serde_json::Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": name, "namespace": "shop",
                      "labels": { "kubernetes.io/service-name": service } },
        "addressType": "IPv4",
        "ports": [ { "name": "http", "port": POD_PORT, "protocol": "TCP" } ],
        "endpoints": addresses.iter().map(|a| json!({ "addresses": [a], "conditions": { "ready": true } })).collect::<Vec<_>>(),
    })
}

pub(crate) async fn set_slice(
    slices: &Api<EndpointSlice>,
    name: &str,
    service: &str,
    addresses: &[&str],
) {
    slices
        .patch(
            name,
            &PatchParams::apply("k8s-traffic-test").force(),
            &Patch::Apply(slice(name, service, addresses)),
        )
        .await
        .unwrap();
}

#[test]
fn traffic_follows_the_api_server() {
    assert!(
        nix_is_root(),
        "this test needs root (it makes a network namespace); run the tests as root"
    );
    // The body runs in a re-run of this test inside the namespace, another process: this
    // one keeps the binary's turn meanwhile, so no other test runs beside it.
    let _turn = (!netns::inside()).then(common::Turn::take);
    netns::in_netns(
        "k8s_traffic::traffic_follows_the_api_server",
        Duration::from_secs(300),
        traffic,
    );
}

pub(crate) fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

/// The test namespace's network as a cluster's: `pods` on its loopback (not 127/8, which
/// EndpointSlices refuse; these kernels have no dummy links), every ClusterIP local, and a
/// default route, without which kube-apiserver cannot pick the address it advertises (a veth
/// pair of the namespace's own gives it one).
pub(crate) fn cluster_network(pods: &[&str]) {
    for pod in pods {
        ip(&format!("addr add {pod}/32 dev lo"));
    }
    ip("link add fmk0 type veth peer name fmk1");
    ip("link set fmk0 up");
    ip("link set fmk1 up");
    ip("addr add 10.250.0.1/24 dev fmk0");
    ip("route add default via 10.250.0.2 dev fmk0");
    ip(&format!("route add local {SERVICE_RANGE} dev lo"));
}

async fn traffic() {
    cluster_network(&[POD_A, POD_B, POD_V2, POD_A2]);

    let (env, client) = api_server().await;

    let a = Backend::start(POD_A, "a").await;
    let _b = Backend::start(POD_B, "b").await;
    let _v2 = Backend::start(POD_V2, "v2").await;
    let _a2 = Backend::start(POD_A2, "a2").await;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    create(&accounts, json!({ "metadata": { "name": "web" } })).await;
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    let mut vips = Vec::new();
    for name in ["web", "web-v2"] {
        let s = create(
            &services,
            json!({ "metadata": { "name": name },
            "spec": { "ports": [ { "name": "http", "port": 80, "targetPort": POD_PORT } ] } }),
        )
        .await;
        let ip = s.spec.unwrap().cluster_ip.unwrap();
        vips.push(SocketAddr::new(ip.parse().unwrap(), 80));
    }
    let (web, web_v2) = (vips[0], vips[1]);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "shop");
    set_slice(&slices, "web-1", "web", &[POD_A]).await;
    set_slice(&slices, "web-v2-1", "web-v2", &[POD_V2]).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    for name in ["web-a", "web-b"] {
        create(
            &pods,
            json!({ "metadata": { "name": name },
            "spec": { "nodeName": "node-a", "serviceAccountName": "web",
                      "containers": [ { "name": "app", "image": "example.invalid/web" } ] } }),
        )
        .await;
    }

    // The control plane and the node, as `flatmesh control --kubeconfig` and
    // `flatmesh node --xds ... --node-id node-a` run them.
    let store = flatmesh_xds::server::Store::new();
    let _controller = Controller::spawn(client.clone(), store.clone(), Default::default());
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(flatmesh_xds::server::serve(
        "127.0.0.1:0".parse().unwrap(),
        store,
        Some(bound_tx),
        async {
            let _ = stop_rx.await;
        },
    ));
    let xds = bound_rx.await.unwrap();
    let (xds_client, node) = node_on_xds(xds, "node-a");

    // 1. The Service answers at its ClusterIP, from its one endpoint.
    let first = until_served(web, "/", "a", Duration::from_secs(20)).await;
    eprintln!("web served at its ClusterIP {web} {first:?} after the node started");

    // 2. An EndpointSlice change moves the traffic.
    let moved = Instant::now();
    set_slice(&slices, "web-1", "web", &[POD_B]).await;
    let took = until_served(web, "/", "b", Duration::from_secs(5)).await;
    eprintln!(
        "endpoints a -> b: traffic followed in {:?}",
        moved.elapsed().max(took)
    );
    for _ in 0..20 {
        assert_eq!(
            get(web, "/").await,
            Ok((200, "b".into())),
            "every request now goes to b"
        );
    }

    // 3. A mesh route (GAMMA: an HTTPRoute whose parent is the Service) moves /v2 to web-v2.
    let routes: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "shop",
        &flatmesh_k8s::routes::http_route_resource(),
    );
    routes
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                "metadata": { "name": "web-v2", "namespace": "shop" },
                "spec": {
                    "parentRefs": [ { "group": "", "kind": "Service", "name": "web", "port": 80 } ],
                    "rules": [
                        { "matches": [ { "path": { "type": "PathPrefix", "value": "/v2" } } ],
                          "backendRefs": [ { "name": "web-v2", "port": 80 } ] },
                        { "backendRefs": [ { "name": "web", "port": 80 } ] }
                    ]
                }
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    until_served(web, "/v2/items", "v2", Duration::from_secs(5)).await;
    assert_eq!(get(web, "/other").await, Ok((200, "b".into())));
    assert_eq!(get(web_v2, "/").await, Ok((200, "v2".into())));

    // 4. A pod dies under load, then is deleted: no request is lost.
    set_slice(&slices, "web-1", "web", &[POD_A, POD_B]).await;
    until_served(web, "/", "a", Duration::from_secs(5)).await;
    let (load, tasks) = Load::start(web, 4);
    tokio::time::sleep(Duration::from_millis(700)).await;
    a.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    pods.delete("web-a", &DeleteParams::default())
        .await
        .unwrap();
    set_slice(&slices, "web-1", "web", &[POD_B]).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (done, failures) = Load::finish(load, tasks).await;
    eprintln!(
        "pod a died under load: {done} requests, {} failed",
        failures.len()
    );
    assert!(done > 50, "the load ran ({done} requests)");
    assert!(
        failures.is_empty(),
        "{} of {done} requests failed when a pod died: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );

    // 5. kube-apiserver stops and starts again under load: no request lost, and changes flow
    //    again after.
    let (load, tasks) = Load::start(web, 4);
    let argv = tokio::task::block_in_place(|| env.stop_apiserver());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    env.start_apiserver(&argv);
    wait_ready(&client, &env.dir).await;
    let (done, failures) = Load::finish(load, tasks).await;
    eprintln!(
        "kube-apiserver restarted under load: {done} requests, {} failed",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {done} requests failed while kube-apiserver restarted: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    // The watches come back on their own (backing off up to 2 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match slices
            .patch(
                "web-1",
                &PatchParams::apply("k8s-traffic-test").force(),
                &Patch::Apply(slice("web-1", "web", &[POD_A2])),
            )
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "cannot patch after the restart: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    until_served(web, "/", "a2", Duration::from_secs(10)).await;

    xds_client.stop().await;
    if let Some(n) = node.lock().take() {
        std::thread::spawn(move || n.shutdown());
    }
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
}
