//! A control-plane restart (issue 20, items 1 and 4: "a restart ... of the control plane loses
//! nothing and drops no traffic (the nodes keep their last config)"): `flatmesh control
//! --kubeconfig` (the release binary) is killed while a node holds its config, and started
//! again on the same address. The node keeps its config while the control plane is away, is
//! never handed an empty or partial one while the new process lists the cluster, and then
//! holds the same versions as before.
//!
//! Needs testenv (as k8s_control.rs) and the release binary (`cargo build --release -p
//! flatmesh`, or $FLATMESH_BIN); fails, never skips, without them.
#![allow(clippy::unwrap_used)]

use crate::common;
use common::{api_server, create, flatmesh_bin};

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flatmesh_config::Config;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service, ServiceAccount};
use kube::api::Api;
use parking_lot::Mutex;
use serde_json::json;

/// Every config the node was handed, in order.
#[derive(Clone, Default)]
struct History(Arc<Mutex<Vec<Config>>>);

impl flatmesh_xds::client::Apply for History {
    fn apply(&mut self, config: Config) -> Result<(), String> {
        self.0.lock().push(config);
        Ok(())
    }
}

impl History {
    fn len(&self) -> usize {
        self.0.lock().len()
    }

    fn last(&self) -> Option<Config> {
        self.0.lock().last().cloned()
    }

    fn since(&self, n: usize) -> Vec<Config> {
        self.0.lock()[n..].to_vec()
    }
}

fn control(kubeconfig: &std::path::Path, listen: SocketAddr, log: &std::path::Path) -> Child {
    Command::new(flatmesh_bin())
        .arg("control")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--listen")
        .arg(listen.to_string())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .unwrap(),
        )
        .spawn()
        .unwrap()
}

/// Kills the control plane on drop, whatever happened.
struct Killed(Option<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_keeps_its_config_through_a_control_plane_restart_and_gets_the_same_again() {
    flatmesh_bin();
    let (env, client) = api_server().await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create(&namespaces, json!({ "metadata": { "name": "shop" } })).await;
    let services: Api<Service> = Api::namespaced(client.clone(), "shop");
    for name in ["web", "api"] {
        create(
            &services,
            json!({ "metadata": { "name": name },
                    "spec": { "ports": [ { "name": "http", "port": 80 } ] } }),
        )
        .await;
    }
    // No controller-manager runs here to create a namespace's `default` account.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "shop");
    create(&accounts, json!({ "metadata": { "name": "default" } })).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    create(
        &pods,
        json!({ "metadata": { "name": "web-1" },
                "spec": { "nodeName": "node-1",
                          "containers": [ { "name": "app", "image": "example.invalid/app" } ] } }),
    )
    .await;

    let listen: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let log = env.dir.join("control.log");
    let mut running = Killed(Some(control(&env.kubeconfig(), listen, &log)));
    let history = History::default();
    let node = flatmesh_xds::client::Client::spawn(
        flatmesh_xds::client::Options {
            server: listen.to_string(),
            node_id: "node-1".into(),
            node_cluster: "node-1".into(),
            protocol: flatmesh_xds::client::Protocol::Sotw,
            security: Default::default(),
            sds_dir: None,
            load_reports: None,
        },
        flatmesh_xds::bootstrap::empty_config(),
        history.clone(),
    );
    let shop = |c: &Config| {
        c.listeners
            .iter()
            .filter(|l| l.name.starts_with("shop/"))
            .count()
    };
    // The API server writes its own Service's EndpointSlice a few seconds after it starts: the
    // config is settled once that is in too.
    let settled = |c: &Config| {
        shop(c) == 2
            && c.clusters
                .iter()
                .any(|cl| cl.name == "default/kubernetes:443" && !cl.endpoints.entries().is_empty())
    };
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();
    let first = Instant::now();
    while history.last().is_none_or(|c| !settled(&c)) {
        assert!(
            first.elapsed() < Duration::from_secs(60),
            "node-1 never got shop/web, shop/api and the API server's endpoint; control's log:\n{}",
            logged()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Settled: the versions the node acknowledged.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = history.last().unwrap();
    let acked = node.status().acked;
    assert!(!acked.is_empty(), "{:?}", node.status());

    // Killed (SIGKILL: no goodbye to the node).
    let mut child = running.0.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let before_restart = history.len();
    wait_until(
        "the node to notice the control plane is gone",
        Duration::from_secs(10),
        || !node.status().connected,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        history.len(),
        before_restart,
        "the node was handed a config while the control plane was away"
    );

    // Started again on the same address: the node reconnects and ends with the same versions.
    running.0 = Some(control(&env.kubeconfig(), listen, &log));
    let streams = node.status().streams;
    let reconnecting = Instant::now();
    loop {
        let status = node.status();
        if status.connected && status.streams > streams && status.acked == acked {
            break;
        }
        assert!(
            reconnecting.elapsed() < Duration::from_secs(60),
            "the node did not reconnect with the same versions within 60 s: connected {}, \
             streams {} (before {streams}), acked now {:?}, before {acked:?}; the config is the \
             same: {}",
            status.connected,
            status.streams,
            status.acked,
            history.last().as_ref() == Some(&held)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Whatever it was handed meanwhile: never an empty or partial config, and now the same.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for config in history.since(before_restart) {
        assert_eq!(
            shop(&config),
            2,
            "after the restart the node was handed a config without the shop: {config:#?}"
        );
    }
    assert_eq!(history.last().unwrap(), held, "the same config again");
    assert_eq!(node.status().acked, acked, "the same versions again");

    node.stop().await;
    drop(running);
    drop(env);
}
