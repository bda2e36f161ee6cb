//! Config reload: asked for (POST /reload, what SIGHUP does for the binary, whose signal is
//! tested in `crates/flatmesh/tests/node.rs`) and on a file change, under continuous load with
//! zero failed requests, in-flight requests finishing on the old snapshot, and bad configs refused.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::backends::{HttpBackend, Proto};
use common::*;
use http::StatusCode;

/// Config generation `version`: a `/version` route answering it, a route only this generation
/// has, and a catch-all to the backend that stamps the generation on forwarded requests.
fn config(admin: SocketAddr, web: SocketAddr, app: SocketAddr, version: u32) -> String {
    format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - name: version
        match: {{ path: {{ exact: /version }} }}
        direct_response: {{ status: 200, body: "v{version}" }}
      - name: only-v{version}
        match: {{ path: {{ prefix: /only-v{version} }} }}
        direct_response: {{ status: 200, body: "only-v{version}" }}
      - name: slow-v{version}
        match: {{ path: {{ prefix: /slow-v{version} }} }}
        cluster: app
      - name: main
        match: {{ path: {{ prefix: / }} }}
        cluster: app
        request_headers_to_add: {{ x-config-version: "v{version}" }}
clusters:
  - name: app
    endpoints: [ {app} ]
"#
    )
}

async fn body_of(client: &Client, url: &str) -> Option<(StatusCode, String)> {
    send(client, get_req(url))
        .await
        .ok()
        .map(|r| (r.status, r.body))
}

