//! The receive side of QNP: per-request reassembly, duplicate suppression and the receiver's
//! limits (§3.2.2, §4.2.2): packets of a request whose first packet was not seen are dropped, at
//! most `max_tracked_requests` requests are in flight, and each expires `request_expiry` after its
//! last packet.
//!
//! An answered request is remembered, with its response, for `dedup_window`, so that its
//! retransmission is answered again instead of delivered twice. UDP source addresses can be
//! forged, so the cache must not become a reflector that sends a stored response to whoever names
//! a victim's address: a response is sent again only for a byte-exact copy of the request's first
//! packet (compared by a keyed hash, so it cannot be guessed), only to the address the request came
//! from, at most `max_attempts` times; and the cached responses are capped in bytes.

use crate::header::{QnpHeader, FLAG_ACK, FLAG_DATA, HEADER_LEN};
use crate::transport::{QnpConfig, Request, Response};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
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
    /// Answered requests whose response was sent again.
    pub replays: u64,
    /// Retransmissions past the `max_attempts` replays of one request: not answered.
    pub replays_refused: u64,
    /// First packets that name an answered request (source and id) but are not it: forged or
    /// stray; not answered.
    pub dropped_mismatched: u64,
    /// Responses not kept for replay because `max_cached_response_bytes` was reached.
    pub responses_not_cached: u64,
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
        self.replays += o.replays;
        self.replays_refused += o.replays_refused;
        self.dropped_mismatched += o.dropped_mismatched;
        self.responses_not_cached += o.responses_not_cached;
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
    /// A retransmitted request that was already answered: send these response packets again, to
    /// `to`, the address the request came from.
    Replay {
        to: SocketAddr,
        pkts: Vec<Bytes>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    peer: SocketAddr,
    req_id: u32,
    response: bool,
}

struct Assembly {
    first: QnpHeader,
    /// Keyed hash of the first packet, to recognise its retransmissions once answered.
    first_digest: u64,
    chunks: Vec<Option<Bytes>>,
    missing: usize,
    last_packet: Instant,
}

struct Completed {
    at: Instant,
    /// The request's first packet, as [`Assembly::first_digest`].
    first_digest: u64,
    response: Option<Vec<Bytes>>,
    /// Replays left: a sender transmits a request at most `max_attempts` times.
    replays_left: u32,
}

impl Completed {
    fn response_bytes(&self) -> usize {
        self.response
            .as_ref()
            .map_or(0, |pkts| pkts.iter().map(Bytes::len).sum())
    }
}

pub(crate) struct RxTable {
    cfg: QnpConfig,
    assemblies: HashMap<Key, Assembly>,
    completed: HashMap<(SocketAddr, u32), Completed>,
    /// Bytes of the responses kept in `completed`.
    cached_bytes: usize,
    /// Random keys of this table's packet digests: a forger who cannot see the request cannot
    /// make a packet with the same digest.
    digest_keys: RandomState,
    last_sweep: Instant,
    pub(crate) stats: RxStats,
}

