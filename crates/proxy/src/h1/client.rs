//! Requests held in `http` types (from HTTP/2 clients) that go to an HTTP/1.1 cluster: the
//! same pooled connections as the HTTP/1 path, with the request written from an
//! `http::Request` and the answer handed back as an `http::Response` whose body streams
//! straight from the connection (and returns it to the pool when it ends).

use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::time::{Instant, Sleep};

use super::chunked::{self, ChunkedParser};
use super::head::{self, Framing, MAX_HEADERS};
use super::pool::{self, H1Pool, HeadState, UpstreamConn};
use crate::body::{BoxError, UpstreamBody};
use crate::l7::error::UpstreamError;
use crate::snapshot::ClusterPlan;

/// One try of a request at `endpoint`: sends `parts` + `body` and reads the head of the
/// answer.
#[allow(clippy::too_many_arguments)]
pub async fn send(
    pool: &Arc<H1Pool>,
    plan: &ClusterPlan,
    worker: usize,
    endpoint: SocketAddr,
    parts: &http::request::Parts,
    mut body: UpstreamBody,
    max_head: usize,
    idle: Duration,
) -> Result<Response<H1Body>, UpstreamError> {
    let mut conn = pool::acquire(pool, endpoint, plan, worker).await?;
    let length = body.size_hint().exact();
    let chunked = length.is_none();
    let mut out = request_head(parts, length);
    // The body, framed: small bodies go out with the head in one write.
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(UpstreamError::request_body)?;
        match frame.into_data() {
            Ok(data) if data.is_empty() => {}
            Ok(data) => {
                if chunked {
                    chunked::chunk_header(&mut out, data.len());
                    out.extend_from_slice(&data);
                    out.extend_from_slice(b"\r\n");
                } else {
                    out.extend_from_slice(&data);
                }
                if out.len() >= 16 * 1024 {
                    let written = conn.stream.write_all(&out).await;
                    written.map_err(|e| conn.failed(e))?;
                    out.clear();
                }
            }
            // Trailers have a place only in a chunked body.
            Err(frame) => {
                if let (true, Ok(trailers)) = (chunked, frame.into_trailers()) {
                    out.extend_from_slice(b"0\r\n");
                    write_fields(&mut out, &trailers);
                    out.extend_from_slice(b"\r\n");
                    let written = conn.stream.write_all(&out).await;
                    written.map_err(|e| conn.failed(e))?;
                    out.clear();
                    return read_answer(pool, endpoint, conn, parts, max_head, idle).await;
                }
            }
        }
    }
    if chunked {
        out.extend_from_slice(chunked::LAST_CHUNK);
    }
    let written = conn.stream.write_all(&out).await;
    written.map_err(|e| conn.failed(e))?;
    read_answer(pool, endpoint, conn, parts, max_head, idle).await
}

async fn read_answer(
    pool: &Arc<H1Pool>,
    endpoint: SocketAddr,
    mut conn: UpstreamConn,
    parts: &http::request::Parts,
    max_head: usize,
    idle: Duration,
) -> Result<Response<H1Body>, UpstreamError> {
    loop {
        match conn.response_head(max_head, false) {
            HeadState::Final => break,
            HeadState::Invalid(why) => return Err(UpstreamError::invalid(why)),
            // The HTTP/2 server sends no informational answers of its own: skip them.
            HeadState::Informational { len, .. } => conn.buf.advance(len),
            HeadState::Incomplete => conn.read_more().await?,
        }
    }
    // The response head, copied into `http` types; its borrow of the buffer ends here.
    let (builder, len, framing, reusable) = {
        let mut lines = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut lines);
        let Ok(httparse::Status::Complete(len)) = resp.parse(&conn.buf) else {
            return Err(UpstreamError::invalid("malformed response head"));
        };
        let info = head::analyze_response(&resp, parts.method == Method::HEAD)
            .map_err(UpstreamError::invalid)?;
        // HTTP/2 has no transfer codings: a `gzip, chunked` body cannot go on as it is.
        if info.has_codings() {
            return Err(UpstreamError::invalid(head::CODINGS_NEED_HTTP11));
        }
        let mut builder = Response::builder().status(info.status);
        if let Some(headers) = builder.headers_mut() {
            for h in resp.headers.iter() {
                if !head::is_end_to_end(h.name, &info) {
                    continue;
                }
                let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(h.name.as_bytes()),
                    HeaderValue::from_bytes(h.value),
                ) else {
                    return Err(UpstreamError::invalid(format!(
                        "bad header line `{}`",
                        h.name
                    )));
                };
                headers.append(name, value);
            }
        }
        (builder, len, info.framing, info.reusable)
    };
    conn.buf.advance(len);
    let body = H1Body {
        conn: Some(conn),
        framing,
        parser: ChunkedParser::new(),
        pool: pool.clone(),
        endpoint,
        reusable,
        idle,
        timer: None,
    };
    builder
        .body(body)
        .map_err(|e| UpstreamError::invalid(e.to_string()))
}

