//! What any client controls on a traced node: the trace headers (`traceparent`,
//! `tracestate`, `b3`, `x-b3-*`). No parser may panic; whatever came in, the upstream
//! request gets one valid `traceparent` that keeps a valid caller's trace id, a
//! `tracestate` only if it holds up, and B3 only in the style the caller used.
//!
//! Input: up to 8 values separated by `\n`, for the headers in `TRACE_HEADERS` order; the
//! first byte of the input (when there is one) is the sampling draw.
#![no_main]

use flatmesh_proxy::fuzz::{
    check_tracestate, parse_b3_multi, parse_b3_single, parse_traceparent, trace_propagation,
};
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 8] = [
    "traceparent",
    "tracestate",
    "b3",
    "x-b3-traceid",
    "x-b3-spanid",
    "x-b3-parentspanid",
    "x-b3-sampled",
    "x-b3-flags",
];

fuzz_target!(|bytes: &[u8]| {
    let Some((&draw, rest)) = bytes.split_first() else {
        return;
    };
    // Each parser alone, on the raw bytes.
    if let Some(p) = parse_traceparent(rest) {
        assert!(p.trace_id != [0; 16] && p.span_id != [0; 8], "{rest:?}");
        assert!(p.sampled.is_some());
    }
    if let Some(p) = parse_b3_single(rest) {
        assert!(p.trace_id != [0; 16] && p.span_id != [0; 8], "{rest:?}");
    }
    if let Some(state) = check_tracestate(rest) {
        assert!(state.len() <= 512);
    }
    let mut fields = rest.split(|b| *b == b'\n');
    let (a, b) = (fields.next().unwrap_or_default(), fields.next().unwrap_or_default());
    if let Some(p) = parse_b3_multi(a, b, None, None) {
        assert!(p.span_id != [0; 8]);
    }

    // The whole propagation, as the node does it.
    let mut headers = HeaderMap::new();
    for (name, value) in NAMES.iter().zip(rest.split(|b| *b == b'\n')) {
        if let Ok(value) = HeaderValue::from_bytes(value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    let sent = trace_propagation(&headers, draw & 1 == 1);
    let get = |name: &str| sent.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_bytes());
    let traceparent = get("traceparent").expect("always a traceparent");
    let out = parse_traceparent(traceparent).expect("the node's traceparent is valid");
    if let Some(caller) = headers.get("traceparent").and_then(|v| parse_traceparent(v.as_bytes())) {
        assert_eq!(out.trace_id, caller.trace_id, "the caller's trace is joined");
        assert_ne!(out.span_id, caller.span_id, "the node's span is the parent upstream");
        assert_eq!(out.sampled, caller.sampled, "the caller's decision is kept");
    }
    if let Some(state) = get("tracestate") {
        assert!(check_tracestate(state).is_some(), "only a valid tracestate goes on");
    }
    assert_eq!(get("b3").is_some(), headers.contains_key("b3"));
    assert_eq!(get("x-b3-traceid").is_some(), headers.contains_key("x-b3-traceid"));
    assert!(get("x-b3-flags").is_none());
});
