//! Shared helpers for the integration tests: the `flatmesh` process under test, ports,
//! temp configs, an HTTP client, and backends that say who they are.
//!
//! Every test binary uses a different subset of these helpers, hence `dead_code`.
#![allow(dead_code, clippy::unwrap_used)]

pub mod backends;
pub mod grpc;

use std::net::{SocketAddr, TcpListener as StdTcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as LegacyClient;
use hyper_util::rt::TokioExecutor;

/// Upper bound for any single request a test makes; a hang becomes a clear failure.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the proxy gets to answer 200 on /ready after it is spawned.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A port on 127.0.0.1 that was free a moment ago. The OS picks it (bind :0) so parallel
/// tests do not collide; the tiny window between release and reuse is acceptable here.
pub fn free_port() -> u16 {
    let listener = StdTcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to pick a port");
    listener
        .local_addr()
        .expect("local_addr of a bound socket")
        .port()
}

pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A private directory under the system temp dir, removed on drop unless the test panicked
/// (then it is kept so the proxy log and config can be inspected).
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new() -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "flatmesh-it-{}-{}-{}",
            std::process::id(),
            n,
            std::thread::current()
                .name()
                .unwrap_or("t")
                .replace("::", "-")
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    /// Write `contents` to `name` inside the dir and return the full path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.path.join(name);
        std::fs::write(&path, contents).expect("write temp file");
        path
    }
}

impl Default for TempDir {
    fn default() -> Self {
        TempDir::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("keeping {} for inspection", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Path of the binary under test, built by cargo for integration tests.
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

pub fn write_atomically(path: &Path, contents: &str) {
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, contents).expect("write temp config");
    std::fs::rename(&tmp, path).expect("rename temp config into place");
}

// ---------------------------------------------------------------------------------------------
// HTTP client
// ---------------------------------------------------------------------------------------------

pub type Client = LegacyClient<HttpConnector, Full<Bytes>>;

/// HTTP/1.1 client with keep-alive.
pub fn h1_client() -> Client {
    LegacyClient::builder(TokioExecutor::new()).build_http()
}

/// HTTP/2 client speaking h2c with prior knowledge.
pub fn h2c_client() -> Client {
    LegacyClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

/// A fully read response.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: StatusCode,
    pub version: http::Version,
    pub headers: HeaderMap,
    /// The body as text (lossy); `raw` has the exact bytes.
    pub body: String,
    pub raw: Bytes,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The `x-backend` header set by our test backends (which backend answered).
    pub fn backend(&self) -> Option<&str> {
        self.header("x-backend")
    }

    /// The JSON echo body of our test backends.
    pub fn echo(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("response body is not a backend echo ({e}): {self:?}"))
    }
}

pub fn get_req(url: &str) -> Request<Full<Bytes>> {
    Request::get(url)
        .body(Full::new(Bytes::new()))
        .expect("valid request")
}

/// Build a request from method, url and headers.
pub fn request(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Request<Full<Bytes>> {
    let mut builder = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("valid request")
}

/// Send a request and read the whole response, bounded by REQUEST_TIMEOUT.
pub async fn send(client: &Client, req: Request<Full<Bytes>>) -> Result<Resp, String> {
    let what = format!("{} {}", req.method(), req.uri());
    let fut = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("{what}: {e:?}"))?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("{what}: reading body: {e}"))?
            .to_bytes();
        Ok(Resp {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
            raw: body,
        })
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| Err(format!("{what}: no response within {REQUEST_TIMEOUT:?}")))
}

/// GET `url` with extra headers; panics on transport errors.
pub async fn get(client: &Client, url: &str, headers: &[(&str, &str)]) -> Resp {
    send(client, request(Method::GET, url, headers, ""))
        .await
        .unwrap_or_else(|e| panic!("request failed: {e}"))
}

/// Count how often each backend (by `x-backend`) answered.
pub fn tally<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for name in names {
        *counts.entry(name.to_owned()).or_insert(0) += 1;
    }
    counts
}

/// Wait until `check` returns true, polling every 50 ms, up to `limit`. Returns whether it did.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Parse Prometheus text and return the value of every sample whose line starts with
/// `name` (a metric name, possibly a prefix) and contains all `label_parts` (e.g. `listener="web"`).
pub fn metric_samples(text: &str, name: &str, label_parts: &[&str]) -> Vec<(String, f64)> {
    text.lines()
        .filter(|line| !line.starts_with('#') && line.starts_with(name))
        .filter(|line| label_parts.iter().all(|part| line.contains(part)))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.trim().parse::<f64>().ok()?))
        })
        .collect()
}
