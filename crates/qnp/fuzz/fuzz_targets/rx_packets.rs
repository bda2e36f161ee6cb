//! Arbitrary packets into the receive side: the transport's reassembly table and the software
//! dispatcher's decision never panic, and whatever the table delivers is consistent with the
//! length its packets claimed.
#![no_main]
use flatmesh_qnp::dispatch::{Rsd, Stash};
use flatmesh_qnp::rules::RuleSet;
use flatmesh_qnp::transport::{receive_packets, QnpConfig};
use libfuzzer_sys::fuzz_target;
use std::net::SocketAddr;

fuzz_target!(|data: &[u8]| {
    // Packets separated by the byte sequence 0xff 0xfe; the first byte of each names the peer.
    let mut packets = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let end = rest
            .windows(2)
            .position(|w| w == [0xff, 0xfe])
            .unwrap_or(rest.len());
        let (pkt, tail) = rest.split_at(end);
        rest = tail.get(2..).unwrap_or(&[]);
        if let Some((&peer, body)) = pkt.split_first() {
            packets.push((body, 9000 + u16::from(peer % 4)));
        }
    }
    let cfg = QnpConfig {
        max_tracked_requests: 4,
        max_completed_requests: 8,
        ..QnpConfig::default()
    };
    let (stats, delivered) = receive_packets(cfg, &packets);
    assert_eq!(stats.delivered + stats.responses, delivered.len() as u64);
    assert!(delivered.len() <= packets.len());
    let rsd = Rsd::new(
        RuleSet::parse("r", "rule 1 0 0 \"a.c\" -> 1\ndefault 1 0 -> 0\n").expect("parses"),
    );
    let mut stash = Stash::new(4);
    for (pkt, port) in &packets {
        let _ = rsd.decide(pkt, SocketAddr::from(([127, 0, 0, 1], *port)), &mut stash);
    }
});
