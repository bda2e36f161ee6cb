//! Distributed tracing on the L7 path (config `tracing`, docs/observability.md "Tracing").
//! Named `trace` so it does not clash with the `tracing` crate the node logs with.
//!
//! For every request the L7 layer decides (both codecs, `crate::l7`):
//! 1. [`Tracer::begin`] reads the caller's trace context (`context`: W3C `traceparent` /
//!    `tracestate`, else B3 `b3`, else `x-b3-*`; anything malformed is ignored and a new
//!    trace begins), draws a span id for the node's span and makes the sampling decision:
//!    the caller's, if it made one, else a draw at `tracing.sample`;
//! 2. [`Started::propagation`] gives the headers the upstream request carries in place of
//!    the caller's: a `traceparent` whose parent is the node's span, the caller's
//!    `tracestate`, the same in B3 if the caller spoke B3, and `x-request-id` when absent;
//! 3. [`Tracer::end`] (from `crate::l7::log::finish`) turns the finished request into a
//!    SERVER span (route, cluster, status, upstream endpoint) and queues it for `export`
//!    when the request was sampled or ended in 5xx. Unsampled, non-5xx requests cost no
//!    allocation past step 2.

mod context;
mod export;
pub mod otlp;
mod wire;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flatmesh_config::Tracing;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

pub use context::{
    check_tracestate, parse_b3_multi, parse_b3_single, parse_traceparent, TRACE_HEADERS,
};
use context::{hex, push_hex, SpanId, Styles, TraceId};
use export::Exporter;
pub use export::TraceCounts;

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// An `x-request-id` longer than this is not copied into the span (it still goes upstream).
const MAX_REQUEST_ID: usize = 128;

/// The headers a request's propagation sets on the upstream request.
pub type Propagation = SmallVec<[(HeaderName, HeaderValue); 4]>;

/// The node's tracer: off (every method a no-op), or the sampling rate and the exporter's
/// queue. Cheap to clone.
#[derive(Clone, Default)]
pub struct Tracer {
    inner: Option<Arc<Inner>>,
}

/// The node's tracer, shared by every worker and replaced when a reload changes `tracing`:
/// a connection takes the tracer in force when it is accepted.
pub type NodeTracer = Arc<arc_swap::ArcSwap<Tracer>>;

struct Inner {
    sample: f64,
    exporter: Exporter,
}

impl Tracer {
    pub fn disabled() -> Tracer {
        Tracer::default()
    }

    /// A tracer for `config` (off when there is none), counting into `counts`.
    pub fn start(config: Option<&Tracing>, counts: Arc<TraceCounts>) -> std::io::Result<Tracer> {
        let Some(config) = config else {
            return Ok(Tracer::disabled());
        };
        let exporter = Exporter::start(&config.otlp, &config.service_name, config.queue, counts)?;
        Ok(Tracer {
            inner: Some(Arc::new(Inner {
                sample: config.sample,
                exporter,
            })),
        })
    }

    /// The node's span for a request with `headers` begins: `None` when tracing is off.
    pub fn begin(
        &self,
        headers: flatmesh_rules::Headers<'_>,
        method: &http::Method,
    ) -> Option<Started> {
        let inner = self.inner.as_ref()?;
        Some(Started::new(headers, method, || {
            rand::random::<f64>() < inner.sample
        }))
    }

    /// The request `started` ended as `outcome` after `elapsed`: its span is queued when it
    /// was sampled or ended in 5xx.
    pub(crate) fn end(&self, started: &Started, span: FinishedSpan<'_>) {
        let Some(inner) = &self.inner else {
            return;
        };
        if started.sampled || span.status >= 500 {
            inner.exporter.send(|buf| started.encode(&span, buf));
        }
    }
}

/// What the L7 layer knows about a finished request, for its span.
pub(crate) struct FinishedSpan<'a> {
    pub listener: &'a str,
    pub route: Option<&'a str>,
    pub cluster: Option<&'a str>,
    pub upstream: Option<std::net::SocketAddr>,
    pub client: std::net::SocketAddr,
    pub status: u16,
    pub elapsed: Duration,
}

