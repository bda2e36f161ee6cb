//! Real microservices for the live demo (E3 Table 2: KVS, Count, EMA, API gateway with a rate
//! limiter), each an HTTP/1.1 server in its own process, and the execution engine around them
//! that a cold migration drives.
//!
//! The engine has three modes. *Serve*: execute requests. *Hold*: the instance was removed from
//! the execution engine; requests that arrive wait in its queue (E3's traffic manager keeps them)
//! instead of failing. *Relay*: the instance restarted on another node; queued and new requests go
//! there until the node proxies have the new endpoint, then the old process retires. That is how a
//! cold migration loses no request: nothing executes in two places, and nothing is refused.
//!
//! The management port (used by the demo's runtime and node agent, not by clients) serves
//! `GET /_stats` (and resets the window), `POST /_control/hold`, `/_control/checkpoint?file=F`,
//! `/_control/resume[?file=F]`, `/_control/relay?to=ADDR`, `/_control/retire`. The service port
//! answers `GET /_stats` too, as a readiness check.

pub mod kinds;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use kinds::{burn, burn_rate, Data, Kind, RateLimiter};

use crate::{LabError, Result};

/// Request bodies larger than this are refused with 413.
const MAX_BODY: usize = 64 * 1024;

#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub kind: Kind,
    pub listen: SocketAddr,
    /// The management port: statistics and migration control, on a thread of its own.
    pub stats_listen: Option<SocketAddr>,
    /// Restore the working state from this checkpoint at start (a migrated instance).
    pub state_file: Option<PathBuf>,
    /// Iterations of [`burn`] per request: the per-request CPU cost.
    pub work_iterations: u64,
    /// The gateway's way to the other services: its node's proxy.
    pub upstream: Option<SocketAddr>,
    /// The gateway's rate limit per client (requests/s) and burst.
    pub rate: f64,
    pub burst: f64,
    /// After `retire`, exit once no request has arrived for this long.
    pub idle_exit: Duration,
}

/// One window of measurements, as an agent reads it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    /// Mean execution time of the requests that finished in the window.
    pub exec_us: Option<u64>,
    pub samples: u64,
    /// Requests inside the instance now (waiting or executing).
    pub queue: u32,
    /// Request and response bytes in the window.
    pub bytes: u64,
    /// Keys of working state held.
    pub keys: usize,
}

#[derive(Debug, Clone, PartialEq)]
enum Mode {
    Serve,
    Hold,
    Relay(SocketAddr),
}

#[derive(Default)]
struct Window {
    exec_us_sum: u64,
    samples: u64,
    bytes: u64,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Engine {
    cfg: ServiceConfig,
    /// `None` once the state was checkpointed and released (cold migration's clean-up).
    data: Mutex<Option<Data>>,
    mode: watch::Sender<Mode>,
    inflight: AtomicU32,
    executing: AtomicU32,
    window: Mutex<Window>,
    retired: AtomicBool,
    last_request: Mutex<Instant>,
    client: HttpClient,
}

/// Decrements a counter when a request leaves, however it leaves.
struct Count<'a>(&'a AtomicU32);
impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn reply(status: u16, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r
}

fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Runs the service until it is retired and idle. Binding failures and unreadable checkpoints are
/// errors; everything after that is answered over HTTP.
pub async fn serve(cfg: ServiceConfig) -> Result<()> {
    let data = match &cfg.state_file {
        Some(path) => load_checkpoint(path, cfg.kind)?,
        None => Data::new(cfg.kind, cfg.rate, cfg.burst),
    };
    let listener = listen(cfg.listen).map_err(|e| LabError::Demo {
        what: format!("{} service", cfg.kind.name()),
        message: format!(
            "cannot listen on {}: {e}; is the address in this network namespace and free?",
            cfg.listen
        ),
    })?;
    let engine = Arc::new(Engine {
        data: Mutex::new(Some(data)),
        mode: watch::Sender::new(Mode::Serve),
        inflight: AtomicU32::new(0),
        executing: AtomicU32::new(0),
        window: Mutex::new(Window::default()),
        retired: AtomicBool::new(false),
        last_request: Mutex::new(Instant::now()),
        client: Client::builder(TokioExecutor::new()).build_http(),
        cfg,
    });
    if let Some(addr) = engine.cfg.stats_listen {
        management_thread(engine.clone(), addr)?;
    }
    let mut check = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let engine = engine.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let engine = engine.clone();
                        async move { Ok::<_, std::convert::Infallible>(handle(&engine, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
            _ = check.tick() => {
                if engine.retired.load(Ordering::SeqCst)
                    && engine.inflight.load(Ordering::SeqCst) == 0
                    && engine.last_request.lock().elapsed() >= engine.cfg.idle_exit
                {
                    return Ok(());
                }
            }
        }
    }
}

/// Connections the kernel queues for an instance that has not accepted them yet.
/// An overloaded instance (throttled to its node's CPU share, busy with the requests it has)
/// accepts late; once its queue is full the kernel drops SYNs, and clients see a connect
/// timeout instead of a slow answer. tokio's default is 1024; the kernel caps this at
/// net.core.somaxconn (4096 by default).
const ACCEPT_BACKLOG: u32 = 4096;

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

fn load_checkpoint(path: &std::path::Path, kind: Kind) -> Result<Data> {
    let text = std::fs::read(path)
        .map_err(|e| LabError::io(format!("cannot read checkpoint {}", path.display()), e))?;
    let data: Data = serde_json::from_slice(&text).map_err(|e| LabError::Demo {
        what: format!("checkpoint {}", path.display()),
        message: format!("{e}; it is not a checkpoint this version wrote"),
    })?;
    if data.kind() != kind {
        return Err(LabError::Demo {
            what: format!("checkpoint {}", path.display()),
            message: format!(
                "holds {} state, not {}; the runtime mixed up two instances",
                data.kind().name(),
                kind.name()
            ),
        });
    }
    Ok(data)
}

async fn handle(e: &Arc<Engine>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return reply(413, format!("request body over {MAX_BODY} bytes\n")),
    };
    let path = parts.uri.path();
    if path == "/_stats" {
        return stats(e);
    }
    if path.starts_with("/_control/") {
        return reply(
            404,
            "control operations are served on the management port\n",
        );
    }
    *e.last_request.lock() = Instant::now();
    e.inflight.fetch_add(1, Ordering::SeqCst);
    let _inflight = Count(&e.inflight);
    let in_bytes = body.len() as u64;
    let (status, out) = request(e, &parts.method, &parts.uri, body).await;
    e.window.lock().bytes += in_bytes + out.len() as u64;
    reply(status, out)
}

fn take_stats(e: &Engine) -> Vec<u8> {
    let w = std::mem::take(&mut *e.window.lock());
    let s = Stats {
        exec_us: (w.samples > 0).then(|| w.exec_us_sum / w.samples),
        samples: w.samples,
        queue: e.inflight.load(Ordering::SeqCst),
        bytes: w.bytes,
        keys: e.data.lock().as_ref().map_or(0, Data::keys),
    };
    serde_json::to_vec(&s).unwrap_or_default()
}

fn stats(e: &Engine) -> Response<Full<Bytes>> {
    reply(200, take_stats(e))
}

/// The management port: `GET /_stats` and `POST /_control/OP?..`, served from a plain thread. An
/// overloaded instance has a long queue of requests on its async runtime; a statistics or control
/// request behind them would come back too late for the 50 ms heartbeat, or stall a migration,
/// exactly when the orchestrator needs them. A thread of its own gets its CPU share from the
/// scheduler directly. Hand-written HTTP/1.1 on purpose: one request line, one response, close.
fn management_thread(e: Arc<Engine>, addr: SocketAddr) -> Result<()> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(addr).map_err(|err| LabError::Demo {
        what: format!("{} service", e.cfg.kind.name()),
        message: format!("cannot listen on {addr} for statistics: {err}"),
    })?;
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
            let mut buf = [0u8; 1024];
            let mut got = 0;
            // Read the request head (bounded); its content does not matter.
            while got < buf.len() {
                match s.read(&mut buf[got..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
                if buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let head = String::from_utf8_lossy(&buf[..got]);
            let target = head.split_whitespace().nth(1).unwrap_or("");
            let (path, query) = match target.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (target, None),
            };
            let (status, body) = if path == "/_stats" {
                (200, take_stats(&e))
            } else if let Some(op) = path.strip_prefix("/_control/") {
                let (status, text) = control(&e, op, query);
                (status, text.into_bytes())
            } else {
                (404, b"try /_stats or /_control/OP\n".to_vec())
            };
            let head = format!(
                "HTTP/1.1 {status} {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                if status == 200 { "OK" } else { "Error" },
                body.len()
            );
            let _ = s
                .write_all(head.as_bytes())
                .and_then(|()| s.write_all(&body));
        }
    });
    Ok(())
}

