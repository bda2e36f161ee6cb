//! The heartbeat transport (E3 §3.4): an agent on every compute node sends one heartbeat per period
//! over UDP to the orchestrator, sealed with the node's key ([`crate::heartbeat`]); the receiver's
//! [`Gate`] admits only authentic, fresh heartbeats from the node's address and feeds them to
//! [`crate::orchestrator::Controller`].
//!
//! UDP because a heartbeat is small, periodic and self-contained: a lost one is replaced by the next
//! 50 ms later, and silence is exactly what the liveness check wants to see. A connection would add
//! retransmissions that arrive too late to matter and hide a dead peer behind a timeout.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::sync::mpsc;

use crate::heartbeat::{
    Heartbeat, HeartbeatKey, OpenError, Sealed, NO_SAMPLE, SLOTS_PER_HEARTBEAT, WIRE_LEN,
};

/// What an agent measured on its node during one heartbeat period.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSample {
    /// Requests queued or executing at the node (the traffic manager's queue).
    pub queue_len: u32,
    /// Bytes the node's microservices received and sent during the period.
    pub bytes: u64,
    /// Mean execution time per microservice slot, in slot order; `None` = no request finished.
    pub exec_us: Vec<Option<u64>>,
}

/// Turns samples into heartbeats: clamps to the wire's field widths and rotates the slot base when
/// a node runs more than four microservices.
#[derive(Debug, Clone)]
pub struct HeartbeatBuilder {
    pub node: u32,
    /// The node's link rate, to express bytes per period as a utilisation.
    pub link_bits_per_sec: u64,
    pub period: Duration,
    next_base: usize,
}

impl HeartbeatBuilder {
    pub fn new(node: u32, link_bits_per_sec: u64, period: Duration) -> Self {
        HeartbeatBuilder {
            node,
            link_bits_per_sec: link_bits_per_sec.max(1),
            period,
            next_base: 0,
        }
    }

    pub fn build(&mut self, s: &NodeSample) -> Heartbeat {
        if self.next_base >= s.exec_us.len() {
            self.next_base = 0;
        }
        let base = self.next_base;
        let mut exec_us = [NO_SAMPLE; SLOTS_PER_HEARTBEAT];
        for (k, e) in exec_us.iter_mut().enumerate() {
            if let Some(Some(us)) = s.exec_us.get(base + k) {
                // 0xFFFF means "no sample", so the largest time we can report is 0xFFFE µs.
                *e = u16::try_from(*us)
                    .unwrap_or(NO_SAMPLE - 1)
                    .min(NO_SAMPLE - 1);
            }
        }
        self.next_base = base + SLOTS_PER_HEARTBEAT;
        let bits = s.bytes.saturating_mul(8) as f64;
        let capacity = self.link_bits_per_sec as f64 * self.period.as_secs_f64();
        let pct = (100.0 * bits / capacity).clamp(0.0, 100.0);
        Heartbeat {
            node: self.node,
            queue_len: u16::try_from(s.queue_len).unwrap_or(u16::MAX),
            bw_util_pct: pct.round() as u8,
            // Slot bases past 255 cannot be expressed; such a node wraps around (and the
            // orchestrator simply sees those slots less often).
            slot_base: u8::try_from(base).unwrap_or(0),
            exec_us,
        }
    }
}

/// The sequence numbers of one agent: its clock in µs since the UNIX epoch, but strictly
/// increasing even when the clock steps back, so the receiver can refuse any number it has seen.
#[derive(Debug, Clone, Default)]
pub struct Sequence {
    last: u64,
}

impl Sequence {
    pub fn next(&mut self, now_unix_us: u64) -> u64 {
        self.last = now_unix_us.max(self.last.saturating_add(1));
        self.last
    }
}

