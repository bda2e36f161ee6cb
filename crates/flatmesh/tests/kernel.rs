//! Tier K wired into the node (`kernel:` section), as root: tcp listeners spliced in the
//! kernel, the L7 listener's first request decided in the kernel with fallbacks that answer
//! exactly as the user tier does, capture of a workload cgroup's connections to a service
//! address, and the one-line degradation when tier K cannot attach.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::backends::{pattern, HttpBackend, Proto, TcpBackend, TcpMode};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn require_root() {
    use std::os::unix::fs::MetadataExt as _;
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(u32::MAX);
    assert_eq!(
        uid, 0,
        "the tier-K node tests attach eBPF programs and need root: run them as root (CI does)"
    );
}

/// A pin directory of this test's own, removed (with whatever a killed node left) on drop.
struct Pins(PathBuf);

impl Pins {
    fn new(test: &str) -> Pins {
        Pins(PathBuf::from(format!(
            "/sys/fs/bpf/fm-node-{test}-{}",
            std::process::id()
        )))
    }

    fn status(&self) -> flatmesh_kernel::KernelStatus {
        flatmesh_kernel::status(&self.0).unwrap()
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        // The node was SIGKILLed: its links died with it; the pins are what is left.
        let _ = flatmesh_kernel::cleanup_stale(&self.0);
    }
}

async fn spliced_metric(proxy: &Proxy, listener: &str) -> f64 {
    let text = proxy.metrics().await;
    metric_samples(
        &text,
        "flatmesh_kernel_spliced_connections_total",
        &[&format!("listener=\"{listener}\"")],
    )
    .iter()
    .map(|(_, v)| v)
    .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_listener_bytes_are_spliced_in_the_kernel() {
    require_root();
    let pins = Pins::new("tcp");
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (admin, listen) = (free_addr(), free_addr());
    let yaml = format!(
        r#"
admin: {admin}
workers: 2
kernel: {{ pin_dir: {pins}, redirect: false, tcp_splice: true }}
listeners:
  - {{ name: db, address: {listen}, protocol: tcp, cluster: db }}
clusters:
  - {{ name: db, endpoints: [ {echo} ] }}
"#,
        pins = pins.0.display(),
        echo = echo.addr
    );
    let proxy = Proxy::start(admin, &yaml).await;

    const LEN: usize = 4 * 1024 * 1024;
    let data = pattern(LEN, 7);
    let stream = TcpStream::connect(listen).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        for chunk in sent.chunks(64 * 1024) {
            wr.write_all(chunk).await.unwrap();
        }
        // Half-close: the echo backend must still answer everything, then close.
        wr.shutdown().await.unwrap();
    });
    let mut back = Vec::with_capacity(LEN);
    tokio::time::timeout(Duration::from_secs(30), rd.read_to_end(&mut back))
        .await
        .expect("the echo came back in time")
        .unwrap();
    writer.await.unwrap();
    assert_eq!(back.len(), LEN, "every byte came back");
    assert!(back == data, "the bytes came back unchanged");

    let verdict = pins.status().stat("fm_verdict");
    // Almost all of the 2 × 4 MiB went through the kernel; a first chunk sent before the
    // splice may reach the relay.
    assert!(
        verdict.bytes >= (2 * LEN as u64) * 9 / 10,
        "the kernel moved only {} of {} bytes: {verdict:?}",
        verdict.bytes,
        2 * LEN
    );
    assert_eq!(spliced_metric(&proxy, "db").await, 1.0);
}

/// One HTTP/1.1 request on its own connection; returns (status, x-backend or body).
async fn ask(addr: SocketAddr, method: &str, path: &str, extra: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\n{extra}Connection: close\r\nContent-Length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut resp))
        .await
        .expect("answer in time")
        .unwrap();
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let backend = text
        .lines()
        .find_map(|l| l.strip_prefix("x-backend: "))
        .map(str::to_owned)
        .unwrap_or_else(|| text.rsplit("\r\n\r\n").next().unwrap_or("").to_owned());
    (status, backend)
}

fn l7_config(admin: SocketAddr, web: SocketAddr, kernel: &str, api: SocketAddr, canary: SocketAddr) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
{kernel}
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: /api/v2 }}, headers: [ {{ name: x-canary, exact: "1" }} ] }}
        cluster: canary
      - match: {{ path: {{ prefix: /api }} }}
        cluster: api
      - match: {{ path: {{ exact: /healthz }} }}
        direct_response: {{ status: 200, body: "ok" }}
      - match: {{ path: {{ prefix: /v2 }}, method: POST }}
        cluster: canary
      - match: {{ path: {{ regex: "^/r[0-9]+$" }} }}
        cluster: api
