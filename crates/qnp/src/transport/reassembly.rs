//! The receive side of QNP: per-request reassembly, duplicate suppression and the receiver's
//! limits (§3.2.2, §4.2.2): packets of a request whose first packet was not seen are dropped, at
//! most `max_tracked_requests` requests are in flight, and each expires `request_expiry` after its
//! last packet.

use crate::header::{QnpHeader, FLAG_ACK, FLAG_DATA, HEADER_LEN};
use crate::transport::{QnpConfig, Request, Response};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::net::SocketAddr;
use tokio::time::Instant;

/// Counters of what the receiver threw away, and why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RxStats {
    pub delivered: u64,
    pub responses: u64,
    pub dropped_no_first_packet: u64,
    pub dropped_table_full: u64,
    pub dropped_malformed: u64,
    pub duplicates: u64,
    pub expired: u64,
}

impl RxStats {
    /// Adds another endpoint's counters to these.
    pub fn add(&mut self, o: &RxStats) {
        self.delivered += o.delivered;
        self.responses += o.responses;
        self.dropped_no_first_packet += o.dropped_no_first_packet;
        self.dropped_table_full += o.dropped_table_full;
        self.dropped_malformed += o.dropped_malformed;
        self.duplicates += o.duplicates;
        self.expired += o.expired;
    }
}

/// What the caller must do after a packet.
#[derive(Debug)]
pub(crate) enum RxEvent {
    Nothing,
    /// A complete new request: hand it to the application.
    Request(Request),
    /// A complete response, which acknowledges request `acked`.
    Response {
        acked: u32,
        resp: Response,
    },
    /// A retransmitted request that was already answered: send these response packets again.
    Replay(Vec<Bytes>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    peer: SocketAddr,
    req_id: u32,
    response: bool,
}

struct Assembly {
    first: QnpHeader,
    chunks: Vec<Option<Bytes>>,
    missing: usize,
    last_packet: Instant,
}

struct Completed {
    at: Instant,
    response: Option<Vec<Bytes>>,
}

pub(crate) struct RxTable {
    cfg: QnpConfig,
    assemblies: HashMap<Key, Assembly>,
    completed: HashMap<(SocketAddr, u32), Completed>,
    last_sweep: Instant,
    pub(crate) stats: RxStats,
}

impl RxTable {
    pub(crate) fn new(cfg: QnpConfig, now: Instant) -> Self {
        RxTable {
            cfg,
            assemblies: HashMap::new(),
            completed: HashMap::new(),
            last_sweep: now,
            stats: RxStats::default(),
        }
    }

    /// Requests being reassembled.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.assemblies.len()
    }

    fn sweep(&mut self, now: Instant) {
        let expiry = self.cfg.request_expiry;
        let before = self.assemblies.len();
        self.assemblies
            .retain(|_, a| now.duration_since(a.last_packet) < expiry);
        self.stats.expired += (before - self.assemblies.len()) as u64;
        let window = self.cfg.dedup_window;
        self.completed
            .retain(|_, c| now.duration_since(c.at) < window);
        self.last_sweep = now;
    }