/// This machine's clock in µs since the UNIX epoch (0 before it, saturating far after).
pub fn unix_now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Sends one heartbeat every `period` to `orchestrator`, sealed with the node's `key`, until
/// `sample` returns `None` (the agent is told to stop). Sampling runs on the same schedule; a
/// missed tick is skipped, not bunched, so a stalled agent looks stalled rather than sending a
/// burst.
pub async fn send_loop<F, Fut>(
    socket: &UdpSocket,
    orchestrator: SocketAddr,
    mut builder: HeartbeatBuilder,
    key: &HeartbeatKey,
    mut sample: F,
) -> std::io::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<NodeSample>>,
{
    let mut tick = tokio::time::interval(builder.period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut seq = Sequence::default();
    loop {
        tick.tick().await;
        let Some(s) = sample().await else {
            return Ok(());
        };
        let hb = builder.build(&s);
        let wire = hb.seal(seq.next(unix_now_us()), key);
        match socket.send_to(&wire, orchestrator).await {
            Ok(_) => {}
            // The orchestrator not listening yet (or restarting) is not the agent's problem: keep
            // beating, it will hear the next one.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            Err(e) => return Err(e),
        }
    }
}

/// What the receiver knows about one node: its key, and where its heartbeats come from when
/// that is known (the port is not checked: agents send from any port).
#[derive(Debug, Clone)]
pub struct NodeCredentials {
    pub key: HeartbeatKey,
    pub address: Option<IpAddr>,
}

/// Limits of the [`Gate`].
#[derive(Debug, Clone, Copy)]
pub struct GateConfig {
    /// A heartbeat whose sequence number (the agent's clock) is further than this from the
    /// receiver's clock is refused: it stops a recording from being played back to an
    /// orchestrator that has restarted (and so forgotten the last numbers). Agents' clocks must be
    /// kept this close (NTP).
    pub max_clock_skew: Duration,
    /// The same refusal is logged at most once per this period (with a count of the rest), so a
    /// flood of forged datagrams cannot flood the log.
    pub log_every: Duration,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            max_clock_skew: Duration::from_secs(30),
            log_every: Duration::from_secs(10),
        }
    }
}

/// Why the [`Gate`] dropped a datagram. Nothing refused reaches the orchestrator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not [`WIRE_LEN`] bytes.
    Length { len: usize },
    /// Claims a node that has no key.
    UnknownNode { node: u32 },
    /// From an address other than the node's.
    WrongSource {
        node: u32,
        from: IpAddr,
        registered: IpAddr,
    },
    /// The node's address is not known yet, and the gate requires one
    /// ([`Gate::require_address`]). Counted as `wrong_source`.
    NoAddress { node: u32 },
    /// The tag does not verify with the node's key.
    BadTag { node: u32 },
    /// A sequence number at or below the last one taken from the node.
    Replayed { node: u32, seq: u64, last: u64 },
    /// A sequence number too far from the receiver's clock.
    Stale { node: u32, skew: Duration },
    /// Authentic but impossible (a broken agent).
    Malformed { node: u32, why: String },
}

/// The refusals, in the order of [`GateCounts`]'s fields and their metric labels.
const REASONS: [&str; 7] = [
    "length",
    "unknown_node",
    "wrong_source",
    "bad_tag",
    "replayed",
    "stale",
    "malformed",
];

