//! Shared helpers for the binary's tests: the `flatmesh` process under test and its
//! commands. The client side (ports, temp dirs, an HTTP client) and the backends are the
//! proxy's test harness, included from `crates/proxy/tests/common` so both crates test with
//! the same ones.
//!
//! Every test binary uses a different subset of these helpers, hence `dead_code`.
#![allow(dead_code, clippy::unwrap_used)]

#[path = "../../../proxy/tests/common/backends.rs"]
pub mod backends;
#[path = "../../../proxy/tests/common/client.rs"]
mod client;
#[path = "../../../proxy/tests/common/netns.rs"]
pub mod netns;

pub use client::*;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use http::StatusCode;

/// How long the proxy gets to answer 200 on /ready after it is spawned.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Path of the binary under test, built by cargo for integration tests.
/// Panics unless this process runs as root, saying `why` the test needs it.
pub fn require_root(why: &str) {
    use std::os::unix::fs::MetadataExt as _;
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    assert_eq!(uid, 0, "{why}: run it as root (CI does)");
}

pub fn flatmesh_bin() -> &'static str {
    env!("CARGO_BIN_EXE_flatmesh")
}

/// Output of a finished `flatmesh` command.
pub struct Finished {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn all_output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Run `flatmesh ARGS...` to completion, bounded in time (a hang is a failure, not a stuck suite).
pub async fn run_flatmesh(args: &[&str], limit: Duration) -> Finished {
    let child = tokio::process::Command::new(flatmesh_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn flatmesh");
    let output = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "`flatmesh {}` did not finish within {limit:?}",
                args.join(" ")
            )
        })
        .expect("wait for flatmesh");
    Finished {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// A running `flatmesh node` process. Killed on drop.
pub struct Proxy {
    child: Child,
    pub admin: SocketAddr,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    pub dir: TempDir,
}

impl Proxy {
    /// Write `yaml` to a temp file, start `flatmesh node --config FILE`, wait for /ready.
    /// `admin` must be the address the YAML puts the admin listener on.
    pub async fn start(admin: SocketAddr, yaml: &str) -> Proxy {
        let mut proxy = Proxy::spawn(admin, yaml);
        proxy.wait_ready(READY_TIMEOUT).await;
        proxy
    }

    /// Start the process without waiting for readiness.
    pub fn spawn(admin: SocketAddr, yaml: &str) -> Proxy {
        let dir = TempDir::new();
        let config_path = dir.write("flatmesh.yaml", yaml);
        let log_path = dir.path.join("proxy.log");
        let log = std::fs::File::create(&log_path).expect("create proxy log");
        let log2 = log.try_clone().expect("clone log handle");
        let child = Command::new(flatmesh_bin())
            .arg("node")
            .arg("--config")
            .arg(&config_path)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .spawn()
            .expect("spawn flatmesh node");
        Proxy {
            child,
            admin,
            config_path,
            log_path,
            dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the proxy printed so far (stdout and stderr share one file).
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `Some(status)` once the process has exited.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("try_wait on flatmesh")
    }

    /// Panic with the proxy's output unless the process is still running.
    pub fn assert_alive(&mut self, context: &str) {
        if let Some(status) = self.exit_status() {
            panic!(
                "flatmesh exited ({status}) {context}; its output:\n{}",
                self.output()
            );
        }
    }

    /// Poll GET /ready until 200, bounded; panic with the proxy's output on timeout or exit.
    pub async fn wait_ready(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let client = h1_client();
        let url = format!("http://{}/ready", self.admin);
        let mut last: String;
        loop {
            if let Some(status) = self.exit_status() {
                panic!(
                    "flatmesh node exited ({status}) before it was ready; its output:\n{}",
                    self.output()
                );
            }
            match send(&client, get_req(&url)).await {
                Ok(resp) if resp.status == StatusCode::OK => return,
                Ok(resp) => last = format!("status {} body {:?}", resp.status, resp.body),
                Err(e) => last = e,
            }
            if Instant::now() > deadline {
                panic!(
                    "flatmesh node not ready at {url} within {limit:?} (last: {last}); its output:\n{}",
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Replace the config file atomically (write + rename), as an operator's tooling would,
    /// so the proxy never reads a half-written file.
    pub fn write_config(&self, yaml: &str) {
        write_atomically(&self.config_path, yaml);
    }

    /// Send SIGHUP (ask for a reload).
    pub fn sighup(&self) {
        let status = Command::new("kill")
            .arg("-HUP")
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill -HUP");
        assert!(status.success(), "kill -HUP {} failed", self.child.id());
    }

    /// GET an admin path; returns (status, body).
    pub async fn admin_get(&self, path: &str) -> (StatusCode, String) {
        let url = format!("http://{}{}", self.admin, path);
        let resp = send(&h1_client(), get_req(&url))
            .await
            .unwrap_or_else(|e| panic!("GET {url} failed: {e}; proxy output:\n{}", self.output()));
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

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- flatmesh node output ----\n{}\n---- end ----",
                self.output()
            );
        }
    }
}
