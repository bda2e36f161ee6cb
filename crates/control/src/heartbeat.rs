//! The heartbeat an orchestrator agent sends every 50 ms (E3 §3.4, §5.6), and its authenticated
//! wire form.
//!
//! A heartbeat makes the orchestrator migrate and fail over services, so a datagram is believed
//! only when it proves which node sent it. Each node has its own 32-byte key, shared with the
//! control center alone; the datagram carries E3's 16-byte report, a sequence number, and an
//! HMAC-SHA256 over both. Wire format, [`WIRE_LEN`] = 56 bytes, big-endian:
//! ```text
//! 0..4    node id (index into the controller's topology)
//! 4..6    traffic-manager queue length (packets)
//! 6       network bandwidth utilisation, percent (0..=100)
//! 7       slot base: the first microservice slot reported below
//! 8..16   execution time of slots base..base+4, microseconds each; 0xFFFF = no sample
//! 16..24  sequence number: the agent's clock in µs since the UNIX epoch, strictly increasing
//! 24..56  HMAC-SHA256 with the node's key over "flatmesh-heartbeat-v1" followed by bytes 0..24
//! ```
//! A node running more than four microservices rotates the slot base across heartbeats, so every
//! slot is reported at least every ceil(n/4) heartbeats and the message stays 56 bytes.
//!
//! The tag proves the node (a forged or altered datagram fails it, and a node's key cannot speak
//! for another node). The sequence number defeats replay: the receiver ([`crate::agent::Gate`])
//! takes only numbers above the last one it took from that node and within
//! [`crate::agent::GateConfig::max_clock_skew`] of its own clock, so a recording cannot be played
//! back later, not even to an orchestrator that restarted.

use std::path::Path;

use ring::hmac;

use crate::error::{ControlError, Result};

/// E3's report: node, queue, bandwidth and four slots of execution times.
pub const PAYLOAD_LEN: usize = 16;
/// The report plus the sequence number: what the tag covers.
pub const SIGNED_LEN: usize = PAYLOAD_LEN + 8;
/// HMAC-SHA256.
pub const TAG_LEN: usize = 32;
/// Bytes of a heartbeat on the wire.
pub const WIRE_LEN: usize = SIGNED_LEN + TAG_LEN;
pub const SLOTS_PER_HEARTBEAT: usize = 4;
pub const NO_SAMPLE: u16 = 0xFFFF;
/// Bytes of a node key.
pub const KEY_LEN: usize = 32;
/// Prefixed to what the tag covers, so a key used here signs nothing that means something
/// elsewhere, and a later format (v2) cannot be mistaken for this one.
const DOMAIN: &[u8] = b"flatmesh-heartbeat-v1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    pub node: u32,
    pub queue_len: u16,
    pub bw_util_pct: u8,
    pub slot_base: u8,
    pub exec_us: [u16; SLOTS_PER_HEARTBEAT],
}

impl Heartbeat {
    /// The 16-byte report (bytes 0..16 of the wire form).
    pub fn encode(&self) -> [u8; PAYLOAD_LEN] {
        let mut b = [0u8; PAYLOAD_LEN];
        b[0..4].copy_from_slice(&self.node.to_be_bytes());
        b[4..6].copy_from_slice(&self.queue_len.to_be_bytes());
        b[6] = self.bw_util_pct;
        b[7] = self.slot_base;
        for (k, e) in self.exec_us.iter().enumerate() {
            b[8 + 2 * k..10 + 2 * k].copy_from_slice(&e.to_be_bytes());
        }
        b
    }

