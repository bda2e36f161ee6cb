//! The L4 relay for `tcp` listeners: no parsing, bytes spliced between two sockets.
//! Half-close is carried through (a FIN on one side becomes a shutdown(WR) on the other)
//! and a reset on one side becomes a reset on the other.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::lb::hash64;
use crate::worker::ConnContext;

/// Counts the bytes read through it, so totals are known even when the relay ends in error.
struct Counted<S> {
    inner: S,
    read: u64,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.read += (buf.filled().len() - before) as u64;
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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
    let key = match ctx.peer.ip() {
        std::net::IpAddr::V4(ip) => hash64(&ip.octets()),
        std::net::IpAddr::V6(ip) => hash64(&ip.octets()),
    };

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

    let mut client = Counted {
        inner: downstream,
        read: 0,
    };
    let mut server = Counted { inner: up, read: 0 };
    let result = tokio::io::copy_bidirectional_with_sizes(
        &mut client,
        &mut server,
        RELAY_BUFFER,
        RELAY_BUFFER,
    )
    .await;
    listener.stats.bytes_in.add_shared(ctx.worker, client.read);
    listener.stats.bytes_out.add_shared(ctx.worker, server.read);
    if result.is_err() {
        // One side reset (or failed): pass the reset on rather than a clean FIN.
        reset_on_close(&client.inner);
        reset_on_close(&server.inner);
    }
}
