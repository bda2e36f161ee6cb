//! The span exporter: workers hand finished spans to a bounded queue (`tracing.queue`
//! spans) without ever waiting; a thread of its own drains it in batches and sends each as
//! one OTLP/gRPC `TraceService/Export` call over HTTP/2 (hyper's client). A full queue drops
//! the span, a failed export drops its batch; both are counted
//! (`flatmesh_tracing_spans_dropped_total{reason}`), so a slow or unreachable collector costs
//! the data path nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message as _;
use tokio::sync::mpsc;

use super::otlp::{
    ExportTraceServiceRequest, InstrumentationScope, KeyValue, Resource, ResourceSpans, ScopeSpans,
    Span, EXPORT_PATH,
};

/// Spans per export call at most (the OpenTelemetry SDKs' default batch size).
pub const BATCH: usize = 512;
/// How long a batch waits for more spans before it goes.
pub const FLUSH_EVERY: Duration = Duration::from_millis(200);
/// Connecting and one export call each get this long; then the batch is dropped.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// What happened to the spans the node kept, for `/metrics`.
#[derive(Debug, Default)]
pub struct TraceCounts {
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans dropped because the queue was full (the exporter lagged).
    pub queue_full: AtomicU64,
    /// Spans dropped because their export call failed (collector unreachable, refused, slow).
    pub export_failed: AtomicU64,
}

/// The workers' end of the queue. Cheap to clone.
#[derive(Clone)]
pub struct Exporter {
    queue: mpsc::Sender<Span>,
    counts: Arc<TraceCounts>,
}

impl Exporter {
    /// Starts the exporter thread sending to `collector` (`HOST:PORT`) with the resource's
    /// `service.name`. It ends once every [`Exporter`] is dropped and the queue is flushed.
    pub fn start(
        collector: &str,
        service_name: &str,
        queue: usize,
        counts: Arc<TraceCounts>,
    ) -> std::io::Result<Exporter> {
        let (tx, rx) = mpsc::channel(queue);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let sender = Sender {
            collector: collector.to_owned(),
            resource: Resource {
                attributes: vec![
                    KeyValue::string("service.name", service_name),
                    KeyValue::string("telemetry.sdk.name", "flatmesh"),
                ],
            },
            counts: counts.clone(),
            conn: None,
            failing: false,
        };
        std::thread::Builder::new()
            .name("flatmesh-trace".into())
            .spawn(move || runtime.block_on(sender.run(rx)))?;
        Ok(Exporter { queue: tx, counts })
    }

    /// Queues `span`, or drops and counts it when the queue is full. Never waits.
    pub fn send(&self, span: Span) {
        if self.queue.try_send(span).is_err() {
            self.counts.queue_full.fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct Sender {
    collector: String,
    resource: Resource,
    counts: Arc<TraceCounts>,
    conn: Option<SendRequest<Full<Bytes>>>,
    /// The last export failed: the next failure is not logged again.
    failing: bool,
}

impl Sender {
    async fn run(mut self, mut rx: mpsc::Receiver<Span>) {
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            let Some(first) = rx.recv().await else {
                return;
            };
            batch.push(first);
            let deadline = tokio::time::Instant::now() + FLUSH_EVERY;
            let mut closed = false;
            while batch.len() < BATCH {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(span)) => batch.push(span),
                    Ok(None) => {
                        closed = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            let spans = batch.len() as u64;
            match self.export(std::mem::take(&mut batch)).await {
                Ok(()) => {
                    self.counts.exported.fetch_add(spans, Ordering::Relaxed);
                    if self.failing {
                        tracing::info!(collector = %self.collector, "span export works again");
                    }
                    self.failing = false;
                }
                Err(why) => {
                    self.counts
                        .export_failed
                        .fetch_add(spans, Ordering::Relaxed);
                    self.conn = None;
                    if !self.failing {
                        tracing::warn!(collector = %self.collector, %why, spans, "span export failed; spans are dropped (and counted) until it works again");
                    }
                    self.failing = true;
                }
            }
            batch = Vec::with_capacity(BATCH);
            if closed {
                return;
            }
        }
    }

    /// One `TraceService/Export` call carrying `spans`.
    async fn export(&mut self, spans: Vec<Span>) -> Result<(), String> {
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "flatmesh-proxy".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                    }),
                    spans,
                }],
            }],
        };
        let body = grpc_frame(&request);
        let conn = match self.conn.as_mut() {
            Some(c) if !c.is_closed() => c,
            _ => self.conn.insert(
                tokio::time::timeout(EXPORT_TIMEOUT, connect(&self.collector))
                    .await
                    .map_err(|_| format!("no connection within {EXPORT_TIMEOUT:?}"))??,
            ),
        };
        let req = http::Request::post(format!("http://{}{EXPORT_PATH}", self.collector))
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let call = async {
            conn.ready().await.map_err(|e| e.to_string())?;
            let resp = conn.send_request(req).await.map_err(|e| e.to_string())?;
            if resp.status() != http::StatusCode::OK {
                return Err(format!("HTTP status {}", resp.status()));
            }
            // A trailers-only answer carries grpc-status in its headers.
            let in_headers = grpc_status(resp.headers());
            let collected = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            let status = in_headers.or_else(|| collected.trailers().and_then(grpc_status));
            match status {
                Some((0, _)) => Ok(()),
                Some((code, message)) => Err(format!("grpc-status {code}: {message}")),
                None => Err("the answer has no grpc-status".into()),
            }
        };
        tokio::time::timeout(EXPORT_TIMEOUT, call)
            .await
            .map_err(|_| format!("no answer within {EXPORT_TIMEOUT:?}"))?
    }
}

async fn connect(collector: &str) -> Result<SendRequest<Full<Bytes>>, String> {
    let stream = tokio::net::TcpStream::connect(collector)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP/2 handshake failed: {e}"))?;
    tokio::spawn(conn);
    Ok(send)
}

/// A gRPC message frame: uncompressed flag, big-endian length, the message.
fn grpc_frame(message: &ExportTraceServiceRequest) -> Bytes {
    let len = message.encoded_len();
    let mut out = BytesMut::with_capacity(5 + len);
    out.put_u8(0);
    out.put_u32(len as u32);
    // Encoding into a buffer with room for the whole message cannot fail.
    let _ = message.encode(&mut out);
    out.freeze()
}

fn grpc_status(headers: &http::HeaderMap) -> Option<(u32, String)> {
    let code = headers
        .get("grpc-status")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Some((code, message))
}
