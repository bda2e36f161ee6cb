//! QNP over UDP (§3.2, §4.1): requests are segmented into packets carrying the Fig. 11 header,
//! ACKed per request by the response that answers them, retransmitted by the sender until then,
//! and suppressed on the receiver when they arrive twice.
//!
//! [`Endpoint`] is the async API (`send_req`, `recv_req`, `respond`); [`BlockingEndpoint`] is the
//! same over a private runtime. Any [`Datagram`] socket works: UDP, or the in-memory and lossy
//! sockets the tests use.

pub mod blocking;
pub mod datagram;
pub mod reassembly;
pub mod segment;

pub use blocking::BlockingEndpoint;
pub use datagram::{Datagram, Impairment, LossySocket, MemNet, MemSocket};
pub use reassembly::RxStats;
pub use segment::{segment, OutReq};

use crate::QnpError;
use bytes::Bytes;
use parking_lot::Mutex;
use reassembly::{RxEvent, RxTable};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Limits and timers of an endpoint. The defaults are the paper's (§4.2.2) where it gives one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QnpConfig {
    /// Largest QNP packet (header + payload) = UDP payload. 1472 keeps IPv4 packets at 1500 bytes.
    pub max_packet_bytes: usize,
    /// Most packets in one request (the header field is a u8).
    pub max_pkts_per_req: u8,
    /// Requests reassembled at once; packets of further new requests are dropped (paper: 1,024).
    pub max_tracked_requests: usize,
    /// A partly received request is forgotten this long after its last packet (paper: 1 s).
    pub request_expiry: Duration,
    /// Answered requests remembered to suppress and answer their retransmissions. Keep it above
    /// the request rate × `dedup_window`: when it is full, new requests are refused (counted in
    /// `RxStats::dropped_table_full`) rather than risk a duplicate delivery.
    pub max_completed_requests: usize,
    /// How long an answered request is remembered. Keep it above `rto × max_attempts`.
    pub dedup_window: Duration,
    /// Bytes of responses kept to answer retransmissions (each is sent again at most
    /// `max_attempts` times, and only for an exact copy of its request). Past it, responses are
    /// not kept (counted in `RxStats::responses_not_cached`): a lost one is then not resent.
    pub max_cached_response_bytes: usize,
    /// Retransmission timeout of the sender.
    pub rto: Duration,
    /// Transmissions of a request before `send_req` gives up.
    pub max_attempts: u32,
}

impl Default for QnpConfig {
    fn default() -> Self {
        QnpConfig {
            max_packet_bytes: 1472,
            max_pkts_per_req: 64,
            max_tracked_requests: 1024,
            request_expiry: Duration::from_secs(1),
            // Sized for ~100k answered requests/s per endpoint over the 2 s window.
            max_completed_requests: 262_144,
            dedup_window: Duration::from_secs(2),
            // ~200k answered requests of 300 bytes over the 2 s window.
            max_cached_response_bytes: 64 << 20,
            rto: Duration::from_millis(50),
            max_attempts: 20,
        }
    }
}

impl QnpConfig {
    /// Checks that the limits make a working endpoint; the error names the setting and a value
    /// that works.
    pub fn validate(&self) -> Result<(), QnpError> {
        let bad = |what: String| Err(QnpError::Config(what));
        // 65,507 is the largest UDP payload over IPv4.
        if self.max_packet_bytes <= crate::header::HEADER_LEN || self.max_packet_bytes > 65_507 {
            return bad(format!(
                "max_packet_bytes is {} but must leave room after the {}-byte QNP header and fit a UDP datagram ({}..=65507); 1472 fills a 1500-byte IPv4 packet",
                self.max_packet_bytes,
                crate::header::HEADER_LEN,
                crate::header::HEADER_LEN + 1
            ));
        }
        if self.max_pkts_per_req == 0 {
            return bad(
                "max_pkts_per_req is 0; a request needs at least one packet (default 64)".into(),
            );
        }
        if self.max_tracked_requests == 0 {
            return bad("max_tracked_requests is 0, so every request would be dropped; the paper tracks 1024".into());
        }
        if self.max_completed_requests == 0 {
            return bad("max_completed_requests is 0, so every request would be refused; keep it above the request rate × dedup_window (default 262144)".into());
        }
        if self.max_cached_response_bytes == 0 {
            return bad("max_cached_response_bytes is 0, so a lost response could never be sent again; keep it above the response bytes per dedup_window (default 64 MiB)".into());
        }
        if self.request_expiry.is_zero() {
            return bad("request_expiry is 0, so a request of several packets could never be reassembled; the paper uses 1 s".into());
        }
        if self.rto.is_zero() {
            return bad("rto is 0, which would retransmit in a busy loop; use e.g. 50 ms".into());
        }
        if self.max_attempts == 0 {
            return bad(
                "max_attempts is 0, so no request would ever be sent; use at least 1 (default 20)"
                    .into(),
            );
        }
        if self.dedup_window < self.rto.saturating_mul(self.max_attempts) {
            return bad(format!(
                "dedup_window ({:?}) is shorter than rto × max_attempts ({:?}): a late retransmission of an answered request would be delivered twice; raise dedup_window",
                self.dedup_window,
                self.rto.saturating_mul(self.max_attempts)
            ));
        }
        Ok(())
    }
}

