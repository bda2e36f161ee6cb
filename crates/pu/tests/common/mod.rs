//! Shared helpers of the split-namespace tests. They need root (network namespaces, nftables).
#![allow(dead_code, clippy::unwrap_used)]

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use flatmesh_pu::pod::Pod;
use flatmesh_pu::SplitConfig;

pub const STATE_DIR: &str = "/run/flatmesh/pu-test";

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "these tests create network namespaces and nftables rules: run them as root (CI does)"
    );
    assert!(
        std::process::Command::new("nft")
            .arg("--version")
            .output()
            .is_ok(),
        "nft (nftables) is not installed: apt-get install nftables"
    );
}

/// A namespace name unique to this test and process (tests may run in parallel).
pub fn ns(tag: &str) -> String {
    format!("{tag}{}", std::process::id() % 100_000)
}

/// Two PUs `a` (CPU 0) and `b` (CPU 1, uplink), plus `extra` YAML lines.
pub fn config(tag: &str, extra: &str) -> SplitConfig {
    let text = format!(
        "namespace: {}\nstate_dir: {STATE_DIR}\npoll_interval_ms: 20\npus:\n  - {{ name: a, cpus: \"0\" }}\n  - {{ name: b, cpus: \"{}\" }}\nuplink: b\n{extra}",
        ns(tag),
        if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 { "1" } else { "0" }
    );
    SplitConfig::parse(&text, "test").unwrap()
}

pub fn pod(tag: &str, extra: &str) -> Pod {
    require_root();
    Pod::up(config(tag, extra)).unwrap()
}

pub fn listen(pod: &Pod, pu: &str, port: u16) -> TcpListener {
    pod.on(pu, || TcpListener::bind(("127.0.0.1", port)))
        .unwrap()
        .unwrap()
}

pub fn wait_owner(pod: &Pod, port: u16, owner: Option<&str>) {
    assert!(
        pod.wait_for_table(Duration::from_secs(10), |s| s
            .ports
            .get(&port)
            .map(String::as_str)
            == owner),
        "port {port} never got owner {owner:?}: {:?}",
        pod.table().read().unwrap().ports
    );
}

pub fn localhost(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub fn bind_errno(pod: &Pod, pu: &str, port: u16) -> Option<i32> {
    pod.on(pu, || {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        s.bind(&localhost(port).into())
            .err()
            .and_then(|e| e.raw_os_error())
    })
    .unwrap()
}

pub fn host_has_no_tables() {
    let leaked = flatmesh_pu::cleanup::host_tables().unwrap();
    assert!(
        leaked.is_empty(),
        "flatmesh-pu tables in the host namespace: {leaked:?}"
    );
}

/// Polls `cond` every 10 ms for up to 10 s (agents react within a poll interval, but a loaded
/// CI machine may be slow); fails the test with `what` if it never holds.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("never happened within 10 s: {what}");
}

/// How many remote ports PU `pu`'s rules map right now.
pub fn mapped(pod: &Pod, pu: &str) -> usize {
    let table = pod.backend_topology_table();
    pod.on(pu, || {
        flatmesh_pu::exec::run("nft", &["list", "map", "ip", &table, "remote_ports"])
            .map(|t| flatmesh_pu::rules::count_mapped(&t))
            .unwrap_or(0)
    })
    .unwrap()
}

trait TopologyTable {
    fn backend_topology_table(&self) -> String;
}

impl TopologyTable for Pod {
    fn backend_topology_table(&self) -> String {
        use flatmesh_pu::PuBackend as _;
        self.backend.topology().nft_table()
    }
}

/// PU `pu`'s nftables table as text ("" if it has none yet).
pub fn rules_text(pod: &Pod, pu: &str) -> String {
    let table = pod.backend_topology_table();
    pod.on(pu, || {
        flatmesh_pu::exec::run("nft", &["list", "table", "ip", &table]).unwrap_or_default()
    })
    .unwrap()
}
