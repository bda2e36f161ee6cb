//! HTTP/1.x message heads: what a parsed head means for framing and connection reuse
//! (RFC 9112 §6, §9), and the rewritten heads the proxy sends on.
//!
//! The parser is httparse; this module decides everything httparse leaves to its caller, and
//! is strict where two parsers could disagree about where a message ends (request
//! smuggling): Content-Length together with Transfer-Encoding, conflicting or non-numeric
//! lengths, and any transfer coding but a lone `chunked` are refused.

use std::borrow::Cow;
use std::io::Write;

use flatmesh_rules::CompiledRoute;
use http::{HeaderName, HeaderValue};
use smallvec::SmallVec;

/// Header lines one head may carry; more is a 431, as in hyper and Envoy (100).
pub const MAX_HEADERS: usize = 128;

/// How a message's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body.
    Empty,
    Length(u64),
    Chunked,
    /// The body runs until the sender closes (responses only).
    UntilClose,
}

/// Why a request cannot be served: the status to answer with and what to tell the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub reason: &'static str,
}

fn refuse(status: u16, reason: &'static str) -> Refusal {
    Refusal { status, reason }
}

/// Header names the proxy treats specially. Everything else is passed on as it came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    ContentLength,
    TransferEncoding,
    Host,
    Connection,
    /// Forwarded only with a protocol upgrade (WebSocket) the client asked for.
    Upgrade,
    /// Hop-by-hop headers (RFC 9110 §7.6.1) that are never forwarded.
    HopByHop,
    Te,
    Expect,
    XForwardedFor,
    Other,
}

fn classify(name: &str) -> Known {
    let is = |known: &str| name.eq_ignore_ascii_case(known);
    match name.len() {
        2 if is("te") => Known::Te,
        4 if is("host") => Known::Host,
        6 if is("expect") => Known::Expect,
        7 if is("upgrade") => Known::Upgrade,
        10 if is("connection") => Known::Connection,
        10 if is("keep-alive") => Known::HopByHop,
        14 if is("content-length") => Known::ContentLength,
        // RFC 7540 §3.2.1: connection-specific, part of an `Upgrade: h2c` the proxy drops.
        14 if is("http2-settings") => Known::HopByHop,
        15 if is("x-forwarded-for") => Known::XForwardedFor,
        16 if is("proxy-connection") => Known::HopByHop,
        17 if is("transfer-encoding") => Known::TransferEncoding,
        19 if is("proxy-authorization") => Known::HopByHop,
        _ => Known::Other,
    }
}

/// The comma-separated elements of a header value, trimmed, empty ones skipped.
fn list(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|b| *b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|v| !v.is_empty())
}

/// A Content-Length value: one number, or a list of the same number (RFC 9110 §8.6).
fn content_length(value: &[u8], seen: Option<u64>) -> Result<u64, Refusal> {
    let mut length = seen;
    let mut any = false;
    for element in value.split(|b| *b == b',').map(<[u8]>::trim_ascii) {
        if element.is_empty() || element.len() > 18 || !element.iter().all(u8::is_ascii_digit) {
            return Err(refuse(400, "Content-Length is not a number"));
        }
        let n = element
            .iter()
            .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        if length.is_some_and(|l| l != n) {
            return Err(refuse(400, "request has conflicting Content-Length values"));
        }
        length = Some(n);
        any = true;
    }
    match (any, length) {
        (true, Some(n)) => Ok(n),
        _ => Err(refuse(400, "Content-Length is not a number")),
    }
}

