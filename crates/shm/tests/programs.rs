//! Real, unmodified programs with the library preloaded on both ends: nginx served to wrk and
//! curl, redis-server with redis-benchmark and redis-cli, sockperf ping-pong, iperf3. Each test
//! checks that results are correct and that the server really mapped connection regions
//! (the data path moved to shared memory). A missing program fails with the Debian package
//! to install.
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::time::Duration;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("flatmesh-shm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[test]
fn nginx_serves_wrk_and_curl() {
    require_root();
    require("nginx", "nginx");
    require("wrk", "wrk");
    require("curl", "curl");
    let dir = temp_dir("nginx");
    let body = random_bytes(300_000, 7);
    std::fs::write(dir.join("file.bin"), &body).unwrap();
    let port = free_port();
    let d = dir.display();
    // `user root`: both ends must run as the same user (region files are mode 0600).
    let config = format!(
        "user root;\nworker_processes 1;\ndaemon off;\nmaster_process on;\nerror_log {d}/error.log warn;\npid {d}/nginx.pid;\n\
         events {{ worker_connections 1024; }}\n\
         http {{ access_log off; sendfile on; keepalive_requests 1000000;\n\
           client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
           server {{ listen 127.0.0.1:{port}; root {d}; location = /hello {{ return 200 \"hello\\n\"; }} }} }}\n"
    );
    std::fs::write(dir.join("nginx.conf"), config).unwrap();
    let mut nginx = command("nginx", true);
    nginx.args(["-p", &d.to_string(), "-c", &format!("{d}/nginx.conf")]);
    let nginx = Running::spawn(nginx);
    wait_listening(port, Duration::from_secs(10));

    // A file through sendfile, byte for byte.
    let mut curl = command("curl", true);
    curl.args([
        "-sf",
        "-o",
        &format!("{d}/got.bin"),
        &format!("http://127.0.0.1:{port}/file.bin"),
    ]);
    let (ok, _, stderr) = run(curl, Duration::from_secs(30));
    assert!(ok, "curl failed: {stderr}");
    assert!(
        std::fs::read(dir.join("got.bin")).unwrap() == body,
        "nginx sent different bytes through shared memory"
    );

    let mut wrk = command("wrk", true);
    wrk.args([
        "-t1",
        "-c16",
        "-d2s",
        &format!("http://127.0.0.1:{port}/hello"),
    ]);
    let mut wrk_run = Running::spawn(wrk);
    std::thread::sleep(Duration::from_millis(1000));
    let mapped = shm_mappings_tree(nginx.pid());
    assert!(
        wrk_run.wait(Duration::from_secs(30)).success(),
        "wrk failed"
    );
    let output: Vec<String> = wrk_run.remaining_lines(Duration::from_secs(10));
    let output = output.join("\n");
    assert!(
        mapped >= 16,
        "nginx mapped {mapped} regions for wrk's 16 connections:\n{output}"
    );
    assert!(output.contains("Requests/sec"), "{output}");
    assert!(
        !output.contains("Non-2xx") && !output.contains("Socket errors"),
        "wrk saw errors:\n{output}"
    );
    drop(nginx);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn redis_server_with_redis_benchmark_and_cli() {
    require_root();
    require("redis-server", "redis-server");
    require("redis-benchmark", "redis-tools");
    require("redis-cli", "redis-tools");
    let port = free_port().to_string();
    let mut server = command("redis-server", true);
    server.args([
        "--port",
        &port,
        "--save",
        "",
        "--appendonly",
        "no",
        "--bind",
        "127.0.0.1",
    ]);
    let server = Running::spawn(server);
    wait_listening(port.parse().unwrap(), Duration::from_secs(10));

    // A 200 KB value in and out (larger than one ring).
    let value: String = random_bytes(200_000, 3)
        .iter()
        .map(|b| (b'a' + b % 26) as char)
        .collect();
    let dir = temp_dir("redis");
    std::fs::write(dir.join("value"), &value).unwrap();
    let mut set = command("redis-cli", true);
    set.args(["-p", &port, "-x", "set", "big"])
        .stdin(std::fs::File::open(dir.join("value")).unwrap());
    let (ok, out, err) = run(set, Duration::from_secs(30));
    let _ = std::fs::remove_dir_all(dir);
    assert!(ok && out.trim() == "OK", "SET failed: {out} {err}");
    let mut get = command("redis-cli", true);
    get.args(["-p", &port, "get", "big"]);
    let (ok, out, err) = run(get, Duration::from_secs(30));
    assert!(
        ok && out.trim_end() == value,
        "GET returned something else ({} bytes): {err}",
        out.len()
    );

    let mut bench = command("redis-benchmark", true);
    bench.args([
        "-p",
        &port,
        "-n",
        "20000",
        "-c",
        "20",
        "-t",
        "set,get,lpush,lpop",
        "-q",
    ]);
    let mut bench_run = Running::spawn(bench);
    // The most connection regions the server held at once while the benchmark ran (one look at
    // a fixed moment could fall between two of its tests, or after its end: over shared memory
    // the whole run takes about a second).
    let mut mapped = 0;
    let started = std::time::Instant::now();
    while bench_run.child.try_wait().ok().flatten().is_none()
        && started.elapsed() < Duration::from_secs(90)
    {
        mapped = mapped.max(shm_mappings(server.pid()));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        bench_run.wait(Duration::from_secs(90)).success(),
        "redis-benchmark failed"
    );
    let output: String = bench_run
        .remaining_lines(Duration::from_secs(10))
        .join("\n");
    for test in ["SET", "GET", "LPUSH", "LPOP"] {
        assert!(
            output.contains(&format!("{test}: ")) && output.contains("requests per second"),
            "no {test} result:\n{output}"
        );
    }
    assert!(
        mapped >= 20,
        "redis-server mapped {mapped} regions for 20 benchmark connections"
    );
}

#[test]
fn sockperf_ping_pong() {
    require_root();
    require("sockperf", "sockperf");
    let port = free_port().to_string();
    let mut server = command("sockperf", true);
    server.args(["server", "--tcp", "-i", "127.0.0.1", "-p", &port]);
    let server = Running::spawn(server);
    std::thread::sleep(Duration::from_millis(500));
    let mut client = command("sockperf", true);
    client.args([
        "ping-pong",
        "--tcp",
        "-i",
        "127.0.0.1",
        "-p",
        &port,
        "-m",
        "16",
        "-t",
        "2",
        // sockperf sizes its reply table for (seconds + 1) x 600,000 round trips when the rate
        // is "max", and exits with "_seqN > m_maxSequenceNo" once a faster transport goes past
        // it (the library does 1-2 million a second here). An explicit rate above any real one
        // sizes the table from it and paces nothing.
        "--mps",
        "10000000",
    ]);
    let mut client_run = Running::spawn(client);
    let mapped = mappings_within(server.pid(), 1, Duration::from_secs(2));
    assert!(
        client_run.wait(Duration::from_secs(30)).success(),
        "sockperf client failed"
    );
    let output: String = client_run
        .remaining_lines(Duration::from_secs(10))
        .join("\n");
    assert!(output.contains("Summary: Latency is"), "{output}");
    assert!(!output.contains("ERROR"), "{output}");
    assert!(mapped >= 1, "sockperf server did not map a region");
}

#[test]
fn iperf3_throughput() {
    require_root();
    require("iperf3", "iperf3");
    let port = free_port().to_string();
    let mut server = command("iperf3", true);
    server.args(["-s", "-1", "-p", &port]);
    let server = Running::spawn(server);
    wait_listening_quietly();
    let mut client = command("iperf3", true);
    client.args(["-c", "127.0.0.1", "-p", &port, "-t", "2", "-J"]);
    let mut client_run = Running::spawn(client);
    let mapped = mappings_within(server.pid(), 2, Duration::from_secs(2));
    assert!(
        client_run.wait(Duration::from_secs(30)).success(),
        "iperf3 client failed"
    );
    let output: String = client_run
        .remaining_lines(Duration::from_secs(10))
        .join("\n");
    let received = output.split("\"sum_received\"").nth(1).unwrap_or("");
    let bytes: u64 = received
        .split("\"bytes\":")
        .nth(1)
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        bytes > 10_000_000,
        "iperf3 moved only {bytes} bytes:\n{output}"
    );
    assert!(
        mapped >= 2,
        "iperf3 server mapped {mapped} regions (control + data connection expected)"
    );
}

/// iperf3 -1 serves exactly one client: probing its port would use that up.
fn wait_listening_quietly() {
    std::thread::sleep(Duration::from_millis(700));
}