impl RxTable {
    pub(crate) fn new(cfg: QnpConfig, now: Instant) -> Self {
        RxTable {
            cfg,
            assemblies: HashMap::new(),
            completed: HashMap::new(),
            cached_bytes: 0,
            digest_keys: RandomState::new(),
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
        let mut freed = 0;
        self.completed.retain(|_, c| {
            let keep = now.duration_since(c.at) < window;
            if !keep {
                freed += c.response_bytes();
            }
            keep
        });
        self.cached_bytes -= freed;
        self.last_sweep = now;
    }

    fn digest(&self, pkt: &[u8]) -> u64 {
        self.digest_keys.hash_one(pkt)
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
        let first_digest = if !response && hdr.pkt_seq_num_in_req == 0 {
            self.digest(pkt)
        } else {
            0
        };
        if !response {
            if let Some(done) = self.completed.get_mut(&(peer, hdr.req_id)) {
                // Only the first packet triggers a replay, so a retransmitted multi-packet
                // request does not multiply the response.
                if hdr.pkt_seq_num_in_req != 0 {
                    self.stats.duplicates += 1;
                    return RxEvent::Nothing;
                }
                // A retransmission repeats the first packet byte for byte; anything else naming
                // this source and id is not the request that was answered.
                if first_digest != done.first_digest {
                    self.stats.dropped_mismatched += 1;
                    return RxEvent::Nothing;
                }
                self.stats.duplicates += 1;
                let Some(pkts) = &done.response else {
                    return RxEvent::Nothing;
                };
                if done.replays_left == 0 {
                    self.stats.replays_refused += 1;
                    return RxEvent::Nothing;
                }
                done.replays_left -= 1;
                self.stats.replays += 1;
                return RxEvent::Replay {
                    to: peer,
                    pkts: pkts.clone(),
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
                    first_digest,
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
                first_digest: asm.first_digest,
                response: None,
                replays_left: 0,
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
        if let Some(c) = self.completed.remove(&(peer, req_id)) {
            self.cached_bytes -= c.response_bytes();
        }
        self.stats.delivered -= 1;
    }

    /// Records the response to a request so a retransmission of it is answered again, unless
    /// the cached responses already hold `max_cached_response_bytes` (then a lost response is
    /// not sent again: the request was still delivered exactly once).
    pub(crate) fn record_response(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        req_id: u32,
        pkts: Vec<Bytes>,
    ) {
        let Some(c) = self.completed.get_mut(&(peer, req_id)) else {
            return;
        };
        self.cached_bytes -= c.response_bytes();
        c.response = None;
        c.at = now;
        let bytes: usize = pkts.iter().map(Bytes::len).sum();
        if self.cached_bytes + bytes > self.cfg.max_cached_response_bytes {
            self.stats.responses_not_cached += 1;
            return;
        }
        self.cached_bytes += bytes;
        c.response = Some(pkts);
        c.replays_left = self.cfg.max_attempts;
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
            matches!(t.on_packet(Instant::now(), addr(), &p[0]), RxEvent::Replay { to, pkts } if to == addr() && pkts.len() == 1)
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

    fn answered(t: &mut RxTable, req_id: u32, len: usize) -> Vec<Bytes> {
        let p = pkts(req_id, len);
        let mut delivered = false;
        for q in &p {
            delivered |= matches!(t.on_packet(Instant::now(), addr(), q), RxEvent::Request(_));
        }
        assert!(delivered);
        t.record_response(
            Instant::now(),
            addr(),
            req_id,
            vec![Bytes::from(vec![1u8; 1400]); 64],
        );
        p
    }

    /// Regression (issue 23, item 10): a bare header naming an answered request's source and id
    /// made the cache send the whole stored response (here 64 packets) to that source, again and
    /// again: a reflector and amplifier for anyone who can forge a UDP source address.
    #[tokio::test(start_paused = true)]
    async fn only_an_exact_retransmission_is_answered_and_only_to_its_source() {
        let mut t = RxTable::new(QnpConfig::default(), Instant::now());
        let p = answered(&mut t, 7, 3000);
        // Forged: the same source and id, but not the request's first packet.
        let mut forged = QnpHeader::parse(&p[0]).unwrap().0;
        forged.req_len_in_bytes = 0;
        forged.req_len_in_pkts = 1;
        let mut altered = p[0].to_vec();
        *altered.last_mut().unwrap() ^= 1;
        for pkt in [&forged.to_bytes()[..], &altered, &p[0][..30]] {
            assert!(matches!(
                t.on_packet(Instant::now(), addr(), pkt),
                RxEvent::Nothing
            ));
        }
        assert_eq!(t.stats.dropped_mismatched, 3);
        assert_eq!(t.stats.replays, 0);
        // The real retransmission is answered, to the request's source.
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &p[0]),
            RxEvent::Replay { to, pkts } if to == addr() && pkts.len() == 64
        ));
        // The same packet from another address is that address's own new request, not a replay.
        let other = SocketAddr::from(([10, 0, 0, 2], 7000));
        assert!(matches!(
            t.on_packet(Instant::now(), other, &p[0]),
            RxEvent::Nothing
        ));
        assert_eq!(t.stats.replays, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_response_is_replayed_at_most_max_attempts_times() {
        let cfg = QnpConfig {
            max_attempts: 3,
            rto: Duration::from_millis(10),
            ..QnpConfig::default()
        };
        let mut t = RxTable::new(cfg, Instant::now());
        let p = answered(&mut t, 1, 10);
        for _ in 0..3 {
            assert!(matches!(
                t.on_packet(Instant::now(), addr(), &p[0]),
                RxEvent::Replay { .. }
            ));
        }
        for _ in 0..5 {
            assert!(matches!(
                t.on_packet(Instant::now(), addr(), &p[0]),
                RxEvent::Nothing
            ));
        }
        assert_eq!((t.stats.replays, t.stats.replays_refused), (3, 5));
        assert_eq!(t.stats.delivered, 1, "still delivered once");
    }

    #[tokio::test(start_paused = true)]
    async fn cached_responses_are_capped_in_bytes_and_freed_when_they_expire() {
        let cfg = QnpConfig {
            // One 64 x 1400-byte response fits, a second does not.
            max_cached_response_bytes: 100_000,
            ..QnpConfig::default()
        };
        let mut t = RxTable::new(cfg, Instant::now());
        let a = answered(&mut t, 1, 10);
        let b = answered(&mut t, 2, 10);
        assert_eq!(t.cached_bytes, 64 * 1400);
        assert_eq!(t.stats.responses_not_cached, 1);
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &a[0]),
            RxEvent::Replay { .. }
        ));
        assert!(matches!(
            t.on_packet(Instant::now(), addr(), &b[0]),
            RxEvent::Nothing
        ));
        assert_eq!(t.stats.delivered, 2, "b was delivered all the same, once");
        // After the dedup window the first is forgotten and its bytes are free again.
        tokio::time::advance(cfg.dedup_window).await;
        answered(&mut t, 3, 10);
        assert_eq!(t.cached_bytes, 64 * 1400);
        assert_eq!(t.stats.responses_not_cached, 1);
        t.undeliver(addr(), 3);
        assert_eq!(t.cached_bytes, 0);
    }
}