    /// Reads the 16-byte report. Only for bytes whose tag was checked ([`Sealed::open`]).
    pub fn decode(b: &[u8]) -> Result<Self> {
        let b: &[u8; PAYLOAD_LEN] = b
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

    /// The wire form: report, `seq`, and the tag made with the node's `key`.
    pub fn seal(&self, seq: u64, key: &HeartbeatKey) -> [u8; WIRE_LEN] {
        let mut b = [0u8; WIRE_LEN];
        b[..PAYLOAD_LEN].copy_from_slice(&self.encode());
        b[PAYLOAD_LEN..SIGNED_LEN].copy_from_slice(&seq.to_be_bytes());
        let (signed, tag) = b.split_at_mut(SIGNED_LEN);
        let mut covered = [0u8; SIGNED_LEN];
        covered.copy_from_slice(signed);
        tag.copy_from_slice(key.tag(&covered).as_ref());
        b
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

/// A datagram of the right size, not yet believed: the claimed node (to pick its key) and the
/// claimed sequence number.
#[derive(Debug, Clone, Copy)]
pub struct Sealed<'a> {
    bytes: &'a [u8; WIRE_LEN],
}

impl<'a> Sealed<'a> {
    pub fn parse(datagram: &'a [u8]) -> Result<Sealed<'a>> {
        let bytes = datagram
            .try_into()
            .map_err(|_| ControlError::HeartbeatLength {
                len: datagram.len(),
            })?;
        Ok(Sealed { bytes })
    }

    /// The node the datagram claims to come from; unproven until [`Sealed::open`].
    pub fn claimed_node(&self) -> u32 {
        u32::from_be_bytes([self.bytes[0], self.bytes[1], self.bytes[2], self.bytes[3]])
    }

    /// The sequence number; unproven until [`Sealed::open`].
    pub fn seq(&self) -> u64 {
        let mut s = [0u8; 8];
        s.copy_from_slice(&self.bytes[PAYLOAD_LEN..SIGNED_LEN]);
        u64::from_be_bytes(s)
    }

    /// Checks the tag with the claimed node's key (in constant time), then reads the report.
    pub fn open(&self, key: &HeartbeatKey) -> std::result::Result<Heartbeat, OpenError> {
        let Some((signed, tag)) = self.bytes.split_first_chunk::<SIGNED_LEN>() else {
            return Err(OpenError::BadTag);
        };
        key.verify(signed, tag).map_err(|()| OpenError::BadTag)?;
        Heartbeat::decode(&self.bytes[..PAYLOAD_LEN]).map_err(OpenError::Malformed)
    }
}

/// Why [`Sealed::open`] refused a datagram.
#[derive(Debug)]
pub enum OpenError {
    /// Not made with this node's key: forged, altered, or the agent has another key.
    BadTag,
    /// Authentic, but the report is impossible (a broken agent).
    Malformed(ControlError),
}

/// A node's heartbeat key: 32 random bytes, known to the node's agent and the control center.
#[derive(Clone)]
pub struct HeartbeatKey {
    bytes: [u8; KEY_LEN],
    key: hmac::Key,
}

impl std::fmt::Debug for HeartbeatKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a secret (logs, panics, test output).
        f.write_str("HeartbeatKey(..)")
    }
}

impl PartialEq for HeartbeatKey {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl HeartbeatKey {
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> HeartbeatKey {
        HeartbeatKey {
            bytes,
            key: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
        }
    }

    /// A fresh key from the operating system's random source.
    pub fn generate() -> Result<HeartbeatKey> {
        let bytes: [u8; KEY_LEN] = ring::rand::generate(&ring::rand::SystemRandom::new())
            .map_err(|_| ControlError::Invalid {
                what: "heartbeat key",
                message: "the system random source failed; check /dev/urandom".into(),
            })?
            .expose();
        Ok(HeartbeatKey::from_bytes(bytes))
    }

    /// 64 hex digits (what `openssl rand -hex 32` prints).
    pub fn from_hex(text: &str) -> std::result::Result<HeartbeatKey, String> {
        let text = text.trim();
        if text.len() != 2 * KEY_LEN {
            return Err(format!(
                "a heartbeat key is {KEY_LEN} bytes written as {} hex digits, this one has {} characters; make one with `openssl rand -hex 32`",
                2 * KEY_LEN,
                text.len()
            ));
        }
        bytes_from_hex(text)
            .map(HeartbeatKey::from_bytes)
            .ok_or_else(|| {
                "a heartbeat key holds only hex digits (0-9, a-f); make one with `openssl rand -hex 32`".to_string()
            })
    }

    pub fn to_hex(&self) -> String {
        hex(&self.bytes)
    }

    /// Reads a key file (64 hex digits) that only its owner may read.
    pub fn load(path: &Path) -> Result<HeartbeatKey> {
        let text = read_secret(path)?;
        HeartbeatKey::from_hex(&text).map_err(|message| ControlError::Invalid {
            what: "heartbeat key",
            message: format!("{}: {message}", path.display()),
        })
    }

    fn tag(&self, signed: &[u8; SIGNED_LEN]) -> hmac::Tag {
        hmac::sign(&self.key, &tagged_message(signed))
    }

