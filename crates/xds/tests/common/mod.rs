//! Shared pieces of the xDS integration tests: the real node proxy behind the client, tiny HTTP
//! backends that answer with their own name, a raw HTTP/1.1 client, free ports, and a bounded
//! wait.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub mod envoy;
pub mod pki;

/// The client's [`flatmesh_xds::client::Apply`] for a real node proxy, as `flatmesh node --xds`
/// wires it: the first config starts the node, every later one reloads it.
pub fn node_apply() -> (
    flatmesh_xds::apply::StartThenReload<flatmesh_proxy::Node>,
    flatmesh_xds::apply::SharedNode<flatmesh_proxy::Node>,
) {
    flatmesh_xds::apply::StartThenReload::new(
        |config| {
            flatmesh_proxy::Node::start(config, flatmesh_proxy::ConfigSource::Inline)
                .map_err(|e| e.to_string())
        },
        |node, config| node.reload(config).map_err(|e| e.to_string()),
    )
}

/// An HTTP/1.1 backend on a loopback port that answers every request with `name` (keep-alive).
pub struct Backend {
    pub addr: SocketAddr,
}

impl Backend {
    pub fn start(name: &str) -> Backend {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let name = name.to_string();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let name = name.clone();
                std::thread::spawn(move || {
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        while let Some(end) = find(&buf, b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            let reply = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{}",
                                name.len(),
                                name
                            );
                            if conn.write_all(reply.as_bytes()).is_err() {
                                return;
                            }
                        }
                        match conn.read(&mut chunk) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        Backend { addr }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// GET `path` from `addr` with `host`; returns (status, body), or None if the connection failed.
pub fn get(addr: SocketAddr, host: &str, path: &str) -> Option<(u16, String)> {
    request(addr, "GET", host, path)
}

/// `method` `path` (without a body) from `addr` with `host`, as [`get`].
pub fn request(addr: SocketAddr, method: &str, host: &str, path: &str) -> Option<(u16, String)> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let length = if method == "GET" {
        ""
    } else {
        "content-length: 0\r\n"
    };
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nhost: {host}\r\n{length}connection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

// Never the same port twice in one test process (two tests of one binary asking at once could
// otherwise be handed the same one): the proxy tests' helper.
#[path = "../../../proxy/tests/common/ports.rs"]
mod ports;
#[allow(unused_imports)] // not every test binary asks for a port
pub use ports::free_port;

/// Poll `check` every 50 ms for up to 20 s; panics with `what` if it never holds.
pub fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out after 20 s waiting for: {what}");
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Build the go-control-plane test server (tests/interop) once per test binary.
pub fn go_test_server() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("xds-test-server");
            let source = repo_root().join("tests/interop");
            // -mod=readonly on the command line beats any GOFLAGS=-mod=mod: go.sum is never
            // rewritten behind the test's back, and a missing entry is an error.
            let status = std::process::Command::new("go")
                .args(["build", "-mod=readonly", "-o"])
                .arg(&out)
                .arg(".")
                .current_dir(&source)
                .status()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot run `go` ({e}): the interop tests need the Go toolchain to build the \
                         go-control-plane test server in tests/interop; install Go 1.26+ (tests/interop/go.mod)"
                    )
                });
            assert!(
                status.success(),
                "`go build -mod=readonly` of {} failed (see the output above); it needs the Go module \
                 proxy the first time, or a filled module cache; if go.sum is incomplete, run \
                 `go mod tidy` in tests/interop and commit go.mod and go.sum",
                source.display()
            );
            out
        })
        .clone()
}

/// flatmesh's own xDS server on its own runtime, so that stopping it ends everything it runs.
pub struct XdsServer {
    pub addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<flatmesh_xds::Result<()>>>,
}

impl XdsServer {
    /// Serve `store` on `addr` (port 0 picks one).
    pub fn start(store: &flatmesh_xds::server::Store, addr: SocketAddr) -> XdsServer {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(flatmesh_xds::server::serve(
            addr,
            store.clone(),
            Some(bound_tx),
            async {
                let _ = stop_rx.await;
            },
        ));
        let addr = rt.block_on(bound_rx).unwrap();
        XdsServer {
            addr,
            rt: Some(rt),
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    /// Shut down: every stream is ended, the port closes.
    pub fn stop(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let (Some(rt), Some(task)) = (self.rt.take(), self.task.take()) {
            let _ = rt.block_on(task);
            rt.shutdown_background();
        }
    }
}

impl Drop for XdsServer {
    fn drop(&mut self) {
        self.shut();
    }
}
