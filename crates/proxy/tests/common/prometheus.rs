//! A real Prometheus server (Debian's `prometheus`), started by a test to scrape nodes'
//! admin `/metrics`, and queried through its HTTP API (`/api/v1/query`). Killed on drop.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{eventually, free_addr, get_req, h1_client, send, TempDir};

/// Where the binary is: `FLATMESH_PROMETHEUS`, else Debian's path, else `prometheus` on PATH.
/// Panics (the test fails, it does not skip) with how to install it when there is none.
pub fn binary() -> PathBuf {
    let found = match std::env::var_os("FLATMESH_PROMETHEUS") {
        Some(path) => Some(PathBuf::from(path)).filter(|p| p.exists()),
        None => std::iter::once(PathBuf::from("/usr/bin/prometheus"))
            .chain(
                std::env::var_os("PATH")
                    .iter()
                    .flat_map(std::env::split_paths)
                    .map(|dir| dir.join("prometheus")),
            )
            .find(|p| p.exists()),
    };
    found.unwrap_or_else(|| {
        panic!(
            "this test needs a Prometheus server and found none (FLATMESH_PROMETHEUS={:?}, \
             /usr/bin/prometheus, PATH): install Debian's package (`apt-get install -y \
             prometheus`, as scripts/setup does; then `service prometheus stop`, the test runs \
             its own), or set FLATMESH_PROMETHEUS=/path/to/prometheus",
            std::env::var_os("FLATMESH_PROMETHEUS")
        )
    })
}

/// One value of an instant query's answer: its labels and its value.
#[derive(Debug, Clone)]
pub struct Sample {
    pub labels: serde_json::Map<String, serde_json::Value>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> &str {
        self.labels.get(name).and_then(|v| v.as_str()).unwrap_or("")
    }
}

/// A Prometheus process with its own storage, scraping `targets` under `job` every
/// `interval`.
pub struct Prometheus {
    child: Child,
    pub addr: SocketAddr,
    dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus and waits (bounded) until it answers `/-/ready`.
    pub async fn start(job: &str, targets: &[SocketAddr], interval: Duration) -> Prometheus {
        let dir = TempDir::new();
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let ms = interval.as_millis();
        let config = dir.write(
            "prometheus.yml",
            &format!(
                "global:\n  scrape_interval: {ms}ms\n  scrape_timeout: {ms}ms\nscrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ),
        );
        let addr = free_addr();
        let log = std::fs::File::create(dir.path.join("prometheus.log")).unwrap();
        let binary = binary();
        let child = Command::new(&binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        let mut prometheus = Prometheus { child, addr, dir };
        let ready = eventually(Duration::from_secs(30), || async {
            send(&h1_client(), get_req(&format!("http://{addr}/-/ready")))
                .await
                .is_ok_and(|r| r.status.is_success())
        })
        .await;
        if !ready {
            let exited = prometheus.child.try_wait().ok().flatten();
            panic!(
                "Prometheus did not get ready within 30 s (exit: {exited:?}); its log:\n{}",
                prometheus.log()
            );
        }
        prometheus
    }

    /// What Prometheus wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path.join("prometheus.log")).unwrap_or_default()
    }

    /// Runs an instant query; panics on an error answer or a result that is not a vector.
    pub async fn query(&self, promql: &str) -> Vec<Sample> {
        let url = format!(
            "http://{}/api/v1/query?query={}",
            self.addr,
            percent_encode(promql)
        );
        let resp = send(&h1_client(), get_req(&url))
            .await
            .unwrap_or_else(|e| panic!("GET {url} failed: {e}"));
        let body: serde_json::Value = serde_json::from_str(&resp.body)
            .unwrap_or_else(|e| panic!("Prometheus answered non-JSON ({e}): {}", resp.body));
        assert_eq!(
            body["status"], "success",
            "query `{promql}` failed: {}",
            resp.body
        );
        assert_eq!(
            body["data"]["resultType"], "vector",
            "query `{promql}`: {}",
            resp.body
        );
        body["data"]["result"]
            .as_array()
            .unwrap_or_else(|| panic!("no result array: {}", resp.body))
            .iter()
            .map(|s| Sample {
                labels: s["metric"].as_object().cloned().unwrap_or_default(),
                value: s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no value in {s}")),
            })
            .collect()
    }

    /// Polls `promql` (bounded by `limit`) until `done` holds for its answer; returns the
    /// last answer and whether it did.
    pub async fn query_until(
        &self,
        promql: &str,
        limit: Duration,
        done: impl Fn(&[Sample]) -> bool,
    ) -> (Vec<Sample>, bool) {
        let deadline = Instant::now() + limit;
        loop {
            let got = self.query(promql).await;
            if done(&got) {
                return (got, true);
            }
            if Instant::now() > deadline {
                return (got, false);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `s` for a URL's query component: every byte but the unreserved ones percent-encoded.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
