//! Moving one HTTP/1 message body from a buffered reader to a sink, in whatever framing the
//! two sides need: passed through as framed, decoded from chunked, or chunked on the way.

use std::io;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::chunked::{self, ChunkError, ChunkedParser};
use super::head::Framing;
use crate::body::BoxError;

/// Bytes read per system call while relaying a body.
const READ_CHUNK: usize = 64 * 1024;
/// Below this, body bytes already read are copied behind the head so both go out in one write.
const COALESCE: usize = 16 * 1024;

/// How the body leaves, given how it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encode {
    /// As it arrived (a chunked body stays chunked).
    AsIs,
    /// Chunked in, plain data out (for an HTTP/1.0 client, or a channel to hyper).
    Dechunk,
    /// Close-delimited in, chunked out (for an HTTP/1.1 client that keeps its connection).
    Rechunk,
}

#[derive(Debug)]
pub enum RelayError {
    /// The source failed, closed early, or fell silent for the idle timeout.
    Source(io::Error),
    /// The source's chunked framing is malformed.
    Framing(ChunkError),
    /// The sink failed (closed, reset, a body channel whose receiver went away), or took
    /// nothing for the idle timeout.
    Sink(io::Error),
}

/// Where a relayed body goes.
pub trait Sink {
    fn send(&mut self, bytes: &[u8]) -> impl std::future::Future<Output = io::Result<()>> + Send;
}

/// A socket (or any writer).
pub struct WriteSink<'w, W>(pub &'w mut W);

impl<W: AsyncWrite + Unpin + Send> Sink for WriteSink<'_, W> {
    async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.write_all(bytes).await
    }
}

/// A sink that marks `progress` (with `false`) after each piece it passes on: the retry
/// driver waits for a request body that keeps moving before it starts the route's timeout.
pub struct Watched<'p, S> {
    pub sink: S,
    pub progress: Option<&'p tokio::sync::watch::Sender<bool>>,
}

impl<S: Sink + Send> Sink for Watched<'_, S> {
    async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.sink.send(bytes).await?;
        if let Some(progress) = self.progress {
            progress.send_replace(false);
        }
        Ok(())
    }
}

/// A sink that keeps a copy of what it passes on in `kept` (when there is one): a request
/// body kept for a retry (`crate::l7::retry`), bounded by the route's `max_replay_body`. It
/// keeps a piece before it sends it, so a piece the sink failed to send is kept too.
pub struct Kept<'k, S> {
    pub sink: S,
    pub kept: Option<&'k mut Vec<u8>>,
}

impl<S: Sink + Send> Sink for Kept<'_, S> {
    async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        if let Some(kept) = self.kept.as_deref_mut() {
            kept.extend_from_slice(bytes);
        }
        self.sink.send(bytes).await
    }
}

/// The body channel of a request handed to the HTTP/2 client (an HTTP/2 upstream).
pub struct ChannelSink(pub mpsc::Sender<Result<Bytes, BoxError>>);

impl Sink for ChannelSink {
    async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0
            .send(Ok(Bytes::copy_from_slice(bytes)))
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "upstream stopped reading the body",
                )
            })
    }
}

/// Reads and forgets a body the proxy answered without forwarding, up to a limit.
pub struct DiscardSink {
    pub left: u64,
}

impl Sink for DiscardSink {
    async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.left = self
            .left
            .checked_sub(bytes.len() as u64)
            .ok_or_else(|| io::Error::other("unread request body too large to drain"))?;
        Ok(())
    }
}

/// Reads more bytes into `buf`, failing on EOF or when nothing arrives within `idle`.
pub async fn read_more<R: AsyncRead + Unpin>(
    src: &mut R,
    buf: &mut BytesMut,
    idle: Duration,
) -> io::Result<usize> {
    buf.reserve(READ_CHUNK.min(buf.capacity().max(4096)));
    match tokio::time::timeout(idle, src.read_buf(buf)).await {
        Ok(Ok(0)) => Err(io::ErrorKind::UnexpectedEof.into()),
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "no body bytes within the idle timeout",
        )),
    }
}

/// Sends `prefix` (a head, or nothing) and then the body framed as `framing` that starts
/// at the front of `buf`, reading the rest from `src`. On success the body's bytes have
/// been taken out of `buf`; what is left is the next message.
pub async fn relay<R: AsyncRead + Unpin>(
    src: &mut R,
    buf: &mut BytesMut,
    sink: &mut impl Sink,
    prefix: Vec<u8>,
    framing: Framing,
    encode: Encode,
    idle: Duration,
) -> Result<(), RelayError> {
    let mut out = prefix;
    match framing {
        Framing::Empty => {}
        Framing::Length(mut left) => loop {
            let take = (buf.len() as u64).min(left) as usize;
            if take > 0 {
                if out.is_empty() || take > COALESCE {
                    flush(sink, &mut out, idle).await?;
                    send(sink, &buf[..take], idle).await?;
                } else {
                    out.extend_from_slice(&buf[..take]);
                }
                buf.advance(take);
                left -= take as u64;
            }
            if left == 0 {
                break;
            }
            flush(sink, &mut out, idle).await?;
            read_more(src, buf, idle)
                .await
                .map_err(RelayError::Source)?;
        },
        Framing::Chunked => {
            let mut parser = ChunkedParser::new();
            loop {
                let input = &buf[..];
                let progress = if encode == Encode::Dechunk {
                    parser.advance(input, |r| out.extend_from_slice(&input[r]))
                } else {
                    parser.advance(input, |_| {})
                }
                .map_err(RelayError::Framing)?;
                if encode != Encode::Dechunk {
                    // The chunks as they came; the trailer section only with the fields
                    // that may be trailers (`crate::trailers`).
                    out.extend_from_slice(&input[..progress.framed]);
                    if progress.done {
                        crate::trailers::filter_section(parser.trailer_section(), &mut out);
                    }
                }
                buf.advance(progress.consumed);
                flush(sink, &mut out, idle).await?;
                if progress.done {
                    break;
                }
                read_more(src, buf, idle)
                    .await
                    .map_err(RelayError::Source)?;
            }
        }
        Framing::UntilClose => loop {
            if !buf.is_empty() {
                if encode == Encode::Rechunk {
                    chunked::chunk_header(&mut out, buf.len());
                    out.extend_from_slice(buf);
                    out.extend_from_slice(b"\r\n");
                } else {
                    out.extend_from_slice(buf);
                }
                buf.clear();
            }
            flush(sink, &mut out, idle).await?;
            match read_more(src, buf, idle).await {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    if encode == Encode::Rechunk {
                        out.extend_from_slice(chunked::LAST_CHUNK);
                    }
                    break;
                }
                Err(e) => return Err(RelayError::Source(e)),
            }
        },
    }
    flush(sink, &mut out, idle).await
}

