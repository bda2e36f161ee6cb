//! HPACK Huffman code (RFC 7541 Appendix B) as the nibble automaton the verdict program walks
//! (`fm_huffman` in bpf/dispatch.bpf.c), with a user-space decoder over the same table (the
//! reference the tests and the fuzzer compare the kernel with) and an encoder for tests.
//!
//! Why a table and not a tree walk: the verifier accepts a bounded loop over input nibbles
//! whose every step is one bounds-checked load from a map (`state * 16 + nibble`); a bit-wise
//! tree walk would need a data-dependent inner loop. Every code is at least 5 bits long, so
//! one nibble completes at most one symbol.

/// (code, length in bits) for symbols 0..=255, then EOS (256).
#[rustfmt::skip]
const CODES: [(u32, u8); 257] = [
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28), (0xfffffe4, 28),
    (0xfffffe5, 28), (0xfffffe6, 28), (0xfffffe7, 28), (0xfffffe8, 28), (0xffffea, 24),
    (0x3ffffffc, 30), (0xfffffe9, 28), (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28),
    (0xfffffec, 28), (0xfffffed, 28), (0xfffffee, 28), (0xfffffef, 28), (0xffffff0, 28),
    (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28), (0xffffff4, 28),
    (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28), (0xffffff8, 28), (0xffffff9, 28),
    (0xffffffa, 28), (0xffffffb, 28), (0x14, 6), (0x3f8, 10), (0x3f9, 10), (0xffa, 12),
    (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11), (0x3fa, 10), (0x3fb, 10), (0xf9, 8),
    (0x7fb, 11), (0xfa, 8), (0x16, 6), (0x17, 6), (0x18, 6), (0x0, 5), (0x1, 5), (0x2, 5),
    (0x19, 6), (0x1a, 6), (0x1b, 6), (0x1c, 6), (0x1d, 6), (0x1e, 6), (0x1f, 6), (0x5c, 7),
    (0xfb, 8), (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10), (0x1ffa, 13), (0x21, 6),
    (0x5d, 7), (0x5e, 7), (0x5f, 7), (0x60, 7), (0x61, 7), (0x62, 7), (0x63, 7), (0x64, 7),
    (0x65, 7), (0x66, 7), (0x67, 7), (0x68, 7), (0x69, 7), (0x6a, 7), (0x6b, 7), (0x6c, 7),
    (0x6d, 7), (0x6e, 7), (0x6f, 7), (0x70, 7), (0x71, 7), (0x72, 7), (0xfc, 8), (0x73, 7),
    (0xfd, 8), (0x1ffb, 13), (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14), (0x22, 6),
    (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5), (0x24, 6), (0x5, 5), (0x25, 6), (0x26, 6),
    (0x27, 6), (0x6, 5), (0x74, 7), (0x75, 7), (0x28, 6), (0x29, 6), (0x2a, 6), (0x7, 5),
    (0x2b, 6), (0x76, 7), (0x2c, 6), (0x8, 5), (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15), (0x7fc, 11), (0x3ffd, 14), (0x1ffd, 13),
    (0xffffffc, 28), (0xfffe6, 20), (0x3fffd2, 22), (0xfffe7, 20), (0xfffe8, 20),
    (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22), (0x7fffd9, 23), (0x3fffd6, 22),
    (0x7fffda, 23), (0x7fffdb, 23), (0x7fffdc, 23), (0x7fffdd, 23), (0x7fffde, 23),
    (0xffffeb, 24), (0x7fffdf, 23), (0xffffec, 24), (0xffffed, 24), (0x3fffd7, 22),
    (0x7fffe0, 23), (0xffffee, 24), (0x7fffe1, 23), (0x7fffe2, 23), (0x7fffe3, 23),
    (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22), (0x7fffe5, 23), (0x3fffd9, 22),
    (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24), (0x3fffda, 22), (0x1fffdd, 21),
    (0xfffe9, 20), (0x3fffdb, 22), (0x3fffdc, 22), (0x7fffe8, 23), (0x7fffe9, 23),
    (0x1fffde, 21), (0x7fffea, 23), (0x3fffdd, 22), (0x3fffde, 22), (0xfffff0, 24),
    (0x1fffdf, 21), (0x3fffdf, 22), (0x7fffeb, 23), (0x7fffec, 23), (0x1fffe0, 21),
    (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21), (0x7fffed, 23), (0x3fffe1, 22),
    (0x7fffee, 23), (0x7fffef, 23), (0xfffea, 20), (0x3fffe2, 22), (0x3fffe3, 22),
    (0x3fffe4, 22), (0x7ffff0, 23), (0x3fffe5, 22), (0x3fffe6, 22), (0x7ffff1, 23),
    (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20), (0x7fff1, 19), (0x3fffe7, 22),
    (0x7ffff2, 23), (0x3fffe8, 22), (0x1ffffec, 25), (0x3ffffe2, 26), (0x3ffffe3, 26),
    (0x3ffffe4, 26), (0x7ffffde, 27), (0x7ffffdf, 27), (0x3ffffe5, 26), (0xfffff1, 24),
    (0x1ffffed, 25), (0x7fff2, 19), (0x1fffe3, 21), (0x3ffffe6, 26), (0x7ffffe0, 27),
    (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27), (0xfffff2, 24), (0x1fffe4, 21),
    (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26), (0xffffffd, 28), (0x7ffffe3, 27),
    (0x7ffffe4, 27), (0x7ffffe5, 27), (0xfffec, 20), (0xfffff3, 24), (0xfffed, 20),
    (0x1fffe6, 21), (0x3fffe9, 22), (0x1fffe7, 21), (0x1fffe8, 21), (0x7ffff3, 23),
    (0x3fffea, 22), (0x3fffeb, 22), (0x1ffffee, 25), (0x1ffffef, 25), (0xfffff4, 24),
    (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23), (0x3ffffeb, 26), (0x7ffffe6, 27),
    (0x3ffffec, 26), (0x3ffffed, 26), (0x7ffffe7, 27), (0x7ffffe8, 27), (0x7ffffe9, 27),
    (0x7ffffea, 27), (0x7ffffeb, 27), (0xffffffe, 28), (0x7ffffec, 27), (0x7ffffed, 27),
    (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27), (0x3ffffee, 26), (0x3fffffff, 30),
];

