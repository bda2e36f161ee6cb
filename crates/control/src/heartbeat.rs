//! The 16-byte heartbeat an orchestrator agent sends every 50 ms (E3 §3.4, §5.6).
//!
//! Wire format, big-endian:
//! ```text
//! 0..4   node id (index into the controller's topology)
//! 4..6   traffic-manager queue length (packets)
//! 6      network bandwidth utilisation, percent (0..=100)
//! 7      slot base: the first microservice slot reported below
//! 8..16  execution time of slots base..base+4, microseconds each; 0xFFFF = no sample
//! ```
//! A node running more than four microservices rotates the slot base across heartbeats, so every
//! slot is reported at least every ceil(n/4) heartbeats and the message stays 16 bytes.

use crate::error::{ControlError, Result};

pub const HEARTBEAT_LEN: usize = 16;
pub const SLOTS_PER_HEARTBEAT: usize = 4;
pub const NO_SAMPLE: u16 = 0xFFFF;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    pub node: u32,
    pub queue_len: u16,
    pub bw_util_pct: u8,
    pub slot_base: u8,
    pub exec_us: [u16; SLOTS_PER_HEARTBEAT],
}

impl Heartbeat {
    pub fn encode(&self) -> [u8; HEARTBEAT_LEN] {
        let mut b = [0u8; HEARTBEAT_LEN];
        b[0..4].copy_from_slice(&self.node.to_be_bytes());
        b[4..6].copy_from_slice(&self.queue_len.to_be_bytes());
        b[6] = self.bw_util_pct;
        b[7] = self.slot_base;
        for (k, e) in self.exec_us.iter().enumerate() {
            b[8 + 2 * k..10 + 2 * k].copy_from_slice(&e.to_be_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        let b: &[u8; HEARTBEAT_LEN] = b
            .try_into()
            .map_err(|_| ControlError::HeartbeatLength { len: b.len() })?;
        let node = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let bw_util_pct = b[6];
        if bw_util_pct > 100 {
            return Err(ControlError::Heartbeat {
                node,
                message: format!("bandwidth utilisation {bw_util_pct}% is above 100%; the agent's counter is broken, restart it"),
            });
        }
        let mut exec_us = [0u16; SLOTS_PER_HEARTBEAT];
        for (k, e) in exec_us.iter_mut().enumerate() {
            *e = u16::from_be_bytes([b[8 + 2 * k], b[9 + 2 * k]]);
        }
        Ok(Heartbeat {
            node,
            queue_len: u16::from_be_bytes([b[4], b[5]]),
            bw_util_pct,
            slot_base: b[7],
            exec_us,
        })
    }

    /// (slot, exec time in µs) for every slot that carries a sample.
    pub fn samples(&self) -> impl Iterator<Item = (usize, u16)> + '_ {
        self.exec_us
            .iter()
            .enumerate()
            .filter(|(_, &e)| e != NO_SAMPLE)
            .map(|(k, &e)| (usize::from(self.slot_base) + k, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_layout() {
        let hb = Heartbeat {
            node: 0x01020304,
            queue_len: 7,
            bw_util_pct: 42,
            slot_base: 4,
            exec_us: [10, NO_SAMPLE, 300, 65534],
        };
        let b = hb.encode();
        assert_eq!(&b[0..4], &[1, 2, 3, 4]);
        assert_eq!(b[6], 42);
        assert_eq!(Heartbeat::decode(&b).unwrap(), hb);
        let s: Vec<_> = hb.samples().collect();
        assert_eq!(s, vec![(4, 10), (6, 300), (7, 65534)]);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(matches!(
            Heartbeat::decode(&[0; 15]),
            Err(ControlError::HeartbeatLength { len: 15 })
        ));
        assert!(Heartbeat::decode(&[0; 17]).is_err());
        let mut b = [0u8; 16];
        b[6] = 101;
        assert!(Heartbeat::decode(&b)
            .unwrap_err()
            .to_string()
            .contains("above 100%"));
    }
}