/// The node's span of one request, from its start.
#[derive(Debug, Clone)]
pub struct Started {
    trace_id: TraceId,
    span_id: SpanId,
    /// The caller's span, when the request joined a trace.
    parent: Option<SpanId>,
    sampled: bool,
    tracestate: Option<String>,
    styles: Styles,
    /// The request's `x-request-id`, or the one the node made for it.
    request_id: String,
    /// The node made `request_id`: it goes upstream.
    request_id_made: bool,
    method: http::Method,
    wall: SystemTime,
}

impl Started {
    /// `draw` makes the sampling decision for a request that brings none.
    pub fn new(
        headers: flatmesh_rules::Headers<'_>,
        method: &http::Method,
        draw: impl FnOnce() -> bool,
    ) -> Started {
        let first = |name: &HeaderName| headers.first(name);
        let styles = Styles {
            b3_single: first(&context::B3).is_some(),
            b3_multi: first(&context::B3_TRACE_ID).is_some(),
        };
        let w3c = first(&context::TRACEPARENT).and_then(parse_traceparent);
        let parent = w3c
            .or_else(|| first(&context::B3).and_then(parse_b3_single))
            .or_else(|| {
                parse_b3_multi(
                    first(&context::B3_TRACE_ID)?,
                    first(&context::B3_SPAN_ID)?,
                    first(&context::B3_SAMPLED),
                    first(&context::B3_FLAGS),
                )
            });
        // tracestate belongs to traceparent: without a valid one it is dropped (W3C §3.3).
        // Several lines make one list.
        let tracestate = w3c.and_then(|_| {
            let lines: Vec<&[u8]> = headers.values(&context::TRACESTATE).collect();
            let joined = lines.join(&b","[..]);
            check_tracestate(&joined).map(str::to_owned)
        });
        let sampled = parent.and_then(|p| p.sampled).unwrap_or_else(draw);
        let (request_id, request_id_made) = match headers.first(&X_REQUEST_ID) {
            Some(id) => (
                String::from_utf8_lossy(&id[..id.len().min(MAX_REQUEST_ID)]).into_owned(),
                false,
            ),
            None => (uuid_v4(), true),
        };
        Started {
            trace_id: parent.map_or_else(new_trace_id, |p| p.trace_id),
            span_id: new_span_id(),
            parent: parent.map(|p| p.span_id),
            sampled,
            tracestate,
            styles,
            request_id,
            request_id_made,
            method: method.clone(),
            wall: SystemTime::now(),
        }
    }

    /// The headers the upstream request carries in place of every header in
    /// [`TRACE_HEADERS`] the client sent (plus `x-request-id` when the client sent none).
    pub fn propagation(&self) -> Propagation {
        let mut out = Propagation::new();
        let flag = if self.sampled { "01" } else { "00" };
        let mut traceparent = String::with_capacity(55);
        traceparent.push_str("00-");
        push_hex(&mut traceparent, &self.trace_id);
        traceparent.push('-');
        push_hex(&mut traceparent, &self.span_id);
        traceparent.push('-');
        traceparent.push_str(flag);
        let mut add = |name: HeaderName, value: String| {
            // Hex, digits and checked tracestate text: always a valid value.
            if let Ok(v) = HeaderValue::try_from(value) {
                out.push((name, v));
            }
        };
        add(context::TRACEPARENT, traceparent);
        if let Some(state) = &self.tracestate {
            add(context::TRACESTATE, state.clone());
        }
        let sampled = if self.sampled { "1" } else { "0" };
        if self.styles.b3_single {
            add(
                context::B3,
                format!("{}-{}-{sampled}", hex(&self.trace_id), hex(&self.span_id)),
            );
        }
        if self.styles.b3_multi {
            add(context::B3_TRACE_ID, hex(&self.trace_id));
            add(context::B3_SPAN_ID, hex(&self.span_id));
            if let Some(parent) = &self.parent {
                add(context::B3_PARENT_SPAN_ID, hex(parent));
            }
            add(context::B3_SAMPLED, sampled.to_owned());
        }
        if self.request_id_made {
            add(X_REQUEST_ID, self.request_id.clone());
        }
        out
    }

