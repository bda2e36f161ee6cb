//! `flatmesh node` as a command: it starts on a config file and serves, SIGHUP reloads the
//! file (a refused reload is logged and the old config stays), and SIGTERM or `flatmesh drain`
//! stops it cleanly.
//! `flatmesh check --explain --admin` shows a running node's rule program as it runs it.
//! What the node does with traffic is tested in process, in `crates/proxy/tests`.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;

fn config(admin: SocketAddr, web: SocketAddr, body: &str) -> String {
    format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - match: {{ path: {{ prefix: / }} }}
        direct_response: {{ status: 200, body: "{body}" }}
"#
    )
}

/// The node's count of reloads that ended `result` ("ok" or "failed").
async fn reloads(proxy: &Proxy, result: &str) -> f64 {
    let label = format!("result=\"{result}\"");
    metric_samples(&proxy.metrics().await, "flatmesh_config_reloads", &[&label])
        .iter()
        .map(|(_, v)| v)
        .sum()
}

async fn body_at(web: SocketAddr) -> String {
    get(&h1_client(), &format!("http://{web}/"), &[]).await.body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_serves_reloads_on_sighup_and_stops_on_sigterm() {
    let (admin, web) = (free_addr(), free_addr());
    let mut proxy = Proxy::start(admin, &config(admin, web, "one")).await;
    assert_eq!(body_at(web).await, "one");

    // SIGHUP re-reads the file even when it has not changed (no file watcher involved).
    let before = reloads(&proxy, "ok").await;
    proxy.sighup();
    let reloaded = eventually(Duration::from_secs(5), || async {
        reloads(&proxy, "ok").await > before
    })
    .await;
    assert!(reloaded, "SIGHUP did not reload:\n{}", proxy.output());

    // A new config takes effect.
    proxy.write_config(&config(admin, web, "two"));
    proxy.sighup();
    let applied = eventually(Duration::from_secs(5), || async {
        body_at(web).await == "two"
    })
    .await;
    assert!(
        applied,
        "the new config was not applied:\n{}",
        proxy.output()
    );

    // A bad one is refused, logged, and the old config stays.
    proxy.write_config("listeners: [ this is not a config");
    proxy.sighup();
    let logged = eventually(Duration::from_secs(5), || async {
        proxy.output().contains("config reload refused")
    })
    .await;
    assert!(
        logged,
        "a refused reload was not logged:\n{}",
        proxy.output()
    );
    assert_eq!(body_at(web).await, "two");
    proxy.assert_alive("after a refused reload");

    // SIGTERM: the node drains and exits 0.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &proxy.pid().to_string()])
        .status()
        .expect("run kill -TERM");
    assert!(status.success());
    let exited = eventually(Duration::from_secs(10), || {
        let done = proxy.exit_status().is_some();
        async move { done }
    })
    .await;
    assert!(
        exited,
        "the node did not stop on SIGTERM:\n{}",
        proxy.output()
    );
    let code = proxy.exit_status().and_then(|s| s.code());
    assert_eq!(
        code,
        Some(0),
        "exit status after SIGTERM:\n{}",
        proxy.output()
    );
    let after = send(&h1_client(), get_req(&format!("http://{admin}/ready"))).await;
    assert!(
        after.is_err(),
        "the admin endpoint still answers after exit: {after:?}"
    );
}

/// A Kubernetes preStop hook: `flatmesh drain --admin ADDR` drains the node and returns once
/// the node has exited (0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flatmesh_drain_stops_the_node_and_waits_for_it() {
    let (admin, web) = (free_addr(), free_addr());
    let mut proxy = Proxy::start(admin, &config(admin, web, "one")).await;
    assert_eq!(body_at(web).await, "one");
    let out = run_flatmesh(
        &["drain", "--admin", &admin.to_string(), "--wait", "20s"],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        out.code,
        Some(0),
        "{}\n{}",
        out.all_output(),
        proxy.output()
    );
    assert!(out.stdout.starts_with("draining: "), "{}", out.stdout);
    assert!(
        out.stdout.contains("drained: the node has stopped"),
        "{}",
        out.stdout
    );
    let exited = eventually(Duration::from_secs(5), || {
        let done = proxy.exit_status().is_some();
        async move { done }
    })
    .await;
    assert!(exited, "the node did not exit:\n{}", proxy.output());
    assert_eq!(
        proxy.exit_status().and_then(|s| s.code()),
        Some(0),
        "{}",
        proxy.output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_admin_shows_where_a_running_node_runs_each_rule() {
    let (admin, web) = (free_addr(), free_addr());
    let proxy = Proxy::start(admin, &config(admin, web, "one")).await;
    let out = run_flatmesh(
        &["check", "--explain", "--admin", &admin.to_string()],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all_output());
    assert!(
        out.stdout
            .contains("this node: tier K not attached: the config has no `kernel:` section"),
        "{}\n{}",
        out.stdout,
        proxy.output()
    );
    assert!(out.stdout.contains("web"), "{}", out.stdout);
    let nobody = free_addr().to_string();
    let out = run_flatmesh(&["check", "--admin", &nobody], Duration::from_secs(30)).await;
    assert_eq!(out.code, Some(1), "{}", out.all_output());
    assert!(
        out.stderr.contains("is it running with `admin:"),
        "{}",
        out.stderr
    );
}

/// A reader of the node's stderr that stalls (a pipe nobody reads) while a flood of
/// warnings comes in (one per failed upstream connect, to 200 different dead endpoints):
/// the worker that logs them is the one that serves HTTP, and it must keep serving. Logs go
/// through a bounded queue drained by a writer thread, so the stall costs log lines, never
/// the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stderr_never_stalls_the_worker() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (admin, web, relay) = (free_addr(), free_addr(), free_addr());
    let dead: Vec<String> = (0..200).map(|_| free_addr().to_string()).collect();
    let yaml = format!(
        "{}  - name: relay\n    address: {relay}\n    protocol: tcp\n    cluster: dead\nclusters:\n  - name: dead\n    endpoints: [ {} ]\n",
        config(admin, web, "alive"),
        dead.join(", ")
    );
    let dir = TempDir::new();
    let path = dir.write("node.yaml", &yaml);
    let mut child = tokio::process::Command::new(flatmesh_bin())
        .arg("node")
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn flatmesh node");
    // Held open and not read: once 64 KiB are in it, every write to it blocks.
    let mut stderr = child.stderr.take().expect("stderr pipe");
    let ready = eventually(READY_TIMEOUT, || async {
        send(&h1_client(), get_req(&format!("http://{admin}/ready")))
            .await
            .is_ok_and(|r| r.status == http::StatusCode::OK)
    })
    .await;
    assert!(ready, "the node did not become ready");

    // The flood: each connection to `relay` makes the worker try three dead endpoints and
    // warn about each.
    let flood = tokio::spawn(async move {
        for _ in 0..30 {
            let batch: Vec<_> = (0..50)
                .map(|_| {
                    tokio::spawn(async move {
                        if let Ok(mut c) = tokio::net::TcpStream::connect(relay).await {
                            let _ = c.write_all(b"x").await;
                            let mut sink = Vec::new();
                            let _ = tokio::time::timeout(
                                Duration::from_secs(5),
                                c.read_to_end(&mut sink),
                            )
                            .await;
                        }
                    })
                })
                .collect();
            for t in batch {
                let _ = t.await;
            }
        }
    });
    // Meanwhile and after, the same (only) worker answers HTTP at once.
    let client = h1_client();
    let mut answered = 0;
    while !flood.is_finished() || answered < 20 {
        let started = std::time::Instant::now();
        let resp = tokio::time::timeout(
            Duration::from_secs(3),
            send(&client, get_req(&format!("http://{web}/"))),
        )
        .await;
        match resp {
            Ok(Ok(r)) if r.body == "alive" => answered += 1,
            other => panic!(
                "the worker stopped serving while its log reader stalled (after {answered} answers, {:?}): {other:?}",
                started.elapsed()
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    flood.await.expect("flood task");
    let metrics = send(&h1_client(), get_req(&format!("http://{admin}/metrics")))
        .await
        .expect("/metrics while stderr is stalled")
        .body;
    let failures: f64 = metric_samples(&metrics, "flatmesh_upstream_connect_failures", &[])
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert!(failures >= 3000.0, "the flood did not happen:\n{metrics}");
    let repeated: f64 = metric_samples(
        &metrics,
        "flatmesh_log_lines_dropped",
        &["log=\"process\"", "reason=\"repeated\""],
    )
    .iter()
    .map(|(_, v)| v)
    .sum();
    assert!(
        repeated > 0.0,
        "repeated warnings were not rate-limited:\n{metrics}"
    );
    // The log really did outgrow the pipe: more than its 64 KiB were waiting to be read.
    let mut logged = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let mut buf = [0u8; 65536];
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            logged.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(
        logged.len() > 65536,
        "only {} bytes of log: the pipe never filled, so nothing was tested",
        logged.len()
    );
    let _ = child.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_admin_sends_the_token_and_reaches_a_unix_socket() {
    let web = free_addr();
    let dir = TempDir::new();
    let token = dir.write("admin-token", "0123456789abcdef0123456789abcdef\n");
    let socket = dir.path.join("admin.sock");
    let yaml = config(free_addr(), web, "one").replacen(
        "admin: ",
        &format!(
            "admin: {{ address: \"unix:{}\", token_file: {} }}\n# was: ",
            socket.display(),
            token.display()
        ),
        1,
    );
    let path = dir.write("node.yaml", &yaml);
    let mut child = tokio::process::Command::new(flatmesh_bin())
        .arg("node")
        .arg("--config")
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn flatmesh node");
    let admin = format!("unix:{}", socket.display());
    let up = eventually(READY_TIMEOUT, || async {
        send(&h1_client(), get_req(&format!("http://{web}/")))
            .await
            .is_ok_and(|r| r.body == "one")
    })
    .await;
    assert!(up, "the node did not start");
    let out = run_flatmesh(
        &["check", "--explain", "--admin", &admin],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.all_output());
    assert!(
        out.stderr.contains("needs the admin token"),
        "{}",
        out.stderr
    );
    let token_arg = token.display().to_string();
    let out = run_flatmesh(
        &[
            "check",
            "--explain",
            "--admin",
            &admin,
            "--admin-token-file",
            &token_arg,
        ],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all_output());
    assert!(out.stdout.contains("web"), "{}", out.stdout);
    let _ = child.kill().await;
}

/// `flatmesh top` shows each route with traffic in the window: its rate, its success rate
/// (a route that answers 503 is at 0%) and the tier it runs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flatmesh_top_shows_each_route_with_its_traffic() {
    let (admin, web) = (free_addr(), free_addr());
    let config = format!(
        r#"
admin: {admin}
workers: 1
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - name: good
        match: {{ path: {{ prefix: /good }} }}
        direct_response: {{ status: 200, body: "ok" }}
      - name: broken
        match: {{ path: {{ prefix: /broken }} }}
        direct_response: {{ status: 503, body: "no" }}
"#
    );
    let proxy = Proxy::start(admin, &config).await;
    // Traffic for the whole run of `top`, bounded in count and time.
    let load = tokio::spawn(async move {
        let client = h1_client();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for i in 0..1_000_000u32 {
            if tokio::time::Instant::now() > deadline {
                break;
            }
            let path = if i % 2 == 0 { "good" } else { "broken" };
            let _ = send(&client, get_req(&format!("http://{web}/{path}"))).await;
        }
    });
    let out = run_flatmesh(
        &[
            "top",
            "--admin",
            &admin.to_string(),
            "--interval",
            "500ms",
            "--samples",
            "2",
            "--sort",
            "route",
        ],
        Duration::from_secs(30),
    )
    .await;
    load.abort();
    assert_eq!(
        out.code,
        Some(0),
        "{}\n{}",
        out.all_output(),
        proxy.output()
    );
    // The table of the first window (the load runs through both).
    let last = out
        .stdout
        .split("flatmesh top:")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let line = |route: &str| {
        last.lines()
            .find(|l| l.contains(&format!(" {route} ")))
            .unwrap_or_else(|| panic!("no row for {route}:\n{}", out.stdout))
            .to_string()
    };
    assert!(line("good").contains("100.00%"), "{last}");
    assert!(line("broken").contains("0.00%"), "{last}");
    assert!(line("good").contains("U7"), "{last}");
    assert!(last.contains("2 routes with traffic"), "{last}");

    // A node that is not there: an error that names the address, not a panic.
    let nobody = free_addr().to_string();
    let out = run_flatmesh(
        &["top", "--admin", &nobody, "--samples", "1"],
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.all_output());
    assert!(out.stderr.contains(&nobody), "{}", out.stderr);
}
