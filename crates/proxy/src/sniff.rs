//! Which protocol an `http` listener's connection speaks, told from its first bytes: the
//! HTTP/2 connection preface (h2c with prior knowledge, gRPC) or anything else (HTTP/1.x).
//! The listener's dispatch and tier K's first-request hand-off both ask here.

/// The HTTP/2 connection preface a client with prior knowledge of h2c opens with.
pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

/// The protocol of a connection that began with `first`; `None` while `first` is still a
/// proper beginning of the HTTP/2 preface (no bytes at all included): read more to tell.
pub fn sniff(first: &[u8]) -> Option<Protocol> {
    if first.starts_with(H2_PREFACE) {
        Some(Protocol::Http2)
    } else if H2_PREFACE.starts_with(first) {
        None
    } else {
        Some(Protocol::Http1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preface_decides_and_its_beginnings_wait() {
        assert_eq!(sniff(b""), None);
        assert_eq!(sniff(b"PRI * HT"), None);
        assert_eq!(sniff(H2_PREFACE), Some(Protocol::Http2));
        assert_eq!(
            sniff(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0"),
            Some(Protocol::Http2)
        );
        assert_eq!(sniff(b"GET / HTTP/1.1\r\n"), Some(Protocol::Http1));
        assert_eq!(sniff(b"PRX"), Some(Protocol::Http1));
    }
}