    /// Puts [`Started::propagation`] into a request held in `http` types whose route's
    /// additions (`route_adds`) are already in: a header the route adds wins over the
    /// node's trace header of the same name, as on the HTTP/1 path (`crate::h1::head`).
    pub fn propagate(&self, headers: &mut HeaderMap, route_adds: &[(HeaderName, HeaderValue)]) {
        let routed = |name: &HeaderName| route_adds.iter().any(|(n, _)| n == name);
        for name in TRACE_HEADERS.iter().filter(|n| !routed(n)) {
            headers.remove(name);
        }
        for (name, value) in self.propagation() {
            if !routed(&name) {
                headers.insert(name, value);
            }
        }
    }

    /// Appends the OTLP `Span` message (`trace.proto`) of the request, finished as `done`,
    /// to `buf`: its fields only, without a key or length of its own.
    fn encode(&self, done: &FinishedSpan<'_>, buf: &mut Vec<u8>) {
        let start = nanos(self.wall);
        let end = start.saturating_add(done.elapsed.as_nanos().min(u64::MAX as u128) as u64);
        let method = self.method.as_str();
        wire::bytes(buf, 1, &self.trace_id);
        wire::bytes(buf, 2, &self.span_id);
        if let Some(state) = self.tracestate.as_deref().filter(|s| !s.is_empty()) {
            wire::bytes(buf, 3, state.as_bytes());
        }
        if let Some(parent) = &self.parent {
            wire::bytes(buf, 4, parent);
        }
        let route = done.route.unwrap_or("(no route)");
        wire::delimited_head(buf, 5, method.len() + 1 + route.len()); // name: "GET route"
        buf.extend_from_slice(method.as_bytes());
        buf.push(b' ');
        buf.extend_from_slice(route.as_bytes());
        wire::int(buf, 6, otlp::SPAN_KIND_SERVER.into());
        wire::fixed64(buf, 7, start);
        wire::fixed64(buf, 8, end);
        const ATTR: u32 = 9;
        wire::attr_str(buf, ATTR, "http.request.method", method.as_bytes());
        wire::attr_int(buf, ATTR, "http.response.status_code", done.status.into());
        wire::attr_str(buf, ATTR, "flatmesh.listener", done.listener.as_bytes());
        let client = done.client.ip();
        wire::attr_text(buf, ATTR, "client.address", |b| wire::push_ip(b, client));
        wire::attr_str(
            buf,
            ATTR,
            "http.request.header.x-request-id",
            self.request_id.as_bytes(),
        );
        if let Some(route) = done.route {
            wire::attr_str(buf, ATTR, "flatmesh.route", route.as_bytes());
        }
        if let Some(cluster) = done.cluster {
            wire::attr_str(buf, ATTR, "flatmesh.cluster", cluster.as_bytes());
        }
        if let Some(upstream) = done.upstream {
            let addr = |b: &mut Vec<u8>| wire::push_socket_addr(b, upstream);
            wire::attr_text(buf, ATTR, "flatmesh.upstream", addr);
        }
        if !self.sampled {
            // Kept only because it failed (docs/observability.md, "Sampling").
            wire::attr_str(buf, ATTR, "flatmesh.kept", b"error");
        }
        if done.status >= 500 {
            wire::delimited(buf, 15, |b| {
                wire::display(b, 2, format_args!("HTTP {}", done.status));
                wire::int(b, 3, otlp::STATUS_ERROR.into());
            });
        }
        if self.sampled {
            wire::fixed32(buf, 16, 1); // flags: W3C sampled
        }
    }
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos().min(u64::MAX as u128) as u64)
}

fn new_trace_id() -> TraceId {
    loop {
        let id: TraceId = rand::random();
        if id != [0; 16] {
            return id;
        }
    }
}

fn new_span_id() -> SpanId {
    loop {
        let id: SpanId = rand::random();
        if id != [0; 8] {
            return id;
        }
    }
}

