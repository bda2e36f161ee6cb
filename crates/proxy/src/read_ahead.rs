//! A read buffer between a TLS connection's socket and rustls.
//!
//! rustls asks its transport for at most 4 KiB per read (`READ_SIZE` in rustls'
//! `msgs/deframer/buffers.rs`), so each full 16 KiB record costs four `recv` calls, and a
//! bulk transfer through a TLS hop spends more CPU in system calls than in AES. [`ReadAhead`]
//! reads up to [`READ_AHEAD`] bytes per call and hands rustls slices of them: one `recv`
//! per two records instead of eight.
//!
//! The buffer exists only while bytes wait in it or the peer keeps it full: it is dropped as
//! soon as it drains after a read that did not fill it (the socket had nothing more), so an
//! idle TLS connection holds none of it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes read from the socket at once: two full TLS records and their headers.
pub const READ_AHEAD: usize = 32 * 1024;

/// `inner` with reads going through a buffer of [`READ_AHEAD`] bytes; writes pass straight
/// through.
pub struct ReadAhead<S> {
    inner: S,
    /// Bytes read from `inner`; `buf[start..end]` are not handed out yet.
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The last read filled the whole buffer: the peer is sending in bulk, keep it.
    last_fill_full: bool,
    /// The socket's error, returned again on every later read: a reader that gets it after
    /// handing out data it read before (`crate::tls::Stream` does) still sees a reset.
    failed: Option<(io::ErrorKind, String)>,
}

impl<S> ReadAhead<S> {
    pub fn new(inner: S) -> ReadAhead<S> {
        ReadAhead {
            inner,
            buf: Box::default(),
            start: 0,
            end: 0,
            last_fill_full: false,
            failed: None,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Copies what is buffered into `out`, and lets the buffer go once it is drained (unless
    /// the peer is sending in bulk).
    fn hand_out(&mut self, out: &mut ReadBuf<'_>) {
        let n = out.remaining().min(self.end - self.start);
        out.put_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if !self.last_fill_full {
                self.buf = Box::default();
            }
        }
    }
}

impl<S> ReadAhead<S> {
    fn remember(&mut self, read: io::Result<()>) -> io::Result<()> {
        if let Err(e) = &read {
            self.failed = Some((e.kind(), e.to_string()));
            self.buf = Box::default();
        }
        read
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadAhead<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.start < this.end {
            this.hand_out(out);
            return Poll::Ready(Ok(()));
        }
        if let Some((kind, message)) = &this.failed {
            return Poll::Ready(Err(io::Error::new(*kind, message.clone())));
        }
        // A reader that asks for as much as the buffer holds gains nothing from it.
        if out.remaining() >= READ_AHEAD {
            let read = std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, out));
            return Poll::Ready(this.remember(read));
        }
        if this.buf.is_empty() {
            this.buf = vec![0u8; READ_AHEAD].into_boxed_slice();
        }
        let mut fill = ReadBuf::new(&mut this.buf);
        let read = std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut fill));
        let n = fill.filled().len();
        this.remember(read)?;
        this.start = 0;
        this.end = n;
        this.last_fill_full = n == READ_AHEAD;
        if n == 0 {
            // End of stream: nothing to hand out, and the buffer is not needed any more.
            this.buf = Box::default();
            return Poll::Ready(Ok(()));
        }
        this.hand_out(out);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ReadAhead<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Counts the reads that reach the transport.
    struct Counted<S> {
        inner: S,
        reads: usize,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            this.reads += 1;
            Pin::new(&mut this.inner).poll_read(cx, out)
        }
    }

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read_and_bytes_stay_in_order() {
        let (mut tx, rx) = tokio::io::duplex(256 * 1024);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        tx.write_all(&data).await.unwrap();
        drop(tx);
        let mut reader = ReadAhead::new(Counted {
            inner: rx,
            reads: 0,
        });
        let mut back = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = reader.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            back.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(back, data);
        // 100,000 bytes in 4 KiB reads would be 25 transport reads; through the buffer it is
        // four fills and the end of stream.
        assert_eq!(reader.inner.reads, 100_000usize.div_ceil(READ_AHEAD) + 1);
        assert!(reader.buf.is_empty(), "the buffer outlived the stream");
    }

    #[tokio::test]
    async fn a_drained_buffer_is_let_go_when_the_peer_went_quiet() {
        let (mut tx, rx) = tokio::io::duplex(64 * 1024);
        tx.write_all(b"hello").await.unwrap();
        let mut reader = ReadAhead::new(rx);
        let mut two = [0u8; 2];
        reader.read_exact(&mut two).await.unwrap();
        assert_eq!(reader.end - reader.start, 3);
        let mut three = [0u8; 3];
        reader.read_exact(&mut three).await.unwrap();
        assert_eq!(&three, b"llo");
        assert!(reader.buf.is_empty(), "an idle connection keeps its buffer");
    }

    #[tokio::test]
    async fn a_large_read_bypasses_the_buffer() {
        let (mut tx, rx) = tokio::io::duplex(128 * 1024);
        tx.write_all(&[1u8; 50_000]).await.unwrap();
        let mut reader = ReadAhead::new(rx);
        let mut big = vec![0u8; 64 * 1024];
        let n = reader.read(&mut big).await.unwrap();
        assert_eq!(n, 50_000);
        assert!(reader.buf.is_empty());
    }

    /// A transport that gives two bytes, then the end of stream.
    struct EndsAfterFirst(bool);

    impl AsyncRead for EndsAfterFirst {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let this = self.get_mut();
            if this.0 {
                return Poll::Ready(Ok(()));
            }
            this.0 = true;
            out.put_slice(b"ab");
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn an_error_is_returned_again_on_every_later_read() {
        struct Once(u8);
        impl AsyncRead for Once {
            fn poll_read(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                let this = self.get_mut();
                this.0 += 1;
                if this.0 == 1 {
                    Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()))
                } else {
                    Poll::Ready(Ok(()))
                }
            }
        }
        let mut reader = ReadAhead::new(Once(0));
        let mut buf = [0u8; 8];
        for _ in 0..2 {
            let err = reader.read(&mut buf).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
        }
        // The plain end of stream is not mistaken for an error.
        let mut ends = ReadAhead::new(EndsAfterFirst(false));
        assert_eq!(ends.read(&mut buf).await.unwrap(), 2);
        assert_eq!(ends.read(&mut buf).await.unwrap(), 0);
    }
}
