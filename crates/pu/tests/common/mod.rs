//! Shared helpers of the split-namespace tests. They need root (network namespaces, nftables).
//!
//! Every test's split namespace is named `<tag><pid>` (tag: 3 letters, one per test), so tests
//! of one run and of concurrent runs never collide. A `Pod` removes its namespaces when dropped,
//! also when the test panics; what a *killed* test run left behind (no destructor ran) is removed
//! by the next run: `pod()` first reaps every `<tag><pid>` namespace whose pid is no longer a
//! running test process.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::time::Duration;

use flatmesh_pu::pod::Pod;
use flatmesh_pu::SplitConfig;

pub const STATE_DIR: &str = "/run/flatmesh/pu-test";

/// The tags of the tests in this directory; only namespaces named `<tag><digits>` are reaped.
pub const TAGS: &[&str] = &[
    "dir", "cfl", "icp", "uid", "mov", "rst", "chn", "cln", "lck", "hst", "now", "rce",
    // crates/shm/tests/pus.rs (hetero-socket between PUs), which includes this module.
    "smx", "smi", "sma", "smp", "smc",
];

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "these tests create network namespaces and nftables rules: run them as root (CI does)"
    );
    for (tool, package) in [("nft", "nftables"), ("ip", "iproute2")] {
        assert!(
            std::process::Command::new(tool).arg("-V").output().is_ok(),
            "`{tool}` is not installed: apt-get install {package}"
        );
    }
}

/// A namespace name unique to this test and process (tests may run in parallel).
pub fn ns(tag: &str) -> String {
    assert!(TAGS.contains(&tag), "add tag {tag} to common::TAGS");
    format!("{tag}{}", std::process::id())
}

/// Is `pid` a live process running the same test binary as this one?
fn is_live_test(pid: u32) -> bool {
    let exe = |p: &str| std::fs::read_link(format!("/proc/{p}/exe")).ok();
    match (exe(&pid.to_string()), exe("self")) {
        (Some(theirs), Some(ours)) => {
            // A rebuilt binary shows as "<path> (deleted)" in a process still running it.
            let theirs = theirs.to_string_lossy().replace(" (deleted)", "");
            Path::new(&theirs).file_name() == ours.file_name()
        }
        _ => false,
    }
}

/// Namespace names `<tag><pid>` with a test tag, found in leftovers of any kind.
fn test_namespace_pid(name: &str) -> Option<u32> {
    TAGS.iter().find_map(|tag| {
        let digits = name.strip_prefix(tag)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    })
}

/// Removes what killed test runs left: namespaces, cgroups and state of test namespaces whose
/// process is gone.
pub fn reap_stale() {
    let mut names = std::collections::BTreeSet::new();
    for ns in flatmesh_pu::netns::list("fmpu-") {
        // fmpu-<ns>-<pu>; test namespaces have no `-`.
        if let Some(name) = ns.strip_prefix("fmpu-").and_then(|r| r.split('-').next()) {
            names.insert(name.to_string());
        }
    }
    if let Ok(dir) = std::fs::read_dir(STATE_DIR) {
        for e in dir.flatten() {
            names.insert(e.file_name().to_string_lossy().into_owned());
        }
    }
    // Port tables and bind hooks: /sys/fs/bpf/flatmesh-pu-<ns>.
    if let Ok(dir) = std::fs::read_dir(flatmesh_pu::topology::PIN_ROOT) {
        for e in dir.flatten() {
            if let Some(name) = e.file_name().to_string_lossy().strip_prefix("flatmesh-pu-") {
                names.insert(name.to_string());
            }
        }
    }
    for cg in flatmesh_pu::cpuset::list("flatmesh-pu-") {
        if let Some(name) = cg
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("flatmesh-pu-"))
            .and_then(|r| r.split('-').next())
        {
            names.insert(name.to_string());
        }
    }
    for name in names {
        match test_namespace_pid(&name) {
            Some(pid) if pid != std::process::id() && !is_live_test(pid) => {
                let _ = flatmesh_pu::cleanup::cleanup(Some(&name), Path::new(STATE_DIR));
            }
            _ => {}
        }
    }
}

pub fn config_text(tag: &str, extra: &str) -> String {
    format!(
        "namespace: {}\nstate_dir: {STATE_DIR}\npoll_interval_ms: 20\npus:\n  - {{ name: a, cpus: \"0\" }}\n  - {{ name: b, cpus: \"{}\" }}\nuplink: b\n{extra}",
        ns(tag),
        if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 { "1" } else { "0" }
    )
}

/// Two PUs `a` (CPU 0) and `b` (CPU 1, uplink), plus `extra` YAML lines.
pub fn config(tag: &str, extra: &str) -> SplitConfig {
    SplitConfig::parse(&config_text(tag, extra), "test").unwrap()
}

pub fn pod(tag: &str, extra: &str) -> Pod {
    require_root();
    reap_stale();
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

/// The owner of `port` in the table right now.
pub fn owner(pod: &Pod, port: u16) -> Option<String> {
    pod.table().read().unwrap().ports.get(&port).cloned()
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
    let table = pod.backend.topology().nft_table();
    pod.on(pu, || {
        flatmesh_pu::exec::run("nft", &["list", "map", "ip", &table, "remote_ports"])
            .map(|t| flatmesh_pu::rules::count_mapped(&t))
            .unwrap_or(0)
    })
    .unwrap()
}

/// PU `pu`'s nftables table as text ("" if it has none yet).
pub fn rules_text(pod: &Pod, pu: &str) -> String {
    let table = pod.backend.topology().nft_table();
    pod.on(pu, || {
        flatmesh_pu::exec::run("nft", &["list", "table", "ip", &table]).unwrap_or_default()
    })
    .unwrap()
}

/// Waits for `child` to exit, killing it after `limit` (a hung agent must not hang the test).
pub fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("process {} did not exit within {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
