//! The heartbeat transport (E3 §3.4): an agent on every compute node sends one 16-byte heartbeat
//! per period over UDP to the orchestrator, which feeds them to [`crate::orchestrator::Controller`].
//!
//! UDP because a heartbeat is small, periodic and self-contained: a lost one is replaced by the next
//! 50 ms later, and silence is exactly what the liveness check wants to see. A connection would add
//! retransmissions that arrive too late to matter and hide a dead peer behind a timeout.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::mpsc;

use crate::heartbeat::{Heartbeat, HEARTBEAT_LEN, NO_SAMPLE, SLOTS_PER_HEARTBEAT};

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

/// Sends one heartbeat every `period` to `orchestrator` until `sample` returns `None` (the agent is
/// told to stop). Sampling runs on the same schedule; a missed tick is skipped, not bunched, so a
/// stalled agent looks stalled rather than sending a burst.
pub async fn send_loop<F, Fut>(
    socket: &UdpSocket,
    orchestrator: SocketAddr,
    mut builder: HeartbeatBuilder,
    mut sample: F,
) -> std::io::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<NodeSample>>,
{
    let mut tick = tokio::time::interval(builder.period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(s) = sample().await else {
            return Ok(());
        };
        let hb = builder.build(&s);
        match socket.send_to(&hb.encode(), orchestrator).await {
            Ok(_) => {}
            // The orchestrator not listening yet (or restarting) is not the agent's problem: keep
            // beating, it will hear the next one.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            Err(e) => return Err(e),
        }
    }
}

/// Receives heartbeats on `socket` and forwards each datagram to the controller's channel. A
/// datagram of the wrong size is passed on too: the controller decodes, logs and drops it, so
/// one place owns the wire format. Returns when the controller's receiver is gone.
pub async fn receive(socket: &UdpSocket, tx: mpsc::Sender<Vec<u8>>) -> std::io::Result<()> {
    // One byte more than a heartbeat, so an oversized datagram is seen as such, not truncated to 16.
    let mut buf = [0u8; HEARTBEAT_LEN + 1];
    loop {
        let (n, _from) = socket.recv_from(&mut buf).await?;
        if tx.send(buf[..n].to_vec()).await.is_err() {
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

    #[tokio::test]
    async fn heartbeats_cross_real_udp() {
        let rx_sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let to = rx_sock.local_addr().unwrap();
        let tx_sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let recv = tokio::spawn(async move { receive(&rx_sock, tx).await });
        let mut left = 3;
        let builder = HeartbeatBuilder::new(2, 1_000_000_000, Duration::from_millis(5));
        send_loop(&tx_sock, to, builder, || {
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
            let msg = rx.recv().await.unwrap();
            let hb = Heartbeat::decode(&msg).unwrap();
            assert_eq!((hb.node, hb.exec_us[0]), (2, 42));
        }
        // A bad datagram reaches the controller as what it is (17 bytes), to be refused there.
        tx_sock.send_to(&[0u8; 40], to).await.unwrap();
        assert_eq!(rx.recv().await.unwrap().len(), HEARTBEAT_LEN + 1);
        drop(rx);
        tx_sock.send_to(&[0u8; 16], to).await.unwrap();
        recv.await.unwrap().unwrap();
    }
}
