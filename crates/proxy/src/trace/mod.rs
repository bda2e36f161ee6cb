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
            inner.exporter.send(started.span(span));
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

    fn span(&self, done: FinishedSpan<'_>) -> otlp::Span {
        use otlp::KeyValue;
        let start = nanos(self.wall);
        let end = start.saturating_add(done.elapsed.as_nanos().min(u64::MAX as u128) as u64);
        let mut attributes = vec![
            KeyValue::string("http.request.method", self.method.as_str()),
            KeyValue::int("http.response.status_code", i64::from(done.status)),
            KeyValue::string("flatmesh.listener", done.listener),
            KeyValue::string("client.address", done.client.ip().to_string()),
            KeyValue::string("http.request.header.x-request-id", self.request_id.clone()),
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
        if !self.sampled {
            // Kept only because it failed (docs/observability.md, "Sampling").
            attributes.push(KeyValue::string("flatmesh.kept", "error"));
        }
        let error = done.status >= 500;
        otlp::Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            trace_state: self.tracestate.clone().unwrap_or_default(),
            parent_span_id: self.parent.map(|p| p.to_vec()).unwrap_or_default(),
            name: format!("{} {}", self.method, done.route.unwrap_or("(no route)")),
            kind: otlp::SPAN_KIND_SERVER,
            start_time_unix_nano: start,
            end_time_unix_nano: end,
            attributes,
            status: error.then(|| otlp::Status {
                message: format!("HTTP {}", done.status),
                code: otlp::STATUS_ERROR,
            }),
            flags: u32::from(self.sampled),
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

/// A random (version 4) UUID, as Envoy makes for `x-request-id`.
fn uuid_v4() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
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
        let span = s.span(FinishedSpan {
            listener: "web",
            route: Some("web/0"),
            cluster: Some("api"),
            upstream: None,
            client: "10.0.0.1:5000".parse().expect("addr"),
            status: 200,
            elapsed: Duration::from_millis(3),
        });
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

    #[test]
    fn ids_are_random_and_never_zero() {
        let a = begin(&[], true);
        let b = begin(&[], true);
        assert_ne!(a.trace_id, b.trace_id);
        assert_ne!(a.span_id, [0; 8]);
    }
}
