//! Trace context on the wire: W3C Trace Context (`traceparent`, `tracestate`) and the B3
//! headers (`b3`, `x-b3-*`), parsed strictly. A header that does not hold up is ignored, as
//! the W3C spec asks: the node then starts a new trace. Nothing here panics on any input
//! (`crates/proxy/fuzz`, target `trace_context`).

use http::header::HeaderName;

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
pub const B3: HeaderName = HeaderName::from_static("b3");
pub const B3_TRACE_ID: HeaderName = HeaderName::from_static("x-b3-traceid");
pub const B3_SPAN_ID: HeaderName = HeaderName::from_static("x-b3-spanid");
pub const B3_PARENT_SPAN_ID: HeaderName = HeaderName::from_static("x-b3-parentspanid");
pub const B3_SAMPLED: HeaderName = HeaderName::from_static("x-b3-sampled");
pub const B3_FLAGS: HeaderName = HeaderName::from_static("x-b3-flags");

/// Every header that carries trace context: the node replaces them all on the upstream
/// request with its own (`super::Started::propagation`).
pub const TRACE_HEADERS: [HeaderName; 8] = [
    TRACEPARENT,
    TRACESTATE,
    B3,
    B3_TRACE_ID,
    B3_SPAN_ID,
    B3_PARENT_SPAN_ID,
    B3_SAMPLED,
    B3_FLAGS,
];

/// `tracestate` is cut off past this (W3C: at least 512 bytes must be passed on); a longer
/// one is dropped rather than cut, since cutting may break its last member.
pub const MAX_TRACESTATE: usize = 512;
/// W3C: at most 32 list members.
const MAX_TRACESTATE_MEMBERS: usize = 32;

pub type TraceId = [u8; 16];
pub type SpanId = [u8; 8];

/// The caller's place in a trace, as a request brought it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    /// The caller's sampling decision; `None` when it made none (B3 may leave it out).
    pub sampled: Option<bool>,
}

/// Which header style the context came in, so the upstream request gets the same style.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Styles {
    pub b3_single: bool,
    pub b3_multi: bool,
}

/// W3C `traceparent` (Trace Context §3.2): `VERSION-TRACEID-PARENTID-FLAGS`, lower-case hex.
/// Version `00` must be exactly that long; a later version may append fields after a `-`
/// (§3.2.4); version `ff` is invalid. All-zero ids are invalid.
pub fn parse_traceparent(value: &[u8]) -> Option<Parent> {
    if value.len() < 55 {
        return None;
    }
    let version = hex_byte(&value[0..2])?;
    match version {
        0xff => return None,
        0 if value.len() != 55 => return None,
        _ if value.len() > 55 && value[55] != b'-' => return None,
        _ => {}
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let trace_id: TraceId = hex_array(&value[3..35])?;
    let span_id: SpanId = hex_array(&value[36..52])?;
    let flags = hex_byte(&value[53..55])?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: Some(flags & 1 == 1),
    })
}

/// `tracestate` passed on when it holds up (§3.3): at most [`MAX_TRACESTATE`] bytes and 32
/// list members, each `key=value` of printable ASCII; else `None` (it is dropped).
pub fn check_tracestate(value: &[u8]) -> Option<&str> {
    if value.len() > MAX_TRACESTATE {
        return None;
    }
    let text = std::str::from_utf8(value).ok()?;
    let mut members = 0;
    for member in text.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        members += 1;
        let (key, val) = member.split_once('=')?;
        let key_ok = !key.is_empty()
            && key.len() <= 256
            && key
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/@".contains(&b));
        let val_ok = !val.is_empty()
            && val.len() <= 256
            && val
                .bytes()
                .all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
            && !val.ends_with(' ');
        if !key_ok || !val_ok {
            return None;
        }
    }
    (members <= MAX_TRACESTATE_MEMBERS).then_some(text)
}

/// B3 single header (openzipkin/b3-propagation): `TRACEID-SPANID[-SAMPLED[-PARENTSPANID]]`,
/// or a sampling decision alone (`0`, `1`, `d`), which carries no parent. A 64-bit trace id
/// is widened with zeros in front, as Zipkin does.
pub fn parse_b3_single(value: &[u8]) -> Option<Parent> {
    let mut fields = value.split(|b| *b == b'-');
    let first = fields.next()?;
    let Some(second) = fields.next() else {
        // A decision alone names no trace to join.
        return None;
    };
    let trace_id = b3_trace_id(first)?;
    let span_id: SpanId = hex_array(second)?;
    let sampled = match fields.next() {
        None => None,
        Some(s) => Some(b3_sampling(s)?),
    };
    if let Some(parent) = fields.next() {
        hex_array::<8>(parent)?;
    }
    if fields.next().is_some() || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled,
    })
}

/// The `x-b3-*` headers: trace and span id both, `x-b3-sampled` (`1`/`0`, or the old
/// `true`/`false`) and `x-b3-flags: 1` (debug, which implies sampled).
pub fn parse_b3_multi(
    trace_id: &[u8],
    span_id: &[u8],
    sampled: Option<&[u8]>,
    flags: Option<&[u8]>,
) -> Option<Parent> {
    let trace_id = b3_trace_id(trace_id)?;
    let span_id: SpanId = hex_array(span_id)?;
    if span_id == [0; 8] {
        return None;
    }
    let debug = flags == Some(b"1");
    let sampled = match sampled {
        _ if debug => Some(true),
        None => None,
        Some(b"1") | Some(b"true") => Some(true),
        Some(b"0") | Some(b"false") => Some(false),
        Some(_) => return None,
    };
    Some(Parent {
        trace_id,
        span_id,
        sampled,
    })
}

