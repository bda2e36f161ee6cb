#![no_main]
//! Any bytes, as a heartbeat datagram from any address, through the receiver's gate: nothing
//! panics, and a forgery is never admitted (the fuzzer does not know the keys). The same bytes
//! read as a report, a sequence number and a source: sealed with the right key they are admitted
//! exactly when the report is possible, the source is the node's, and the number is new and near
//! the clock; a second copy is always refused as a replay. The same bytes read as an agent's
//! measurements: the builder clamps them into a heartbeat that seals and opens again.
use std::net::SocketAddr;
use std::time::Duration;

use flatmesh_control::agent::{
    Gate, GateConfig, HeartbeatBuilder, NodeCredentials, NodeSample, Refusal,
};
use flatmesh_control::heartbeat::{Heartbeat, HeartbeatKey, Sealed, KEY_LEN, PAYLOAD_LEN};
use libfuzzer_sys::fuzz_target;

const NOW: u64 = 1_800_000_000_000_000;
const NODES: u32 = 3;

fn key(node: u32) -> HeartbeatKey {
    HeartbeatKey::from_bytes([node as u8 + 7; KEY_LEN])
}

/// Node 0 at 10.0.0.1, node 1 at 10.0.0.2, node 2 from anywhere.
fn gate() -> Gate {
    let nodes = (0..NODES)
        .map(|n| {
            Some(NodeCredentials {
                key: key(n),
                address: (n < 2).then(|| [10, 0, 0, n as u8 + 1].into()),
            })
        })
        .collect();
    Gate::new(
        nodes,
        GateConfig {
            max_clock_skew: Duration::from_secs(30),
            // Keep the log quiet: one line per reason.
            log_every: Duration::from_secs(3600),
        },
    )
}

fn word(data: &[u8], k: usize) -> u64 {
    let mut b = [0u8; 8];
    for (i, x) in data.iter().skip(k * 8).take(8).enumerate() {
        b[i] = *x;
    }
    u64::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    let mut g = gate();
    let from = |b: u8| SocketAddr::from(([10, 0, 0, b % 4], 40000));

    // 1. The bytes as they are: never admitted (no valid tag can be guessed).
    let sender = from(data.first().copied().unwrap_or(1));
    assert!(g.admit(data, sender, NOW).is_err(), "a forgery was admitted");
    if let Ok(sealed) = Sealed::parse(data) {
        let _ = (sealed.claimed_node(), sealed.seq());
    }

    // 2. The bytes as a report sealed with the right key.
    if data.len() >= PAYLOAD_LEN + 9 {
        let report = &data[..PAYLOAD_LEN];
        let seq = NOW
            .wrapping_add(word(&data[PAYLOAD_LEN..], 0) % 80_000_000)
            .wrapping_sub(40_000_000);
        let sender = from(data[PAYLOAD_LEN + 8]);
        if let Ok(hb) = Heartbeat::decode(report) {
            assert_eq!(&hb.encode()[..], report);
            let _ = hb.samples().count();
            let node = hb.node % NODES;
            let hb = Heartbeat { node, ..hb };
            let wire = hb.seal(seq, &key(node));
            let from_ok = node == 2 || sender.ip() == std::net::IpAddr::from([10, 0, 0, node as u8 + 1]);
            let fresh = seq.abs_diff(NOW) <= 30_000_000;
            match g.admit(&wire, sender, NOW) {
                Ok(got) => {
                    assert!(from_ok && fresh, "admitted from {sender} at seq {seq}");
                    assert_eq!(got, hb);
                    assert!(matches!(
                        g.admit(&wire, sender, NOW),
                        Err(Refusal::Replayed { .. })
                    ));
                }
                Err(Refusal::WrongSource { .. }) => assert!(!from_ok),
                Err(Refusal::Stale { .. }) => assert!(from_ok && !fresh),
                Err(other) => panic!("an authentic heartbeat refused: {other}"),
            }
            // Another node's key never opens it.
            let other = (node + 1) % NODES;
            assert!(Sealed::parse(&wire).unwrap().open(&key(other)).is_err());
        }
    }

    // 3. The bytes as an agent's measurements.
    let sample = NodeSample {
        queue_len: word(data, 0) as u32,
        bytes: word(data, 1),
        exec_us: (2..(data.len() / 8).min(40))
            .map(|k| (word(data, k) % 3 != 0).then(|| word(data, k) >> 2))
            .collect(),
    };
    let mut b = HeartbeatBuilder::new(
        word(data, 2) as u32,
        word(data, 3),
        Duration::from_millis(1 + word(data, 4) % 1000),
    );
    for k in 0..3 {
        let hb = b.build(&sample);
        let wire = hb.seal(k, &key(0));
        let opened = Sealed::parse(&wire).unwrap().open(&key(0));
        assert_eq!(opened.expect("a built heartbeat opens"), hb);
    }
});
