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
    pub headers: Headers<'a>,
    /// The first gRPC message's payload (at most `protobuf::MESSAGE_PREFIX_MAX` bytes of it),
    /// when the listener has a `grpc_field` route and the request is gRPC; else `None`.
    pub message: Option<&'a [u8]>,
}

/// The request's headers as the matcher reads them: hyper's map (HTTP/2), or the raw header
/// lines of the proxy's own HTTP/1 parser, which builds no map on its hot path.
#[derive(Debug, Clone, Copy)]
pub enum Headers<'a> {
    Map(&'a http::HeaderMap),
    Raw(&'a [httparse::Header<'a>]),
}

impl<'a> From<&'a http::HeaderMap> for Headers<'a> {
    fn from(map: &'a http::HeaderMap) -> Self {
        Headers::Map(map)
    }
}

impl<'a> Headers<'a> {
    /// Every value of `name`, in order. Names compare case-insensitively.
    pub fn values<'n>(&self, name: &'n http::HeaderName) -> Values<'a, 'n> {
        match *self {
            Headers::Map(map) => Values::Map(map.get_all(name).into_iter()),
            Headers::Raw(raw) => Values::Raw {
                name: name.as_str(),
                rest: raw.iter(),
            },
        }
    }

    /// The first value of `name`.
    pub fn first<'n>(&self, name: &'n http::HeaderName) -> Option<&'a [u8]> {
        self.values(name).next()
    }
}

/// The values of one header name; see [`Headers::values`].
pub enum Values<'a, 'n> {
    Map(http::header::ValueIter<'a, http::HeaderValue>),
    Raw {
        /// Lower case, as `HeaderName` keeps it.
        name: &'n str,
        rest: std::slice::Iter<'a, httparse::Header<'a>>,
    },
}

impl<'a> Iterator for Values<'a, '_> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        match self {
            Values::Map(values) => values.next().map(http::HeaderValue::as_bytes),
            Values::Raw { name, rest } => rest
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| h.value),
        }
    }
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

/// Whether `host` is a valid `Host` value or `:authority` (RFC 9110 §7.2: `uri-host [ ":"
/// port ]`, RFC 3986 §3.2.2): a registered name (letters, digits, `-._~`, `!$&'()*+,;=` and
/// `%xx` escapes, which covers IPv4 addresses) or a bracketed IPv6 address, then an optional
/// port of up to 5 digits. Empty is valid: a request whose target has no authority sends an
/// empty Host (RFC 9112 §3.2). No user info (`user@`), no spaces, no control bytes.
pub fn is_valid_authority(host: &str) -> bool {
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let Some((ip, after)) = rest.split_once(']') else {
            return false;
        };
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return false;
        }
        match after {
            "" => return true,
            _ => match after.strip_prefix(':') {
                Some(port) => ("", port),
                None => return false,
            },
        }
    } else {
        match host.split_once(':') {
            Some((name, port)) => (name, port),
            None => (host, ""),
        }
    };
    let port_ok = port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit());
    let bytes = name.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = |j: usize| bytes.get(j).is_some_and(u8::is_ascii_hexdigit);
            if !(hex(i + 1) && hex(i + 2)) {
                return false;
            }
            i += 3;
            continue;
        }
        if !(b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=".contains(&b)) {
            return false;
        }
        i += 1;
    }
    port_ok
}

#[cfg(test)]
mod tests {
    use super::{is_valid_authority, strip_port};

    #[test]
    fn authorities_follow_rfc_3986() {
        for good in [
            "api.local",
            "api.local:8080",
            "API.Local:",
            "10.0.0.1:80",
            "[::1]",
            "[::1]:443",
            "[2001:db8::7]",
            "xn--bcher-kva.example",
            "a_b~c!$&'()*+,;=",
            "%41pi",
            "",
        ] {
            assert!(is_valid_authority(good), "{good:?} is valid");
        }
        for bad in [
            "a b",
            "a\0b",
            "user@host",
            "host:port",
            "host:123456",
            "host:1:2",
            "[::1",
            "[::1]x",
            "[nope]",
            "::1",
            "a/b",
            "a?b",
            "a#b",
            "a%zz",
            "a%4",
            "é.example",
            "a\tb",
            "<script>",
            "a\"b",
        ] {
            assert!(!is_valid_authority(bad), "{bad:?} is not valid");
        }
    }

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