/// A request delivered to the application.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub peer: SocketAddr,
    pub app_id: u8,
    pub req_type: u8,
    pub req_id: u32,
    pub payload: Bytes,
}

/// A response delivered to the sender of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub peer: SocketAddr,
    pub app_id: u8,
    pub req_type: u8,
    pub payload: Bytes,
}

struct Shared<S> {
    sock: S,
    cfg: QnpConfig,
    next_id: AtomicU32,
    pending: Mutex<HashMap<u32, oneshot::Sender<Response>>>,
    rx: Mutex<RxTable>,
}

/// A QNP endpoint: it sends requests and receives them, on one socket.
pub struct Endpoint<S: Datagram> {
    shared: Arc<Shared<S>>,
    requests: tokio::sync::Mutex<mpsc::Receiver<Request>>,
    task: JoinHandle<()>,
}

impl<S: Datagram> Drop for Endpoint<S> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Removes a pending request when its `send_req` future ends or is dropped.
struct PendingGuard<'a> {
    pending: &'a Mutex<HashMap<u32, oneshot::Sender<Response>>>,
    id: u32,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.pending.lock().remove(&self.id);
    }
}

impl<S: Datagram> Endpoint<S> {
    /// Starts an endpoint on `sock`. Must be called inside a tokio runtime: it spawns the
    /// receive task. Fails if `cfg` does not pass [`QnpConfig::validate`].
    pub fn new(sock: S, cfg: QnpConfig) -> Result<Self, QnpError> {
        cfg.validate()?;
        let (tx, rx) = mpsc::channel(cfg.max_tracked_requests.max(1));
        let shared = Arc::new(Shared {
            sock,
            cfg,
            // A random start keeps a restarted sender's ids apart from its predecessor's, which
            // the receiver may still remember as answered.
            next_id: AtomicU32::new(rand::random()),
            pending: Mutex::new(HashMap::new()),
            rx: Mutex::new(RxTable::new(cfg, Instant::now())),
        });
        let task = tokio::spawn(receive_loop(Arc::clone(&shared), tx));
        Ok(Endpoint {
            shared,
            requests: tokio::sync::Mutex::new(rx),
            task,
        })
    }

    /// The address peers send to.
    pub fn local_addr(&self) -> Result<SocketAddr, QnpError> {
        self.shared
            .sock
            .local_addr()
            .map_err(|e| QnpError::io("reading the endpoint's address", e))
    }

    /// The configuration.
    pub fn config(&self) -> &QnpConfig {
        &self.shared.cfg
    }

    /// Receiver counters.
    pub fn stats(&self) -> RxStats {
        self.shared.rx.lock().stats
    }