impl Refusal {
    /// A bounded label for counters and logs.
    pub fn reason(&self) -> &'static str {
        REASONS[self.index()]
    }

    fn index(&self) -> usize {
        match self {
            Refusal::Length { .. } => 0,
            Refusal::UnknownNode { .. } => 1,
            Refusal::WrongSource { .. } | Refusal::NoAddress { .. } => 2,
            Refusal::BadTag { .. } => 3,
            Refusal::Replayed { .. } => 4,
            Refusal::Stale { .. } => 5,
            Refusal::Malformed { .. } => 6,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Length { len } => write!(
                f,
                "{len} bytes, not {WIRE_LEN}: not a heartbeat, or an agent of the old unauthenticated 16-byte format; upgrade the agent"
            ),
            Refusal::UnknownNode { node } => write!(
                f,
                "node {node} has no heartbeat key; check the agent's --node, or give the node a key (--heartbeat-keys)"
            ),
            Refusal::WrongSource {
                node,
                from,
                registered,
            } => write!(
                f,
                "node {node} is registered at {registered} but this came from {from}: spoofed, or the node's address (--addresses) is wrong"
            ),
            Refusal::NoAddress { node } => write!(
                f,
                "node {node}'s address is not known yet, so nothing can be taken from it: give its Node an InternalIP"
            ),
            Refusal::BadTag { node } => write!(
                f,
                "node {node}: the tag does not verify: forged or altered, or the agent's key is not the node's key in --heartbeat-keys"
            ),
            Refusal::Replayed { node, seq, last } => write!(
                f,
                "node {node}: sequence number {seq} is not above the last one taken ({last}): a replay, or two agents run for one node"
            ),
            Refusal::Stale { node, skew } => write!(
                f,
                "node {node}: its sequence number is {:.1} s away from this clock: a replay of an old recording, or the agent's clock is wrong (sync the clocks)",
                skew.as_secs_f64()
            ),
            Refusal::Malformed { node, why } => write!(f, "node {node}: {why}"),
        }
    }
}

/// How many datagrams the [`Gate`] took and dropped, by reason. Shared with whoever reports them.
#[derive(Debug, Default)]
pub struct GateStats {
    accepted: AtomicU64,
    refused: [AtomicU64; REASONS.len()],
}

/// A reading of [`GateStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GateCounts {
    pub accepted: u64,
    pub length: u64,
    pub unknown_node: u64,
    pub wrong_source: u64,
    pub bad_tag: u64,
    pub replayed: u64,
    pub stale: u64,
    pub malformed: u64,
}

impl GateCounts {
    /// Every datagram dropped, whatever the reason.
    pub fn refused(&self) -> u64 {
        self.length
            + self.unknown_node
            + self.wrong_source
            + self.bad_tag
            + self.replayed
            + self.stale
            + self.malformed
    }
}

impl GateStats {
    pub fn read(&self) -> GateCounts {
        let r = |k: usize| self.refused[k].load(Ordering::Relaxed);
        GateCounts {
            accepted: self.accepted.load(Ordering::Relaxed),
            length: r(0),
            unknown_node: r(1),
            wrong_source: r(2),
            bad_tag: r(3),
            replayed: r(4),
            stale: r(5),
            malformed: r(6),
        }
    }
}

struct NodeState {
    credentials: NodeCredentials,
    /// The last sequence number taken; `None` until the first heartbeat.
    last_seq: Option<u64>,
}

/// The receiver's admission check: only a heartbeat that proves its node (tag), comes from the
/// node's address, and is new (sequence number) reaches the orchestrator. Everything else is
/// dropped, counted, and logged at a bounded rate.
pub struct Gate {
    nodes: Vec<Option<NodeState>>,
    cfg: GateConfig,
    stats: Arc<GateStats>,
    /// Per reason: when it was last logged, and how many were not logged since.
    logged: [(Option<Instant>, u64); REASONS.len()],
    /// A node without an address is refused ([`Gate::require_address`]).
    address_required: bool,
}

impl Gate {
    /// `nodes[i]` holds node `i`'s credentials; a node without any can send nothing.
    pub fn new(nodes: Vec<Option<NodeCredentials>>, cfg: GateConfig) -> Gate {
        Gate {
            nodes: nodes
                .into_iter()
                .map(|c| {
                    c.map(|credentials| NodeState {
                        credentials,
                        last_seq: None,
                    })
                })
                .collect(),
            cfg,
            stats: Arc::default(),
            logged: [(None, 0); REASONS.len()],
            address_required: false,
        }
    }

    pub fn stats(&self) -> Arc<GateStats> {
        Arc::clone(&self.stats)
    }

    /// Refuses heartbeats of a node whose address is not known (set none yet, or `None`),
    /// instead of taking them from anywhere.
    pub fn require_address(&mut self) {
        self.address_required = true;
    }