/// A random (version 4) UUID, as Envoy makes for `x-request-id`: one allocation, since
/// every request without an id gets one.
fn uuid_v4() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let mut out = String::with_capacity(36);
    for (group, range) in [0..4, 4..6, 6..8, 8..10, 10..16].into_iter().enumerate() {
        if group > 0 {
            out.push('-');
        }
        push_hex(&mut out, &b[range]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::try_from(*k).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    fn begin(pairs: &[(&str, &str)], draw: bool) -> Started {
        let h = map(pairs);
        Started::new((&h).into(), &http::Method::GET, || draw)
    }

    /// The span `s` encodes for `done`, decoded by prost as the collector would.
    fn decoded(s: &Started, done: &FinishedSpan<'_>) -> otlp::Span {
        use prost::Message as _;
        let mut buf = Vec::new();
        s.encode(done, &mut buf);
        otlp::Span::decode(buf.as_slice()).expect("a valid OTLP span")
    }

    fn sent(s: &Started) -> HeaderMap {
        let mut h = HeaderMap::new();
        s.propagate(&mut h, &[]);
        h
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).and_then(|v| v.to_str().ok())
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_w3c_caller_s_trace_is_joined_and_the_node_s_span_goes_upstream() {
        let s = begin(&[("traceparent", PARENT), ("tracestate", "rojo=1")], false);
        assert!(s.sampled, "the caller's decision wins over the draw");
        let h = sent(&s);
        let tp = get(&h, "traceparent").expect("traceparent");
        let up = parse_traceparent(tp.as_bytes()).expect("valid traceparent upstream");
        assert_eq!(hex(&up.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(
            hex(&up.span_id),
            "00f067aa0ba902b7",
            "the parent is the node's span"
        );
        assert_eq!(up.span_id, s.span_id);
        assert_eq!(up.sampled, Some(true));
        assert_eq!(get(&h, "tracestate"), Some("rojo=1"));
        assert!(get(&h, "x-request-id").is_some(), "added when absent");
        assert!(get(&h, "b3").is_none(), "no B3 for a W3C caller");
        let span = decoded(
            &s,
            &FinishedSpan {
                listener: "web",
                route: Some("web/0"),
                cluster: Some("api"),
                upstream: None,
                client: "10.0.0.1:5000".parse().expect("addr"),
                status: 200,
                elapsed: Duration::from_millis(3),
            },
        );
        assert_eq!(hex(&span.parent_span_id), "00f067aa0ba902b7");
        assert_eq!(span.trace_id, up.trace_id.to_vec());
        assert_eq!(span.name, "GET web/0");
        assert_eq!(
            span.end_time_unix_nano - span.start_time_unix_nano,
            3_000_000
        );
    }

    #[test]
    fn a_malformed_traceparent_starts_a_new_trace_and_drops_tracestate() {
        let s = begin(
            &[
                ("traceparent", "00-zz-00f067aa0ba902b7-01"),
                ("tracestate", "rojo=1"),
            ],
            false,
        );
        assert_eq!(s.parent, None);
        assert!(!s.sampled, "no caller decision: the draw decides");
        let h = sent(&s);
        let up = parse_traceparent(get(&h, "traceparent").expect("tp").as_bytes()).expect("ok");
        assert_eq!(up.sampled, Some(false));
        assert!(get(&h, "tracestate").is_none());
    }

    #[test]
    fn b3_callers_get_b3_back_with_the_node_s_span() {
        let s = begin(
            &[("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1")],
            false,
        );
        assert_eq!(hex(&s.trace_id), "80f198ee56343ba864fe8b2a57d3eff7");
        assert!(s.sampled);
        let h = sent(&s);
        assert_eq!(
            get(&h, "b3"),
            Some(format!("80f198ee56343ba864fe8b2a57d3eff7-{}-1", hex(&s.span_id)).as_str())
        );
        assert!(get(&h, "traceparent").is_some());

        let m = begin(
            &[
                ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
                ("x-b3-spanid", "a2fb4a1d1a96d312"),
                ("x-b3-sampled", "0"),
                ("x-b3-flags", "0"),
            ],
            true,
        );
        assert!(!m.sampled);
        let h = sent(&m);
        assert_eq!(
            get(&h, "x-b3-traceid"),
            Some("463ac35c9f6413ad48485a3953bb6124")
        );
        assert_eq!(get(&h, "x-b3-parentspanid"), Some("a2fb4a1d1a96d312"));
        assert_eq!(get(&h, "x-b3-spanid"), Some(hex(&m.span_id).as_str()));
        assert_eq!(get(&h, "x-b3-sampled"), Some("0"));
        assert!(get(&h, "x-b3-flags").is_none());
    }

    #[test]
    fn a_request_id_is_kept_or_made() {
        let kept = begin(&[("x-request-id", "abc")], true);
        assert!(get(&sent(&kept), "x-request-id").is_none(), "not touched");
        assert_eq!(kept.request_id, "abc");
        let made = begin(&[], true);
        let id = made.request_id.clone();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(
            id.split('-').map(str::len).eq([8, 4, 4, 4, 12]),
            "8-4-4-4-12 hex digits: {id}"
        );
        assert!(
            matches!(&id[19..20], "8" | "9" | "a" | "b"),
            "variant: {id}"
        );
        assert_eq!(get(&sent(&made), "x-request-id"), Some(id.as_str()));
    }

    #[test]
    fn a_header_the_route_adds_wins_over_the_node_s() {
        let s = begin(&[("traceparent", PARENT)], true);
        let mut h = map(&[("x-request-id", "from-route")]);
        let route_adds = [(X_REQUEST_ID, HeaderValue::from_static("from-route"))];
        s.propagate(&mut h, &route_adds);
        assert_eq!(
            h.get_all("x-request-id").iter().collect::<Vec<_>>(),
            vec!["from-route"]
        );
        assert!(get(&h, "traceparent").is_some());
    }

    /// The span the node means to send for `s` finished as `done`, built field by field with
    /// the OTLP prost messages: what the hand encoding must decode to.
    fn expected(s: &Started, done: &FinishedSpan<'_>) -> otlp::Span {
        use otlp::KeyValue;
        let start = nanos(s.wall);
        let mut attributes = vec![
            KeyValue::string("http.request.method", s.method.as_str()),
            KeyValue::int("http.response.status_code", i64::from(done.status)),
            KeyValue::string("flatmesh.listener", done.listener),
            KeyValue::string("client.address", done.client.ip().to_string()),
            KeyValue::string("http.request.header.x-request-id", s.request_id.clone()),
        ];
        if let Some(route) = done.route {
            attributes.push(KeyValue::string("flatmesh.route", route));
        }
        if let Some(cluster) = done.cluster {
            attributes.push(KeyValue::string("flatmesh.cluster", cluster));
        }
        if let Some(upstream) = done.upstream {
            attributes.push(KeyValue::string("flatmesh.upstream", upstream.to_string()));
        }
        if !s.sampled {
            attributes.push(KeyValue::string("flatmesh.kept", "error"));
        }
        otlp::Span {
            trace_id: s.trace_id.to_vec(),
            span_id: s.span_id.to_vec(),
            trace_state: s.tracestate.clone().unwrap_or_default(),
            parent_span_id: s.parent.map(|p| p.to_vec()).unwrap_or_default(),
            name: format!("{} {}", s.method, done.route.unwrap_or("(no route)")),
            kind: otlp::SPAN_KIND_SERVER,
            start_time_unix_nano: start,
            end_time_unix_nano: start.saturating_add(done.elapsed.as_nanos() as u64),
            attributes,
            status: (done.status >= 500).then(|| otlp::Status {
                message: format!("HTTP {}", done.status),
                code: otlp::STATUS_ERROR,
            }),
            flags: u32::from(s.sampled),
        }
    }

    #[test]
    fn an_error_span_decodes_field_by_field() {
        let mut s = begin(
            &[
                ("traceparent", PARENT),
                ("tracestate", "rojo=1"),
                ("x-request-id", "req-7"),
            ],
            false,
        );
        s.sampled = false; // kept only because it failed
        s.wall = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let span = decoded(
            &s,
            &FinishedSpan {
                listener: "web",
                route: Some("web/0"),
                cluster: Some("api"),
                upstream: Some("[::1]:8080".parse().expect("addr")),
                client: "10.0.0.1:5000".parse().expect("addr"),
                status: 503,
                elapsed: Duration::from_micros(1500),
            },
        );
        assert_eq!(hex(&span.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(span.span_id, s.span_id.to_vec());
        assert_eq!(span.trace_state, "rojo=1");
        assert_eq!(hex(&span.parent_span_id), "00f067aa0ba902b7");
        assert_eq!(span.name, "GET web/0");
        assert_eq!(span.kind, otlp::SPAN_KIND_SERVER);
        assert_eq!(span.start_time_unix_nano, 1_700_000_000_123_456_789);
        assert_eq!(span.end_time_unix_nano, 1_700_000_000_124_956_789);
        let attrs: Vec<(&str, otlp::Value)> = span
            .attributes
            .iter()
            .map(|kv| {
                let v = kv.value.clone().and_then(|v| v.value).expect("a value");
                (kv.key.as_str(), v)
            })
            .collect();
        let text = |v: &str| otlp::Value::String(v.into());
        assert_eq!(
            attrs,
            vec![
                ("http.request.method", text("GET")),
                ("http.response.status_code", otlp::Value::Int(503)),
                ("flatmesh.listener", text("web")),
                ("client.address", text("10.0.0.1")),
                ("http.request.header.x-request-id", text("req-7")),
                ("flatmesh.route", text("web/0")),
                ("flatmesh.cluster", text("api")),
                ("flatmesh.upstream", text("[::1]:8080")),
                ("flatmesh.kept", text("error")),
            ]
        );
        assert_eq!(
            span.status,
            Some(otlp::Status {
                message: "HTTP 503".into(),
                code: otlp::STATUS_ERROR,
            })
        );
        assert_eq!(span.flags, 0, "not sampled");
    }

    #[test]
    fn every_span_decodes_to_the_span_the_node_means() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        // Lengths around the points where a length prefix grows (128, 16384).
        let text = |rng: &mut rand::rngs::StdRng| -> String {
            let len = match rng.random_range(0..4) {
                0 => rng.random_range(0..8),
                1 => rng.random_range(120..140),
                2 => rng.random_range(0..400),
                _ => rng.random_range(16_370..16_400),
            };
            (0..len)
                .map(|_| char::from_u32(rng.random_range(0x20..0x3000)).unwrap_or('x'))
                .collect()
        };
        let methods = ["GET", "POST", "DELETE", "PURGE", "M-SEARCH"];
        for _ in 0..500 {
            let addr = |rng: &mut rand::rngs::StdRng| -> std::net::SocketAddr {
                if rng.random() {
                    (rng.random::<[u8; 4]>(), rng.random::<u16>()).into()
                } else {
                    (rng.random::<[u16; 8]>(), rng.random::<u16>()).into()
                }
            };
            let (listener, route, cluster) = (text(&mut rng), text(&mut rng), text(&mut rng));
            let tracestate = text(&mut rng);
            let s = Started {
                trace_id: new_trace_id(),
                span_id: new_span_id(),
                parent: rng.random::<bool>().then(new_span_id),
                sampled: rng.random(),
                tracestate: rng.random::<bool>().then_some(tracestate),
                styles: Styles::default(),
                request_id: text(&mut rng),
                request_id_made: rng.random(),
                method: http::Method::from_bytes(
                    methods[rng.random_range(0..methods.len())].as_bytes(),
                )
                .expect("method"),
                wall: UNIX_EPOCH + Duration::from_nanos(rng.random_range(0..u64::MAX / 2)),
            };
            let done = FinishedSpan {
                listener: &listener,
                route: rng.random::<bool>().then_some(route.as_str()),
                cluster: rng.random::<bool>().then_some(cluster.as_str()),
                upstream: rng.random::<bool>().then(|| addr(&mut rng)),
                client: addr(&mut rng),
                status: rng.random_range(100..600),
                elapsed: Duration::from_nanos(rng.random_range(0..10_000_000_000)),
            };
            assert_eq!(decoded(&s, &done), expected(&s, &done));
        }
    }

    #[test]
    fn ids_are_random_and_never_zero() {
        let a = begin(&[], true);
        let b = begin(&[], true);
        assert_ne!(a.trace_id, b.trace_id);
        assert_ne!(a.span_id, [0; 8]);
    }
}
