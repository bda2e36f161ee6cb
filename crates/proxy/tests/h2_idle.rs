//! An idle HTTP/2 client connection gives its buffers back: h2 holds a 16 KiB write buffer and
//! an 8 KiB read buffer per connection from its handshake on (vendor/h2/FLATMESH.md), and the
//! node's server has it release them once a connection has had no stream and no traffic for a
//! second. One test in this binary: it counts the process's live heap bytes with its own
//! allocator, which other tests running beside it would disturb.
#![allow(clippy::unwrap_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;

/// The system allocator, counting the bytes live at any moment.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

// SAFETY: every call is passed to the system allocator unchanged; the count is a side effect.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, passed on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc`, passed on.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Connections held: enough that their buffers stand far above the noise of everything else.
const CONNECTIONS: usize = 300;

/// Asks `path` on `client` and checks the answer: 200, "ok".
async fn ask(client: &h2::client::SendRequest<Bytes>, listen: std::net::SocketAddr, path: &str) {
    let mut client = client.clone().ready().await.unwrap();
    let request = http::Request::get(format!("http://{listen}{path}"))
        .body(())
        .unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut got = Vec::new();
    while let Some(data) = body.data().await {
        let data = data.unwrap();
        let _ = body.flow_control().release_capacity(data.len());
        got.extend_from_slice(&data);
    }
    assert_eq!(got, b"ok");
}

/// One h2c connection that has had one answer and stays open (its driver runs on a task).
async fn open_and_ask(
    listen: std::net::SocketAddr,
) -> (h2::client::SendRequest<Bytes>, tokio::task::JoinHandle<()>) {
    let tcp = tokio::net::TcpStream::connect(listen).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    ask(&client, listen, "/").await;
    (client, driver)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_give_their_buffers_back_and_still_serve() {
    let (admin, listen) = (free_addr(), free_addr());
    let node = TestNode::start(&format!(
        r#"
admin: {admin}
workers: 2
listeners:
  - name: web
    address: {listen}
    protocol: http
    routes:
      - direct_response: {{ status: 200, body: "ok" }}
"#
    ));
    let before = live();
    let mut held = Vec::new();
    for _ in 0..CONNECTIONS {
        held.push(open_and_ask(listen).await);
    }
    let with_buffers = live();
    let per_connection = (with_buffers - before) / CONNECTIONS as isize;
    // Both ends' buffers are in this process: the node's 24 KiB and the client's.
    assert!(
        per_connection > 40 * 1024,
        "{per_connection} bytes per connection while busy: the count does not see h2's buffers"
    );
    // Quiet for a second, then checked again a second later: given back. The node's 24 KiB
    // per connection must go (most of what it holds for a connection), the clients' stay.
    let released = eventually(Duration::from_secs(10), || async {
        with_buffers - live() >= (CONNECTIONS * 20 * 1024) as isize
    })
    .await;
    assert!(
        released,
        "{} bytes per connection given back, not 20 KiB or more",
        (with_buffers - live()) / CONNECTIONS as isize
    );
    // Every connection still works, on buffers allocated again.
    for (client, _) in &held {
        ask(client, listen, "/again").await;
    }
    node.assert_alive("after idle connections gave their buffers back")
        .await;
    for (_, driver) in held {
        driver.abort();
    }
}
