//! Trailer fields (RFC 9110 §6.5): which names may travel in a trailer section, and the
//! checks a trailer field line must pass, the same as a header line. Used by the HTTP/1
//! chunked relay (`h1::body`), whose trailer sections are bytes, and by bodies held in `http`
//! types (`l7`), whose trailers are a `HeaderMap` (names and values already checked by it).
//!
//! A recipient may merge trailers into the header section, so a `Content-Length`, `Host` or
//! `Transfer-Encoding` that arrives as a trailer could reframe or reroute a message after the
//! proxy has checked its head. Such fields, and lines no header section would accept (a NUL,
//! a bare CR, an obs-fold continuation), are dropped; the rest go on.

use http::HeaderMap;

/// Names a trailer must not carry (RFC 9110 §6.5.1: "message framing, routing,
/// authentication, request modifiers, response controls, or content format"), and the
/// hop-by-hop fields, which belong to one connection. hyper refuses the same kinds.
const FORBIDDEN: &[&str] = &[
    // framing
    "content-length",
    "transfer-encoding",
    "trailer",
    // routing
    "host",
    // authentication and session
    "authorization",
    "proxy-authorization",
    "www-authenticate",
    "proxy-authenticate",
    "cookie",
    "set-cookie",
    // request modifiers and controls
    "cache-control",
    "expect",
    "max-forwards",
    "pragma",
    "range",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "if-range",
    // response controls
    "age",
    "date",
    "expires",
    "location",
    "retry-after",
    "vary",
    "warning",
    // content format
    "content-encoding",
    "content-type",
    "content-range",
    // hop by hop
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "http2-settings",
];

/// Whether a field named `name` may go on in a trailer section.
pub fn allowed(name: &[u8]) -> bool {
    !FORBIDDEN
        .iter()
        .any(|f| f.as_bytes().eq_ignore_ascii_case(name))
}

/// An RFC 9110 token character.
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A field value's bytes (RFC 9110 §5.5): visible ASCII, obs-text, spaces and tabs.
fn value_byte(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80
}

/// Whether one trailer line (`name: value`, without its CRLF) may go on: a token name not
/// in the forbidden list, a colon right after it, and a clean value.
pub fn line_goes_on(line: &[u8]) -> bool {
    let Some(colon) = line.iter().position(|b| *b == b':') else {
        return false;
    };
    let (name, value) = (&line[..colon], &line[colon + 1..]);
    !name.is_empty()
        && name.iter().all(|b| tchar(*b))
        && allowed(name)
        && value.iter().all(|b| value_byte(*b))
}

/// Writes the trailer section `section` (every byte after the last chunk's line, the final
/// empty line included) to `out` with only the lines that may go on, then the final empty
/// line. A line that starts with a space or tab continues the one before it (obs-fold,
/// RFC 9112 §5.2): both are dropped, as is every line `line_goes_on` refuses.
pub fn filter_section(section: &[u8], out: &mut Vec<u8>) {
    let mut lines: Vec<(&[u8], bool)> = Vec::new();
    for line in section.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue; // the final empty line (and the nothing after its LF)
        }
        if matches!(line[0], b' ' | b'\t') {
            if let Some(last) = lines.last_mut() {
                last.1 = false;
            }
            continue;
        }
        lines.push((line, line_goes_on(line)));
    }
    for (line, keep) in lines {
        if keep {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(b"\r\n");
}

/// Removes the fields a trailer section must not carry from trailers held in `http` types.
pub fn filter_map(trailers: &mut HeaderMap) {
    if trailers.keys().all(|n| allowed(n.as_str().as_bytes())) {
        return;
    }
    let forbidden: Vec<http::HeaderName> = trailers
        .keys()
        .filter(|n| !allowed(n.as_str().as_bytes()))
        .cloned()
        .collect();
    for name in forbidden {
        trailers.remove(name);
    }
}

/// A body frame with its trailers, if it is trailers, filtered by [`filter_map`].
pub fn filter_frame<D>(frame: http_body::Frame<D>) -> http_body::Frame<D> {
    match frame.into_trailers() {
        Ok(mut trailers) => {
            filter_map(&mut trailers);
            http_body::Frame::trailers(trailers)
        }
        Err(frame) => frame,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filtered(section: &[u8]) -> String {
        let mut out = Vec::new();
        filter_section(section, &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn forbidden_and_malformed_trailer_lines_are_dropped() {
        // Issue 23 item 9: each of these was forwarded as it came.
        let section = b"x-checksum: abc\r\nContent-Length: 5\r\nHost: evil\r\nx-nul: a\0b\r\nx-fold: a\r\n b\r\nTransfer-Encoding: chunked\r\nbad name: 1\r\nno-colon\r\nx-cr: a\rb\r\ngrpc-status: 0\r\n\r\n";
        assert_eq!(
            filtered(section),
            "x-checksum: abc\r\ngrpc-status: 0\r\n\r\n"
        );
        assert_eq!(filtered(b"\r\n"), "\r\n");
        assert!(line_goes_on(b"x-t:"));
        assert!(line_goes_on(b"x-t: caf\xc3\xa9\t1"));
        assert!(!line_goes_on(b": v"));
    }

    #[test]
    fn forbidden_names_leave_a_header_map() {
        let mut map = HeaderMap::new();
        map.insert("grpc-status", http::HeaderValue::from_static("0"));
        map.insert("content-length", http::HeaderValue::from_static("9"));
        map.insert("host", http::HeaderValue::from_static("x"));
        filter_map(&mut map);
        assert_eq!(map.len(), 1);
        assert!(map.contains_key("grpc-status"));
    }
}