    /// Sends a request and waits for its response, retransmitting every `rto` until the response
    /// (which carries the ACK) arrives or `max_attempts` transmissions went unanswered.
    pub async fn send_req(&self, peer: SocketAddr, req: &OutReq) -> Result<Response, QnpError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let pkts = segment(req, id, None, &self.shared.cfg)?;
        let (tx, mut rx) = oneshot::channel();
        self.shared.pending.lock().insert(id, tx);
        let _guard = PendingGuard {
            pending: &self.shared.pending,
            id,
        };
        for _ in 0..self.shared.cfg.max_attempts {
            for p in &pkts {
                self.shared
                    .sock
                    .send_to(p, peer)
                    .await
                    .map_err(|e| QnpError::io(format!("sending request {id} to {peer}"), e))?;
            }
            match tokio::time::timeout(self.shared.cfg.rto, &mut rx).await {
                Ok(Ok(resp)) => return Ok(resp),
                Ok(Err(_)) => return Err(QnpError::Closed),
                Err(_elapsed) => continue,
            }
        }
        Err(QnpError::Timeout {
            req_id: id,
            peer,
            attempts: self.shared.cfg.max_attempts,
        })
    }

    /// Waits for the next complete request.
    pub async fn recv_req(&self) -> Result<Request, QnpError> {
        self.requests
            .lock()
            .await
            .recv()
            .await
            .ok_or(QnpError::Closed)
    }

    /// Answers a request. The response carries the request's ACK; it is remembered, so a
    /// retransmission of the request is answered again instead of delivered twice.
    pub async fn respond(&self, to: &Request, resp: &OutReq) -> Result<(), QnpError> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let pkts = segment(resp, id, Some(to.req_id), &self.shared.cfg)?;
        self.shared
            .rx
            .lock()
            .record_response(Instant::now(), to.peer, to.req_id, pkts.clone());
        for p in &pkts {
            self.shared.sock.send_to(p, to.peer).await.map_err(|e| {
                QnpError::io(format!("answering request {} of {}", to.req_id, to.peer), e)
            })?;
        }
        Ok(())
    }
}

/// Feeds `packets` (each with the port of the peer that sent it, on 127.0.0.1) to a fresh
/// receive table, as an endpoint's receive task does, and returns what it counted and the
/// payloads it would deliver. For fuzzing and tests: no socket, no runtime.
#[doc(hidden)]
pub fn receive_packets(cfg: QnpConfig, packets: &[(&[u8], u16)]) -> (RxStats, Vec<Bytes>) {
    let mut t = RxTable::new(cfg, Instant::now());
    let mut delivered = Vec::new();
    for (pkt, port) in packets {
        let peer = SocketAddr::from(([127, 0, 0, 1], *port));
        match t.on_packet(Instant::now(), peer, pkt) {
            RxEvent::Request(r) => delivered.push(r.payload),
            RxEvent::Response { resp, .. } => delivered.push(resp.payload),
            RxEvent::Nothing | RxEvent::Replay { .. } => {}
        }
    }
    (t.stats, delivered)
}

/// Whether a UDP receive error concerns one packet (an ICMP error for an earlier datagram, an
/// interrupted call): the next receive may well succeed. Anything else (a closed or broken
/// socket, no memory) would fail again at once, so a receive loop must not retry it in a
/// tight loop.
pub fn receive_error_is_per_packet(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        error.kind(),
        ConnectionRefused
            | ConnectionReset
            | HostUnreachable
            | NetworkUnreachable
            | Interrupted
            | WouldBlock
            | TimedOut
    )
}

/// How long a receive loop waits after an error that is not per packet, so that a broken
/// socket costs a log line per interval, not a spinning core.
pub const RECEIVE_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