clusters:
  - {{ name: api, endpoints: [ {api} ] }}
  - {{ name: canary, endpoints: [ {canary} ] }}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_first_request_is_decided_in_the_kernel_and_fallbacks_answer_as_the_user_tier() {
    require_root();
    let pins = Pins::new("l7");
    let api = HttpBackend::start("api", Proto::H1).await;
    let canary = HttpBackend::start("canary", Proto::H1).await;
    let (admin_k, web_k, admin_u, web_u) = (free_addr(), free_addr(), free_addr(), free_addr());
    let kernel = format!(
        "kernel: {{ pin_dir: {}, redirect: false, l7_dispatch: true }}",
        pins.0.display()
    );
    let with_kernel = Proxy::start(
        admin_k,
        &l7_config(admin_k, web_k, &kernel, api.addr, canary.addr),
    )
    .await;
    let user_only = Proxy::start(
        admin_u,
        &l7_config(admin_u, web_u, "", api.addr, canary.addr),
    )
    .await;

    // (method, path, extra headers, decided by the kernel?). The header route cannot be
    // decided in the kernel, so its punt entry sends every /api/v2 request to the user tier.
    let cases = [
        ("GET", "/api/items", "", true),
        ("GET", "/api/items?x=1", "x-canary: 1\r\n", true),
        ("GET", "/api/v2/items", "", false),
        ("GET", "/api/v2/items", "x-canary: 1\r\n", false),
        ("GET", "/healthz", "", false),
        ("POST", "/v2/orders", "", true),
        ("GET", "/v2/orders", "", false),
        ("GET", "/r42", "", false),
        ("GET", "/nothing", "", false),
    ];
    let mut decided = 0;
    for (method, path, extra, in_kernel) in cases {
        let k = ask(web_k, method, path, extra).await;
        let u = ask(web_u, method, path, extra).await;
        assert_eq!(k, u, "{method} {path} {extra:?}: the kernel path answered differently");
        decided += in_kernel as u32;
        assert_eq!(
            spliced_metric(&with_kernel, "web").await,
            decided as f64,
            "after {method} {path} {extra:?}: spliced connections"
        );
    }
    let verdict = pins.status().stat("fm_verdict");
    assert!(verdict.hits >= decided as u64, "verdict decisions: {verdict:?}");
    assert!(verdict.fallbacks >= 1, "fallbacks were counted: {verdict:?}");
    let sockops = pins.status().stat("fm_sockops_l7");
    assert!(sockops.hits >= cases.len() as u64, "each connection was registered at establishment: {sockops:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_workload_reaches_the_node_listener_through_the_service_address() {
    require_root();
    let pins = Pins::new("cap");
    let cgroup = flatmesh_kernel::default_cgroup_root().join(format!("fm-node-cap-{}", std::process::id()));
    std::fs::create_dir_all(&cgroup).unwrap();
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (admin, listen) = (free_addr(), free_addr());
    let vip = "10.250.7.1:80";
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
kernel:
  pin_dir: {pins}
  redirect: false
  tcp_splice: false
  capture: {{ cgroup: {cg}, services: [ {{ address: "{vip}", listener: db }} ] }}
listeners:
  - {{ name: db, address: {listen}, protocol: tcp, cluster: db }}
clusters:
  - {{ name: db, endpoints: [ {echo} ] }}
"#,
        pins = pins.0.display(),
        cg = cgroup.display(),
        echo = echo.addr
    );
    let proxy = Proxy::start(admin, &yaml).await;
    // A workload: a shell that joins the cgroup, then talks to the service address.
    let script = format!(
        "echo $$ > {procs} && exec 3<>/dev/tcp/10.250.7.1/80 && printf captured >&3 && head -c 8 <&3",
        procs = cgroup.join("cgroup.procs").display()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new("bash").arg("-c").arg(&script).output(),
    )
    .await
    .expect("the workload finished in time")
    .unwrap();
    let _ = std::fs::remove_dir(&cgroup);
    assert!(
        out.status.success(),
        "workload failed: {}; node output:\n{}",
        String::from_utf8_lossy(&out.stderr),
        proxy.output()
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "captured");
    assert!(pins.status().stat("fm_connect4").hits >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kernel_support_the_node_logs_one_line_and_runs_on_the_user_tiers() {
    let echo = TcpBackend::start(TcpMode::Echo).await;
    let (admin, listen) = (free_addr(), free_addr());
    // A pin directory outside bpffs cannot hold eBPF pins: tier K cannot attach.
    let dir = TempDir::new();
    let yaml = format!(
        r#"
admin: {admin}
workers: 1
kernel: {{ pin_dir: {pins}/flatmesh }}
listeners:
  - {{ name: db, address: {listen}, protocol: tcp, cluster: db }}
clusters:
  - {{ name: db, endpoints: [ {echo} ] }}
"#,
        pins = dir.path.display(),
        echo = echo.addr
    );
    let proxy = Proxy::start(admin, &yaml).await;
    let mut s = TcpStream::connect(listen).await.unwrap();
    s.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .unwrap();
    assert_eq!(&back, b"ping");
    let out = proxy.output();
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("running on the user tiers"))
        .collect();
    assert_eq!(lines.len(), 1, "one line says tier K is off and why:\n{out}");
}
