//! A client's request body on its way upstream, held in `http` types (an HTTP/2 client's, or
//! an HTTP/1 client's bound for an HTTP/2 cluster). It tells the retry driver each time a
//! frame moves on and when it is complete (`super::retry`: the route's timeout starts then,
//! as Envoy starts it once the downstream request is complete, and a body that moves nothing
//! for the idle timeout fails the request), and its trailers lose the fields a trailer must
//! not carry (`crate::trailers`).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::watch;

use crate::body::{BoxError, UpstreamBody};

pub(crate) struct Upload {
    inner: UpstreamBody,
    /// `false` each time a frame moves on, `true` once the body has ended (or failed, or
    /// was dropped): what the retry driver watches.
    progress: watch::Sender<bool>,
}

impl Upload {
    /// Wraps `inner`; returns the body and what the retry driver watches of it.
    pub(crate) fn new(inner: UpstreamBody) -> (Upload, watch::Receiver<bool>) {
        let (progress, watched) = watch::channel(false);
        (Upload { inner, progress }, watched)
    }

    fn finished(&self) {
        self.progress.send_replace(true);
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = crate::trailers::filter_frame(frame);
                if this.inner.is_end_stream() {
                    this.finished();
                } else {
                    this.progress.send_replace(false);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => {
                this.finished();
                Poll::Ready(other)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Upload {
    /// A body dropped unfinished (its try gave up) leaves no one waiting on it.
    fn drop(&mut self) {
        self.finished();
    }
}
