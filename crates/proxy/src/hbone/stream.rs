//! One HTTP/2 CONNECT stream as a byte stream ([`AsyncRead`] + [`AsyncWrite`]), so the
//! relay that copies between two sockets (`crate::tcp::copy_until_idle`) copies between a
//! socket and a tunnelled stream alike, and an HTTP connection to an endpoint may ride on it
//! (`crate::upstream::transport`). Flow control is HTTP/2's: what is read releases
//! window to the peer, and a write waits for window the peer granted.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most a single write asks the peer's window for: one HTTP/2 frame's worth of a relay
/// buffer, so a slow stream does not hold the connection's window.
const MAX_WRITE: usize = 64 * 1024;

pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    /// Received data not yet read.
    pending: Bytes,
    /// The end of the stream was sent (our half-close).
    finished: bool,
}

impl H2Stream {
    pub fn new(send: SendStream<Bytes>, recv: RecvStream) -> H2Stream {
        H2Stream {
            send,
            recv,
            pending: Bytes::new(),
            finished: false,
        }
    }

    /// Resets the stream (the tunnelled connection failed): the peer sees RST_STREAM, not a
    /// clean end.
    pub fn reset(&mut self) {
        self.send.send_reset(h2::Reason::CANCEL);
    }
}

fn io_error(err: h2::Error) -> io::Error {
    if err.is_io() {
        return err
            .into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"));
    }
    io::Error::new(io::ErrorKind::ConnectionReset, err)
}

impl H2Stream {
    /// Waits until some received data is pending. Ready(Ok(false)): the peer ended the
    /// stream and nothing is left.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        while self.pending.is_empty() {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // The bytes are ours now: the peer may send as much again.
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    self.pending = data;
                }
                Some(Err(err)) => return Poll::Ready(Err(io_error(err))),
                None => return Poll::Ready(Ok(false)),
            }
        }
        Poll::Ready(Ok(true))
    }

    /// Moves what has arrived into `buf` (an upstream HTTP connection's read buffer);
    /// Ready(Ok(0)) at the end of the stream.
    pub fn poll_read_buf(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        if !ready!(self.poll_pending(cx))? {
            return Poll::Ready(Ok(0));
        }
        let n = self.pending.len();
        buf.extend_from_slice(&self.pending);
        self.pending.clear();
        Poll::Ready(Ok(n))
    }

    /// True if an idle stream is known to be unusable: the peer ended or reset it, its
    /// tunnel connection is gone, or it holds bytes nobody asked for. Never blocks.
    pub fn is_stale(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        !self.pending.is_empty() || self.poll_pending(&mut cx).is_ready()
    }
}

impl AsyncRead for H2Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !ready!(this.poll_pending(cx))? {
            return Poll::Ready(Ok(()));
        }
        let n = this.pending.len().min(buf.remaining());
        buf.put_slice(&this.pending[..n]);
        this.pending.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        this.send.reserve_capacity(buf.len().min(MAX_WRITE));
        let granted = loop {
            if this.send.capacity() > 0 {
                break this.send.capacity();
            }
            match ready!(this.send.poll_capacity(cx)) {
                Some(Ok(n)) if n > 0 => break n,
                Some(Ok(_)) => continue,
                Some(Err(err)) => return Poll::Ready(Err(io_error(err))),
                None => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the tunnel stream is closed",
                    )))
                }
            }
        };
        let n = granted.min(buf.len());
        this.send
            .send_data(Bytes::copy_from_slice(&buf[..n]), false)
            .map_err(io_error)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // h2's connection task writes what was queued; there is nothing to push here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.finished {
            this.finished = true;
            this.send.send_data(Bytes::new(), true).map_err(io_error)?;
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client stream and the server's two halves of it, over an in-memory HTTP/2
    /// connection.
    async fn pair() -> (
        H2Stream,
        SendStream<Bytes>,
        tokio::sync::mpsc::UnboundedReceiver<RecvStream>,
    ) {
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let (streams_tx, streams) = tokio::sync::mpsc::unbounded_channel();
        let (send_tx, send_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut conn = h2::server::handshake(server_io).await.unwrap();
            let mut send_tx = Some(send_tx);
            while let Some(Ok((request, mut respond))) = conn.accept().await {
                let send = respond
                    .send_response(http::Response::new(()), false)
                    .unwrap();
                if let Some(tx) = send_tx.take() {
                    let _ = tx.send(send);
                }
                let _ = streams_tx.send(request.into_body());
            }
        });
        let (send, conn) = h2::client::handshake(client_io).await.unwrap();
        tokio::spawn(conn);
        let mut send = send.ready().await.unwrap();
        let mut request = http::Request::new(());
        *request.method_mut() = http::Method::CONNECT;
        *request.uri_mut() = http::Uri::from_static("127.0.0.1:80");
        let (response, stream) = send.send_request(request, false).unwrap();
        let response = response.await.unwrap();
        let server_send = send_rx.await.unwrap();
        (
            H2Stream::new(stream, response.into_body()),
            server_send,
            streams,
        )
    }

    /// Lets the connection tasks move what was sent.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_stream_is_stale_once_the_peer_ends_it_or_sends_unasked_bytes() {
        // Bytes both ways, then quiet: usable.
        let (mut stream, mut server, mut streams) = pair().await;
        let mut from_client = streams.recv().await.unwrap();
        stream.write_all(b"ping").await.unwrap();
        assert_eq!(&from_client.data().await.unwrap().unwrap()[..], b"ping");
        server
            .send_data(Bytes::from_static(b"pong"), false)
            .unwrap();
        let mut back = [0u8; 4];
        stream.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"pong");
        settle().await;
        assert!(!stream.is_stale(), "a quiet open stream is usable");
        // The peer ends its side (its destination closed the connection): stale.
        server.send_data(Bytes::new(), true).unwrap();
        settle().await;
        assert!(stream.is_stale(), "a stream the peer ended");

        // Bytes nobody asked for: stale.
        let (mut chatty, mut server, _streams) = pair().await;
        server
            .send_data(Bytes::from_static(b"unasked"), false)
            .unwrap();
        settle().await;
        assert!(chatty.is_stale(), "a stream with unasked bytes");

        // Read into a buffer as the HTTP/1 pool does; 0 at the end.
        let (mut read, mut server, _streams) = pair().await;
        server.send_data(Bytes::from_static(b"abc"), true).unwrap();
        let mut buf = BytesMut::new();
        let n = std::future::poll_fn(|cx| read.poll_read_buf(cx, &mut buf))
            .await
            .unwrap();
        assert_eq!((n, &buf[..]), (3, &b"abc"[..]));
        let n = std::future::poll_fn(|cx| read.poll_read_buf(cx, &mut buf))
            .await
            .unwrap();
        assert_eq!(n, 0);
    }
}