/// `METHOD /target HTTP/1.1`, the (already rewritten) header fields, and the framing.
fn request_head(parts: &http::request::Parts, length: Option<u64>) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(
        parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .as_bytes(),
    );
    out.extend_from_slice(b" HTTP/1.1\r\n");
    write_fields(&mut out, &parts.headers);
    match length {
        // A bodyless GET says nothing; a bodyless POST says its length is 0.
        Some(0)
            if matches!(
                parts.method,
                Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
            ) => {}
        Some(n) => out.extend_from_slice(format!("content-length: {n}\r\n").as_bytes()),
        None => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
    out
}

fn write_fields(out: &mut Vec<u8>, headers: &HeaderMap) {
    for (name, value) in headers {
        // The framing is the proxy's: written by the caller.
        if name == http::header::CONTENT_LENGTH || name == http::header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// The body of an HTTP/1.1 answer, read from its connection as the client consumes it.
pub struct H1Body {
    /// `None` once the body has ended (the connection went back to the pool or was closed).
    conn: Option<UpstreamConn>,
    framing: Framing,
    parser: ChunkedParser,
    pool: Arc<H1Pool>,
    endpoint: SocketAddr,
    reusable: bool,
    /// A body that stalls this long is cut off.
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl H1Body {
    /// The body is complete: the connection goes back to the pool if it can carry more.
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take() {
            if self.reusable && conn.buf.is_empty() {
                self.pool.checkin(self.endpoint, conn);
            }
        }
    }

    /// The next data already buffered, if any. `Err` on malformed chunked framing.
    fn take_buffered(&mut self) -> Result<Option<Bytes>, BoxError> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(None);
        };
        let data = match self.framing {
            Framing::Empty => None,
            Framing::Length(left) => {
                let n = (conn.buf.len() as u64).min(left) as usize;
                self.framing = Framing::Length(left - n as u64);
                (n > 0).then(|| conn.buf.split_to(n).freeze())
            }
            Framing::Chunked => {
                let mut data = BytesMut::new();
                let input = &conn.buf[..];
                let progress = self
                    .parser
                    .advance(input, |r| data.extend_from_slice(&input[r]))
                    .map_err(|e| format!("upstream body: {}", e.describe()))?;
                conn.buf.advance(progress.consumed);
                (!data.is_empty()).then(|| data.freeze())
            }
            Framing::UntilClose => (!conn.buf.is_empty()).then(|| conn.buf.split().freeze()),
        };
        if self.is_complete() {
            self.finish();
        }
        Ok(data)
    }

    fn is_complete(&self) -> bool {
        match self.framing {
            Framing::Empty | Framing::Length(0) => true,
            Framing::Chunked => self.parser.is_done(),
            Framing::Length(_) | Framing::UntilClose => false,
        }
    }
}

impl Body for H1Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            match this.take_buffered() {
                Ok(Some(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(None) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e)));
                }
            }
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match poll_read(conn, cx) {
                Poll::Ready(Ok(0)) => {
                    this.conn = None;
                    return Poll::Ready(match this.framing {
                        Framing::UntilClose => None,
                        _ => Some(Err("upstream closed the connection mid-body".into())),
                    });
                }
                Poll::Ready(Ok(_)) => this.timer = None,
                Poll::Ready(Err(e)) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Pending => {
                    let idle = this.idle;
                    let timer = this.timer.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep_until(Instant::now() + idle))
                    });
                    ready!(timer.as_mut().poll(cx));
                    this.conn = None;
                    return Poll::Ready(Some(Err(format!(
                        "upstream body stalled for {}",
                        flatmesh_config::duration::format(&idle)
                    )
                    .into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || self.is_complete()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Empty => SizeHint::with_exact(0),
            Framing::Length(left) => SizeHint::with_exact(left),
            _ => SizeHint::default(),
        }
    }
}

/// Reads what the connection has into its buffer.
fn poll_read(conn: &mut UpstreamConn, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
    conn.buf.reserve(16 * 1024);
    conn.stream.poll_read_buf(cx, &mut conn.buf)
}
