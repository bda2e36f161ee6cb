//! The framing sniffer sees every byte a client sends. It must never panic, and how the
//! bytes are split across reads must never change its verdict.
#![no_main]

use flatmesh_proxy::downstream::FramingSniffer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else { return };
    let mut whole = FramingSniffer::new();
    whole.feed(bytes);
    let mut pieces = FramingSniffer::new();
    for chunk in bytes.chunks(usize::from(split).max(1)) {
        pieces.feed(chunk);
    }
    assert_eq!(whole.conflict(), pieces.conflict(), "verdict depends on read boundaries");
});