/// What the proxy needs to know about a request head, borrowed from the read buffer.
#[derive(Debug)]
pub struct RequestInfo<'b> {
    pub framing: Framing,
    pub http10: bool,
    /// The client may send another request on this connection after the response.
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the proxy answers it itself before reading the body.
    pub expect_continue: bool,
    /// The authority of an absolute-form target, else the Host header.
    pub host: Option<&'b str>,
    /// The target's path in origin form; or `*`. The listener's path normalisation may
    /// replace it (`crate::l7::decide`): what is written upstream is what the routes matched.
    pub path: Cow<'b, str>,
    pub query: Option<&'b str>,
    /// The target was absolute-form: Host is rewritten to its authority.
    pub absolute_form: bool,
    /// The protocol the client asks to switch to (`Connection: upgrade` and an `Upgrade`
    /// header, as WebSocket does), if any. Forwarded (both headers) only where the route lets
    /// it through (`upgrades`); a 101 answer then turns the connection into a tunnel.
    /// `Upgrade: h2c` is dropped, as Envoy drops it: the request is served as HTTP/1.1.
    pub upgrade: Option<&'b str>,
    pub had_host_header: bool,
    /// Header names listed in Connection: hop-by-hop for this message only.
    connection_tokens: SmallVec<[&'b [u8]; 4]>,
}

/// Splits a request target into (authority of an absolute form, origin-form target).
fn split_target<'b>(method: &str, target: &'b str) -> Result<(Option<&'b str>, &'b str), Refusal> {
    if target.starts_with('/') || target == "*" && method == "OPTIONS" {
        return Ok((None, target));
    }
    let lower = |n: usize| target.get(..n).map(str::to_ascii_lowercase);
    let rest = if lower(7).as_deref() == Some("http://") {
        &target[7..]
    } else if lower(8).as_deref() == Some("https://") {
        &target[8..]
    } else if method == "CONNECT" {
        return Err(refuse(
            405,
            "CONNECT is not supported by this listener; use a tcp listener for tunnels",
        ));
    } else {
        return Err(refuse(
            400,
            "request target is not a path or an absolute URL",
        ));
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.is_empty() || authority.contains('@') {
        return Err(refuse(400, "absolute URL has no usable authority"));
    }
    Ok((Some(authority), path))
}

impl RequestInfo<'_> {
    /// The origin-form target: `path?query`.
    pub fn target(&self) -> String {
        match self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.clone().into_owned(),
        }
    }
}