    /// Node `node`'s address from now on (its IP changed, or became known). What the gate
    /// remembers of the node (its last sequence number) stays. An index past the gate's nodes
    /// is ignored: such a node has no key.
    pub fn set_address(&mut self, node: usize, address: Option<IpAddr>) {
        if let Some(Some(state)) = self.nodes.get_mut(node) {
            state.credentials.address = address;
        }
    }

    /// Admits one datagram received from `from` at `now_unix_us` (the receiver's clock), or
    /// counts and logs why not.
    pub fn admit(
        &mut self,
        datagram: &[u8],
        from: SocketAddr,
        now_unix_us: u64,
    ) -> std::result::Result<Heartbeat, Refusal> {
        match self.check(datagram, from, now_unix_us) {
            Ok(hb) => {
                self.stats.accepted.fetch_add(1, Ordering::Relaxed);
                Ok(hb)
            }
            Err(refusal) => {
                self.stats.refused[refusal.index()].fetch_add(1, Ordering::Relaxed);
                self.log(&refusal, from);
                Err(refusal)
            }
        }
    }

    fn check(
        &mut self,
        datagram: &[u8],
        from: SocketAddr,
        now_unix_us: u64,
    ) -> std::result::Result<Heartbeat, Refusal> {
        let sealed = Sealed::parse(datagram).map_err(|_| Refusal::Length {
            len: datagram.len(),
        })?;
        let node = sealed.claimed_node();
        let state = usize::try_from(node)
            .ok()
            .and_then(|i| self.nodes.get_mut(i)?.as_mut())
            .ok_or(Refusal::UnknownNode { node })?;
        // The address first: it costs nothing, and a flood from elsewhere costs no HMAC.
        let from_ip = from.ip().to_canonical();
        match state.credentials.address {
            Some(registered) if from_ip != registered.to_canonical() => {
                return Err(Refusal::WrongSource {
                    node,
                    from: from_ip,
                    registered,
                })
            }
            None if self.address_required => return Err(Refusal::NoAddress { node }),
            _ => {}
        }
        let hb = match sealed.open(&state.credentials.key) {
            Ok(hb) => hb,
            Err(OpenError::BadTag) => return Err(Refusal::BadTag { node }),
            Err(OpenError::Malformed(e)) => {
                return Err(Refusal::Malformed {
                    node,
                    why: e.to_string(),
                })
            }
        };
        // Only now is the sequence number the node's own.
        let seq = sealed.seq();
        if let Some(last) = state.last_seq.filter(|&last| seq <= last) {
            return Err(Refusal::Replayed { node, seq, last });
        }
        let skew = Duration::from_micros(seq.abs_diff(now_unix_us));
        if skew > self.cfg.max_clock_skew {
            return Err(Refusal::Stale { node, skew });
        }
        state.last_seq = Some(seq);
        Ok(hb)
    }

    /// The first refusal of a kind is logged, then at most one per `log_every` with the number
    /// left unlogged in between.
    fn log(&mut self, refusal: &Refusal, from: SocketAddr) {
        let now = Instant::now();
        let (last, quiet) = &mut self.logged[refusal.index()];
        if last.is_some_and(|t| now.duration_since(t) < self.cfg.log_every) {
            *quiet += 1;
            return;
        }
        tracing::warn!(
            %from,
            reason = refusal.reason(),
            also_dropped_since_last_warning = *quiet,
            "dropping heartbeat: {refusal}"
        );
        *last = Some(now);
        *quiet = 0;
    }
}

