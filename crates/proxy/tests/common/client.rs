//! The client side of the data-plane tests, shared by the proxy's in-process tests
//! (`crates/proxy/tests`) and the binary's CLI tests (`crates/flatmesh/tests`, which include
//! this file): ports, temp dirs, an HTTP client and its fully read responses, polling, and
//! Prometheus text.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
// The one `free_port` of every crate's tests (the xDS and shm tests include it too).
#[path = "ports.rs"]
mod ports;
pub use ports::free_port;

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