    /// Constant time: a forger learns nothing from how long a refusal took.
    fn verify(&self, signed: &[u8; SIGNED_LEN], tag: &[u8]) -> std::result::Result<(), ()> {
        hmac::verify(&self.key, &tagged_message(signed), tag).map_err(|_| ())
    }
}

/// What the tag covers: the domain, then the report and the sequence number.
fn tagged_message(signed: &[u8; SIGNED_LEN]) -> [u8; DOMAIN.len() + SIGNED_LEN] {
    let mut msg = [0u8; DOMAIN.len() + SIGNED_LEN];
    msg[..DOMAIN.len()].copy_from_slice(DOMAIN);
    msg[DOMAIN.len()..].copy_from_slice(signed);
    msg
}

/// Reads a file holding secrets, refusing one that others than its owner may read: a key that
/// every local user can read authenticates nothing.
/// `N` bytes written as `2N` hex digits (surrounding whitespace ignored); `None` for any other
/// text. The control center's secrets (heartbeat keys, token digests) are written so.
pub fn bytes_from_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let text = text.trim().as_bytes();
    if text.len() != 2 * N || !text.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let mut bytes = [0u8; N];
    for (byte, pair) in bytes.iter_mut().zip(text.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(bytes)
}

/// `bytes` as lower-case hex digits.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn read_secret(path: &Path) -> Result<String> {
    use std::os::unix::fs::PermissionsExt as _;
    let read = |cause| ControlError::Read {
        path: path.display().to_string(),
        cause,
    };
    let meta = std::fs::metadata(path).map_err(read)?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(ControlError::Invalid {
            what: "secret file",
            message: format!(
                "{} has mode {mode:03o}, so other users can read its keys; run `chmod 600 {}`",
                path.display(),
                path.display()
            ),
        });
    }
    std::fs::read_to_string(path).map_err(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> HeartbeatKey {
        HeartbeatKey::from_bytes([b; KEY_LEN])
    }

    fn hb() -> Heartbeat {
        Heartbeat {
            node: 0x01020304,
            queue_len: 7,
            bw_util_pct: 42,
            slot_base: 4,
            exec_us: [10, NO_SAMPLE, 300, 65534],
        }
    }

    #[test]
    fn round_trip_and_layout() {
        let hb = hb();
        let b = hb.seal(0x1122334455667788, &key(1));
        assert_eq!(b.len(), 56);
        assert_eq!(&b[0..4], &[1, 2, 3, 4]);
        assert_eq!(b[6], 42);
        assert_eq!(
            &b[16..24],
            &[0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]
        );
        let sealed = Sealed::parse(&b).unwrap();
        assert_eq!(sealed.claimed_node(), 0x01020304);
        assert_eq!(sealed.seq(), 0x1122334455667788);
        assert_eq!(sealed.open(&key(1)).unwrap(), hb);
        let s: Vec<_> = hb.samples().collect();
        assert_eq!(s, vec![(4, 10), (6, 300), (7, 65534)]);
    }

    #[test]
    fn the_tag_is_hmac_sha256_over_the_domain_and_the_first_24_bytes() {
        let b = hb().seal(9, &key(1));
        let mut msg = b"flatmesh-heartbeat-v1".to_vec();
        msg.extend_from_slice(&b[..24]);
        let expected = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, &[1; 32]), &msg);
        assert_eq!(&b[24..], expected.as_ref());
    }

    #[test]
    fn a_forged_altered_or_foreign_datagram_is_refused() {
        let b = hb().seal(9, &key(1));
        assert!(matches!(
            Sealed::parse(&b).unwrap().open(&key(2)),
            Err(OpenError::BadTag)
        ));
        for i in [0, 6, 16, 23, 24, 55] {
            let mut bad = b;
            bad[i] ^= 1;
            assert!(
                matches!(
                    Sealed::parse(&bad).unwrap().open(&key(1)),
                    Err(OpenError::BadTag)
                ),
                "byte {i} flipped"
            );
        }
        // The old unauthenticated 16-byte form, and anything else not 56 bytes long.
        for len in [0, 16, 55, 57] {
            assert!(matches!(
                Sealed::parse(&vec![0; len]),
                Err(ControlError::HeartbeatLength { len: l }) if l == len
            ));
        }
    }

    #[test]
    fn an_authentic_impossible_report_is_malformed() {
        let mut h = hb();
        h.bw_util_pct = 101;
        let b = h.seal(1, &key(1));
        match Sealed::parse(&b).unwrap().open(&key(1)) {
            Err(OpenError::Malformed(e)) => assert!(e.to_string().contains("above 100%"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            Heartbeat::decode(&[0; 15]),
            Err(ControlError::HeartbeatLength { len: 15 })
        ));
    }

    #[test]
    fn keys_read_from_hex_and_secret_files() {
        let k = HeartbeatKey::generate().unwrap();
        assert_eq!(HeartbeatKey::from_hex(&k.to_hex()).unwrap(), k);
        assert_ne!(HeartbeatKey::generate().unwrap(), k, "random keys");
        assert_eq!(format!("{k:?}"), "HeartbeatKey(..)", "never printed");
        let e = HeartbeatKey::from_hex("abcd").unwrap_err();
        assert!(e.contains("openssl rand -hex 32"), "{e}");
        let e = HeartbeatKey::from_hex(&"zz".repeat(32)).unwrap_err();
        assert!(e.contains("hex digits"), "{e}");
        assert!(HeartbeatKey::from_hex(&format!("{}é", "0".repeat(62))).is_err());

        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("hb-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("node.key");
        std::fs::write(&path, format!("{}\n", k.to_hex())).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = HeartbeatKey::load(&path).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(HeartbeatKey::load(&path).unwrap(), k);
        let e = HeartbeatKey::load(&dir.join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
