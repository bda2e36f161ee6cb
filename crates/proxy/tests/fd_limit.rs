//! File-descriptor exhaustion: at the common limit of 1,024 descriptors, a client process
//! holding more idle connections than that must not stop the node. Connections past the
//! data plane's share are closed at accept (and counted), the admin port still answers, and
//! service resumes when they close. The idle connections come from a child process (this
//! binary again, running `idle_connections_helper`), so that they spend its descriptors,
//! not this process's, which is the node's.
//!
//! This process's hard limit is lowered to 1,024 (so the node cannot raise its way out);
//! the child is started before, with the limits the test started with. One test in this
//! binary, because the limit is the whole process's.

mod common;

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use tokio::io::AsyncReadExt as _;

/// The node's process limit: the common default soft limit, here also the hard one.
const NODE_FDS: u64 = 1024;
/// Idle connections the client process holds: more than the node's descriptors.
const HELD: usize = 1100;
const TARGET_ENV: &str = "FLATMESH_TEST_IDLE_TARGET";

/// Not a test: the client process of the test below. Once told `go` on stdin, opens [`HELD`]
/// idle connections to the address in `FLATMESH_TEST_IDLE_TARGET`, says `holding N` on
/// stdout, and holds them until its stdin closes.
#[test]
#[ignore = "a helper process, started by idle_sockets_past_the_fd_budget_are_refused_and_the_admin_port_still_answers"]
fn idle_connections_helper() {
    let Ok(target) = std::env::var(TARGET_ENV) else {
        return;
    };
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    let mut held = Vec::with_capacity(HELD);
    for _ in 0..HELD {
        held.push(
            std::net::TcpStream::connect(&target)
                .unwrap_or_else(|e| panic!("connect to {target}: {e}")),
        );
    }
    println!("holding {}", held.len());
    std::io::stdout().flush().expect("stdout");
    let _ = std::io::stdin().read_line(&mut line);
}

/// The child process holding idle connections; they close when it is dropped. Its stdout
/// stays open (read or not) until it has ended, so its last words do not hit a closed pipe.
struct IdleClients(
    std::process::Child,
    Option<BufReader<std::process::ChildStdout>>,
);

impl IdleClients {
    /// Starts the client process (with this process's fd limits as they are now), which
    /// waits to be told to connect to `target`.
    fn start(target: std::net::SocketAddr) -> IdleClients {
        let exe = std::env::current_exe().expect("this test binary's path");
        let child = Command::new(exe)
            .args([
                "idle_connections_helper",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env(TARGET_ENV, target.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the client process");
        IdleClients(child, None)
    }

    /// Has the client process open its connections; returns once it holds them all.
    fn connect(&mut self) {
        let stdin = self.0.stdin.as_mut().expect("its stdin");
        writeln!(stdin, "go").expect("tell the client process to connect");
        let stdout = self.0.stdout.take().expect("its stdout");
        let mut lines = BufReader::new(stdout);
        let holding = (&mut lines)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("holding"));
        self.1 = Some(lines);
        assert_eq!(
            holding.as_deref(),
            Some(format!("holding {HELD}").as_str()),
            "the client process did not open its connections"
        );
    }
}

impl Drop for IdleClients {
    fn drop(&mut self) {
        // Closing its stdin ends it; its connections close with it.
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_past_the_fd_budget_are_refused_and_the_admin_port_still_answers() {
    let (admin, web) = (free_addr(), free_addr());
    // Started while this process's limits are still as they were: its own connections
    // must not run into the node's limit.
    let mut clients = IdleClients::start(web);
    let found = getrlimit(Resource::Nofile);
    assert!(
        found.maximum.is_none_or(|hard| hard >= NODE_FDS),
        "the hard fd limit is below {NODE_FDS}"
    );
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(NODE_FDS),
            maximum: Some(NODE_FDS),
        },
    )
    .expect("lower this process's fd limit to 1024");

    let node = TestNode::start(&format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {web}
    protocol: http
    routes:
      - direct_response: {{ status: 200, body: "ok" }}
"#
    ));
    let (_, ready) = node.admin_get("/ready").await;
    assert!(ready.contains("fd limit: 1024, hard 1024"), "{ready}");

    clients.connect();
    // The admin port answers, and says how many were refused and why.
    node.assert_alive("with more idle client connections than descriptors")
        .await;
    // The workers may still be accepting the last of them: wait (bounded) for the count.
    let refused_now = || async {
        let metrics = node.metrics().await;
        let refused = metric_samples(
            &metrics,
            "flatmesh_downstream_connections_refused_total",
            &["listener=\"web\"", "reason=\"fd_budget\""],
        )
        .first()
        .map_or(0.0, |(_, v)| *v);
        (refused, metrics)
    };
    eventually(Duration::from_secs(10), || async {
        refused_now().await.0 >= (HELD as f64) - (NODE_FDS as f64)
    })
    .await;
    let (refused, metrics) = refused_now().await;
    assert!(
        refused >= (HELD as f64) - (NODE_FDS as f64),
        "only {refused} connections were refused for the fd budget:\n{metrics}"
    );
    // A new client is refused cleanly, at once.
    let mut late = tokio::net::TcpStream::connect(web)
        .await
        .expect("the kernel still completes the handshake");
    let read = tokio::time::timeout(Duration::from_secs(2), late.read(&mut [0u8; 16])).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "a connection past the fd budget was kept: {read:?}"
    );

    // Service resumes once the idle connections close.
    drop(clients);
    let url = format!("http://{web}/");
    let served = eventually(Duration::from_secs(10), || {
        let url = url.clone();
        async move { matches!(send(&h1_client(), get_req(&url)).await, Ok(r) if r.status == 200) }
    })
    .await;
    assert!(
        served,
        "the node did not serve again after the idle clients left"
    );
}
