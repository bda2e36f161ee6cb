//! The web console in a real browser: `flatmesh control demo --ui` runs (network namespaces,
//! node proxies, an overload and a migration; needs root, CI runs as root), headless Chromium
//! opens `/ui` through chromedriver's WebDriver API, and the test checks the DOM: the service
//! graph (`#service-graph`) has the demo's services and the edges between them, and after the
//! overload a migration appears on the timeline. It saves a screenshot into the build's temp dir
//! (`target/tmp/console.png`); with `FLATMESH_SCREENSHOT=docs/img/console.png` it refreshes the
//! one the README shows.
//!
//! Needs Debian's `chromium` and `chromium-driver`; without them the test fails and says how to
//! install them. Every wait is bounded.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};

use common::free_port;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

fn require_browser() {
    for (path, package) in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")] {
        assert!(
            Path::new(path).exists(),
            "{path} is missing: the console test drives headless Chromium through chromedriver; \
             install both with `apt-get install chromium chromium-driver` (package {package})"
        );
    }
}

/// One HTTP/1.1 exchange on its own connection: (status, body). The body ends at its
/// `Content-Length` (chromedriver keeps connections open) or at close.
fn http(
    at: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {at}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&chunk[..n]);
        if let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&out[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if length.is_some_and(|len| out.len() >= end + 4 + len) {
                break;
            }
        }
    }
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

/// Polls `probe` every 250 ms until it returns `Some`, for at most `limit`.
fn wait_for<T>(what: &str, limit: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// A WebDriver session on chromedriver.
struct Browser {
    driver: SocketAddr,
    session: String,
}

impl Browser {
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let (status, body) = http(self.driver, method, &path, body).unwrap();
        assert_eq!(status, 200, "WebDriver {method} {path}: {body}");
        serde_json::from_str::<Value>(&body).unwrap()["value"].clone()
    }

    fn script(&self, script: &str) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(&json!({ "script": script, "args": [] })),
        )
    }
}

/// Kills a child process when dropped (a failed assertion must not leave it running).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let clean: Vec<u8> = text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

const GRAPH_SCRIPT: &str = r#"
const g = document.getElementById('service-graph');
if (!g) return null;
return {
  services: [...g.querySelectorAll('[data-service]')].map(e => e.dataset.service),
  edges: [...g.querySelectorAll('[data-edge]')].map(e => e.dataset.edge),
  labels: [...g.querySelectorAll('[data-edge] text')].map(e => e.textContent),
};"#;

const TIMELINE_SCRIPT: &str = r#"
return {
  migrated: [...document.querySelectorAll('#timeline li[data-kind=migrated]')].map(e => e.textContent),
  detected: document.querySelectorAll('#timeline li[data-kind=detected]').length,
  moved: [...document.querySelectorAll('#placement .chip.moved')].map(e => e.dataset.instance),
};"#;

