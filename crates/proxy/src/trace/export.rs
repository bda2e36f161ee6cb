//! The span exporter: workers encode each finished span (OTLP protobuf, `super::wire`)
//! straight into a bounded queue of batches without ever waiting for the exporter; a thread
//! of its own sends each batch as one OTLP/gRPC `TraceService/Export` call over HTTP/2
//! (hyper's client). A full queue drops the span (before it is encoded), a failed export
//! drops its batch; both are counted (`flatmesh_tracing_spans_dropped_total{reason}`), so a
//! slow or unreachable collector costs the data path nothing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::otlp::EXPORT_PATH;
use super::wire;

/// Spans per export call at most, and fewer when the queue is smaller (half of it, so one
/// batch can fill while another is sent). Four times the OpenTelemetry SDKs' default (512):
/// every call costs the exporter thread, which shares the workers' CPU, the same fixed work.
pub const BATCH: usize = 2048;
/// Bytes of encoded spans per export call at most: well under the 4 MiB a gRPC server takes
/// by default, whatever the spans hold.
const BATCH_BYTES: usize = 1 << 20;
/// How long a batch waits for more spans before it goes.
pub const FLUSH_EVERY: Duration = Duration::from_millis(200);
/// Connecting and one export call each get this long; then the batch is dropped.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// Emptied batch buffers kept for reuse.
const SPARE_BUFFERS: usize = 2;

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

/// The workers' end of the queue. Dropping it lets the exporter thread send what is queued
/// and end.
pub struct Exporter {
    queue: Arc<Queue>,
    counts: Arc<TraceCounts>,
}

/// Encoded spans waiting for the exporter, shared by the workers and the exporter thread.
struct Queue {
    pending: Mutex<Pending>,
    /// Wakes the exporter: a batch is full, the first span of a batch came, or the workers
    /// are gone.
    wake: Notify,
    /// Spans queued at most (`tracing.queue`).
    capacity: usize,
    /// Spans per batch at most.
    batch: usize,
}

#[derive(Default)]
struct Pending {
    /// The batch the workers append to.
    filling: Batch,
    /// Batches that are full, oldest first.
    full: VecDeque<Batch>,
    /// Spans in `filling` and `full`.
    queued: usize,
    spare: Vec<Vec<u8>>,
    /// Every [`Exporter`] is gone: send what is left and end.
    closed: bool,
}

/// Spans encoded back to back, each as an OTLP `ScopeSpans.spans` field.
#[derive(Default)]
struct Batch {
    bytes: Vec<u8>,
    spans: usize,
}