const EOS: u16 = 256;

/// Entries of the automaton: 256 states (the code tree's inner nodes) by 16 nibbles.
pub(crate) const TABLE_LEN: usize = 256 * 16;

/// Entry flags (bits 16..24 of an entry; bits 0..8 are the next state, 8..16 the symbol).
pub(crate) const EMIT: u32 = 1;
pub(crate) const FAIL: u32 = 2;
pub(crate) const ACCEPT: u32 = 4;

#[derive(Clone, Copy, Default)]
struct Node {
    child: [u16; 2], // 0 = none (the root is never a child)
    leaf: Option<u16>,
}

/// The code tree: node 0 is the root.
fn tree() -> Vec<Node> {
    let mut nodes = vec![Node::default()];
    for (sym, &(code, len)) in CODES.iter().enumerate() {
        let mut n = 0usize;
        for i in (0..len).rev() {
            let bit = ((code >> i) & 1) as usize;
            if nodes[n].child[bit] == 0 {
                nodes.push(Node::default());
                nodes[n].child[bit] = (nodes.len() - 1) as u16;
            }
            n = nodes[n].child[bit] as usize;
        }
        nodes[n].leaf = Some(sym as u16);
    }
    nodes
}

/// The automaton: entry `state * 16 + nibble` = next state | symbol << 8 | flags << 16.
/// ACCEPT marks a position where the input may end: the bits read since the last symbol are
/// a prefix of EOS (all ones) of at most 7 bits, the only padding RFC 7541 allows.
pub(crate) fn table() -> Vec<u32> {
    let nodes = tree();
    // Inner nodes get state numbers in creation order (root = 0); 257 leaves make 256.
    let mut state_of = vec![u32::MAX; nodes.len()];
    let mut inner = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if n.leaf.is_none() {
            state_of[i] = inner.len() as u32;
            inner.push(i);
        }
    }
    debug_assert_eq!(inner.len(), 256);
    // Depth and "all ones so far" of each inner node.
    let mut padding_ok = vec![false; nodes.len()];
    let mut stack = vec![(0usize, 0u32, true)];
    while let Some((n, depth, ones)) = stack.pop() {
        padding_ok[n] = ones && depth <= 7;
        for bit in 0..2 {
            let c = nodes[n].child[bit] as usize;
            if c != 0 && nodes[c].leaf.is_none() {
                stack.push((c, depth + 1, ones && bit == 1));
            }
        }
    }
    let mut out = vec![0u32; TABLE_LEN];
    for (state, &start) in inner.iter().enumerate() {
        for nibble in 0..16u32 {
            let mut n = start;
            let (mut sym, mut flags) = (0u32, 0u32);
            for i in (0..4).rev() {
                let bit = ((nibble >> i) & 1) as usize;
                n = nodes[n].child[bit] as usize;
                match nodes[n].leaf {
                    Some(EOS) => {
                        flags |= FAIL;
                        n = 0;
                    }
                    Some(s) => {
                        sym = u32::from(s);
                        flags |= EMIT;
                        n = 0;
                    }
                    None => {}
                }
            }
            if flags & FAIL == 0 && padding_ok[n] {
                flags |= ACCEPT;
            }
            out[state * 16 + nibble as usize] = state_of[n] | sym << 8 | flags << 16;
        }
    }
    out
}

