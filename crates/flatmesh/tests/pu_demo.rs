//! `flatmesh pu demo` for real (root; CI runs as root): every row passes, including the calls
//! carried by the `flatmesh node` proxy on the other PU with SO_ORIGINAL_DST intact; nothing is
//! left behind; and a run killed with SIGKILL is cleaned up by the next one. And `flatmesh pu
//! demo --mesh` (HeteroK8s-Mesh-All): every request answered with the node proxy on the host, on
//! the DPU over veth and on the DPU over shared memory, where the client's connections did move
//! to shared memory; the charts written; nothing left behind.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STATE_DIR: &str = "/run/flatmesh/pu-clitest";

fn demo(namespace: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flatmesh"));
    c.args([
        "pu",
        "demo",
        "--namespace",
        namespace,
        "--state-dir",
        STATE_DIR,
    ])
    .stdin(Stdio::null());
    c
}

/// Runs the demo to its end (killed after `limit`: a hung demo must not hang CI).
fn run_to_end(namespace: &str, limit: Duration) -> (bool, String) {
    run_command_to_end(demo(namespace), limit)
}

fn run_command_to_end(mut command: Command, limit: Duration) -> (bool, String) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`flatmesh pu demo` did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = format!(
        "{}\n--- stderr ---\n{}",
        reader.join().unwrap(),
        err_reader.join().unwrap()
    );
    (status.success(), text)
}

fn leftovers(namespace: &str) -> Vec<String> {
    flatmesh_pu::cleanup::leftovers(namespace, &Path::new(STATE_DIR).join(namespace))
}

/// Processes still running the demo's node proxy of `namespace`.
fn node_processes(namespace: &str) -> Vec<u32> {
    let needle = format!("{STATE_DIR}/{namespace}/node.yaml");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
        })
        .collect()
}

/// Removes whatever the demos of `namespace` left, also when the test fails half-way.
struct Remove(String);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = flatmesh_pu::cleanup::cleanup(Some(&self.0), Path::new(STATE_DIR));
    }
}

#[test]
fn pu_demo_goes_through_the_node_proxy_and_cleans_up_even_after_kill_9() {
    common::require_root("this test creates network namespaces and nftables rules");
    let ns = format!("fmt{}", std::process::id());
    let _remove = Remove(ns.clone());
    let limit = Duration::from_secs(60);

    // 1. A run to the end: every row ok, nothing left.
    let (ok, out) = run_to_end(&ns, limit);
    assert!(ok, "the demo failed:\n{out}");
    for needle in [
        "SO_ORIGINAL_DST on the node's socket=10.96.0.10:80",
        "SO_ORIGINAL_DST on the node's socket=10.96.0.12:7000",
        "svc-a saw peer=10.213.255.1",
        "Address already in use",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    assert!(!out.contains("| NO "), "a row failed:\n{out}");
    assert_eq!(leftovers(&ns), Vec::<String>::new());

    // 2. A run killed with SIGKILL while its PUs are up and its node proxy runs: it leaves the
    //    PUs behind, but its node proxy dies with it.
    let mut child = demo(&ns)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while node_processes(&ns).is_empty() {
        assert!(
            Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "the demo never started its node proxy"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !leftovers(&ns).is_empty(),
        "a killed demo should have left its namespaces (or the test killed it too late)"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !node_processes(&ns).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the node proxy outlived the killed demo: {:?}",
            node_processes(&ns)
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // 3. The next run removes what the killed one left, then works as usual.
    let (ok, out) = run_to_end(&ns, limit);
    assert!(ok, "the demo after a killed run failed:\n{out}");
    assert!(
        out.contains("removed leftovers of an earlier run"),
        "no clean-up reported:\n{out}"
    );
    assert_eq!(leftovers(&ns), Vec::<String>::new());
    let _ = std::fs::remove_dir(STATE_DIR);
}

/// The preload library `cargo test` builds (crates/shm builds it as an example: see its
/// Cargo.toml), next to this binary's profile directory.
fn preload_library() -> std::path::PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_flatmesh"));
    let library = bin
        .parent()
        .unwrap()
        .join("examples/libflatmesh_shm_preload.so");
    assert!(
        library.is_file(),
        "{} is missing: build it with `cargo build --release -p flatmesh-shm --examples` (cargo test --workspace does)",
        library.display()
    );
    library
}

#[test]
fn the_mesh_scenario_answers_every_request_in_all_three_placements() {
    common::require_root("this test creates network namespaces and nftables rules");
    let ns = format!("fmm{}", std::process::id());
    let _remove = Remove(ns.clone());
    let plots = std::env::temp_dir().join(format!("flatmesh-pu-mesh-{}", std::process::id()));
    let mut command = demo(&ns);
    command
        .args(["--mesh", "--rounds", "1", "--seconds", "1", "--plots"])
        .arg(&plots)
        .env("FLATMESH_SHM_LIB", preload_library());
    let (ok, out) = run_command_to_end(command, Duration::from_secs(120));
    // It fails when a request fails or placement (c) moved no connection to shared memory.
    assert!(ok, "the mesh demo failed:\n{out}");
    for needle in [
        "(a) proxy on host CPU, loopback",
        "(b) proxy on DPU, veth",
        "(c) proxy on DPU, shared memory",
        "target <= 1.2x",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    for chart in ["pu-mesh-latency.svg", "pu-mesh-cpu.svg"] {
        let svg = std::fs::read_to_string(plots.join(chart)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("(c) DPU, shm"),
            "{chart}"
        );
    }
    let _ = std::fs::remove_dir_all(&plots);
    assert_eq!(leftovers(&ns), Vec::<String>::new());
}
