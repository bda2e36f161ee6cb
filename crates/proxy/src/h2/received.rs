//! A stream's received half read as a body, for both sides of the node's HTTP/2: a client's
//! request (`super::stream`) and an endpoint's answer (`super::client`). Its DATA, whose bytes
//! go back to the peer's window as they are taken, so the peer can be ahead by one window and
//! no more; then its trailers; and what its `content-length` says is still to come.

use std::task::{ready, Context, Poll};

use bytes::Bytes;
use h2::RecvStream;
use http::header::{HeaderMap, CONTENT_LENGTH};
use http_body::Frame;

pub(crate) struct Received {
    recv: RecvStream,
    /// What `content-length` says is left, when it says.
    left: Option<u64>,
    data_done: bool,
}

impl Received {
    /// `recv`, of a message whose head is `headers`.
    pub fn new(recv: RecvStream, headers: &HeaderMap) -> Received {
        let left = headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        Received {
            recv,
            left,
            data_done: false,
        }
    }

    /// The next piece of data, then the trailers, then the end.
    pub fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // The next hop has the bytes: the peer may send as many more.
                    let _ = self.recv.flow_control().release_capacity(data.len());
                    if let Some(left) = &mut self.left {
                        *left = left.saturating_sub(data.len() as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(err)) => return Poll::Ready(Some(Err(err))),
                None => self.data_done = true,
            }
        }
        match ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Ok(None) => Poll::Ready(None),
            Err(err) => Poll::Ready(Some(Err(err))),
        }
    }

    pub fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    /// The bytes `content-length` says are still to come, when it says.
    pub fn left(&self) -> Option<u64> {
        self.left
    }

    pub fn into_inner(self) -> RecvStream {
        self.recv
    }
}