impl Exporter {
    /// Starts the exporter thread sending to `collector` (`HOST:PORT`) with the resource's
    /// `service.name`. It ends once the [`Exporter`] is dropped and the queue is flushed.
    pub fn start(
        collector: &str,
        service_name: &str,
        queue: usize,
        counts: Arc<TraceCounts>,
    ) -> std::io::Result<Exporter> {
        let queue = Arc::new(Queue {
            pending: Mutex::new(Pending::default()),
            wake: Notify::new(),
            capacity: queue,
            batch: BATCH.min(queue / 2).max(1),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let sender = Sender {
            collector: collector.to_owned(),
            uri: format!("http://{collector}{EXPORT_PATH}"),
            envelope: Envelope::new(service_name),
            counts: counts.clone(),
            conn: None,
            failing: false,
        };
        let drained = queue.clone();
        std::thread::Builder::new()
            .name("flatmesh-trace".into())
            .spawn(move || runtime.block_on(sender.run(drained)))?;
        Ok(Exporter { queue, counts })
    }

    /// Queues the span `encode` writes (its `Span` message's fields), or drops and counts it
    /// when the queue is full. Never waits for the exporter.
    pub fn send(&self, encode: impl FnOnce(&mut Vec<u8>)) {
        let q = &*self.queue;
        let mut p = q.pending.lock();
        if p.queued >= q.capacity {
            drop(p);
            self.counts.queue_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        p.queued += 1;
        let filling = &mut p.filling;
        if filling.bytes.capacity() == 0 {
            // Room for a batch of usual spans (300-500 bytes); it grows if they are larger.
            filling.bytes.reserve(q.batch * 512);
        }
        wire::delimited(&mut filling.bytes, 2, encode); // ScopeSpans.spans
        filling.spans += 1;
        let wake = if filling.spans >= q.batch || filling.bytes.len() >= BATCH_BYTES {
            let next = Batch {
                bytes: p.spare.pop().unwrap_or_default(),
                spans: 0,
            };
            let done = std::mem::replace(&mut p.filling, next);
            p.full.push_back(done);
            true
        } else {
            // The exporter starts the batch's clock.
            p.filling.spans == 1
        };
        drop(p);
        if wake {
            q.wake.notify_one();
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.queue.pending.lock().closed = true;
        self.queue.wake.notify_one();
    }
}

impl Queue {
    /// The next batch to send: a full one, else the filling one once it has waited
    /// [`FLUSH_EVERY`] (or at once when closed). `None` when closed and empty.
    async fn next(&self) -> Option<Batch> {
        let mut deadline = None;
        loop {
            {
                let mut p = self.pending.lock();
                let due = p.closed || deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
                let batch = match p.full.pop_front() {
                    Some(b) => Some(b),
                    None if p.filling.spans > 0 && due => {
                        let next = Batch {
                            bytes: p.spare.pop().unwrap_or_default(),
                            spans: 0,
                        };
                        Some(std::mem::replace(&mut p.filling, next))
                    }
                    None if p.closed => return None,
                    None => None,
                };
                if let Some(b) = batch {
                    p.queued -= b.spans;
                    return Some(b);
                }
                if p.filling.spans > 0 && deadline.is_none() {
                    deadline = Some(tokio::time::Instant::now() + FLUSH_EVERY);
                }
            }
            match deadline {
                Some(d) => {
                    let _ = tokio::time::timeout_at(d, self.wake.notified()).await;
                }
                None => self.wake.notified().await,
            }
        }
    }

    /// Keeps `bytes`'s buffer for a later batch.
    fn recycle(&self, mut bytes: Vec<u8>) {
        bytes.clear();
        let mut p = self.pending.lock();
        if p.spare.len() < SPARE_BUFFERS {
            p.spare.push(bytes);
        }
    }
}

/// What every export call wraps its spans in: an `ExportTraceServiceRequest` with one
/// `ResourceSpans` (the node's resource) holding one `ScopeSpans` (the node's scope).
struct Envelope {
    /// `ResourceSpans.resource`, encoded with its field key.
    resource: Vec<u8>,
    /// `ScopeSpans.scope`, encoded with its field key.
    scope: Vec<u8>,
}

impl Envelope {
    fn new(service_name: &str) -> Envelope {
        let mut resource = Vec::new();
        wire::delimited(&mut resource, 1, |b| {
            wire::attr_str(b, 1, "service.name", service_name.as_bytes());
            wire::attr_str(b, 1, "telemetry.sdk.name", b"flatmesh");
        });
        let mut scope = Vec::new();
        wire::delimited(&mut scope, 1, |b| {
            wire::bytes(b, 1, b"flatmesh-proxy");
            wire::bytes(b, 2, env!("CARGO_PKG_VERSION").as_bytes());
        });
        Envelope { resource, scope }
    }

    /// The gRPC message (flag, big-endian length, then the request) carrying `spans`.
    fn frame(&self, spans: &[u8]) -> Bytes {
        let scope_spans = self.scope.len() + spans.len();
        let resource_spans =
            self.resource.len() + 1 + wire::varint_len(scope_spans as u64) + scope_spans;
        let request = 1 + wire::varint_len(resource_spans as u64) + resource_spans;
        let mut head = Vec::with_capacity(32);
        wire::delimited_head(&mut head, 1, resource_spans); // ExportTraceServiceRequest.resource_spans
        head.extend_from_slice(&self.resource);
        wire::delimited_head(&mut head, 2, scope_spans); // ResourceSpans.scope_spans
        let mut out = BytesMut::with_capacity(5 + request);
        out.put_u8(0);
        out.put_u32(request as u32);
        out.put_slice(&head);
        out.put_slice(&self.scope);
        out.put_slice(spans);
        debug_assert_eq!(out.len(), 5 + request);
        out.freeze()
    }
}

struct Sender {
    collector: String,
    uri: String,
    envelope: Envelope,
    counts: Arc<TraceCounts>,
    conn: Option<SendRequest<Full<Bytes>>>,
    /// The last export failed: the next failure is not logged again.
    failing: bool,
}

impl Sender {
    async fn run(mut self, queue: Arc<Queue>) {
        while let Some(batch) = queue.next().await {
            let spans = batch.spans as u64;
            let body = self.envelope.frame(&batch.bytes);
            queue.recycle(batch.bytes);
            match self.export(body).await {
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
        }
    }

    /// One `TraceService/Export` call carrying `body` (a gRPC message frame).
    async fn export(&mut self, body: Bytes) -> Result<(), String> {
        let conn = match self.conn.as_mut() {
            Some(c) if !c.is_closed() => c,
            _ => self.conn.insert(
                tokio::time::timeout(EXPORT_TIMEOUT, connect(&self.collector))
                    .await
                    .map_err(|_| format!("no connection within {EXPORT_TIMEOUT:?}"))??,
            ),
        };
        let req = http::Request::post(self.uri.as_str())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::otlp::{self, ExportTraceServiceRequest, Value};
    use prost::Message as _;

    fn exporter(capacity: usize) -> Exporter {
        Exporter {
            queue: Arc::new(Queue {
                pending: Mutex::new(Pending::default()),
                wake: Notify::new(),
                capacity,
                batch: BATCH.min(capacity / 2).max(1),
            }),
            counts: Arc::default(),
        }
    }

    fn span(n: u8) -> otlp::Span {
        otlp::Span {
            trace_id: vec![n; 16],
            span_id: vec![n; 8],
            name: format!("GET /{n}"),
            kind: otlp::SPAN_KIND_SERVER,
            attributes: vec![otlp::KeyValue::int("n", n.into())],
            ..Default::default()
        }
    }

    fn send(e: &Exporter, n: u8) {
        e.send(|buf| span(n).encode_raw(buf));
    }

    /// The spans a batch holds, decoded.
    fn spans_in(batch: &Batch) -> Vec<otlp::Span> {
        let frame = Envelope::new("svc").frame(&batch.bytes);
        let request = ExportTraceServiceRequest::decode(&frame[5..]).expect("valid request");
        request.resource_spans[0].scope_spans[0].spans.clone()
    }

    #[test]
    fn a_frame_is_one_grpc_message_holding_the_resource_the_scope_and_the_spans() {
        let mut spans = Vec::new();
        for n in 0..200 {
            // Enough spans that every length prefix takes more than one byte.
            wire::delimited(&mut spans, 2, |buf| span(n).encode_raw(buf));
        }
        let frame = Envelope::new("web-node-1").frame(&spans);
        assert_eq!(frame[0], 0, "uncompressed");
        let len = u32::from_be_bytes(frame[1..5].try_into().expect("4 bytes")) as usize;
        assert_eq!(len, frame.len() - 5);
        let request = ExportTraceServiceRequest::decode(&frame[5..]).expect("valid request");
        assert_eq!(request.resource_spans.len(), 1);
        let rs = &request.resource_spans[0];
        let resource = rs.resource.as_ref().expect("resource");
        let attrs: Vec<(String, Option<Value>)> = resource
            .attributes
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone().and_then(|v| v.value)))
            .collect();
        assert_eq!(
            attrs,
            vec![
                (
                    "service.name".to_owned(),
                    Some(Value::String("web-node-1".into()))
                ),
                (
                    "telemetry.sdk.name".to_owned(),
                    Some(Value::String("flatmesh".into()))
                ),
            ]
        );
        assert_eq!(rs.scope_spans.len(), 1);
        let scope = rs.scope_spans[0].scope.as_ref().expect("scope");
        assert_eq!(scope.name, "flatmesh-proxy");
        assert_eq!(scope.version, env!("CARGO_PKG_VERSION"));
        let expected: Vec<otlp::Span> = (0..200).map(span).collect();
        assert_eq!(rs.scope_spans[0].spans, expected);
    }

    #[tokio::test(start_paused = true)]
    async fn full_batches_go_at_once_and_a_partial_one_after_the_flush_interval() {
        let e = exporter(4 * BATCH);
        assert_eq!(e.queue.batch, BATCH);
        for n in 0..(BATCH + 3) {
            send(&e, n as u8);
        }
        let first = e.queue.next().await.expect("a full batch");
        assert_eq!(first.spans, BATCH);
        let decoded = spans_in(&first);
        assert_eq!(decoded.len(), BATCH);
        assert_eq!(decoded[7], span(7));
        let began = tokio::time::Instant::now();
        let rest = e.queue.next().await.expect("the partial batch");
        assert_eq!(rest.spans, 3);
        assert_eq!(began.elapsed(), FLUSH_EVERY, "it waited for more spans");
        assert_eq!(spans_in(&rest), vec![span(0), span(1), span(2)]);
        assert_eq!(e.queue.pending.lock().queued, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_drops_and_counts_and_closing_flushes_what_is_left() {
        let e = exporter(16);
        for n in 0..40 {
            send(&e, n);
        }
        assert_eq!(e.counts.queue_full.load(Ordering::Relaxed), 24);
        let queue = e.queue.clone();
        let first = queue.next().await.expect("a batch");
        assert_eq!(
            first.spans, 8,
            "batches are half the queue when it is small"
        );
        // Room again: the next span is queued.
        send(&e, 99);
        drop(e);
        let mut rest = Vec::new();
        while let Some(b) = queue.next().await {
            rest.extend(spans_in(&b));
        }
        let expected: Vec<otlp::Span> = (8..16).chain([99]).map(span).collect();
        assert_eq!(rest, expected, "closing sends what is queued, then ends");
    }
}
