//! The L4 relay for `tcp` listeners: no parsing, bytes spliced between two sockets.
//! Half-close is carried through (a FIN on one side becomes a shutdown(WR) on the other)
//! and a reset on one side becomes a reset on the other.

use std::sync::Arc;

use tokio::net::TcpStream;

use crate::lb::hash_client;
use crate::tap::{Tap, Tapped};
use crate::worker::ConnContext;

/// Counts the bytes read through a socket, so totals are known even when the relay ends in error.
#[derive(Default)]
struct ByteCount(u64);

impl Tap for ByteCount {
    fn on_read(&mut self, bytes: &[u8]) {
        self.0 += bytes.len() as u64;
    }
}

/// Make dropping the socket send a RST instead of a FIN.
fn reset_on_close(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(std::time::Duration::ZERO));
}

const RELAY_BUFFER: usize = 64 * 1024;

pub async fn relay(ctx: Arc<ConnContext>, downstream: TcpStream) {
    let view = ctx.view.load_full();
    let snap = &view.snapshot;
    let Some(lid) = snap.listener_at(ctx.listener_address, ctx.protocol) else {
        reset_on_close(&downstream);
        return;
    };
    let listener = &snap.listeners[lid];
    let Some(cid) = snap.program.tcp_cluster(lid) else {
        tracing::warn!(listener = %listener.name, "tcp listener has no cluster; closing the connection");
        return;
    };
    let plan = &snap.clusters[cid];
    let upstream = &view.upstreams.by_cluster[cid];
    let key = hash_client(ctx.peer.ip());

    // Try each endpoint at most once (up to 3), so one dead endpoint does not fail the client.
    let tries = plan.endpoints.len().clamp(1, 3);
    let mut connected = None;
    for attempt in 0..tries {
        let Some((index, in_flight)) = upstream.balancer.pick(key, attempt) else {
            break;
        };
        let endpoint = plan.endpoints[index];
        match tokio::time::timeout(plan.connect_timeout, TcpStream::connect(endpoint)).await {
            Ok(Ok(stream)) => {
                plan.stats.connections.add_shared(ctx.worker, 1);
                connected = Some((stream, in_flight));
                break;
            }
            Ok(Err(err)) => {
                plan.stats.connect_failures.add_shared(ctx.worker, 1);
                tracing::warn!(listener = %listener.name, cluster = %plan.name, %endpoint, error = %err,
                    "tcp upstream connect failed; check that the endpoint is listening");
            }
            Err(_) => {
                plan.stats.connect_failures.add_shared(ctx.worker, 1);
                tracing::warn!(listener = %listener.name, cluster = %plan.name, %endpoint,
                    "tcp upstream connect timed out; check the endpoint or raise connect_timeout");
            }
        }
    }
    let Some((up, _in_flight)) = connected else {
        reset_on_close(&downstream);
        return;
    };
    let _ = up.set_nodelay(true);
    let _ = downstream.set_nodelay(true);

    let mut client = Tapped {
        inner: downstream,
        tap: ByteCount::default(),
    };
    let mut server = Tapped {
        inner: up,
        tap: ByteCount::default(),
    };
    let result = tokio::io::copy_bidirectional_with_sizes(
        &mut client,
        &mut server,
        RELAY_BUFFER,
        RELAY_BUFFER,
    )
    .await;
    listener.stats.bytes_in.add_shared(ctx.worker, client.tap.0);
    listener
        .stats
        .bytes_out
        .add_shared(ctx.worker, server.tap.0);
    if result.is_err() {
        // One side reset (or failed): pass the reset on rather than a clean FIN.
        reset_on_close(&client.inner);
        reset_on_close(&server.inner);
    }
}
