//! Support for the crate's unit tests: a worker's view of a config written in YAML, and an
//! HTTP/1 client connection served on the test's own runtime, so that a test of timeouts or
//! retries runs on tokio's paused clock.
#![allow(clippy::unwrap_used)]
// The fuzz targets use only the view and the client connection.
#![cfg_attr(fuzzing, allow(dead_code))]

use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use tokio::io::{AsyncReadExt as _, DuplexStream};

use crate::access_log::AccessLog;
use crate::context::{ConnContext, WorkerView};
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;
use crate::upstream::Upstreams;

/// Worker 0's view of `yaml`.
pub(crate) fn view(yaml: &str) -> Arc<ArcSwap<WorkerView>> {
    let config = flatmesh_config::parse(yaml, "test.yaml").unwrap();
    let metrics = Metrics::new(1);
    let snapshot = Arc::new(Snapshot::build(config, 1, &metrics).unwrap());
    let upstreams = Upstreams::build(&snapshot, 0, None);
    Arc::new(ArcSwap::from_pointee(WorkerView {
        snapshot,
        upstreams,
    }))
}

/// A connection from 127.0.0.1 to the config's first listener.
pub(crate) fn context(view: &Arc<ArcSwap<WorkerView>>) -> Arc<ConnContext> {
    let listener = &view.load().snapshot.listeners[0];
    Arc::new(ConnContext {
        worker: 0,
        listener_address: listener.address,
        protocol: listener.protocol,
        peer: SocketAddr::from(([127, 0, 0, 1], 40000)),
        peer_ip: http::HeaderValue::from_static("127.0.0.1"),
        view: view.clone(),
        access_log: AccessLog::disabled(),
        tracer: crate::trace::Tracer::disabled(),
        kernel: None,
        budget: crate::limits::NodeBudget::new(),
        principal: None,
        draining: crate::drain::DrainSignal::new().subscribe(),
        dialled: None,
    })
}

/// Serves an HTTP/1 client connection with `ctx` on this runtime; returns the client's end.
pub(crate) fn h1_client(ctx: Arc<ConnContext>) -> DuplexStream {
    let (client, server) = tokio::io::duplex(256 * 1024);
    tokio::spawn(crate::h1::serve(ctx, server, BytesMut::new()));
    client
}

/// Serves an `http` listener's connection with `ctx` on this runtime, from the protocol
/// sniff on (`crate::dispatch`); returns the client's end.
pub(crate) fn http_client(ctx: Arc<ConnContext>) -> DuplexStream {
    let (client, server) = tokio::io::duplex(256 * 1024);
    let view = ctx.view.load_full();
    tokio::spawn(async move { crate::dispatch::serve_http(ctx, server, &view.snapshot).await });
    client
}

/// An HTTP/2 client (h2c, prior knowledge) on a connection served with `ctx` on this
/// runtime.
pub(crate) async fn h2_client(
    ctx: Arc<ConnContext>,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>> {
    let io = hyper_util::rt::TokioIo::new(http_client(ctx));
    let (sender, connection) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

/// A response as a test reads it off the wire.
#[derive(Debug)]
pub(crate) struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one response with a `content-length` body (every answer the proxy makes itself has
/// one) or a chunked one; `None` if the connection ends first.
pub(crate) async fn read_reply<R: tokio::io::AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut Vec<u8>,
) -> Option<Reply> {
    loop {
        let mut lines = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut lines);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(buf) {
            let status = resp.code?;
            let headers: Vec<(String, String)> = resp
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_ascii_lowercase(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect();
            let reply = |body: Vec<u8>| Reply {
                status,
                headers: headers.clone(),
                body: String::from_utf8_lossy(&body).into_owned(),
            };
            if (100..200).contains(&status) {
                buf.drain(..len);
                continue;
            }
            let length = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .and_then(|(_, v)| v.parse::<usize>().ok());
            let chunked = headers
                .iter()
                .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
            buf.drain(..len);
            if chunked {
                let mut body = Vec::new();
                loop {
                    let line_end = loop {
                        if let Some(at) = buf.windows(2).position(|w| w == b"\r\n") {
                            break at;
                        }
                        read_some(io, buf).await?;
                    };
                    let size = usize::from_str_radix(
                        std::str::from_utf8(&buf[..line_end]).ok()?.trim(),
                        16,
                    )
                    .ok()?;
                    while buf.len() < line_end + 2 + size + 2 {
                        read_some(io, buf).await?;
                    }
                    body.extend_from_slice(&buf[line_end + 2..line_end + 2 + size]);
                    buf.drain(..line_end + 2 + size + 2);
                    if size == 0 {
                        return Some(reply(body));
                    }
                }
            }
            let length = length.unwrap_or(0);
            while buf.len() < length {
                read_some(io, buf).await?;
            }
            let body: Vec<u8> = buf.drain(..length).collect();
            return Some(reply(body));
        }
        read_some(io, buf).await?;
    }
}

async fn read_some<R: tokio::io::AsyncRead + Unpin>(io: &mut R, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 16 * 1024];
    match io.read(&mut chunk).await {
        Ok(n @ 1..) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
        _ => None,
    }
}

/// What a scripted endpoint does with one request.
pub(crate) enum Script {
    /// Answer with these bytes after this (tokio) delay.
    Answer(std::time::Duration, Vec<u8>),
    /// Close the connection without answering.
    Close,
}

/// An HTTP/1.1 endpoint on this runtime that answers requests by script: `script(n, head)`
/// for the `n`th request (from 0) on the `c`th connection, whose head is `head`.
pub(crate) struct Endpoint {
    pub addr: SocketAddr,
    pub connections: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A 200 answer with `body`.
pub(crate) fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

impl Endpoint {
    pub async fn start(
        script: impl Fn(usize, usize, &str) -> Script + Send + Sync + 'static,
    ) -> Endpoint {
        use std::sync::atomic::Ordering;
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = connections.clone();
        let script = Arc::new(script);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let c = counter.fetch_add(1, Ordering::Relaxed);
                let script = script.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    for n in 0.. {
                        let Some(head) = read_head(&mut stream, &mut buf).await else {
                            return;
                        };
                        match script(c, n, &head) {
                            Script::Answer(delay, bytes) => {
                                tokio::time::sleep(delay).await;
                                if stream.write_all(&bytes).await.is_err() {
                                    return;
                                }
                            }
                            Script::Close => return,
                        }
                    }
                });
            }
        });
        Endpoint {
            addr,
            connections,
            task,
        }
    }

    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Reads one request head and its `content-length` body off `stream`; returns the head.
async fn read_head(stream: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            let length = head
                .lines()
                .find_map(|l| {
                    let (n, v) = l.split_once(':')?;
                    n.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                read_some(stream, buf).await?;
            }
            buf.drain(..end + 4 + length);
            return Some(head);
        }
        read_some(stream, buf).await?;
    }
}

/// A port on 127.0.0.1 where nothing listens (it was bound a moment ago and let go).
pub(crate) fn dead_endpoint() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}
