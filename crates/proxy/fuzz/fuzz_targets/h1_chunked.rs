//! The chunked-body parser sees every byte of a chunked request or response. It must never
//! panic, and how the bytes are split across reads must never change where the body ends,
//! what data it carries, what goes on (the chunks as they came, the trailer section
//! filtered), or whether it is refused. What goes on is itself a chunked body with the same
//! data, whose every trailer line may be a trailer.
#![no_main]

use flatmesh_proxy::fuzz::{filter_section, line_goes_on, ChunkedParser};
use libfuzzer_sys::fuzz_target;

/// (data, what is forwarded, end offset), or None if refused or incomplete.
fn run(bytes: &[u8], step: usize) -> Option<(Vec<u8>, Vec<u8>, usize)> {
    let mut parser = ChunkedParser::new();
    let mut data = Vec::new();
    let mut forwarded = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let piece = &bytes[offset..(offset + step).min(bytes.len())];
        let progress = parser
            .advance(piece, |r| data.extend_from_slice(&piece[r]))
            .ok()?;
        assert!(progress.framed <= progress.consumed && progress.consumed <= piece.len());
        forwarded.extend_from_slice(&piece[..progress.framed]);
        offset += progress.consumed;
        if progress.done {
            filter_section(parser.trailer_section(), &mut forwarded);
            return Some((data, forwarded, offset));
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
    if let Some((data, forwarded, _)) = whole {
        let (again, reforwarded, end) =
            run(&forwarded, forwarded.len().max(1)).expect("what goes on is a chunked body");
        assert_eq!(end, forwarded.len(), "nothing after the body");
        assert_eq!(again, data, "the data changed on the way");
        assert_eq!(reforwarded, forwarded, "filtering is idempotent");
        let mut parser = ChunkedParser::new();
        let _ = parser.advance(&forwarded, |_| {});
        let section = parser.trailer_section();
        for line in section.split(|b| *b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l)) {
            assert!(line.is_empty() || line_goes_on(line), "trailer line {line:?} went on");
        }
    }
});
