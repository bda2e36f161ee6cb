//! Backends the proxy forwards to. Each HTTP backend names itself in an `x-backend` response
//! header and echoes what it saw (method, path, query, version, headers, body length) as JSON,
//! so a test can tell which backend answered and what the proxy sent it.
//!
//! Request headers that steer an HTTP backend (for timeout and error tests):
//! - `x-delay-ms: N` sleeps N ms before answering;
//! - `x-status: N` answers with status N;
//! - `x-response-bytes: N` answers with N pattern bytes (seed 42) instead of the JSON echo,
//!   with their CRC-32 in `x-body-crc`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Which HTTP version an HTTP backend speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// HTTP/1.1 only.
    H1,
    /// HTTP/2 over cleartext with prior knowledge only.
    H2c,
}

/// A running HTTP backend; stops when dropped.
pub struct HttpBackend {
    pub name: String,
    pub addr: SocketAddr,
    /// Requests answered so far.
    pub hits: Arc<AtomicU64>,
    /// Connections accepted so far (to check upstream connection reuse).
    pub conns: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl HttpBackend {
    pub async fn start(name: &str, proto: Proto) -> HttpBackend {
        HttpBackend::start_with_delay(name, proto, Duration::ZERO).await
    }

    /// A backend that waits `delay` before every answer (a slow endpoint for least_request).
    pub async fn start_with_delay(name: &str, proto: Proto, delay: Duration) -> HttpBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind backend");
        let addr = listener.local_addr().expect("backend addr");
        let hits = Arc::new(AtomicU64::new(0));
        let conns = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(serve_http(
            listener,
            name.to_owned(),
            proto,
            delay,
            hits.clone(),
            conns.clone(),
        ));
        HttpBackend {
            name: name.to_owned(),
            addr,
            hits,
            conns,
            task,
        }
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    pub fn conns(&self) -> u64 {
        self.conns.load(Ordering::Relaxed)
    }
}

impl Drop for HttpBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_http(
    listener: TcpListener,
    name: String,
    proto: Proto,
    delay: Duration,
    hits: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
) {
    let name: Arc<str> = name.into();
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        let name = name.clone();
        let hits = hits.clone();
        let service = service_fn(move |req| echo(req, name.clone(), delay, hits.clone()));
        let io = TokioIo::new(stream);
        // The JoinSet ties connection tasks to this task, so aborting the backend drops them too.
        conns.spawn(async move {
            let _ = match proto {
                Proto::H1 => hyper::server::conn::http1::Builder::new()
                    .max_buf_size(1024 * 1024)
                    .serve_connection(io, service)
                    .await
                    .map_err(|e| e.to_string()),
                Proto::H2c => hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(io, service)
                    .await
                    .map_err(|e| e.to_string()),
            };
        });
        while conns.try_join_next().is_some() {}
    }
}

async fn echo(
    req: Request<Incoming>,
    name: Arc<str>,
    delay: Duration,
    hits: Arc<AtomicU64>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    // Read the whole body first: the proxy must have delivered it before we answer.
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Ok(Response::builder()
                .status(StatusCode::BAD_REQUEST)
                .header("x-backend", &*name)
                .body(Full::new(Bytes::from(format!(
                    "backend {name}: body error: {e}"
                ))))
                .expect("valid response"))
        }
    };
    let header = |n: &str| {
        parts
            .headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let extra_delay = header("x-delay-ms")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let total_delay = delay + Duration::from_millis(extra_delay);
    if !total_delay.is_zero() {
        tokio::time::sleep(total_delay).await;
    }
    let status = header("x-status")
        .and_then(|v| v.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    if let Some(n) = header("x-response-bytes").and_then(|v| v.parse::<usize>().ok()) {
        let data = pattern(n, 42);
        hits.fetch_add(1, Ordering::Relaxed);
        return Ok(Response::builder()
            .status(status)
            .header("x-backend", &*name)
            .header("x-body-crc", crc32fast::hash(&data).to_string())
            .body(Full::new(Bytes::from(data)))
            .expect("valid response"));
    }
    let mut headers = serde_json::Map::new();
    for (k, v) in &parts.headers {
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        match headers.get_mut(k.as_str()) {
            Some(serde_json::Value::String(prev)) => {
                prev.push_str(", ");
                prev.push_str(&v);
            }
            _ => {
                headers.insert(k.as_str().to_owned(), serde_json::Value::String(v));
            }
        }
    }
    let echo = serde_json::json!({
        "backend": &*name,
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body_len": body.len(),
        "body_crc": crc32fast::hash(&body),
    });
    hits.fetch_add(1, Ordering::Relaxed);
    Ok(Response::builder()
        .status(status)
        .header("x-backend", &*name)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(echo.to_string())))
        .expect("valid response"))
}

