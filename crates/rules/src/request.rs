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
