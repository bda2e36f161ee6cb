//! The client-side socket of an HTTP connection, wrapped for two jobs hyper does not do:
//!
//! * **Framing conflicts.** hyper quietly drops `Content-Length` when `Transfer-Encoding` is
//!   also present (RFC 9112 §6.3 allows that), so the service never sees the conflict. The
//!   issue asks for a 400, as Envoy gives, so [`FramingSniffer`] watches the request heads
//!   as they are read and flags a head that carries both.
//! * **Idle timeout.** hyper's header timer starts only once bytes arrive, and protocol
//!   detection waits forever for the first byte. Every read and write bumps an activity
//!   counter that the connection's watchdog samples.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::tap::Tap;

/// Scans a byte stream for a request head (a block ended by an empty line) that has both a
/// `content-length` and a `transfer-encoding` header line. Streaming: state is carried across
/// calls, nothing is buffered, and any input is safe.
#[derive(Debug, Default, Clone)]
pub struct FramingSniffer {
    /// Bytes of the current line seen so far, capped (only the start of a line matters).
    line_len: usize,
    /// Which header-name prefixes the current line still matches.
    may_be_cl: bool,
    may_be_te: bool,
    /// The previous line was empty-so-far tracking: true right after a CRLF.
    at_line_start: bool,
    saw_cl: bool,
    saw_te: bool,
    conflict: bool,
}

const CL: &[u8] = b"content-length:";
const TE: &[u8] = b"transfer-encoding:";

impl FramingSniffer {
    pub fn new() -> Self {
        FramingSniffer {
            at_line_start: true,
            may_be_cl: true,
            may_be_te: true,
            ..Default::default()
        }
    }

    /// True once some head carried both framing headers.
    pub fn conflict(&self) -> bool {
        self.conflict
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\n' {
                // An empty line (just "\r\n" or "\n") ends a head.
                if self.line_len == 0 || (self.line_len == 1 && self.at_line_start) {
                    if self.saw_cl && self.saw_te {
                        self.conflict = true;
                    }
                    self.saw_cl = false;
                    self.saw_te = false;
                }
                self.line_len = 0;
                self.may_be_cl = true;
                self.may_be_te = true;
                self.at_line_start = true;
                continue;
            }
            let i = self.line_len;
            // A lone '\r' as the first byte keeps the line "empty" for the check above.
            self.at_line_start = i == 0 && b == b'\r';
            let lower = b.to_ascii_lowercase();
            if self.may_be_cl && i < CL.len() {
                self.may_be_cl = CL[i] == lower;
                if self.may_be_cl && i + 1 == CL.len() {
                    self.saw_cl = true;
                }
            }
            if self.may_be_te && i < TE.len() {
                self.may_be_te = TE[i] == lower;
                if self.may_be_te && i + 1 == TE.len() {
                    self.saw_te = true;
                }
            }
            self.line_len = self.line_len.saturating_add(1);
        }
    }
}

/// Shared between the socket's tap, the connection's watchdog and the request handler.
#[derive(Default)]
pub struct ConnSignals {
    /// Bumped on every read or write that moved bytes.
    pub activity: AtomicU64,
    /// Set when a request head carried both Content-Length and Transfer-Encoding.
    pub framing_conflict: AtomicBool,
}

/// The HTTP connection's tap: sniffs request framing, counts activity for the idle timeout.
pub struct HttpTap {
    sniffer: FramingSniffer,
    signals: Arc<ConnSignals>,
}

impl HttpTap {
    pub fn new(signals: Arc<ConnSignals>) -> Self {
        HttpTap {
            sniffer: FramingSniffer::new(),
            signals,
        }
    }

    fn bump(&self) {
        // Only this connection's task writes the counter: load + store is exact.
        let a = &self.signals.activity;
        a.store(a.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }
}

impl Tap for HttpTap {
    fn on_read(&mut self, bytes: &[u8]) {
        self.sniffer.feed(bytes);
        if self.sniffer.conflict() {
            self.signals.framing_conflict.store(true, Ordering::Relaxed);
        }
        self.bump();
    }

    fn on_write(&mut self, written: usize) {
        if written > 0 {
            self.bump();
        }
    }
}

/// Resolves once no byte has moved for `idle` (checked every quarter of it).
pub async fn idle(signals: &ConnSignals, idle: std::time::Duration) {
    let step = (idle / 4).max(std::time::Duration::from_millis(10));
    let mut last = signals.activity.load(Ordering::Relaxed);
    let mut quiet = std::time::Duration::ZERO;
    loop {
        tokio::time::sleep(step).await;
        let now = signals.activity.load(Ordering::Relaxed);
        if now == last {
            quiet += step;
            if quiet >= idle {
                return;
            }
        } else {
            last = now;
            quiet = std::time::Duration::ZERO;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sniff(chunks: &[&[u8]]) -> bool {
        let mut s = FramingSniffer::new();
        for c in chunks {
            s.feed(c);
        }
        s.conflict()
    }

    #[test]
    fn both_framing_headers_in_one_head_conflict() {
        let req = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(sniff(&[req]));
        // Split at every byte boundary: state carries across reads.
        for cut in 0..req.len() {
            assert!(
                sniff(&[&req[..cut], &req[cut..]]),
                "missed with a split at {cut}"
            );
        }
        assert!(sniff(&[
            b"POST / HTTP/1.1\r\nTRANSFER-ENCODING: chunked\r\ncontent-LENGTH: 1\r\n\r\n"
        ]));
    }

    #[test]
    fn separate_heads_and_bodies_do_not_conflict() {
        assert!(!sniff(&[
            b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
        ]));
        assert!(!sniff(&[
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        ]));
        assert!(!sniff(&[
            b"POST /a HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        ]));
        // A header whose name merely starts like one of them is not it.
        assert!(!sniff(&[b"GET / HTTP/1.1\r\nx-content-length: 1\r\ntransfer-encodingx: 2\r\ncontent-length: 0\r\n\r\n"]));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_fires_only_after_quiet_time() {
        let s = ConnSignals::default();
        let started = tokio::time::Instant::now();
        idle(&s, std::time::Duration::from_secs(4)).await;
        assert!(started.elapsed() >= std::time::Duration::from_secs(4));
    }
}