pub fn analyze_request<'b>(req: &httparse::Request<'_, 'b>) -> Result<RequestInfo<'b>, Refusal> {
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(refuse(400, "incomplete request line"));
    };
    let (authority, target) = split_target(method, target)?;
    let http10 = version == 0;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut transfer_encoding = false;
    let mut host_header: Option<&'b [u8]> = None;
    let mut hosts = 0;
    let (mut close, mut keep_alive) = (false, false);
    let mut expect_continue = false;
    let mut upgrade_token = false;
    let mut upgrade_header: Option<&'b [u8]> = None;
    let mut connection_tokens = SmallVec::new();
    for h in req.headers.iter() {
        match classify(h.name) {
            Known::ContentLength => length = Some(content_length(h.value, length)?),
            Known::Upgrade if h.value.trim_ascii().is_empty() => {}
            // The route checks the one protocol asked for; a second line could ask for
            // another behind its back.
            Known::Upgrade if upgrade_header.replace(h.value.trim_ascii()).is_some() => {
                return Err(refuse(400, "request has more than one Upgrade header"));
            }
            Known::TransferEncoding => {
                // Only a lone `chunked` is accepted: `gzip, chunked` would have to be passed
                // on intact, and anything not ending in chunked cannot be framed at all.
                for coding in list(h.value) {
                    if chunked || transfer_encoding || !coding.eq_ignore_ascii_case(b"chunked") {
                        return Err(refuse(
                            400,
                            "Transfer-Encoding must be exactly `chunked` (RFC 9112 §6.3)",
                        ));
                    }
                    chunked = true;
                }
                transfer_encoding = true;
            }
            Known::Host => {
                hosts += 1;
                host_header = Some(h.value);
            }
            Known::Connection => {
                for token in list(h.value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep_alive = true;
                    } else if token.eq_ignore_ascii_case(b"upgrade") {
                        upgrade_token = true;
                    } else if connection_tokens.len() < 32 {
                        connection_tokens.push(token);
                    } else {
                        return Err(refuse(400, "too many Connection options"));
                    }
                }
            }
            Known::Expect => expect_continue |= h.value.eq_ignore_ascii_case(b"100-continue"),
            _ => {}
        }
    }
    if transfer_encoding && length.is_some() {
        return Err(refuse(
            400,
            "request has both Content-Length and Transfer-Encoding; send exactly one",
        ));
    }
    if transfer_encoding && !chunked {
        return Err(refuse(
            400,
            "Transfer-Encoding must be exactly `chunked` (RFC 9112 §6.3)",
        ));
    }
    if hosts > 1 {
        return Err(refuse(400, "request has more than one Host header"));
    }
    if !http10 && hosts == 0 {
        return Err(refuse(400, "HTTP/1.1 request has no Host header"));
    }
    let host_header = match host_header.map(std::str::from_utf8) {
        Some(Ok(h)) => Some(h.trim()),
        Some(Err(_)) => return Err(refuse(400, "Host header is not valid text")),
        None => None,
    };
    // The host the request is routed by and sent on with: garbage would reach the upstream.
    let host = authority.or(host_header);
    if host.is_some_and(|h| !flatmesh_rules::is_valid_authority(h)) {
        return Err(refuse(
            400,
            "the host is not a valid `host[:port]` (RFC 3986 §3.2)",
        ));
    }
    // `Upgrade: h2c` (RFC 7540 §3.2) is dropped: the request goes on as HTTP/1.1.
    let upgrade = match (upgrade_token, upgrade_header.map(std::str::from_utf8)) {
        (true, Some(Ok(p))) if !p.eq_ignore_ascii_case("h2c") => Some(p),
        (true, Some(Err(_))) => return Err(refuse(400, "Upgrade header is not valid text")),
        _ => None,
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    // "http://a?x" has an empty path; its origin form is "/?x" (RFC 9112 §3.2.1).
    let path = if path.is_empty() { "/" } else { path };
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked,
        (false, Some(0)) | (false, None) => Framing::Empty,
        (false, Some(n)) => Framing::Length(n),
    };
    Ok(RequestInfo {
        framing,
        http10,
        keep_alive: !close && (!http10 || keep_alive),
        expect_continue: expect_continue && framing != Framing::Empty,
        host,
        path: Cow::Borrowed(path),
        query,
        absolute_form: authority.is_some(),
        upgrade,
        had_host_header: host_header.is_some(),
        connection_tokens,
    })
}

fn listed(tokens: &[&[u8]], name: &str) -> bool {
    tokens
        .iter()
        .any(|t| t.eq_ignore_ascii_case(name.as_bytes()))
}

fn named(list: &[HeaderName], name: &str) -> bool {
    list.iter().any(|n| name.eq_ignore_ascii_case(n.as_str()))
}

fn added(list: &[(HeaderName, HeaderValue)], name: &str) -> bool {
    list.iter()
        .any(|(n, _)| name.eq_ignore_ascii_case(n.as_str()))
}

fn header_line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