/// The migration steps, as the runtime asks for them. Synchronous: it runs on the management
/// thread, not behind the request queue.
fn control(e: &Engine, op: &str, query: Option<&str>) -> (u16, String) {
    match op {
        "hold" => {
            e.mode.send_replace(Mode::Hold);
            // Requests already executing finish; new ones wait. Bounded: a request stuck in
            // execution for 10 s means the instance is broken, and the step fails.
            let deadline = Instant::now() + Duration::from_secs(10);
            while e.executing.load(Ordering::SeqCst) > 0 {
                if Instant::now() > deadline {
                    e.mode.send_replace(Mode::Serve);
                    return answer(503, "requests still executing after 10 s; not removed\n");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            answer(
                200,
                format!("held; {} queued\n", e.inflight.load(Ordering::SeqCst)),
            )
        }
        "checkpoint" => {
            let Some(file) = query_param(query, "file") else {
                return answer(400, "checkpoint needs ?file=PATH\n");
            };
            if *e.mode.borrow() != Mode::Hold {
                return answer(409, "hold the instance before checkpointing it\n");
            }
            let Some(data) = e.data.lock().take() else {
                return answer(409, "already checkpointed\n");
            };
            match write_checkpoint(file, &data) {
                Ok(()) => answer(200, format!("{} keys\n", data.keys())),
                Err(msg) => {
                    *e.data.lock() = Some(data);
                    answer(500, msg)
                }
            }
        }
        "resume" => {
            if e.data.lock().is_none() {
                let Some(file) = query_param(query, "file") else {
                    return answer(400, "state was released; resume needs ?file=CHECKPOINT\n");
                };
                match load_checkpoint(std::path::Path::new(file), e.cfg.kind) {
                    Ok(d) => *e.data.lock() = Some(d),
                    Err(err) => return answer(500, format!("{err}\n")),
                }
            }
            e.mode.send_replace(Mode::Serve);
            answer(200, "serving\n")
        }
        "relay" => match query_param(query, "to").map(str::parse::<SocketAddr>) {
            Some(Ok(to)) => {
                e.mode.send_replace(Mode::Relay(to));
                answer(200, format!("relaying to {to}\n"))
            }
            _ => answer(400, "relay needs ?to=IP:PORT\n"),
        },
        "retire" => {
            e.retired.store(true, Ordering::SeqCst);
            answer(200, "retiring once idle\n")
        }
        _ => answer(
            404,
            "unknown control operation; try hold, checkpoint, resume, relay, retire\n",
        ),
    }
}

fn answer(status: u16, body: impl Into<String>) -> (u16, String) {
    (status, body.into())
}

fn write_checkpoint(file: &str, data: &Data) -> std::result::Result<(), String> {
    let text = serde_json::to_vec(data).map_err(|e| format!("cannot encode state: {e}\n"))?;
    let tmp = format!("{file}.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, file))
        .map_err(|e| format!("cannot write checkpoint {file}: {e}\n"))
}

/// Waits out a hold, then executes here or relays to the new location.
async fn request(e: &Engine, method: &Method, uri: &http::Uri, body: Bytes) -> (u16, Bytes) {
    let mut mode = e.mode.subscribe();
    loop {
        let now = mode.borrow_and_update().clone();
        match now {
            Mode::Serve => {
                e.executing.fetch_add(1, Ordering::SeqCst);
                let _executing = Count(&e.executing);
                // A hold that slipped in between: wait it out rather than execute during it.
                if *e.mode.borrow() != Mode::Serve {
                    continue;
                }
                return execute(e, method, uri, &body).await;
            }
            Mode::Hold => {
                if mode.changed().await.is_err() {
                    return (503, Bytes::from_static(b"instance shut down\n"));
                }
            }
            Mode::Relay(to) => return relay(e, to, method, uri, body).await,
        }
    }
}

async fn relay(
    e: &Engine,
    to: SocketAddr,
    method: &Method,
    uri: &http::Uri,
    body: Bytes,
) -> (u16, Bytes) {
    let pq = uri.path_and_query().map_or("/", |p| p.as_str());
    let Ok(req) = Request::builder()
        .method(method.clone())
        .uri(format!("http://{to}{pq}"))
        .body(Full::new(body))
    else {
        return (400, Bytes::from_static(b"unusable request target\n"));
    };
    call(&e.client, req).await
}

async fn call(client: &HttpClient, req: Request<Full<Bytes>>) -> (u16, Bytes) {
    let target = req.uri().to_string();
    match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
        Ok(Ok(resp)) => {
            let status = resp.status().as_u16();
            match resp.into_body().collect().await {
                Ok(b) => (status, b.to_bytes()),
                Err(err) => (502, Bytes::from(format!("{target}: {err}\n"))),
            }
        }
        Ok(Err(err)) => (502, Bytes::from(format!("{target}: {err}\n"))),
        Err(_) => (504, Bytes::from(format!("{target}: no answer in 10 s\n"))),
    }
}

/// Executes one request; only the local work counts as execution time (not the gateway's wait
/// for the services it calls, which is theirs).
async fn execute(e: &Engine, method: &Method, uri: &http::Uri, body: &Bytes) -> (u16, Bytes) {
    let prefix = e.cfg.kind.path_prefix();
    let Some(key) = uri.path().strip_prefix(prefix.as_str()) else {
        return (
            404,
            Bytes::from(format!(
                "this is the {} service; paths start with {prefix}\n",
                e.cfg.kind.name()
            )),
        );
    };
    let started = Instant::now();
    burn(key.len() as u64, e.cfg.work_iterations);
    if e.cfg.kind == Kind::Gateway {
        let allowed = {
            let client = query_param(uri.query(), "client").unwrap_or("anonymous");
            let mut data = e.data.lock();
            match data.as_mut() {
                Some(Data::Gateway(limiter)) => Some(limiter.allow(client, Instant::now())),
                _ => None,
            }
        };
        record(e, started);
        return match allowed {
            Some(true) => gateway(e, key, uri.query()).await,
            Some(false) => (429, Bytes::from_static(b"rate limited\n")),
            None => (503, Bytes::from_static(b"gateway state is not loaded\n")),
        };
    }
    let text = String::from_utf8_lossy(body);
    let out = match e.data.lock().as_mut() {
        Some(d) => d.execute(method, key, &text),
        None => (503, "state was released (instance migrated)\n".into()),
    };
    record(e, started);
    (out.0, Bytes::from(out.1))
}

fn record(e: &Engine, started: Instant) {
    let us = started.elapsed().as_micros() as u64;
    let mut w = e.window.lock();
    w.exec_us_sum += us;
    w.samples += 1;
}

/// The API gateway's fan-out: `GET /api/event?client=C&key=K&value=V` stores V in KVS, counts
/// the event and folds V into the EMA, all through the node proxy, concurrently.
async fn gateway(e: &Engine, path: &str, query: Option<&str>) -> (u16, Bytes) {
    if path != "event" {
        return (404, Bytes::from_static(b"the gateway serves /api/event\n"));
    }
    let (Some(key), Some(value)) = (query_param(query, "key"), query_param(query, "value")) else {
        return (
            400,
            Bytes::from_static(b"/api/event needs ?key=K&value=V\n"),
        );
    };
    let Some(upstream) = e.cfg.upstream else {
        return (
            503,
            Bytes::from_static(b"the gateway has no upstream proxy configured\n"),
        );
    };
    let make = |method: Method, path: String, body: &str| {
        Request::builder()
            .method(method)
            .uri(format!("http://{upstream}{path}"))
            .body(Full::new(Bytes::from(body.to_string())))
    };
    let (Ok(put), Ok(count), Ok(ema)) = (
        make(Method::PUT, format!("/kvs/{key}"), value),
        make(Method::POST, format!("/count/{key}"), ""),
        make(Method::POST, format!("/ema/{key}"), value),
    ) else {
        return (400, Bytes::from_static(b"unusable key or value\n"));
    };
    let (put, count, ema) = tokio::join!(
        call(&e.client, put),
        call(&e.client, count),
        call(&e.client, ema)
    );
    for (what, (status, body)) in [("kvs", &put), ("count", &count), ("ema", &ema)] {
        if *status != 200 {
            return (
                502,
                Bytes::from(format!(
                    "{what} answered {status}: {}",
                    String::from_utf8_lossy(body)
                )),
            );
        }
    }
    (
        200,
        Bytes::from(format!(
            "{{\"count\":{},\"ema\":{}}}",
            String::from_utf8_lossy(&count.1),
            String::from_utf8_lossy(&ema.1)
        )),
    )
}
