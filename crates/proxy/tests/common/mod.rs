//! The proxy's in-process test harness (ztunnel's `tests/direct.rs` is the model): a node
//! started in the test process from a YAML config, next to in-process backends (HTTP/1,
//! h2c, gRPC, raw TCP, [`backends`] and [`grpc`]), reached over real loopback sockets with the
//! client helpers of [`client`].
//!
//! Every test binary uses a different subset of these helpers, hence `dead_code`.
#![allow(dead_code, clippy::unwrap_used)]

pub mod backends;
mod client;
pub mod grpc;
pub mod hbone;
pub mod hostile;
pub mod netns;
pub mod otlp;
pub mod pki;
pub mod prometheus;

pub use client::*;

use std::net::SocketAddr;
use std::path::PathBuf;

use flatmesh_proxy::{ConfigSource, Node};
use http::{Method, StatusCode};

/// A node running in this process, started from a config file. Stopped when dropped.
pub struct TestNode {
    node: Option<Node>,
    /// The admin endpoint's address.
    pub admin: SocketAddr,
    pub config_path: PathBuf,
    pub dir: TempDir,
}

impl TestNode {
    /// Writes `yaml` to a temp file and starts a node on it; returns once every listener
    /// accepts connections. Panics with the node's error if it does not start.
    pub fn start(yaml: &str) -> TestNode {
        let dir = TempDir::new();
        let config_path = dir.write("flatmesh.yaml", yaml);
        let config = flatmesh_config::load(&config_path)
            .unwrap_or_else(|e| panic!("the test's config is invalid: {e}"));
        let node = Node::start(config, ConfigSource::File(config_path.clone()))
            .unwrap_or_else(|e| panic!("the node did not start: {e}"));
        TestNode {
            admin: node
                .admin_addr()
                .tcp()
                .unwrap_or_else(|| panic!("TestNode serves the admin endpoint on TCP")),
            node: Some(node),
            config_path,
            dir,
        }
    }

    /// The bound address of listener `name`.
    pub fn listener(&self, name: &str) -> SocketAddr {
        self.node
            .as_ref()
            .and_then(|n| n.listener_addr(name))
            .unwrap_or_else(|| panic!("no listener `{name}`"))
    }

    /// Replaces the config file atomically (write + rename), as an operator's tooling would.
    pub fn write_config(&self, yaml: &str) {
        write_atomically(&self.config_path, yaml);
    }

    /// Asks for a reload of the config file (POST /reload, what SIGHUP does for the
    /// binary); returns the admin endpoint's answer.
    pub async fn reload(&self) -> (StatusCode, String) {
        let url = format!("http://{}/reload", self.admin);
        let resp = send(&h1_client(), request(Method::POST, &url, &[], ""))
            .await
            .unwrap_or_else(|e| panic!("POST {url} failed: {e}"));
        (resp.status, resp.body)
    }

    /// Asks the node to drain (POST /drain); returns the admin endpoint's answer.
    pub async fn drain(&self) -> (StatusCode, String) {
        let url = format!("http://{}/drain", self.admin);
        let resp = send(&h1_client(), request(Method::POST, &url, &[], ""))
            .await
            .unwrap_or_else(|e| panic!("POST {url} failed: {e}"));
        (resp.status, resp.body)
    }

    /// Stops the node as its owner does (`Node::shutdown`: drain, wait for the open
    /// connections up to `drain_timeout`), off the test's runtime; returns how long it took.
    pub async fn shutdown(&mut self) -> std::time::Duration {
        let node = self
            .node
            .take()
            .unwrap_or_else(|| panic!("the node is stopped already"));
        let started = std::time::Instant::now();
        tokio::task::spawn_blocking(move || node.shutdown())
            .await
            .unwrap_or_else(|e| panic!("Node::shutdown panicked: {e}"));
        started.elapsed()
    }

    /// Panics unless the node still answers /ready.
    pub async fn assert_alive(&self, context: &str) {
        let (status, body) = self.admin_get("/ready").await;
        assert_eq!(
            status,
            StatusCode::OK,
            "the node is not ready {context}: {body}"
        );
    }

    /// GET an admin path; returns (status, body).
    pub async fn admin_get(&self, path: &str) -> (StatusCode, String) {
        let url = format!("http://{}{}", self.admin, path);
        let resp = send(&h1_client(), get_req(&url))
            .await
            .unwrap_or_else(|e| panic!("GET {url} failed: {e}"));
        (resp.status, resp.body)
    }

    /// GET /config and parse it as JSON.
    pub async fn config_json(&self) -> serde_json::Value {
        let (status, body) = self.admin_get("/config").await;
        assert_eq!(status, StatusCode::OK, "/config answered {status}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("/config is not JSON ({e}): {body}"))
    }

    /// GET /metrics.
    pub async fn metrics(&self) -> String {
        let (status, body) = self.admin_get("/metrics").await;
        assert_eq!(status, StatusCode::OK, "/metrics answered {status}: {body}");
        body
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        // Shutting down waits (up to drain_timeout, 5 s by default) for open connections to
        // finish, and a test's clients may keep theirs: stop off the test's thread.
        if let Some(node) = self.node.take() {
            std::thread::spawn(move || node.shutdown());
        }
    }
}

/// One sample's value from the node's `/metrics` (0 when the series is absent).
pub async fn metric(node: &TestNode, name: &str, labels: &[&str]) -> f64 {
    let text = node.metrics().await;
    metric_samples(&text, name, labels)
        .first()
        .map_or(0.0, |(_, v)| *v)
}