fn framing_line(out: &mut Vec<u8>, framing: Framing) {
    match framing {
        Framing::Length(n) => {
            let _ = write!(out, "content-length: {n}\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        Framing::Empty | Framing::UntilClose => {}
    }
}

/// The request head sent upstream: origin-form target, HTTP/1.1, hop-by-hop headers
/// removed, the route's header edits applied, the client appended to x-forwarded-for, and
/// the body framed exactly as it will be sent. `endpoint` is the Host of last resort, for
/// HTTP/1.0 clients that sent none.
pub fn write_request_head(
    out: &mut Vec<u8>,
    req: &httparse::Request<'_, '_>,
    info: &RequestInfo<'_>,
    route: &CompiledRoute,
    peer_ip: &[u8],
    endpoint: &str,
    trace: &[(http::HeaderName, http::HeaderValue)],
) {
    out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
    out.push(b' ');
    out.extend_from_slice(info.path.as_bytes());
    if let Some(q) = info.query {
        out.push(b'?');
        out.extend_from_slice(q.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let host = if info.absolute_form || !info.had_host_header {
        info.host.unwrap_or(endpoint)
    } else {
        info.host.unwrap_or_default()
    };
    // Config validation keeps routes from adding or removing Host.
    header_line(out, b"host", host.as_bytes());
    let mut forwarded_for = false;
    for h in req.headers.iter() {
        let keep =
            match classify(h.name) {
                Known::Other => !listed(&info.connection_tokens, h.name),
                Known::Te => h.value.eq_ignore_ascii_case(b"trailers"),
                Known::Expect => !h.value.eq_ignore_ascii_case(b"100-continue"),
                Known::Upgrade => info.upgrade.is_some(),
                Known::XForwardedFor => {
                    if !forwarded_for {
                        // All values, in order, then the client: one line.
                        out.extend_from_slice(b"x-forwarded-for: ");
                        for v in req.headers.iter().filter(|v| {
                            classify(v.name) == Known::XForwardedFor && !v.value.is_empty()
                        }) {
                            out.extend_from_slice(v.value);
                            out.extend_from_slice(b", ");
                        }
                        out.extend_from_slice(peer_ip);
                        out.extend_from_slice(b"\r\n");
                        forwarded_for = true;
                    }
                    false
                }
                _ => false,
            };
        // With tracing on, the client's trace context is replaced by the node's.
        let replaced = !trace.is_empty() && is_trace_header(h.name);
        if keep
            && !replaced
            && !named(&route.request_headers_to_remove, h.name)
            && !added(&route.request_headers_to_add, h.name)
        {
            header_line(out, h.name.as_bytes(), h.value);
        }
    }
    if !forwarded_for {
        header_line(out, b"x-forwarded-for", peer_ip);
    }
    // A header the route adds wins over the node's trace header of the same name.
    let traced = trace
        .iter()
        .filter(|(name, _)| !added(&route.request_headers_to_add, name.as_str()));
    for (name, value) in route.request_headers_to_add.iter().chain(traced) {
        header_line(out, name.as_str().as_bytes(), value.as_bytes());
    }
    framing_line(out, info.framing);
    if info.upgrade.is_some() {
        out.extend_from_slice(b"connection: upgrade\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

fn is_trace_header(name: &str) -> bool {
    crate::trace::TRACE_HEADERS
        .iter()
        .any(|t| t.as_str().eq_ignore_ascii_case(name))
}

/// What the proxy needs to know about an upstream response head.
#[derive(Debug)]
pub struct ResponseInfo<'b> {
    pub status: u16,
    pub framing: Framing,
    /// The upstream connection can carry another request after this response.
    pub reusable: bool,
    connection_tokens: SmallVec<[&'b [u8]; 4]>,
    /// The transfer codings applied to the body other than a final `chunked` (`gzip` of
    /// `gzip, chunked`), in order. The proxy re-frames the body but does not decode them, so
    /// they go on in the client's Transfer-Encoding.
    codings: SmallVec<[&'b [u8]; 2]>,
}

/// Why an answer with transfer codings cannot go to a client that reads none.
pub const CODINGS_NEED_HTTP11: &str =
    "upstream answered with a transfer coding other than chunked, which only an HTTP/1.1 client can be sent";

impl ResponseInfo<'_> {
    pub fn is_informational(&self) -> bool {
        (100..200).contains(&self.status)
    }

    /// Whether the body carries transfer codings besides chunked, which only an HTTP/1.1
    /// client reads (RFC 9112 §6.1: none may be sent to HTTP/1.0, and HTTP/2 has none).
    pub fn has_codings(&self) -> bool {
        !self.codings.is_empty() && self.framing != Framing::Empty
    }
}

/// Framing of a response to a request (RFC 9112 §6.3). A malformed length is the
/// upstream's fault: the caller answers 502.
pub fn analyze_response<'b>(
    resp: &httparse::Response<'_, 'b>,
    request_was_head: bool,
) -> Result<ResponseInfo<'b>, &'static str> {
    let status = resp.code.ok_or("incomplete status line")?;
    let http10 = resp.version == Some(0);
    let mut length = None;
    let mut transfer_encoding = false;
    let mut codings: SmallVec<[&'b [u8]; 2]> = SmallVec::new();
    let (mut close, mut keep_alive) = (false, false);
    let mut connection_tokens = SmallVec::new();
    for h in resp.headers.iter() {
        match classify(h.name) {
            Known::ContentLength => {
                length = Some(
                    content_length(h.value, length)
                        .map_err(|_| "invalid or conflicting Content-Length")?,
                )
            }
            Known::TransferEncoding => {
                transfer_encoding = true;
                for coding in list(h.value) {
                    if codings.len() == 8 {
                        return Err("more than 8 transfer codings");
                    }
                    if coding.iter().any(|b| b.is_ascii_control()) {
                        return Err("invalid Transfer-Encoding");
                    }
                    codings.push(coding);
                }
            }
            Known::Connection => {
                for token in list(h.value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep_alive = true;
                    } else if connection_tokens.len() < 32 {
                        connection_tokens.push(token);
                    }
                }
            }
            _ => {}
        }
    }
    // RFC 9112 §6.1: chunked is applied last and once; anything else cannot be framed.
    let is_chunked = |c: &&[u8]| c.eq_ignore_ascii_case(b"chunked");
    let chunked_last = codings.last().is_some_and(is_chunked);
    if chunked_last {
        codings.pop();
    }
    if codings.iter().any(is_chunked) {
        return Err("`chunked` is not the last transfer coding");
    }
    let no_body =
        request_was_head || (100..200).contains(&status) || status == 204 || status == 304;
    let framing = if no_body {
        Framing::Empty
    } else if transfer_encoding {
        // Transfer-Encoding wins over Content-Length (§6.3 rule 3).
        if chunked_last {
            Framing::Chunked
        } else {
            Framing::UntilClose
        }
    } else {
        match length {
            Some(0) => Framing::Empty,
            Some(n) => Framing::Length(n),
            None => Framing::UntilClose,
        }
    };
    Ok(ResponseInfo {
        status,
        framing,
        reusable: framing != Framing::UntilClose && !close && (!http10 || keep_alive),
        connection_tokens,
        codings,
    })
}

/// Whether a response header field goes on to the client: not hop-by-hop (RFC 9110
/// §7.6.1, and the names the response's Connection lists), not Transfer-Encoding (the
/// proxy frames the body itself), Upgrade only with a 101.
pub fn is_end_to_end(name: &str, info: &ResponseInfo<'_>) -> bool {
    match classify(name) {
        Known::Other | Known::Host | Known::Expect | Known::XForwardedFor => {
            !listed(&info.connection_tokens, name)
        }
        Known::ContentLength => matches!(info.framing, Framing::Empty | Framing::Length(_)),
        Known::Upgrade => info.status == 101,
        _ => false,
    }
}

/// The response head sent to the client: hop-by-hop headers removed, the route's response
/// headers applied, the body framed as `framing` (which may differ from the upstream's: a
/// close-delimited body goes to an HTTP/1.1 client chunked), and `Connection: close` when
/// the proxy will close after it.
pub fn write_response_head(
    out: &mut Vec<u8>,
    resp: &httparse::Response<'_, '_>,
    info: &ResponseInfo<'_>,
    add: &[(HeaderName, HeaderValue)],
    framing: Framing,
    close: bool,
    http10_keep_alive: bool,
) {
    let _ = write!(
        out,
        "HTTP/1.1 {} {}\r\n",
        info.status,
        resp.reason.unwrap_or_default()
    );
    for h in resp.headers.iter() {
        // A length is written below for the framing the client gets; only a HEAD, 1xx,
        // 204 or 304 answer (no body) keeps its own, which says what the body would have been.
        let keep = is_end_to_end(h.name, info)
            && (framing == Framing::Empty || classify(h.name) != Known::ContentLength);
        if keep && !added(add, h.name) {
            header_line(out, h.name.as_bytes(), h.value);
        }
    }
    if !info.is_informational() {
        for (name, value) in add {
            header_line(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    match framing {
        // The codings the body still carries, then the chunked framing of this hop.
        Framing::Chunked if info.has_codings() => {
            out.extend_from_slice(b"transfer-encoding: ");
            for coding in &info.codings {
                out.extend_from_slice(coding);
                out.extend_from_slice(b", ");
            }
            out.extend_from_slice(b"chunked\r\n");
        }
        _ => framing_line(out, framing),
    }
    if info.status == 101 {
        out.extend_from_slice(b"connection: upgrade\r\n");
    } else if close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if http10_keep_alive {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse<'h, 'b>(
        raw: &'b [u8],
        headers: &'h mut [httparse::Header<'b>],
    ) -> httparse::Request<'h, 'b> {
        let mut req = httparse::Request::new(headers);
        assert!(req.parse(raw).expect("parses").is_complete());
        req
    }

    fn info(raw: &[u8]) -> Result<(Framing, bool), Refusal> {
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let req = parse(raw, &mut headers);
        analyze_request(&req).map(|i| (i.framing, i.keep_alive))
    }

    #[test]
    fn request_framing() {
        let ok = |raw: &[u8]| info(raw).expect("accepted");
        assert_eq!(
            ok(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"),
            (Framing::Empty, true)
        );
        assert_eq!(
            ok(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n"),
            (Framing::Length(5), true)
        );
        assert_eq!(
            ok(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n"),
            (Framing::Length(5), true)
        );
        assert_eq!(
            ok(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\nConnection: close\r\n\r\n"),
            (Framing::Chunked, false)
        );
        assert_eq!(ok(b"GET / HTTP/1.0\r\n\r\n"), (Framing::Empty, false));
        assert_eq!(
            ok(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"),
            (Framing::Empty, true)
        );
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        for raw in [
            &b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 6\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: \r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            b"GET x HTTP/1.1\r\nHost: a\r\n\r\n",
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            assert!(info(raw).is_err(), "{}", String::from_utf8_lossy(raw));
        }
    }

    #[test]
    fn absolute_form_targets_become_origin_form() {
        let raw = b"GET http://Api.Example:80?x=1 HTTP/1.1\r\nHost: other\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 4];
        let req = parse(raw, &mut headers);
        let i = analyze_request(&req).expect("accepted");
        assert_eq!(
            (i.host, i.target(), &*i.path, i.query),
            (Some("Api.Example:80"), "/?x=1".to_owned(), "/", Some("x=1"))
        );
    }

    #[test]
    fn upstream_head_is_rewritten() {
        let raw = b"POST /p?q HTTP/1.1\r\nHost: a\r\nConnection: x-hop, keep-alive\r\nX-Hop: 1\r\nTE: gzip\r\nX-Forwarded-For: 10.0.0.1\r\nx-forwarded-for: 10.0.0.2\r\nExpect: 100-continue\r\nX-Drop: 1\r\nX-Keep: 1\r\nX-Via: old\r\nContent-Length: 3, 3\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let req = parse(raw, &mut headers);
        let i = analyze_request(&req).expect("accepted");
        let config = flatmesh_config::parse(
            r#"
listeners:
  - name: web
    address: 127.0.0.1:1
    protocol: http
    routes:
      - match: { path: { prefix: / } }
        direct_response: { status: 200 }
        request_headers_to_add: { x-via: flatmesh }
        request_headers_to_remove: [ x-drop ]
"#,
            "test.yaml",
        )
        .expect("config");
        let program = flatmesh_rules::compile(&config).expect("compiles");
        let flatmesh_rules::TableKind::Http(table) = &program.listeners()[0].kind else {
            panic!("an http table");
        };
        let route = &table.routes[0];
        let mut out = Vec::new();
        write_request_head(&mut out, &req, &i, route, b"127.0.0.9", "10.1.1.1:80", &[]);
        assert_eq!(
            String::from_utf8_lossy(&out),
            "POST /p?q HTTP/1.1\r\nhost: a\r\nx-forwarded-for: 10.0.0.1, 10.0.0.2, 127.0.0.9\r\nX-Keep: 1\r\nx-via: flatmesh\r\ncontent-length: 3\r\n\r\n"
        );
    }

    #[test]
    fn with_tracing_the_client_s_trace_context_is_replaced_by_the_node_s() {
        let raw = b"GET / HTTP/1.1\r\nHost: a\r\nTraceParent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nX-B3-Sampled: 1\r\nB3: 0\r\nX-Keep: 1\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; 8];
        let req = parse(raw, &mut headers);
        let i = analyze_request(&req).expect("accepted");
        let config = flatmesh_config::parse(
            "listeners: [ { name: web, address: 127.0.0.1:1, protocol: http, routes: [ { match: { path: { prefix: / } }, direct_response: { status: 200 } } ] } ]\n",
            "test.yaml",
        )
        .expect("config");
        let program = flatmesh_rules::compile(&config).expect("compiles");
        let flatmesh_rules::TableKind::Http(table) = &program.listeners()[0].kind else {
            panic!("an http table");
        };
        let node_s = [(
            http::HeaderName::from_static("traceparent"),
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01",
            ),
        )];
        let mut out = Vec::new();
        write_request_head(
            &mut out,
            &req,
            &i,
            &table.routes[0],
            b"10.0.0.9",
            "e:80",
            &node_s,
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            "GET / HTTP/1.1\r\nhost: a\r\nX-Keep: 1\r\nx-forwarded-for: 10.0.0.9\r\ntraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01\r\n\r\n"
        );
        // Tracing off: the client's headers go on untouched.
        let mut out = Vec::new();
        write_request_head(
            &mut out,
            &req,
            &i,
            &table.routes[0],
            b"10.0.0.9",
            "e:80",
            &[],
        );
        assert!(String::from_utf8_lossy(&out).contains("TraceParent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nX-B3-Sampled: 1\r\nB3: 0\r\n"));
    }

    #[test]
    fn response_framing() {
        let framing = |raw: &[u8], head: bool| {
            let mut headers = [httparse::EMPTY_HEADER; 8];
            let mut resp = httparse::Response::new(&mut headers);
            assert!(resp.parse(raw).expect("parses").is_complete());
            analyze_response(&resp, head).map(|i| (i.framing, i.reusable))
        };
        assert_eq!(
            framing(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", false),
            Ok((Framing::Length(4), true))
        );
        assert_eq!(
            framing(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", true),
            Ok((Framing::Empty, true))
        );
        assert_eq!(
            framing(b"HTTP/1.1 204 No Content\r\n\r\n", false),
            Ok((Framing::Empty, true))
        );
        assert_eq!(
            framing(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n",
                false
            ),
            Ok((Framing::Chunked, true))
        );
        assert_eq!(
            framing(b"HTTP/1.1 200 OK\r\n\r\n", false),
            Ok((Framing::UntilClose, false))
        );
        assert_eq!(
            framing(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false),
            Ok((Framing::Length(1), false))
        );
        assert!(framing(b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", false).is_err());
    }
}