    pub(crate) fn on_packet(&mut self, now: Instant, peer: SocketAddr, pkt: &[u8]) -> RxEvent {
        if now.duration_since(self.last_sweep) >= self.cfg.request_expiry {
            self.sweep(now);
        }
        let Ok((hdr, body)) = QnpHeader::parse(pkt) else {
            self.stats.dropped_malformed += 1;
            return RxEvent::Nothing;
        };
        if hdr.pkt_flag & FLAG_DATA == 0 {
            // A bare ACK: this endpoint never sends them, and they carry nothing to deliver.
            return RxEvent::Nothing;
        }
        let response = hdr.pkt_flag & FLAG_ACK != 0;
        if !response {
            if let Some(done) = self.completed.get(&(peer, hdr.req_id)) {
                self.stats.duplicates += 1;
                return match &done.response {
                    // Only the first packet triggers a replay, so a retransmitted multi-packet
                    // request does not multiply the response.
                    Some(pkts) if hdr.pkt_seq_num_in_req == 0 => RxEvent::Replay(pkts.clone()),
                    _ => RxEvent::Nothing,
                };
            }
        }
        let key = Key {
            peer,
            req_id: hdr.req_id,
            response,
        };
        let chunk_cap = self.cfg.max_packet_bytes.saturating_sub(HEADER_LEN);
        let asm = match self.assemblies.get_mut(&key) {
            Some(a) => a,
            None => {
                if hdr.pkt_seq_num_in_req != 0 {
                    self.stats.dropped_no_first_packet += 1;
                    return RxEvent::Nothing;
                }
                let pkts = usize::from(hdr.req_len_in_pkts);
                let plausible = pkts >= 1
                    && hdr.req_len_in_pkts <= self.cfg.max_pkts_per_req
                    && (hdr.req_len_in_bytes as usize) <= pkts * chunk_cap;
                if !plausible {
                    self.stats.dropped_malformed += 1;
                    return RxEvent::Nothing;
                }
                if self.assemblies.len() >= self.cfg.max_tracked_requests {
                    self.sweep(now);
                    if self.assemblies.len() >= self.cfg.max_tracked_requests {
                        self.stats.dropped_table_full += 1;
                        return RxEvent::Nothing;
                    }
                }
                self.assemblies.entry(key).or_insert(Assembly {
                    first: hdr,
                    chunks: vec![None; pkts],
                    missing: pkts,
                    last_packet: now,
                })
            }
        };
        let consistent = hdr.app_id == asm.first.app_id
            && hdr.req_type == asm.first.req_type
            && hdr.req_len_in_pkts == asm.first.req_len_in_pkts
            && hdr.req_len_in_bytes == asm.first.req_len_in_bytes
            && hdr.req_acked_id == asm.first.req_acked_id;
        let slot = asm.chunks.get_mut(usize::from(hdr.pkt_seq_num_in_req));
        let Some(slot) = slot.filter(|_| consistent) else {
            self.stats.dropped_malformed += 1;
            return RxEvent::Nothing;
        };
        if slot.is_some() {
            self.stats.duplicates += 1;
            return RxEvent::Nothing;
        }
        *slot = Some(Bytes::copy_from_slice(body));
        asm.missing -= 1;
        asm.last_packet = now;
        if asm.missing > 0 {
            return RxEvent::Nothing;
        }
        let Some(asm) = self.assemblies.remove(&key) else {
            return RxEvent::Nothing;
        };
        let mut payload = BytesMut::with_capacity(asm.first.req_len_in_bytes as usize);
        for c in asm.chunks.iter().flatten() {
            payload.extend_from_slice(c);
        }
        if payload.len() != asm.first.req_len_in_bytes as usize {
            self.stats.dropped_malformed += 1;
            return RxEvent::Nothing;
        }
        let payload = payload.freeze();
        if response {
            self.stats.responses += 1;
            return RxEvent::Response {
                acked: asm.first.req_acked_id,
                resp: Response {
                    peer,
                    app_id: asm.first.app_id,
                    req_type: asm.first.req_type,
                    payload,
                },
            };
        }
        if self.completed.len() >= self.cfg.max_completed_requests {
            self.sweep(now);
            if self.completed.len() >= self.cfg.max_completed_requests {
                // Forgetting an answered request would let its retransmission be delivered
                // twice; refusing the new one only costs the sender a retransmission.
                self.stats.dropped_table_full += 1;
                return RxEvent::Nothing;
            }
        }
        self.completed.insert(
            (peer, asm.first.req_id),
            Completed {
                at: now,
                response: None,
            },
        );
        self.stats.delivered += 1;
        RxEvent::Request(Request {
            peer,
            app_id: asm.first.app_id,
            req_type: asm.first.req_type,
            req_id: asm.first.req_id,
            payload,
        })
    }