/// Decodes a Huffman-coded HPACK string with [`table`], as the kernel does. `None` for an
/// invalid string (EOS inside, or padding that is not a short all-ones EOS prefix).
pub fn decode(input: &[u8]) -> Option<Vec<u8>> {
    thread_local! {
        static TABLE: Vec<u32> = table();
    }
    TABLE.with(|t| {
        let mut out = Vec::with_capacity(input.len() * 8 / 5);
        let mut state = 0usize;
        let mut accept = true;
        for b in input {
            for nibble in [b >> 4, b & 0xf] {
                let e = t[state * 16 + nibble as usize];
                let flags = e >> 16;
                if flags & FAIL != 0 {
                    return None;
                }
                if flags & EMIT != 0 {
                    out.push((e >> 8) as u8);
                }
                state = (e & 0xff) as usize;
                accept = flags & ACCEPT != 0;
            }
        }
        accept.then_some(out)
    })
}

/// Huffman-encodes `input` as an HPACK string payload (padded with EOS bits).
pub fn encode(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0u32);
    for &b in input {
        let (code, len) = CODES[b as usize];
        acc = acc << len | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
        acc &= (1u64 << bits) - 1;
    }
    if bits > 0 {
        out.push((acc << (8 - bits) | (0xff >> bits)) as u8);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_code_is_complete_and_prefix_free() {
        let nodes = tree();
        let leaves = nodes.iter().filter(|n| n.leaf.is_some()).count();
        assert_eq!(leaves, 257);
        // Every inner node has both children: a complete code.
        for n in nodes.iter().filter(|n| n.leaf.is_none()) {
            assert!(n.child[0] != 0 && n.child[1] != 0);
        }
        assert_eq!(table().len(), TABLE_LEN);
    }

    #[test]
    fn round_trips_every_octet_and_typical_paths() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&encode(&all)).as_deref(), Some(&all[..]));
        for s in [
            "/",
            "/bench.Echo/Unary",
            "/grpc.health.v1.Health/Check",
            "/api/v2/items?x=1&y=%20",
            "POST",
            "",
        ] {
            assert_eq!(
                decode(&encode(s.as_bytes())).as_deref(),
                Some(s.as_bytes()),
                "{s}"
            );
        }
    }

    #[test]
    fn known_vectors_from_rfc_7541() {
        // C.4.1: "www.example.com"
        let www = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        assert_eq!(encode(b"www.example.com"), www);
        assert_eq!(decode(&www).as_deref(), Some(&b"www.example.com"[..]));
        // C.4.2: "no-cache"
        assert_eq!(encode(b"no-cache"), [0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf]);
    }

    #[test]
    fn invalid_padding_and_eos_are_refused() {
        // Eight bits of padding (a whole 0xff byte after a complete string) is too long.
        let mut s = encode(b"/a");
        s.push(0xff);
        assert_eq!(decode(&s), None);
        // Padding that is not all ones: '0' is 00000, so 0x00 pads with zeros.
        assert_eq!(decode(&[0x00]), None);
        // EOS itself (30 ones) inside the string.
        assert_eq!(decode(&[0xff, 0xff, 0xff, 0xff]), None);
    }
}
