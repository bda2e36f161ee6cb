//! Any bytes after the HTTP/2 preface, as one client connection to an `http` listener of the
//! node, served in process (the protocol sniff, then the node's HTTP/2 server and the L7 layer
//! behind it: routes, header edits, local replies). Nothing may panic, and every connection must
//! end: the runtime's clock is paused, so the server's timeouts fire as soon as it waits, and a
//! connection still open after 5 minutes of that clock is a hang.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use flatmesh_proxy::fuzz::Listener;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Routes that answer without a working upstream: a direct response, a cluster whose one
/// endpoint refuses connections (127.0.0.1:1, where nothing listens: 503), header edits, and a
/// gRPC-looking path.
const CONFIG: &str = r#"
limits:
  header_read_timeout: 2s
  idle_timeout: 5s
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: { path: { exact: /ok } }
        direct_response: { status: 200, body: "ok" }
      - match: { path: { prefix: /grpc.Service/ } }
        cluster: empty
      - match: { path: { prefix: / } }
        cluster: empty
        request_headers_to_add: { x-via: flatmesh }
        request_headers_to_remove: [ cookie ]
clusters:
  - name: empty
    endpoints: [ 127.0.0.1:1 ]
"#;

fn listener() -> &'static Listener {
    static LISTENER: OnceLock<Listener> = OnceLock::new();
    LISTENER.get_or_init(|| Listener::new(CONFIG))
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let mut io = listener().connect();
        // The server may close before it has read everything; that is an answer, not a failure.
        let _ = io.write_all(PREFACE).await;
        let _ = io.write_all(data).await;
        let _ = io.shutdown().await;
        let mut buf = vec![0u8; 64 * 1024];
        let ended = tokio::time::timeout(Duration::from_secs(300), async {
            while let Ok(n) = io.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "the connection was still open after 5 minutes");
    });
});