    /// Forgets a delivered request the application could not take, so its retransmission is
    /// delivered instead of suppressed.
    pub(crate) fn undeliver(&mut self, peer: SocketAddr, req_id: u32) {
        self.completed.remove(&(peer, req_id));
        self.stats.delivered -= 1;
    }

    /// Records the response to a request so a retransmission of it is answered again.
    pub(crate) fn record_response(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        req_id: u32,
        pkts: Vec<Bytes>,
    ) {
        if let Some(c) = self.completed.get_mut(&(peer, req_id)) {
            c.response = Some(pkts);
            c.at = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::segment::{segment, OutReq};
    use std::time::Duration;

    fn addr() -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], 7000))
    }

    fn pkts(req_id: u32, len: usize) -> Vec<Bytes> {
        let req = OutReq {
            app_id: 1,
            req_type: 2,
            payload: Bytes::from(vec![7u8; len]),
            dispatch_len: 0,
        };
        segment(&req, req_id, None, &QnpConfig::default()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn drops_follow_on_packets_without_a_first_packet() {
        let mut t = RxTable::new(QnpConfig::default(), Instant::now());
        let p = pkts(1, 3000);
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &p[1]),
            RxEvent::Nothing
        ));
        assert_eq!(t.stats.dropped_no_first_packet, 1);
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &p[0]),
            RxEvent::Nothing
        ));
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &p[2]),
            RxEvent::Nothing
        ));
        assert!(
            matches!(t.on_packet(Instant::now(), addr(), &p[1]), RxEvent::Request(r) if r.payload.len() == 3000)
        );
        // A retransmission after delivery is suppressed.
        for q in &p {
            assert!(matches!(
                t.on_packet(Instant::now(), addr(), q),
                RxEvent::Nothing
            ));
        }
        assert_eq!(t.stats.delivered, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn tracks_at_most_the_configured_requests_and_expires_them() {
        let cfg = QnpConfig {
            max_tracked_requests: 2,
            request_expiry: Duration::from_secs(1),
            ..QnpConfig::default()
        };
        let mut t = RxTable::new(cfg, Instant::now());
        for id in 0..3 {
            let p = pkts(id, 3000);
            t.on_packet(Instant::now(), addr(), &p[0]);
        }
        assert_eq!(t.in_flight(), 2);
        assert_eq!(t.stats.dropped_table_full, 1);
        tokio::time::advance(Duration::from_millis(999)).await;
        t.on_packet(Instant::now(), addr(), &pkts(9, 3000)[0]);
        assert_eq!(t.stats.dropped_table_full, 2, "not expired yet at 999 ms");
        tokio::time::advance(Duration::from_millis(1)).await;
        t.on_packet(Instant::now(), addr(), &pkts(9, 3000)[0]);
        assert_eq!(t.stats.expired, 2);
        assert_eq!(t.in_flight(), 1);
        // The expired request's remaining packets are now orphans.
        t.on_packet(Instant::now(), addr(), &pkts(0, 3000)[1]);
        assert_eq!(t.stats.dropped_no_first_packet, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn replays_recorded_responses_and_rejects_inconsistent_packets() {
        let mut t = RxTable::new(QnpConfig::default(), Instant::now());
        let p = pkts(5, 10);
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &p[0]),
            RxEvent::Request(_)
        ));
        t.record_response(Instant::now(), addr(), 5, vec![Bytes::from_static(b"resp")]);
        assert!(
            matches!(t.on_packet(Instant::now(), addr(), &p[0]), RxEvent::Replay(v) if v.len() == 1)
        );
        // A follow-on packet claiming a different length than its first packet is dropped.
        let a = pkts(6, 3000);
        let b = pkts(6, 2000);
        t.on_packet(Instant::now(), addr(), &a[0]);
        t.on_packet(Instant::now(), addr(), &b[1]);
        assert_eq!(t.stats.dropped_malformed, 1);
        t.on_packet(Instant::now(), addr(), b"short");
        assert_eq!(t.stats.dropped_malformed, 2);
    }
}
