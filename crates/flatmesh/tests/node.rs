//! `flatmesh node` as a command: it starts on a config file and serves, SIGHUP reloads the
//! file (a refused reload is logged and the old config stays), and SIGTERM stops it cleanly.
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