/// Sends `bytes`; a sink that takes none of them for `idle` (a peer that stopped reading)
/// fails the relay, as a source that sends nothing for `idle` does.
async fn send(sink: &mut impl Sink, bytes: &[u8], idle: Duration) -> Result<(), RelayError> {
    match tokio::time::timeout(idle, sink.send(bytes)).await {
        Ok(sent) => sent.map_err(RelayError::Sink),
        Err(_) => Err(RelayError::Sink(io::Error::new(
            io::ErrorKind::TimedOut,
            "the receiver took no body bytes within the idle timeout",
        ))),
    }
}

async fn flush(sink: &mut impl Sink, out: &mut Vec<u8>, idle: Duration) -> Result<(), RelayError> {
    if !out.is_empty() {
        send(sink, out, idle).await?;
        out.clear();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn run(input: &[u8], framing: Framing, encode: Encode) -> (Vec<u8>, Vec<u8>) {
        let mut src = pieces(input);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        relay(
            &mut src,
            &mut buf,
            &mut WriteSink(&mut out),
            b"HEAD|".to_vec(),
            framing,
            encode,
            Duration::from_secs(1),
        )
        .await
        .expect("relays");
        let mut rest = buf.to_vec();
        src.read_to_end(&mut rest).await.expect("rest");
        (out, rest)
    }

    /// A reader that hands out its input 3 bytes at a time, so that every parser state is
    /// crossed between two reads.
    struct Pieces(std::collections::VecDeque<Vec<u8>>);

    fn pieces(input: &[u8]) -> Pieces {
        Pieces(input.chunks(3).map(<[u8]>::to_vec).collect())
    }

    impl AsyncRead for Pieces {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            if let Some(mut p) = self.0.pop_front() {
                let n = p.len().min(buf.remaining());
                buf.put_slice(&p[..n]);
                if n < p.len() {
                    self.0.push_front(p.split_off(n));
                }
            }
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn framings_and_encodings() {
        let (out, rest) = run(b"hello worldNEXT", Framing::Length(11), Encode::AsIs).await;
        assert_eq!(
            (out.as_slice(), rest.as_slice()),
            (&b"HEAD|hello world"[..], &b"NEXT"[..])
        );

        let chunked = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\nNEXT";
        let (out, rest) = run(chunked, Framing::Chunked, Encode::AsIs).await;
        assert_eq!(&out[5..], &chunked[..chunked.len() - 4]);
        assert_eq!(rest, b"NEXT");
        let (out, _) = run(chunked, Framing::Chunked, Encode::Dechunk).await;
        assert_eq!(out, b"HEAD|hello world");

        let (out, _) = run(b"abcdefg", Framing::UntilClose, Encode::Rechunk).await;
        let body = &out[5..];
        let mut parser = ChunkedParser::new();
        let mut data = Vec::new();
        let p = parser
            .advance(body, |r| data.extend_from_slice(&body[r]))
            .expect("valid chunked");
        assert!(p.done && p.consumed == body.len());
        assert_eq!(data, b"abcdefg");
    }

    #[tokio::test]
    async fn trailers_go_on_without_the_fields_no_trailer_may_carry() {
        let chunked = b"5\r\nhello\r\n0\r\nx-sum: 1\r\nContent-Length: 99\r\nHost: evil\r\nx-nul: a\0b\r\nx-fold: a\r\n\tb\r\n\r\nNEXT";
        let (out, rest) = run(chunked, Framing::Chunked, Encode::AsIs).await;
        assert_eq!(
            String::from_utf8_lossy(&out),
            "HEAD|5\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n"
        );
        assert_eq!(rest, b"NEXT");
    }

    #[tokio::test]
    async fn early_eof_and_bad_framing_are_errors() {
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let err = relay(
            &mut pieces(b"abc"),
            &mut buf,
            &mut WriteSink(&mut out),
            Vec::new(),
            Framing::Length(10),
            Encode::AsIs,
            Duration::from_secs(1),
        )
        .await;
        assert!(matches!(err, Err(RelayError::Source(_))));
        let err = relay(
            &mut pieces(b"zz\r\n"),
            &mut BytesMut::new(),
            &mut WriteSink(&mut out),
            Vec::new(),
            Framing::Chunked,
            Encode::AsIs,
            Duration::from_secs(1),
        )
        .await;
        assert!(matches!(err, Err(RelayError::Framing(_))));
    }
}
