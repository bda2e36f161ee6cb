//! HTTP/2 SETTINGS surgery for the first-request hand-off: while tier K waits for an HTTP/2
//! client's first HEADERS, the proxy answers the client's preface with an empty SETTINGS
//! frame of its own; the client's ACK of it must then be taken out of the stream, for the
//! backend never sent those settings and neither did the user tier's HTTP/2 server.

use super::FIRST_REQUEST_MAX;
use crate::sniff::{sniff, Protocol, H2_PREFACE};

/// An empty SETTINGS frame: the server connection preface with every setting at its default.
pub(super) const H2_EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];

/// The header of the HTTP/2 frame at `at` in `bytes`, if all 9 bytes of it are there: the
/// frame's payload length, and whether it is a SETTINGS ACK (type 4, flag ACK, no payload).
fn frame_at(bytes: &[u8], at: usize) -> Option<(usize, bool)> {
    let h = bytes.get(at..at + 9)?;
    let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
    Some((len, h[3] == 4 && h[4] & 1 == 1 && len == 0))
}

/// Where the client's first SETTINGS ACK sits in `stream` (bytes from the connection's start):
/// `Ok(offset)` of its 9-byte frame, `Err(true)` if more bytes are needed to tell, `Err(false)`
/// if the stream is not HTTP/2 framing the proxy can walk.
pub(super) fn settings_ack_at(stream: &[u8]) -> Result<usize, bool> {
    match sniff(stream) {
        Some(Protocol::Http2) => {}
        more => return Err(more.is_none()),
    }
    let mut at = H2_PREFACE.len();
    loop {
        let Some((len, is_ack)) = frame_at(stream, at) else {
            return Err(true);
        };
        if is_ack {
            return Ok(at);
        }
        at += 9 + len;
    }
}

pin_project_lite::pin_project! {
    /// The client's side of an HTTP/2 connection with the first SETTINGS ACK frame taken
    /// out: the ACK of the SETTINGS the proxy sent while tier K was deciding, which the
    /// user tier's HTTP/2 server never sent and would refuse as a protocol error. Walks the
    /// frames from the preface up to that ACK (at most [`FIRST_REQUEST_MAX`] bytes), then
    /// passes everything through.
    pub struct StripSettingsAck<S> {
        #[pin]
        inner: S,
        // Bytes read from `inner` and not yet handed out (or dropped).
        held: Vec<u8>,
        // Offset in the stream of `held[0]`.
        held_at: usize,
        // Stream offset up to which the bytes are known to need no stripping.
        clear_to: usize,
        done: bool,
    }
}

impl<S> StripSettingsAck<S> {
    pub fn new(inner: S) -> Self {
        StripSettingsAck {
            inner,
            held: Vec::new(),
            held_at: 0,
            clear_to: 0,
            done: false,
        }
    }
}

impl<S: tokio::io::AsyncRead> tokio::io::AsyncRead for StripSettingsAck<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let mut this = self.project();
        loop {
            // Hand out what is known to be clear.
            let clear = if *this.done {
                this.held.len()
            } else {
                this.clear_to
                    .saturating_sub(*this.held_at)
                    .min(this.held.len())
            };
            if clear > 0 {
                let n = clear.min(buf.remaining());
                buf.put_slice(&this.held[..n]);
                this.held.drain(..n);
                *this.held_at += n;
                return Poll::Ready(Ok(()));
            }
            if *this.done {
                return this.inner.as_mut().poll_read(cx, buf);
            }
            // Read more, then walk the frames the held bytes complete.
            let mut chunk = [0u8; 4096];
            let mut rb = tokio::io::ReadBuf::new(&mut chunk);
            match this.inner.as_mut().poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    // EOF: whatever is held goes out as it is.
                    *this.done = true;
                    if this.held.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                    continue;
                }
                Poll::Ready(Ok(())) => this.held.extend_from_slice(rb.filled()),
            }
            // Re-walk from the stream's start over a view of everything seen so far: cheap,
            // as only the first few frames are ever walked.
            let walked = *this.held_at;
            let mut at = (*this.clear_to).max(walked);
            if at < H2_PREFACE.len() {
                at = (walked + this.held.len()).min(H2_PREFACE.len());
                *this.clear_to = at;
                if at < H2_PREFACE.len() {
                    continue;
                }
            }
            loop {
                let rel = at - walked;
                let Some((len, is_ack)) = frame_at(this.held, rel) else {
                    break;
                };
                if is_ack {
                    this.held.drain(rel..rel + 9);
                    *this.done = true;
                    break;
                }
                at += 9 + len;
                *this.clear_to = at;
                if at >= FIRST_REQUEST_MAX {
                    *this.done = true;
                    break;
                }
            }
        }
    }
}

impl<S: tokio::io::AsyncWrite> tokio::io::AsyncWrite for StripSettingsAck<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            0,
        ];
        f.extend_from_slice(payload);
        f
    }

    /// preface, SETTINGS, WINDOW_UPDATE, SETTINGS ACK, HEADERS, SETTINGS ACK (a second one).
    fn client_stream() -> (Vec<u8>, usize) {
        let mut s = H2_PREFACE.to_vec();
        s.extend(frame(4, 0, &[0, 3, 0, 0, 0, 100]));
        s.extend(frame(8, 0, &[0, 0, 0xff, 0xff]));
        let ack = s.len();
        s.extend(frame(4, 1, &[]));
        s.extend(frame(1, 4, &[0x83, 0x86, 0x84]));
        s.extend(frame(4, 1, &[]));
        (s, ack)
    }

    #[test]
    fn the_first_settings_ack_is_found_after_the_preface() {
        let (s, ack) = client_stream();
        assert_eq!(settings_ack_at(&s), Ok(ack));
        // Not there yet: more bytes needed, at any cut before the ACK's end.
        for cut in 0..ack + 9 {
            assert_eq!(settings_ack_at(&s[..cut]), Err(true), "cut at {cut}");
        }
        assert_eq!(settings_ack_at(b"GET / HTTP/1.1\r\n"), Err(false));
    }

    async fn strip(input: Vec<u8>, chunk: usize) -> Vec<u8> {
        let (mut a, b) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            for c in input.chunks(chunk) {
                a.write_all(c).await.unwrap();
            }
        });
        let mut out = Vec::new();
        let mut s = StripSettingsAck::new(b);
        s.read_to_end(&mut out).await.unwrap();
        writer.await.unwrap();
        out
    }

    #[tokio::test]
    async fn only_the_first_settings_ack_is_taken_out_however_the_bytes_arrive() {
        let (s, ack) = client_stream();
        let mut want = s.clone();
        want.drain(ack..ack + 9);
        for chunk in [1, 2, 7, 9, 24, 25, 1000] {
            assert_eq!(strip(s.clone(), chunk).await, want, "chunks of {chunk}");
        }
        // A stream without any ACK passes unchanged.
        let mut none = H2_PREFACE.to_vec();
        none.extend(frame(4, 0, &[]));
        none.extend(frame(1, 4, &[0x82]));
        assert_eq!(strip(none.clone(), 5).await, none);
    }
}
