//! The chunked-body parser sees every byte of a chunked request or response. It must never
//! panic, and how the bytes are split across reads must never change where the body ends,
//! what data it carries, or whether it is refused.
#![no_main]

use flatmesh_proxy::fuzz::ChunkedParser;
use libfuzzer_sys::fuzz_target;

/// (data, end offset), or None if refused or incomplete.
fn run(bytes: &[u8], step: usize) -> Option<(Vec<u8>, usize)> {
    let mut parser = ChunkedParser::new();
    let mut data = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let piece = &bytes[offset..(offset + step).min(bytes.len())];
        let progress = parser
            .advance(piece, |r| data.extend_from_slice(&piece[r]))
            .ok()?;
        assert!(progress.consumed <= piece.len());
        offset += progress.consumed;
        if progress.done {
            return Some((data, offset));
        }
    }
    None
}

fuzz_target!(|data: &[u8]| {
    let Some((&split, bytes)) = data.split_first() else {
        return;
    };
    let whole = run(bytes, bytes.len().max(1));
    let pieces = run(bytes, usize::from(split).max(1));
    assert_eq!(whole, pieces, "the verdict depends on read boundaries");
});