/// Receives heartbeats on `socket`, admits them through `gate`, and forwards those it admits to
/// the controller's channel; the rest are dropped there, counted in [`Gate::stats`]. Returns when
/// the controller's receiver is gone.
pub async fn receive(
    socket: &UdpSocket,
    mut gate: Gate,
    tx: mpsc::Sender<Heartbeat>,
) -> std::io::Result<()> {
    // One byte more than a heartbeat, so an oversized datagram is seen as such, not truncated.
    let mut buf = [0u8; WIRE_LEN + 1];
    loop {
        let (n, from) = socket.recv_from(&mut buf).await?;
        let Ok(hb) = gate.admit(&buf[..n], from, unix_now_us()) else {
            continue;
        };
        if tx.send(hb).await.is_err() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn builder_clamps_and_rotates() {
        let mut b = HeartbeatBuilder::new(7, 8_000, Duration::from_millis(50));
        let s = NodeSample {
            queue_len: 70_000,
            // 8 kbit/s x 50 ms = 400 bits = 50 bytes of capacity; 25 bytes is 50%.
            bytes: 25,
            exec_us: vec![Some(10), None, Some(1_000_000), Some(3), Some(4), Some(5)],
        };
        let h = b.build(&s);
        assert_eq!(h.node, 7);
        assert_eq!(h.queue_len, u16::MAX);
        assert_eq!(h.bw_util_pct, 50);
        assert_eq!(h.slot_base, 0);
        assert_eq!(h.exec_us, [10, NO_SAMPLE, NO_SAMPLE - 1, 3]);
        let h = b.build(&s);
        assert_eq!(h.slot_base, 4);
        assert_eq!(h.exec_us, [4, 5, NO_SAMPLE, NO_SAMPLE]);
        assert_eq!(b.build(&s).slot_base, 0, "wraps around");
        let full = NodeSample {
            bytes: u64::MAX,
            ..Default::default()
        };
        assert_eq!(b.build(&full).bw_util_pct, 100);
        assert_eq!(b.build(&full).exec_us, [NO_SAMPLE; 4]);
    }

    const NOW: u64 = 1_800_000_000_000_000;

    fn key(b: u8) -> HeartbeatKey {
        HeartbeatKey::from_bytes([b; crate::heartbeat::KEY_LEN])
    }

    fn beat(node: u32) -> Heartbeat {
        Heartbeat {
            node,
            queue_len: 1,
            bw_util_pct: 10,
            slot_base: 0,
            exec_us: [42, NO_SAMPLE, NO_SAMPLE, NO_SAMPLE],
        }
    }

    /// Nodes 0 and 1 with keys 1 and 2, node 0 registered at 10.0.0.1, node 1 anywhere; node 2
    /// exists but has no key.
    fn gate() -> Gate {
        Gate::new(
            vec![
                Some(NodeCredentials {
                    key: key(1),
                    address: Some([10, 0, 0, 1].into()),
                }),
                Some(NodeCredentials {
                    key: key(2),
                    address: None,
                }),
                None,
            ],
            GateConfig::default(),
        )
    }

    fn from(ip: [u8; 4]) -> SocketAddr {
        (ip, 40000).into()
    }

    #[test]
    fn sequence_numbers_only_go_up() {
        let mut s = Sequence::default();
        assert_eq!(s.next(100), 100);
        assert_eq!(s.next(100), 101, "same clock reading");
        assert_eq!(s.next(50), 102, "the clock stepped back");
        assert_eq!(s.next(500), 500);
    }

    #[test]
    fn the_gate_admits_authentic_fresh_heartbeats_from_the_nodes_address() {
        let mut g = gate();
        let hb = beat(0);
        assert_eq!(
            g.admit(&hb.seal(NOW, &key(1)), from([10, 0, 0, 1]), NOW),
            Ok(hb)
        );
        // IPv4 seen through a dual-stack socket is the same address.
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:1".parse().unwrap();
        assert!(g.admit(&hb.seal(NOW + 1, &key(1)), mapped, NOW).is_ok());
        // A node without a registered address is taken from anywhere, with its own key.
        assert!(g
            .admit(&beat(1).seal(NOW, &key(2)), from([192, 0, 2, 9]), NOW)
            .is_ok());
        assert_eq!(
            g.stats().read(),
            GateCounts {
                accepted: 3,
                ..GateCounts::default()
            }
        );
    }

    /// Kubernetes: nodes come with no address, which is set once their Node shows one and
    /// changed when it changes; until then nothing of theirs is taken, and a new address keeps
    /// what the gate knows of the node (a replay stays a replay).
    #[test]
    fn a_gate_that_requires_addresses_takes_each_node_from_its_current_one() {
        let mut g = Gate::new(
            vec![Some(NodeCredentials {
                key: key(1),
                address: None,
            })],
            GateConfig::default(),
        );
        g.require_address();
        let first = beat(0).seal(NOW, &key(1));
        assert_eq!(
            g.admit(&first, from([10, 0, 0, 1]), NOW),
            Err(Refusal::NoAddress { node: 0 })
        );
        g.set_address(0, Some([10, 0, 0, 1].into()));
        g.set_address(7, Some([10, 0, 0, 7].into())); // no such node: ignored
        assert!(g.admit(&first, from([10, 0, 0, 1]), NOW).is_ok());
        g.set_address(0, Some([10, 0, 0, 2].into()));
        let second = beat(0).seal(NOW + 1, &key(1));
        assert!(matches!(
            g.admit(&second, from([10, 0, 0, 1]), NOW),
            Err(Refusal::WrongSource { .. })
        ));
        assert!(matches!(
            g.admit(&first, from([10, 0, 0, 2]), NOW),
            Err(Refusal::Replayed { .. })
        ));
        assert!(g.admit(&second, from([10, 0, 0, 2]), NOW).is_ok());
        let counts = g.stats().read();
        assert_eq!(
            (counts.accepted, counts.wrong_source, counts.replayed),
            (2, 2, 1)
        );
    }

    /// Regression (issue 23, item 10): heartbeats were believed from anyone who could send a
    /// datagram. Each forgery below would have moved services; none reaches the orchestrator.
    #[test]
    fn forged_spoofed_replayed_and_stale_heartbeats_are_dropped_and_counted() {
        let mut g = gate();
        let node0 = from([10, 0, 0, 1]);
        // The old unauthenticated form, and garbage.
        let old = beat(0).encode();
        assert_eq!(g.admit(&old, node0, NOW), Err(Refusal::Length { len: 16 }));
        assert!(matches!(
            g.admit(&[0; 57], node0, NOW),
            Err(Refusal::Length { len: 57 })
        ));
        // Signed with another node's key, or with none.
        assert_eq!(
            g.admit(&beat(0).seal(NOW, &key(2)), node0, NOW),
            Err(Refusal::BadTag { node: 0 })
        );
        let mut altered = beat(0).seal(NOW, &key(1));
        altered[5] ^= 0x40; // a queue length the node never reported
        assert_eq!(
            g.admit(&altered, node0, NOW),
            Err(Refusal::BadTag { node: 0 })
        );
        // A node that has no key, or does not exist.
        for node in [2, 3, u32::MAX] {
            assert_eq!(
                g.admit(&beat(node).seal(NOW, &key(1)), node0, NOW),
                Err(Refusal::UnknownNode { node })
            );
        }
        // Authentic, but from another address.
        let r = g.admit(&beat(0).seal(NOW, &key(1)), from([10, 0, 0, 66]), NOW);
        assert_eq!(
            r,
            Err(Refusal::WrongSource {
                node: 0,
                from: [10, 0, 0, 66].into(),
                registered: [10, 0, 0, 1].into()
            })
        );
        // Authentic and fresh: taken once, then a replay.
        let good = beat(0).seal(NOW + 10, &key(1));
        assert!(g.admit(&good, node0, NOW).is_ok());
        assert_eq!(
            g.admit(&good, node0, NOW),
            Err(Refusal::Replayed {
                node: 0,
                seq: NOW + 10,
                last: NOW + 10
            })
        );
        let older = beat(0).seal(NOW + 5, &key(1));
        assert!(matches!(
            g.admit(&older, node0, NOW),
            Err(Refusal::Replayed { .. })
        ));
        // A recording played to an orchestrator that has forgotten the last numbers (restarted).
        let mut fresh = gate();
        let recorded = beat(0).seal(NOW - 31_000_000, &key(1));
        assert!(matches!(
            fresh.admit(&recorded, node0, NOW),
            Err(Refusal::Stale { node: 0, skew }) if skew == Duration::from_secs(31)
        ));
        let future = beat(0).seal(NOW + 31_000_000, &key(1));
        assert!(matches!(
            fresh.admit(&future, node0, NOW),
            Err(Refusal::Stale { .. })
        ));
        // Authentic but impossible.
        let mut broken = beat(0);
        broken.bw_util_pct = 200;
        assert!(matches!(
            fresh.admit(&broken.seal(NOW, &key(1)), node0, NOW),
            Err(Refusal::Malformed { node: 0, .. })
        ));
        assert_eq!(
            g.stats().read(),
            GateCounts {
                accepted: 1,
                length: 2,
                unknown_node: 3,
                wrong_source: 1,
                bad_tag: 2,
                replayed: 2,
                ..GateCounts::default()
            }
        );
        assert_eq!(g.stats().read().refused(), 10);
        assert_eq!(
            (fresh.stats().read().stale, fresh.stats().read().malformed),
            (2, 1)
        );
    }

    #[test]
    fn refusals_say_what_to_do() {
        let text = |r: Refusal| format!("{}: {r}", r.reason());
        assert!(text(Refusal::Length { len: 16 }).contains("upgrade the agent"));
        assert!(text(Refusal::UnknownNode { node: 7 }).contains("--heartbeat-keys"));
        assert!(text(Refusal::BadTag { node: 1 }).starts_with("bad_tag: "));
        let stale = Refusal::Stale {
            node: 1,
            skew: Duration::from_secs(40),
        };
        assert!(text(stale).contains("sync the clocks"));
    }

    #[tokio::test]
    async fn heartbeats_cross_real_udp() {
        let rx_sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let to = rx_sock.local_addr().unwrap();
        let tx_sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let credentials = |k| NodeCredentials {
            key: key(k),
            address: Some([127, 0, 0, 1].into()),
        };
        let gate = Gate::new(
            vec![None, None, Some(credentials(2))],
            GateConfig::default(),
        );
        let stats = gate.stats();
        let recv = tokio::spawn(async move { receive(&rx_sock, gate, tx).await });
        let mut left = 3;
        let builder = HeartbeatBuilder::new(2, 1_000_000_000, Duration::from_millis(5));
        send_loop(&tx_sock, to, builder, &key(2), || {
            left -= 1;
            let more = left >= 0;
            async move {
                more.then(|| NodeSample {
                    queue_len: 1,
                    bytes: 0,
                    exec_us: vec![Some(42)],
                })
            }
        })
        .await
        .unwrap();
        for _ in 0..3 {
            let hb = rx.recv().await.unwrap();
            assert_eq!((hb.node, hb.exec_us[0]), (2, 42));
        }
        // Forgeries never reach the controller: a datagram of the old format, one signed with
        // another key; then a good one from a new agent (its own sequence) shows the channel works.
        tx_sock.send_to(&beat(2).encode(), to).await.unwrap();
        tx_sock
            .send_to(&beat(2).seal(unix_now_us(), &key(9)), to)
            .await
            .unwrap();
        tx_sock
            .send_to(&beat(2).seal(unix_now_us() + 1_000, &key(2)), to)
            .await
            .unwrap();
        assert_eq!(rx.recv().await.unwrap(), beat(2));
        let counts = stats.read();
        assert_eq!((counts.accepted, counts.length, counts.bad_tag), (4, 1, 1));
        drop(rx);
        tx_sock
            .send_to(&beat(2).seal(unix_now_us() + 2_000, &key(2)), to)
            .await
            .unwrap();
        recv.await.unwrap().unwrap();
    }
}