/// Wait until GET /version answers `want`, bounded.
async fn wait_for_version(web: SocketAddr, want: &str, limit: Duration) -> bool {
    let client = h1_client();
    let url = format!("http://{web}/version");
    eventually(limit, || {
        let client = client.clone();
        let url = url.clone();
        let want = want.to_owned();
        async move { body_of(&client, &url).await == Some((StatusCode::OK, want)) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_drops_nothing_and_new_routes_take_effect() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let proxy = TestNode::start(&config(admin, web, app.addr, 0));

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let mut loaders = Vec::new();
    // Four HTTP/1.1 keep-alive clients and one h2c client, each in a bounded loop.
    for c in 0..5 {
        let stop = stop.clone();
        let ok = ok.clone();
        loaders.push(tokio::spawn(async move {
            let client = if c == 4 { h2c_client() } else { h1_client() };
            let mut failures = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline && i < 50_000 {
                let url = format!("http://{web}/load/{c}/{i}");
                match send(&client, get_req(&url)).await {
                    Ok(r) if r.status == StatusCode::OK && r.backend() == Some("app") => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) => failures.push(format!("{url}: {} {:?}", r.status, r.body)),
                    Err(e) => failures.push(format!("{url}: {e}")),
                }
                i += 1;
            }
            failures
        }));
    }

    let started = Instant::now();
    let mut seen_versions = Vec::new();
    for version in 1..=3u32 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        proxy.write_config(&config(admin, web, app.addr, version));
        proxy.reload().await;
        let want = format!("v{version}");
        assert!(
            wait_for_version(web, &want, Duration::from_secs(5)).await,
            "reload {version}: /version never answered {want} within 5 s"
        );
        let client = h1_client();
        let new_route = body_of(&client, &format!("http://{web}/only-v{version}")).await;
        assert_eq!(
            new_route,
            Some((StatusCode::OK, format!("only-v{version}"))),
            "new route of v{version}"
        );
        let old_route = body_of(&client, &format!("http://{web}/only-v{}", version - 1)).await;
        let old_route = old_route.expect("request for the removed route");
        // The removed route now falls through to the catch-all (the backend), not its old body.
        assert_ne!(
            old_route.1,
            format!("only-v{}", version - 1),
            "route of v{} still in force",
            version - 1
        );
        let stamped = get(&client, &format!("http://{web}/stamp"), &[]).await;
        assert_eq!(stamped.echo()["headers"]["x-config-version"], want.as_str());
        seen_versions.push(want);
        proxy.assert_alive("during reloads").await;
    }
    // Keep the load going a little after the last reload, then stop it.
    let elapsed = started.elapsed();
    if elapsed < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_secs(3) - elapsed).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for l in loaders {
        failures.extend(l.await.expect("load task"));
    }
    let ok = ok.load(Ordering::Relaxed);
    assert!(
        failures.is_empty(),
        "{} request(s) failed during reloads ({} ok); first ones:\n{}",
        failures.len(),
        ok,
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        ok >= 200,
        "only {ok} requests completed under load; the load loop barely ran"
    );
    eprintln!("{ok} requests, 0 failed, across reloads to {seen_versions:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_change_alone_triggers_reload() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let proxy = TestNode::start(&config(admin, web, app.addr, 0));
    assert!(wait_for_version(web, "v0", Duration::from_secs(2)).await);
    // Give a change watcher based on mtime a distinct timestamp.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    proxy.write_config(&config(admin, web, app.addr, 7));
    let t0 = Instant::now();
    assert!(
        wait_for_version(web, "v7", Duration::from_secs(5)).await,
        "a changed config file (no reload asked for) was not picked up within 5 s"
    );
    eprintln!("file change picked up after {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_request_finishes_on_the_old_snapshot() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let proxy = TestNode::start(&config(admin, web, app.addr, 0));

    // A slow request on a route that the next config removes.
    let slow = tokio::spawn(async move {
        let client = h1_client();
        get(
            &client,
            &format!("http://{web}/slow-v0/x"),
            &[("x-delay-ms", "1500")],
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.write_config(&config(admin, web, app.addr, 1));
    proxy.reload().await;
    assert!(
        wait_for_version(web, "v1", Duration::from_secs(5)).await,
        "reload to v1 did not happen"
    );
    let resp = tokio::time::timeout(Duration::from_secs(10), slow)
        .await
        .expect("slow request done")
        .expect("task");
    assert_eq!(
        resp.status,
        StatusCode::OK,
        "in-flight request broken by reload: {resp:?}"
    );
    assert_eq!(resp.backend(), Some("app"));
    assert_eq!(resp.echo()["path"], "/slow-v0/x");
}

/// Find `key` anywhere in a JSON tree.
fn find_key<'a>(v: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    match v {
        serde_json::Value::Object(map) => map
            .get(key)
            .or_else(|| map.values().find_map(|child| find_key(child, key))),
        serde_json::Value::Array(items) => items.iter().find_map(|child| find_key(child, key)),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_new_config_is_refused_and_the_old_stays() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let proxy = TestNode::start(&config(admin, web, app.addr, 0));

    let good_v1 = config(admin, web, app.addr, 1);
    let bad_variants = [
        // unknown key
        good_v1.replace(
            "cluster: app\n        request_headers_to_add",
            "clustr: app\n        request_headers_to_add",
        ),
        // route to a cluster that does not exist
        good_v1.replace(
            "cluster: app\n        request_headers_to_add",
            "cluster: nope\n        request_headers_to_add",
        ),
        // not YAML at all
        "listeners: [ {{{ nope".to_owned(),
    ];
    for (i, bad) in bad_variants.iter().enumerate() {
        assert_ne!(
            bad, &good_v1,
            "bad variant {i} must differ from the good config"
        );
        proxy.write_config(bad);
        let (status, answer) = proxy.reload().await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "bad variant {i} was not refused: {answer}"
        );
        assert!(answer.starts_with("reload refused: "), "{answer}");
        // /config shows the error too.
        let refused = eventually(Duration::from_secs(5), || {
            let admin = proxy.admin;
            async move {
                let Ok(resp) = send(&h1_client(), get_req(&format!("http://{admin}/config"))).await
                else {
                    return false;
                };
                let Ok(json) = serde_json::from_str::<serde_json::Value>(&resp.body) else {
                    return false;
                };
                matches!(find_key(&json, "last_reload_error"), Some(v) if !v.is_null())
            }
        })
        .await;
        proxy.assert_alive("after a bad reload").await;
        assert!(
            refused,
            "bad variant {i}: /config never showed a last_reload_error"
        );
        let json = proxy.config_json().await;
        let err = find_key(&json, "last_reload_error")
            .expect("last_reload_error")
            .to_string();
        assert!(
            err.len() > 10,
            "bad variant {i}: the reload error says nothing useful: {err}"
        );
        // The old config is still in force.
        assert!(
            wait_for_version(web, "v0", Duration::from_millis(200)).await,
            "bad variant {i} replaced v0"
        );
        let resp = get(&h1_client(), &format!("http://{web}/only-v0"), &[]).await;
        assert_eq!(resp.body, "only-v0");
        let stamped = get(&h1_client(), &format!("http://{web}/x"), &[]).await;
        assert_eq!(stamped.status, StatusCode::OK);
        assert_eq!(stamped.echo()["headers"]["x-config-version"], "v0");
        // Clear the state between variants so each one is judged on its own.
        proxy.write_config(&config(admin, web, app.addr, 0));
        proxy.reload().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // A good config afterwards is accepted.
    proxy.write_config(&good_v1);
    proxy.reload().await;
    assert!(
        wait_for_version(web, "v1", Duration::from_secs(5)).await,
        "good config after bad ones not applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_moves_traffic_to_new_endpoints() {
    let old = HttpBackend::start("old", Proto::H1).await;
    let new = HttpBackend::start("new", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let proxy = TestNode::start(&config(admin, web, old.addr, 0));
    // One keep-alive client throughout: its downstream connection outlives the reload.
    let client = h1_client();
    let resp = get(&client, &format!("http://{web}/x"), &[]).await;
    assert_eq!(resp.backend(), Some("old"));

    proxy.write_config(&config(admin, web, new.addr, 1));
    proxy.reload().await;
    assert!(
        wait_for_version(web, "v1", Duration::from_secs(5)).await,
        "reload to v1 did not happen"
    );
    for i in 0..20 {
        let resp = get(&client, &format!("http://{web}/x/{i}"), &[]).await;
        assert_eq!(resp.status, StatusCode::OK, "{resp:?}");
        assert_eq!(
            resp.backend(),
            Some("new"),
            "request {i} after the reload still went to the old endpoint"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_connections_survive_a_reload() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = common::backends::TcpBackend::start(common::backends::TcpMode::Echo).await;
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web, tcp) = (free_addr(), free_addr(), free_addr());
    // The http config plus a tcp listener (appended to the listeners) and its cluster.
    let yaml = |version: u32| {
        config(admin, web, app.addr, version).replacen(
            "clusters:\n",
            &format!(
                "  - name: db\n    address: {tcp}\n    protocol: tcp\n    cluster: db\n\
                 clusters:\n  - name: db\n    endpoints: [ {} ]\n",
                echo.addr
            ),
            1,
        )
    };
    let proxy = TestNode::start(&yaml(0));
    let mut conn = tokio::net::TcpStream::connect(tcp)
        .await
        .expect("connect tcp listener");
    let mut buf = [0u8; 5];
    conn.write_all(b"before").await.expect("write");
    let mut first = [0u8; 6];
    tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut first))
        .await
        .expect("echo in time")
        .expect("echo before reload");
    assert_eq!(&first, b"before");

    proxy.write_config(&yaml(1));
    proxy.reload().await;
    assert!(
        wait_for_version(web, "v1", Duration::from_secs(5)).await,
        "reload to v1 did not happen"
    );

    // The same connection still relays after the reload.
    conn.write_all(b"after").await.expect("write after reload");
    tokio::time::timeout(Duration::from_secs(5), conn.read_exact(&mut buf))
        .await
        .expect("echo after reload in time")
        .expect("echo after reload");
    assert_eq!(&buf, b"after");
    // And new connections work too.
    let mut fresh = tokio::net::TcpStream::connect(tcp)
        .await
        .expect("connect after reload");
    fresh.write_all(b"fresh").await.expect("write");
    tokio::time::timeout(Duration::from_secs(5), fresh.read_exact(&mut buf))
        .await
        .expect("fresh echo in time")
        .expect("fresh echo");
    assert_eq!(&buf, b"fresh");
}

/// A config whose `/version` route (answering `version`) comes last, after `filler` routes
/// and after the cluster: any prefix of it cut at a line end before `/version` is still a
/// valid config, one without that route.
fn version_last(admin: SocketAddr, web: SocketAddr, app: SocketAddr, version: &str) -> String {
    let mut yaml = format!(
        "admin: {admin}\nworkers: 1\nclusters:\n  - name: app\n    endpoints: [ {app} ]\nlisteners:\n  - name: web\n    address: {web}\n    protocol: http\n    routes:\n"
    );
    for i in 0..20 {
        yaml.push_str(&format!(
            "      - name: filler-{i}\n        match: {{ path: {{ exact: /filler-{i} }} }}\n        direct_response: {{ status: 200, body: \"{version}\" }}\n"
        ));
    }
    yaml.push_str(&format!(
        "      - name: version\n        match: {{ path: {{ exact: /version }} }}\n        direct_response: {{ status: 200, body: \"{version}\" }}\n"
    ));
    yaml
}

/// The node's count of reloads that ended `result` ("ok" or "failed").
async fn reloads(proxy: &TestNode, result: &str) -> f64 {
    let label = format!("result=\"{result}\"");
    metric_samples(&proxy.metrics().await, "flatmesh_config_reloads", &[&label])
        .iter()
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_written_in_two_steps_is_applied_only_whole() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let (admin, web) = (free_addr(), free_addr());
    let proxy = TestNode::start(&version_last(admin, web, app.addr, "v0"));
    assert!(wait_for_version(web, "v0", Duration::from_secs(2)).await);
    let ok_before = reloads(&proxy, "ok").await;

    // Watch /version throughout: it must always answer, first v0 and then v1.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let client = h1_client();
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let answer = body_of(&client, &format!("http://{web}/version")).await;
                if seen.last() != Some(&answer) {
                    seen.push(answer);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        })
    };

    // An editor's save caught halfway: the first half (cut at a line end, so it parses and
    // validates, without the /version route), a pause longer than the old watcher's poll,
    // then the rest, written in place rather than renamed.
    let whole = version_last(admin, web, app.addr, "v1");
    let cut = whole
        .find("      - name: filler-10\n")
        .expect("the config has a tenth filler route");
    assert!(
        flatmesh_config::parse(&whole[..cut], "half").is_ok(),
        "the first half must be a valid config for this test to mean anything"
    );
    std::fs::write(&proxy.config_path, &whole[..cut]).expect("write the first half");
    tokio::time::sleep(Duration::from_millis(700)).await;
    {
        use std::io::Write as _;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&proxy.config_path)
            .expect("open for the second half");
        file.write_all(&whole.as_bytes()[cut..])
            .expect("write the second half");
    }
    assert!(
        wait_for_version(web, "v1", Duration::from_secs(5)).await,
        "the whole file was not applied"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = watcher.await.expect("watcher task");
    let want = [
        Some((StatusCode::OK, "v0".to_string())),
        Some((StatusCode::OK, "v1".to_string())),
    ];
    assert_eq!(
        seen, want,
        "the half-written file was applied: /version went through {seen:?}"
    );
    assert_eq!(
        reloads(&proxy, "ok").await - ok_before,
        1.0,
        "expected exactly one reload, of the whole file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_series_of_removed_routes_clusters_and_listeners_are_dropped() {
    let app = HttpBackend::start("app", Proto::H1).await;
    let admin = free_addr();
    // Generation `i`: listener `web-i` with route `route-i` to cluster `app-i`.
    let generation = |i: usize, web: SocketAddr| {
        format!(
            "admin: {admin}\nworkers: 1\nlisteners:\n  - name: web-{i}\n    address: {web}\n    protocol: http\n    routes:\n      - name: route-{i}\n        match: {{ path: {{ prefix: / }} }}\n        cluster: app-{i}\nclusters:\n  - name: app-{i}\n    endpoints: [ {} ]\n",
            app.addr
        )
    };
    let web = free_addr();
    let proxy = TestNode::start(&generation(0, web));
    let client = h1_client();
    const RELOADS: usize = 40;
    for i in 0..=RELOADS {
        if i > 0 {
            proxy.write_config(&generation(i, web));
            let (status, body) = proxy.reload().await;
            assert_eq!(status, StatusCode::OK, "reload {i}: {body}");
        }
        let resp = get(&client, &format!("http://{web}/x"), &[]).await;
        assert_eq!(resp.status, StatusCode::OK, "generation {i}");
    }
    let text = proxy.metrics().await;
    let labelled = |word: &str| {
        text.lines()
            .filter(|l| !l.starts_with('#') && l.contains(word))
            .count()
    };
    // Only the last generation's series are left: its listener, route and cluster.
    for i in 0..RELOADS {
        for gone in [
            format!("listener=\"web-{i}\""),
            format!("route=\"route-{i}\""),
            format!("cluster=\"app-{i}\""),
        ] {
            assert!(!text.contains(&gone), "{gone} is still exported:\n{text}");
        }
    }
    assert!(
        text.contains(&format!("route=\"route-{RELOADS}\"")),
        "{text}"
    );
    // One generation's series take some 45 lines (the histogram's buckets among them); the
    // 41 generations would take some 1,800.
    assert!(
        labelled("listener=") + labelled("cluster=") < 100,
        "{} labelled series after {RELOADS} reloads:\n{text}",
        labelled("listener=") + labelled("cluster=")
    );
}
