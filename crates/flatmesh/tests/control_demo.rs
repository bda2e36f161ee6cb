//! `flatmesh control demo`, shortened, for real: network namespaces, a bridge, CPU cgroups,
//! microservice processes, node proxies, UDP heartbeats. Needs root (CI runs as root).
//!
//! Asserts on what happened (after the load step a SmartNIC was found overloaded, its hottest
//! microservice moved to a host, the SmartNIC recovered, no request failed, everything was cleaned
//! up), never on how fast.

#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn flatmesh() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flatmesh"))
}

fn assert_clean(pid: u32) {
    let left = flatmesh_lab::control::leftovers(pid);
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

/// Offered requests/s after the load step (the well-behaved clients; the greedy one adds its
/// allowed share): past the emulated SmartNIC's CPU quota, so the overload is sustained rather
/// than a few CFS-throttling bursts that a loaded machine's noise can hide.
const HIGH_RPS: u32 = 300;

/// The run in a few lines, for the head of a failure message (CI shows a failure's first and
/// last lines): detections, migrations, and per second the served rate and the SmartNIC's
/// execution time.
fn story(s: &serde_json::Value) -> String {
    let mut out = format!("step at {} s; detections:", s["step_at_s"]);
    for d in s["detections"].as_array().into_iter().flatten() {
        out += &format!(" [{} at {} s: {}]", d["node"], d["at_s"], d["signal"]);
    }
    out += "; migrations:";
    for m in s["migrations"].as_array().into_iter().flatten() {
        out += &format!(
            " [{} {} -> {} at {} s]",
            m["instance"], m["from"], m["to"], m["at_s"]
        );
    }
    out += "\nper second (served req/s / r0-s0/nic0 exec µs):";
    for r in s["timeline"].as_array().into_iter().flatten() {
        let nic = r["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["node"] == "r0-s0/nic0")
            .map(|n| n["exec_us"].to_string())
            .unwrap_or_default();
        out += &format!(
            " {}:{}/{}",
            r["t_s"].as_f64().unwrap_or(0.0).round(),
            r["ok_rps"],
            nic
        );
    }
    out
}

#[test]
fn demo_migrates_the_overloaded_smartnic_without_failed_requests_and_cleans_up() {
    common::require_root("this test creates network namespaces and cgroups");

    // 1. A short run to the end.
    let mut child = flatmesh()
        .args([
            "control",
            "demo",
            // Detection takes a few heartbeats on a quiet machine and many more on a loaded
            // one (throttled execution times are noisy): the run ends 10 s after the last move
            // (the queue built up during the overload takes a few seconds to drain), so it is
            // as long as it needs to be, up to 50 s.
            "--duration",
            "50",
            "--end-after-move",
            "10",
            "--step-at",
            "0.1",
            "--high-rps",
            &HIGH_RPS.to_string(),
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

    assert_eq!(
        s["failed"],
        0,
        "failed requests: {}\n{}",
        s["failures"],
        story(&s)
    );
    assert!(s["ok"].as_u64().unwrap() > 100, "{s}");
    assert!(
        s["limited"].as_u64().unwrap() > 0,
        "the greedy client was never rate-limited: {s}"
    );
    assert!(s["heartbeats"].as_u64().unwrap() > 100, "{s}");
    assert_eq!(
        s["heartbeats_refused"], 0,
        "every agent's heartbeats pass the gate: {s}"
    );
    // SmartNIC nodes were throttled for real.
    let throttled = s["throttled"].as_object().unwrap();
    assert!(
        throttled.values().any(|v| v[0].as_u64().unwrap() > 0),
        "no SmartNIC cgroup was ever throttled: {s}"
    );
    // The load step overloads a SmartNIC; detection, then a move from that SmartNIC to a host,
    // and the placement shows it.
    let step_at = s["step_at_s"].as_f64().unwrap();
    let migrations = s["migrations"].as_array().unwrap();
    let m = migrations
        .iter()
        .find(|m| {
            m["from"].as_str().unwrap().contains("/nic")
                && m["to"].as_str().unwrap().ends_with("/host")
                && m["at_s"].as_f64().unwrap() >= step_at
        })
        .unwrap_or_else(|| {
            panic!(
                "no SmartNIC -> host migration after the load step at {step_at} s\n{}\n{err}\n{s}",
                story(&s)
            )
        });
    let detections = s["detections"].as_array().unwrap();
    assert!(
        detections
            .iter()
            .any(|d| d["node"] == m["from"] && d["at_s"].as_f64() <= m["at_s"].as_f64()),
        "migration without a detection on its node: {s}"
    );
    let inst = m["instance"].as_str().unwrap();
    assert_eq!(s["placement_before"][inst], m["from"]);
    // Recovery, in the per-second table: once the queue built up during the overload has
    // drained (3 s after the last move off that SmartNIC: one move may not be enough, and the
    // controller then moves another instance), the SmartNIC's execution time is back far below
    // its overload peak, and the clients are served at the offered rate again (the well-behaved
    // clients at HIGH_RPS; the greedy one is rate-limited). The run ends 10 s after the last move.
    let moved_at = migrations
        .iter()
        .filter(|n| n["from"] == m["from"])
        .filter_map(|n| n["at_s"].as_f64())
        .fold(0.0, f64::max);
    let settled_at = moved_at + 3.0;
    let nic_exec = |row: &serde_json::Value| {
        row["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == m["from"])
            .and_then(|n| n["exec_us"].as_f64())
    };
    let timeline = s["timeline"].as_array().unwrap();
    // The peak is whichever is higher: a per-second sample of the overload (from the step until
    // the queue has drained), or the slot that tripped the detection (a move soon after the load
    // step can come before any sample sees it).
    let detected_exec = detections
        .iter()
        .filter(|d| d["node"] == m["from"] && d["at_s"].as_f64() <= m["at_s"].as_f64())
        .filter_map(|d| d["exec_us"].as_f64());
    let peak = timeline
        .iter()
        .filter(|r| {
            let t = r["t_s"].as_f64().unwrap();
            t >= step_at && t <= settled_at
        })
        .filter_map(nic_exec)
        .chain(detected_exec)
        .fold(0.0, f64::max);
    let after: Vec<&serde_json::Value> = timeline
        .iter()
        .filter(|r| r["t_s"].as_f64().unwrap() > settled_at)
        .collect();
    assert!(
        after.len() >= 4,
        "too little time after the move to see recovery: {s}"
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let exec_after = median(after.iter().filter_map(|r| nic_exec(r)).collect());
    assert!(
        exec_after * 3.0 < peak,
        "the SmartNIC did not recover: exec {exec_after} µs after the move, peak {peak} µs\n{}\n{s}",
        story(&s)
    );
    let ok_after = median(
        after
            .iter()
            .map(|r| r["ok_rps"].as_f64().unwrap())
            .collect(),
    );
    assert!(
        ok_after >= 0.8 * f64::from(HIGH_RPS),
        "served {ok_after} req/s after the move\n{}\n{s}",
        story(&s)
    );
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
    assert!(flatmesh_lab::control::leftovers(pid)
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
