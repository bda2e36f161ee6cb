//! `flatmesh control demo`, shortened, for real: network namespaces, a bridge, CPU cgroups,
//! microservice processes, node proxies, UDP heartbeats. Needs root (CI runs as root).
//!
//! Asserts on what happened (a SmartNIC was found overloaded, its hottest microservice moved to a
//! host, no request failed, everything was cleaned up), never on how fast.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn require_root() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    assert_eq!(
        euid, "0",
        "this test creates network namespaces and cgroups: run it as root (CI does)"
    );
}

fn flatmesh() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flatmesh"))
}

fn assert_clean(pid: u32) {
    let left = flatmesh_control::demo::leftovers(pid);
    assert!(
        left.is_empty(),
        "the demo (pid {pid}) left behind: {left:?}"
    );
}

/// Waits for the child, killing it if it runs past `limit` (a hung demo must not hang CI).
fn wait_bounded(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the demo did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn demo_migrates_the_overloaded_smartnic_without_failed_requests_and_cleans_up() {
    require_root();

    // 1. A short run to the end.
    let mut child = flatmesh()
        .args([
            "control",
            "demo",
            "--duration",
            "14",
            "--step-at",
            "0.3",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap());
    let err = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap());
    let status = wait_bounded(&mut child, Duration::from_secs(120));
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(status.success(), "demo failed: {status}\n{err}\n{out}");
    let s: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("demo output is not JSON ({e}):\n{out}\n{err}"));

    assert_eq!(s["failed"], 0, "failed requests: {}", s["failures"]);
    assert!(s["ok"].as_u64().unwrap() > 100, "{s}");
    assert!(
        s["limited"].as_u64().unwrap() > 0,
        "the greedy client was never rate-limited: {s}"
    );
    assert!(s["heartbeats"].as_u64().unwrap() > 100, "{s}");
    // SmartNIC nodes were throttled for real.
    let throttled = s["throttled"].as_object().unwrap();
    assert!(
        throttled.values().any(|v| v[0].as_u64().unwrap() > 0),
        "no SmartNIC cgroup was ever throttled: {s}"
    );
    // Detection, then a move from a SmartNIC to a host, and the placement shows it.
    let migrations = s["migrations"].as_array().unwrap();
    let m = migrations
        .iter()
        .find(|m| {
            m["from"].as_str().unwrap().contains("/nic")
                && m["to"].as_str().unwrap().ends_with("/host")
        })
        .unwrap_or_else(|| panic!("no SmartNIC -> host migration:\n{err}\n{s}"));
    let detections = s["detections"].as_array().unwrap();
    assert!(
        detections
            .iter()
            .any(|d| d["node"] == m["from"] && d["at_s"].as_f64() <= m["at_s"].as_f64()),
        "migration without a detection on its node: {s}"
    );
    let inst = m["instance"].as_str().unwrap();
    assert_eq!(s["placement_before"][inst], m["from"]);
    assert!(s["endpoint_versions"].as_u64().unwrap() >= 2);
    // The log tells the story: the paper's steps in order.
    let steps = [
        "push binary",
        "remove from execution engine",
        "clean up local resources",
        "migrate working state",
        "restart on new node",
        "update connections",
    ];
    let mut at = 0;
    for step in steps {
        let found = err[at..]
            .find(&format!("step {step}"))
            .unwrap_or_else(|| panic!("step `{step}` missing from the log (in order):\n{err}"));
        at += found;
    }
    assert!(s["cleanup_left"].as_array().unwrap().is_empty(), "{s}");
    assert_clean(pid);

    // 2. Interrupted part-way: Ctrl-C (SIGINT) still removes everything.
    let mut child = flatmesh()
        .args(["control", "demo", "--duration", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut log = String::new();
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("demo exited before its proxies were ready:\n{log}"))
            .unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("node proxies ready") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no `node proxies ready` within 60 s:\n{log}"
        );
    }
    // Let the load and the heartbeats run for a moment, then interrupt.
    std::thread::sleep(Duration::from_secs(2));
    assert!(flatmesh_control::demo::leftovers(pid)
        .iter()
        .any(|l| l.starts_with("namespace")));
    // `kill -INT` is what a terminal's Ctrl-C does to the process.
    let ok = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    std::thread::spawn(move || for _ in lines {});
    let status = wait_bounded(&mut child, Duration::from_secs(60));
    assert!(
        !status.success(),
        "an interrupted demo reports it was interrupted"
    );
    assert_clean(pid);
}