fn b3_sampling(field: &[u8]) -> Option<bool> {
    match field {
        b"1" | b"d" => Some(true),
        b"0" => Some(false),
        _ => None,
    }
}

/// A B3 trace id: 16 or 32 lower-case hex digits, not all zero.
fn b3_trace_id(field: &[u8]) -> Option<TraceId> {
    let id: TraceId = match field.len() {
        32 => hex_array(field)?,
        16 => {
            let low: [u8; 8] = hex_array(field)?;
            let mut id = [0; 16];
            id[8..].copy_from_slice(&low);
            id
        }
        _ => return None,
    };
    (id != [0; 16]).then_some(id)
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    match two {
        [hi, lo] => Some(hex_digit(*hi)? << 4 | hex_digit(*lo)?),
        _ => None,
    }
}

/// Exactly `2 * N` lower-case hex digits.
fn hex_array<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = hex_byte(pair)?;
    }
    Some(out)
}

/// Lower-case hex of `bytes` appended to `out`.
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
}

pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_read() {
        let p = parse_traceparent(GOOD.as_bytes()).expect("valid");
        assert_eq!(hex(&p.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&p.span_id), "00f067aa0ba902b7");
        assert_eq!(p.sampled, Some(true));
        let unsampled = GOOD.replace("-01", "-00");
        assert_eq!(
            parse_traceparent(unsampled.as_bytes()).map(|p| p.sampled),
            Some(Some(false))
        );
        // A later version may carry more fields after a dash.
        let future = GOOD.replacen("00-", "01-", 1) + "-extra";
        assert!(parse_traceparent(future.as_bytes()).is_some());
    }

    #[test]
    fn a_malformed_traceparent_is_ignored() {
        for bad in [
            "",
            "00",
            &GOOD.to_uppercase(),
            &GOOD.replacen("00-", "ff-", 1),
            &(GOOD.to_owned() + "-x"),
            &GOOD.replace(
                "4bf92f3577b34da6a3ce929d0e0e4736",
                "00000000000000000000000000000000",
            ),
            &GOOD.replace("00f067aa0ba902b7", "0000000000000000"),
            &GOOD.replace('-', "_"),
            &GOOD.replace("b7-", "bz-"),
            &GOOD.replace("-01", "-1x"),
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            &GOOD.replacen("00-", "01-", 1).replace("-01", "-01x"),
        ] {
            assert_eq!(parse_traceparent(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn tracestate_passes_when_well_formed() {
        assert_eq!(
            check_tracestate(b"rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
        );
        assert_eq!(
            check_tracestate(b"tenant@vendor=x"),
            Some("tenant@vendor=x")
        );
        for bad in [
            &b"novalue"[..],
            b"Upper=x",
            b"a=b=c",
            b"a=\x01",
            &[b'a'; 600],
        ] {
            assert_eq!(check_tracestate(bad), None, "{bad:?}");
        }
        let many = (0..33)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(check_tracestate(many.as_bytes()), None);
    }

    #[test]
    fn b3_single_is_read_in_every_form() {
        let full = parse_b3_single(
            b"80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90",
        )
        .expect("full");
        assert_eq!(hex(&full.trace_id), "80f198ee56343ba864fe8b2a57d3eff7");
        assert_eq!(hex(&full.span_id), "e457b5a2e4d86bd1");
        assert_eq!(full.sampled, Some(true));
        let short = parse_b3_single(b"64fe8b2a57d3eff7-e457b5a2e4d86bd1").expect("64-bit");
        assert_eq!(hex(&short.trace_id), "000000000000000064fe8b2a57d3eff7");
        assert_eq!(short.sampled, None);
        let debug = parse_b3_single(b"64fe8b2a57d3eff7-e457b5a2e4d86bd1-d").expect("debug");
        assert_eq!(debug.sampled, Some(true));
        for bad in [
            &b"1"[..],
            b"0",
            b"d",
            b"64fe8b2a57d3eff7",
            b"64fe8b2a57d3eff7-e457b5a2e4d86bd1-2",
            b"64fe8b2a57d3eff7-e457b5a2e4d86bd1-1-xyz",
            b"64fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90-more",
            b"64fe8b2a57d3eff-e457b5a2e4d86bd1",
            b"0000000000000000-e457b5a2e4d86bd1",
        ] {
            assert_eq!(parse_b3_single(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn b3_multi_headers_are_read() {
        let p = parse_b3_multi(
            b"463ac35c9f6413ad48485a3953bb6124",
            b"a2fb4a1d1a96d312",
            Some(b"0"),
            None,
        )
        .expect("multi");
        assert_eq!(p.sampled, Some(false));
        let debug = parse_b3_multi(
            b"463ac35c9f6413ad",
            b"a2fb4a1d1a96d312",
            Some(b"0"),
            Some(b"1"),
        );
        assert_eq!(debug.map(|p| p.sampled), Some(Some(true)));
        assert_eq!(
            parse_b3_multi(b"463ac35c9f6413ad", b"a2fb4a1d1a96d312", Some(b"yes"), None),
            None
        );
        assert_eq!(
            parse_b3_multi(b"463ac35c9f6413ad", b"a2fb", None, None),
            None
        );
    }
}
