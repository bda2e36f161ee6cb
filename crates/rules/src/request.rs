//! The executor's view of a request: borrowed fields only, so building one costs nothing.

/// What the user-tier executor looks at. The proxy fills it from the parsed request head.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a http::Method,
    /// `:authority` or `Host`. May carry a port, which is ignored; compared case-insensitively.
    pub host: Option<&'a str>,
    /// Path only, no query, as received (not decoded).
    pub path: &'a str,
    /// Raw query without `?`, percent-encoded as received.
    pub query: Option<&'a str>,
    pub headers: &'a http::HeaderMap,
}

/// The host without its port: `a.b:80` -> `a.b`, `[::1]:80` -> `[::1]`.
/// Only a trailing all-digit `:port` is a port, so a bare IPv6 address is left whole.
pub fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rfind(':') {
        Some(colon)
            if host[colon + 1..].bytes().all(|b| b.is_ascii_digit())
                && !host[..colon].contains(':') =>
        {
            &host[..colon]
        }
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::strip_port;

    #[test]
    fn ports_are_stripped() {
        assert_eq!(strip_port("api.local:8080"), "api.local");
        assert_eq!(strip_port("api.local:"), "api.local");
        assert_eq!(strip_port("api.local"), "api.local");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
        assert_eq!(strip_port("::1"), "::1");
        assert_eq!(strip_port("a:b"), "a:b");
        assert_eq!(strip_port(""), "");
    }
}
