#![no_main]
//! Any bytes: decode never panics, and a decoded heartbeat re-encodes to the same 16 bytes. The
//! same bytes read as an agent's measurements: the builder clamps them into a heartbeat that
//! decodes.
use flatmesh_control::agent::{HeartbeatBuilder, NodeSample};
use flatmesh_control::heartbeat::Heartbeat;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hb) = Heartbeat::decode(data) {
        assert_eq!(&hb.encode()[..], data);
        let _ = hb.samples().count();
    }
    let word = |k: usize| {
        let mut b = [0u8; 8];
        for (i, x) in data.iter().skip(k * 8).take(8).enumerate() {
            b[i] = *x;
        }
        u64::from_le_bytes(b)
    };
    let sample = NodeSample {
        queue_len: word(0) as u32,
        bytes: word(1),
        exec_us: (2..(data.len() / 8).min(40))
            .map(|k| (word(k) % 3 != 0).then(|| word(k) >> 2))
            .collect(),
    };
    let mut b = HeartbeatBuilder::new(
        word(2) as u32,
        word(3),
        std::time::Duration::from_millis(1 + word(4) % 1000),
    );
    for _ in 0..3 {
        let hb = b.build(&sample);
        assert_eq!(Heartbeat::decode(&hb.encode()).expect("a built heartbeat decodes"), hb);
    }
});