async fn receive_loop<S: Datagram>(shared: Arc<Shared<S>>, requests: mpsc::Sender<Request>) {
    let mut buf = vec![0u8; shared.cfg.max_packet_bytes + 1];
    loop {
        let (n, from) = match shared.sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::NotConnected => return,
            Err(e) if receive_error_is_per_packet(&e) => {
                // A stray ICMP error on a UDP socket must not stop the endpoint.
                tracing::debug!(error = %e, "qnp: receive error");
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "qnp: receive failed; retrying shortly");
                tokio::time::sleep(RECEIVE_ERROR_PAUSE).await;
                continue;
            }
        };
        if n > shared.cfg.max_packet_bytes {
            shared.rx.lock().stats.dropped_malformed += 1;
            continue;
        }
        let event = shared.rx.lock().on_packet(Instant::now(), from, &buf[..n]);
        match event {
            RxEvent::Nothing => {}
            RxEvent::Request(req) => {
                let (peer, id) = (req.peer, req.req_id);
                if requests.try_send(req).is_err() {
                    shared.rx.lock().undeliver(peer, id);
                }
            }
            RxEvent::Response { acked, resp } => {
                if let Some(waiter) = shared.pending.lock().remove(&acked) {
                    let _ = waiter.send(resp);
                }
            }
            // To the address the answered request came from, never to anyone else.
            RxEvent::Replay { to, pkts } => {
                for p in pkts {
                    let _ = shared.sock.send_to(&p, to).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn a(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    fn payload(i: u32, len: usize) -> Bytes {
        // Content derived from the request number, so corruption and mix-ups are detectable.
        Bytes::from(
            (0..len)
                .map(|j| (i as usize * 31 + j * 7) as u8)
                .collect::<Vec<_>>(),
        )
    }

    fn out(i: u32, len: usize) -> OutReq {
        let mut p = i.to_be_bytes().to_vec();
        p.extend_from_slice(&payload(i, len));
        OutReq {
            app_id: 1,
            req_type: 0,
            payload: Bytes::from(p),
            dispatch_len: 4,
        }
    }

    /// An echo server that counts deliveries per request number and checks their content.
    fn echo_server<S: Datagram>(
        ep: Arc<Endpoint<S>>,
        seen: Arc<Mutex<Vec<u32>>>,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            while let Ok(req) = ep.recv_req().await {
                let Some((num, body)) = req.payload.split_first_chunk::<4>() else {
                    panic!("request without its number")
                };
                let num = u32::from_be_bytes(*num);
                assert_eq!(
                    body,
                    &payload(num, body.len())[..],
                    "request {num} corrupted"
                );
                seen.lock().push(num);
                let resp = OutReq {
                    payload: req.payload.clone(),
                    ..out(num, 0)
                };
                ep.respond(&req, &resp).await.unwrap();
            }
        })
    }

    async fn run_lossy(how: Impairment, n: u32, len: usize) -> (Vec<u32>, RxStats) {
        let net = MemNet::new();
        let server = Arc::new(
            Endpoint::new(
                LossySocket::new(
                    net.socket(a(1)),
                    Impairment {
                        seed: how.seed ^ 1,
                        ..how
                    },
                ),
                QnpConfig::default(),
            )
            .unwrap(),
        );
        let client = Arc::new(
            Endpoint::new(
                LossySocket::new(net.socket(a(2)), how),
                QnpConfig::default(),
            )
            .unwrap(),
        );
        let seen = Arc::new(Mutex::new(Vec::new()));
        let srv = echo_server(Arc::clone(&server), Arc::clone(&seen));
        let mut calls = Vec::new();
        for i in 0..n {
            let client = Arc::clone(&client);
            calls.push(tokio::spawn(async move {
                let req = out(i, len + (i as usize % 3) * 1000);
                let resp = client.send_req(a(1), &req).await.unwrap();
                assert_eq!(
                    resp.payload, req.payload,
                    "response {i} corrupted or mixed up"
                );
            }));
        }
        for c in calls {
            c.await.unwrap();
        }
        srv.abort();
        let seen = seen.lock().clone();
        (seen, server.stats())
    }

    #[test]
    fn only_per_packet_receive_errors_are_retried_at_once() {
        use std::io::{Error, ErrorKind};
        for kind in [
            ErrorKind::ConnectionRefused,
            ErrorKind::Interrupted,
            ErrorKind::WouldBlock,
        ] {
            assert!(receive_error_is_per_packet(&Error::from(kind)), "{kind:?}");
        }
        // EBADF, ENOMEM: they would come back at once; the loops pause instead of spinning.
        for code in [libc::EBADF, libc::ENOMEM] {
            assert!(
                !receive_error_is_per_packet(&Error::from_raw_os_error(code)),
                "{code}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lossless_round_trip() {
        let none = Impairment {
            drop: 0.0,
            duplicate: 0.0,
            delay: 0.0,
            max_delay: Duration::ZERO,
            seed: 0,
        };
        let (seen, stats) = run_lossy(none, 50, 3000).await;
        assert_eq!(seen.len(), 50);
        assert_eq!(stats.duplicates, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn loss_duplication_and_reordering_deliver_each_request_exactly_once() {
        for seed in 0..4 {
            let how = Impairment {
                drop: 0.15,
                duplicate: 0.1,
                delay: 0.3,
                max_delay: Duration::from_millis(80),
                seed,
            };
            let (seen, stats) = run_lossy(how, 60, 2000).await;
            let unique: HashSet<_> = seen.iter().copied().collect();
            assert_eq!(unique.len(), 60, "seed {seed}: every request arrives");
            assert_eq!(seen.len(), 60, "seed {seed}: no request is delivered twice");
            assert!(
                stats.duplicates > 0,
                "seed {seed}: the shim did duplicate packets"
            );
            assert!(
                stats.dropped_no_first_packet > 0,
                "seed {seed}: reordering was exercised"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn unanswered_requests_time_out_after_max_attempts() {
        let net = MemNet::new();
        let cfg = QnpConfig {
            rto: Duration::from_millis(10),
            max_attempts: 3,
            ..QnpConfig::default()
        };
        let client = Endpoint::new(net.socket(a(2)), cfg).unwrap();
        let start = Instant::now();
        let err = client.send_req(a(9), &out(1, 10)).await.unwrap_err();
        assert!(
            matches!(err, QnpError::Timeout { attempts: 3, .. }),
            "{err}"
        );
        assert_eq!(start.elapsed(), Duration::from_millis(30));
        assert!(
            client.shared.pending.lock().is_empty(),
            "the waiter is cleaned up"
        );
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        QnpConfig::default().validate().unwrap();
        let d = QnpConfig::default();
        for (cfg, name) in [
            (
                QnpConfig {
                    max_packet_bytes: 22,
                    ..d
                },
                "max_packet_bytes",
            ),
            (
                QnpConfig {
                    max_packet_bytes: 70_000,
                    ..d
                },
                "max_packet_bytes",
            ),
            (
                QnpConfig {
                    max_pkts_per_req: 0,
                    ..d
                },
                "max_pkts_per_req",
            ),
            (
                QnpConfig {
                    max_tracked_requests: 0,
                    ..d
                },
                "max_tracked_requests",
            ),
            (
                QnpConfig {
                    max_completed_requests: 0,
                    ..d
                },
                "max_completed_requests",
            ),
            (
                QnpConfig {
                    max_cached_response_bytes: 0,
                    ..d
                },
                "max_cached_response_bytes",
            ),
            (
                QnpConfig {
                    request_expiry: Duration::ZERO,
                    ..d
                },
                "request_expiry",
            ),
            (
                QnpConfig {
                    rto: Duration::ZERO,
                    ..d
                },
                "rto",
            ),
            (
                QnpConfig {
                    max_attempts: 0,
                    ..d
                },
                "max_attempts",
            ),
            (
                QnpConfig {
                    dedup_window: Duration::from_millis(100),
                    ..d
                },
                "dedup_window",
            ),
        ] {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.starts_with(&format!("bad QNP setting: {name} ")), "{e}");
        }
    }

    #[tokio::test]
    async fn endpoints_refuse_bad_settings() {
        let net = MemNet::new();
        let cfg = QnpConfig {
            max_attempts: 0,
            ..QnpConfig::default()
        };
        assert!(matches!(
            Endpoint::new(net.socket(a(3)), cfg),
            Err(QnpError::Config(_))
        ));
    }

    #[tokio::test]
    async fn works_over_real_udp() {
        let bind = |_| async { tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap() };
        let server = Arc::new(Endpoint::new(bind(()).await, QnpConfig::default()).unwrap());
        let client = Endpoint::new(bind(()).await, QnpConfig::default()).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let srv = echo_server(Arc::clone(&server), Arc::clone(&seen));
        let to = server.local_addr().unwrap();
        for i in 0..20 {
            let req = out(i, 4000);
            let resp = client.send_req(to, &req).await.unwrap();
            assert_eq!(resp.payload, req.payload);
        }
        assert_eq!(seen.lock().len(), 20);
        srv.abort();
    }
}