/// What a raw TCP backend does with each connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpMode {
    /// Write back everything read; shut down its write side after the client's EOF.
    Echo,
    /// Read to EOF, then answer one line `"<bytes> <crc32>\n"` and close (half-close test).
    Count,
    /// Read the first bytes, then reset the connection (RST via SO_LINGER 0).
    Reset,
    /// Read until EOF or error and report how it ended on `events` (never writes).
    Hold,
    /// Write `hello`, shut down its write side at once, then read to EOF and report the
    /// byte count on `events` (server-initiated half-close).
    GreetThenHold,
}

/// How a connection to a TCP backend ended, as the backend saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcpEnd {
    /// Clean EOF after this many bytes.
    Eof(u64),
    /// A read error (e.g. connection reset) after this many bytes.
    Error(u64, std::io::ErrorKind),
}

pub struct TcpBackend {
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
    /// One event per finished connection.
    pub events: mpsc::UnboundedReceiver<TcpEnd>,
    task: JoinHandle<()>,
}

impl TcpBackend {
    pub async fn start(mode: TcpMode) -> TcpBackend {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind tcp backend");
        let addr = listener.local_addr().expect("tcp backend addr");
        let accepted = Arc::new(AtomicU64::new(0));
        let (tx, events) = mpsc::unbounded_channel();
        let counter = accepted.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                counter.fetch_add(1, Ordering::Relaxed);
                let tx = tx.clone();
                conns.spawn(async move {
                    let end = handle_tcp(stream, mode).await;
                    let _ = tx.send(end);
                });
                while conns.try_join_next().is_some() {}
            }
        });
        TcpBackend {
            addr,
            accepted,
            events,
            task,
        }
    }

    /// Wait (bounded) for the next connection-end event.
    pub async fn next_end(&mut self, limit: Duration) -> Option<TcpEnd> {
        tokio::time::timeout(limit, self.events.recv())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle_tcp(mut stream: TcpStream, mode: TcpMode) -> TcpEnd {
    if mode == TcpMode::GreetThenHold {
        if let Err(e) = stream.write_all(b"hello").await {
            return TcpEnd::Error(0, e.kind());
        }
        if let Err(e) = stream.shutdown().await {
            return TcpEnd::Error(0, e.kind());
        }
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    let mut crc = crc32fast::Hasher::new();
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => return TcpEnd::Error(total, e.kind()),
        };
        total += n as u64;
        match mode {
            TcpMode::Echo => {
                if let Err(e) = stream.write_all(&buf[..n]).await {
                    return TcpEnd::Error(total, e.kind());
                }
            }
            TcpMode::Count => crc.update(&buf[..n]),
            TcpMode::Reset => {
                // Zero linger turns close into an RST: an abrupt upstream failure.
                let _ = stream.set_zero_linger();
                drop(stream);
                return TcpEnd::Eof(total);
            }
            TcpMode::Hold | TcpMode::GreetThenHold => {}
        }
    }
    match mode {
        TcpMode::Echo => {
            let _ = stream.shutdown().await;
        }
        TcpMode::Count => {
            let line = format!("{} {}\n", total, crc.finalize());
            let _ = stream.write_all(line.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
        TcpMode::Reset | TcpMode::Hold | TcpMode::GreetThenHold => {}
    }
    TcpEnd::Eof(total)
}

/// Deterministic pseudo-random bytes (xorshift), so a large transfer's content is checkable.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
