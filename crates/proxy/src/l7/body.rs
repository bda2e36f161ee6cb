//! The body of a response sent downstream, whichever codec carries it: an upstream's body
//! streamed through (its trailers checked, `crate::trailers`), or the proxy's own.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::Full;

use crate::body::BoxError;
use crate::h1::client::H1Body;
use crate::h2::client::H2Body;

pub enum ResponseBody {
    /// From an HTTP/2 endpoint (`crate::h2::client`).
    Http2(H2Body),
    /// From an HTTP/1.1 endpoint (`crate::h1::client`).
    Http1(Box<H1Body>),
    /// Made by the proxy.
    Local(Full<Bytes>),
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            // Trailers from an HTTP/2 endpoint lose the fields no trailer may carry.
            ResponseBody::Http2(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|frame| frame.map(|f| f.map(crate::trailers::filter_frame))),
            ResponseBody::Http1(b) => Pin::new(b).poll_frame(cx),
            ResponseBody::Local(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Http2(b) => b.is_end_stream(),
            ResponseBody::Http1(b) => b.is_end_stream(),
            ResponseBody::Local(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Http2(b) => b.size_hint(),
            ResponseBody::Http1(b) => b.size_hint(),
            ResponseBody::Local(b) => b.size_hint(),
        }
    }
}