#[test]
fn the_console_shows_the_demo_graph_and_its_migration_in_a_real_browser() {
    common::require_root(
        "this test runs the control demo, which creates network namespaces and cgroups",
    );
    require_browser();

    let ui: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let log =
        std::env::temp_dir().join(format!("flatmesh-console-test-{}.log", std::process::id()));
    let mut demo = Reaped(
        Command::new(env!("CARGO_BIN_EXE_flatmesh"))
            .args([
                "control",
                "demo",
                "--ui",
                &ui.to_string(),
                // The load steps up at 4 s; the run ends 15 s after the first migration (the
                // page is checked meanwhile), at most after 60 s.
                "--duration",
                "60",
                "--step-at",
                "0.07",
                "--end-after-move",
                "15",
                "--json",
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let demo_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for(
        "the console to answer /ui/state",
        Duration::from_secs(30),
        || {
            if let Some(status) = demo.0.try_wait().unwrap() {
                panic!(
                    "the demo exited ({status}) before serving the console: {}",
                    demo_log()
                );
            }
            http(ui, "GET", "/ui/state", None)
                .ok()
                .filter(|(s, _)| *s == 200)
        },
    );

    let driver: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let _chromedriver = Reaped(
        Command::new(CHROMEDRIVER)
            .arg(format!("--port={}", driver.port()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("chromedriver to be ready", Duration::from_secs(20), || {
        let (status, body) = http(driver, "GET", "/status", None).ok()?;
        (status == 200 && body.contains("\"ready\":true")).then_some(())
    });
    let (status, body) = http(
        driver,
        "POST",
        "/session",
        Some(&json!({ "capabilities": { "alwaysMatch": { "goog:chromeOptions": {
            "binary": CHROMIUM,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1150"]
        } } } })),
    )
    .unwrap();
    assert_eq!(status, 200, "chromedriver could not start Chromium: {body}");
    let session: Value = serde_json::from_str(&body).unwrap();
    let browser = Browser {
        driver,
        session: session["value"]["sessionId"].as_str().unwrap().to_string(),
    };
    browser.call(
        "POST",
        "/url",
        Some(&json!({ "url": format!("http://{ui}/ui") })),
    );

    // The graph: the demo's four services, ingress, and the calls between them with traffic.
    let graph = wait_for(
        "the service graph to show the demo's calls",
        Duration::from_secs(40),
        || {
            let g = browser.script(GRAPH_SCRIPT);
            let edges: Vec<&str> = g["edges"]
                .as_array()?
                .iter()
                .filter_map(Value::as_str)
                .collect();
            let want = [
                "ingress->gateway/api",
                "gateway/api->telemetry/kvs",
                "gateway/api->telemetry/count",
                "gateway/api->telemetry/ema",
            ];
            want.iter().all(|e| edges.contains(e)).then_some(g)
        },
    );
    let services: Vec<&str> = graph["services"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for s in [
        "ingress",
        "gateway/api",
        "telemetry/kvs",
        "telemetry/count",
        "telemetry/ema",
    ] {
        assert!(
            services.contains(&s),
            "{s} missing from the graph: {services:?}"
        );
    }
    let labels = graph["labels"].to_string();
    assert!(
        labels.contains("req/s") && labels.contains("p99"),
        "edge labels: {labels}"
    );

    // The overload is detected and a microservice migrates: the timeline shows it, and the
    // placement map marks the moved instance.
    let timeline = wait_for(
        "a migration on the timeline",
        Duration::from_secs(50),
        || {
            let t = browser.script(TIMELINE_SCRIPT);
            (!t["migrated"].as_array()?.is_empty() && !t["moved"].as_array()?.is_empty())
                .then_some(t)
        },
    );
    assert!(timeline["detected"].as_u64().unwrap() >= 1, "{timeline}");
    let migrated = timeline["migrated"][0].as_str().unwrap();
    assert!(
        migrated.contains("nic0") && migrated.contains("host"),
        "{migrated}"
    );
    let nodes = browser
        .script("return [...document.querySelectorAll('#nodes tr')].map(r => r.textContent)");
    assert_eq!(nodes.as_array().unwrap().len(), 4, "{nodes}");
    assert!(nodes.to_string().contains("up"), "{nodes}");

    // Let the graph show the traffic after the move, then take the picture.
    std::thread::sleep(Duration::from_secs(2));
    let png = base64_decode(browser.call("GET", "/screenshot", None).as_str().unwrap());
    assert!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
    // Into the build's temp dir; FLATMESH_SCREENSHOT=docs/img/console.png refreshes the README's.
    let out = std::env::var_os("FLATMESH_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console.png"));
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&out, &png).unwrap();
    browser.call("DELETE", "", None);

    // The demo finishes on its own, without failed requests.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = demo.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the demo did not finish: {}",
            demo_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "the demo failed: {}", demo_log());
    let _ = std::fs::remove_file(&log);
}
