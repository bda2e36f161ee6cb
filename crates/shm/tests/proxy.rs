//! The node proxy's hop to local services over shared memory: `flatmesh shm run -- flatmesh
//! node ...` between a preloaded client and a preloaded local service. Both hops (client to
//! proxy, proxy to service) move to shared memory; the proxy is an unmodified tokio program
//! (epoll through a dup'ed epoll fd, nonblocking connect, writev).
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn flatmesh() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("flatmesh");
    assert!(
        path.exists(),
        "{} not found: build it with `cargo build --release -p flatmesh`",
        path.display()
    );
    path
}

/// `GET path` on 127.0.0.1:port without the library; the status line and body.
fn http_get(port: u16, path: &str) -> Option<(String, String)> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_string(), body.to_string()))
}

/// Starts `flatmesh node` under `flatmesh shm run` and waits for its /ready.
fn start_node(config: &str, admin: u16, stats: &std::path::Path, name: &str) -> Running {
    let dir =
        std::env::temp_dir().join(format!("flatmesh-shm-proxy-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("node.yaml");
    std::fs::write(&path, config).unwrap();
    let mut node = command(flatmesh(), false);
    node.args(["shm", "run", "--"])
        .arg(flatmesh())
        .args(["node", "--config"])
        .arg(&path)
        .env("FLATMESH_SHM_LIB", library())
        .env("FLATMESH_SHM_STATS", stats);
    let node = Running::spawn(node);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((status, _)) = http_get(admin, "/ready") {
            if status.contains(" 200") {
                return node;
            }
        }
        assert!(
            Instant::now() < deadline,
            "flatmesh node not ready on admin port {admin}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGTERM, then the node's exit report.
fn stop_node(
    mut node: Running,
    stats: &std::path::Path,
) -> std::collections::BTreeMap<String, u64> {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(node.pid() as i32, libc::SIGTERM) };
    assert!(
        node.wait(Duration::from_secs(30)).success(),
        "node did not stop cleanly"
    );
    let reports = read_stats(stats);
    let _ = std::fs::remove_file(stats);
    assert_eq!(
        reports.len(),
        1,
        "expected the node's exit report: {reports:?}"
    );
    reports.into_iter().next().unwrap()
}

#[test]
fn node_proxy_tcp_hop_to_a_local_service_over_shared_memory() {
    require_root();
    let mut backend = command(probe(), true);
    backend.args(["serve", "thread", "1"]);
    let mut backend = Running::spawn(backend);
    let backend_port = backend.expect_line("ready ", Duration::from_secs(10))[6..]
        .trim()
        .to_string();
    let (admin, listen) = (free_port(), free_port());
    let config = format!(
        "admin: 127.0.0.1:{admin}\nworkers: 1\nlisteners:\n  - name: echo\n    address: 127.0.0.1:{listen}\n    protocol: tcp\n    cluster: echo\nclusters:\n  - name: echo\n    endpoints: [ 127.0.0.1:{backend_port} ]\n"
    );
    let stats = stats_path("proxy-tcp");
    let node = start_node(&config, admin, &stats, "tcp");

    // 8 MiB full duplex with half-close, through client -> proxy -> service and back.
    let mut client = command(probe(), true);
    client.args(["client", &listen.to_string(), "integrity"]);
    let (ok, stdout, stderr) = run(client, Duration::from_secs(90));
    assert!(ok, "client through the proxy failed:\n{stdout}\n{stderr}");
    let served = backend.expect_line("served ", Duration::from_secs(30));
    assert_eq!(
        served, "served 1 attached 1 ticks 0",
        "proxy-to-service hop not accelerated"
    );
    assert!(backend.wait(Duration::from_secs(30)).success());

    // Both hops: the client's connection (accepted) and the upstream one (connected).
    let report = stop_node(node, &stats);
    assert!(
        report["accelerated"] >= 2,
        "the proxy accelerated {} connections, expected both hops: {report:?}",
        report["accelerated"]
    );
}

#[test]
fn node_proxy_http_hop_to_nginx_over_shared_memory() {
    require_root();
    require("nginx", "nginx");
    require("curl", "curl");
    let dir = std::env::temp_dir().join(format!("flatmesh-shm-proxy-nginx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let body: String = (0..200_000)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    std::fs::write(dir.join("big.txt"), &body).unwrap();
    let nginx_port = free_port();
    let d = dir.display();
    std::fs::write(
        dir.join("nginx.conf"),
        format!(
            "user root;\nworker_processes 1;\ndaemon off;\nmaster_process off;\nerror_log {d}/error.log warn;\npid {d}/nginx.pid;\n\
             events {{ worker_connections 256; }}\n\
             http {{ access_log off; client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n\
               server {{ listen 127.0.0.1:{nginx_port}; root {d}; location = /hello {{ return 200 \"hello from nginx\\n\"; }} }} }}\n"
        ),
    )
    .unwrap();
    let mut nginx = command("nginx", true);
    nginx.args(["-p", &d.to_string(), "-c", &format!("{d}/nginx.conf")]);
    let nginx = Running::spawn(nginx);
    wait_listening(nginx_port, Duration::from_secs(10));

    let (admin, listen) = (free_port(), free_port());
    let config = format!(
        "admin: 127.0.0.1:{admin}\nworkers: 1\nlisteners:\n  - name: web\n    address: 127.0.0.1:{listen}\n    protocol: http\n    routes:\n      - match: {{ path: {{ prefix: / }} }}\n        cluster: web\nclusters:\n  - name: web\n    endpoints: [ 127.0.0.1:{nginx_port} ]\n"
    );
    let stats = stats_path("proxy-http");
    let node = start_node(&config, admin, &stats, "http");

    for (path, expected) in [
        ("/hello", "hello from nginx\n".to_string()),
        ("/big.txt", body),
    ] {
        let mut curl = command("curl", true);
        curl.args(["-sf", &format!("http://127.0.0.1:{listen}{path}")]);
        let (ok, out, err) = run(curl, Duration::from_secs(30));
        assert!(ok, "curl {path} through the proxy failed: {err}");
        assert!(out == expected, "{path}: wrong body ({} bytes)", out.len());
    }
    let mapped = shm_mappings(nginx.pid());
    assert!(
        mapped >= 1,
        "nginx holds no shared-memory connection from the proxy"
    );
    let report = stop_node(node, &stats);
    assert!(
        report["accelerated"] >= 3,
        "expected both curl connections and the upstream connection on shared memory: {report:?}"
    );
    drop(nginx);
    let _ = std::fs::remove_dir_all(dir);
}
