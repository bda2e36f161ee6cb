//! Reading one field out of a protobuf message without its schema (papers/003: a route that
//! matches on the request message, not only the head).
//!
//! The bytes are untrusted and may be only the start of the message (the proxy reads a bounded
//! prefix). The walk goes field by field; whatever is malformed or cut off ends it, and a field
//! that was not reached counts as absent. It never allocates and never reads past `message`.

/// How much of the first gRPC message the proxy reads to decide a route: enough for the
/// leading fields of any request message; a field further in does not match.
pub const MESSAGE_PREFIX_MAX: usize = 4096;

/// The value of one field, as found in the wire bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldValue<'m> {
    /// Wire type 0 (int32/64, uint32/64, bool, enum; sint* are zig-zag encoded and read as
    /// the raw unsigned number).
    Varint(u64),
    /// Wire type 2 (string, bytes, sub-messages, packed repeated fields).
    Bytes(&'m [u8]),
    /// A wire type 2 value that runs past the bytes read: its start, and its whole length.
    /// A prefix can still be compared; an exact value cannot.
    Partial { start: &'m [u8], len: u64 },
}

/// A protobuf varint at the start of `bytes`: its value and length, or `None` if it is cut
/// off or longer than ten bytes.
fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// The first occurrence of field `number` whose wire type is varint or length-delimited, in the
/// message bytes `message`. Fixed-width fields are stepped over; groups (wire types 3 and 4,
/// deprecated) and anything malformed end the walk.
pub fn find_field(message: &[u8], number: u32) -> Option<FieldValue<'_>> {
    let mut rest = message;
    while !rest.is_empty() {
        let (key, used) = varint(rest)?;
        rest = &rest[used..];
        let field = key >> 3;
        if field == 0 || field > u64::from(u32::MAX) {
            // No protobuf field has number 0: these are not protobuf bytes.
            return None;
        }
        let skip = match key & 7 {
            0 => {
                let (value, used) = varint(rest)?;
                if field == u64::from(number) {
                    return Some(FieldValue::Varint(value));
                }
                used
            }
            1 => 8,
            2 => {
                let (len, used) = varint(rest)?;
                let end = usize::try_from(len).ok().and_then(|l| used.checked_add(l));
                match end.and_then(|end| rest.get(used..end)) {
                    Some(value) if field == u64::from(number) => {
                        return Some(FieldValue::Bytes(value))
                    }
                    Some(value) => used + value.len(),
                    // The value runs past what was read: the walk ends here either way.
                    None if field == u64::from(number) => {
                        return Some(FieldValue::Partial {
                            start: &rest[used..],
                            len,
                        })
                    }
                    None => return None,
                }
            }
            5 => 4,
            _ => return None,
        };
        rest = rest.get(skip..)?;
    }
    None
}

/// The payload of the first gRPC message in `body` (the start of a request body): after its
/// 5-byte prefix (flag, big-endian length), at most [`MESSAGE_PREFIX_MAX`] bytes, and only as
/// much as `body` holds. `None` for a compressed message (flag 1: its bytes are not the
/// protobuf) or a body shorter than the prefix.
pub fn first_message(body: &[u8]) -> Option<&[u8]> {
    let (&flag, rest) = body.split_first()?;
    if flag != 0 {
        return None;
    }
    let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let payload = &rest[4..];
    Some(&payload[..payload.len().min(len).min(MESSAGE_PREFIX_MAX)])
}

/// How many bytes of a request body hold everything [`first_message`] looks at: the 5-byte
/// prefix and the message's first [`MESSAGE_PREFIX_MAX`] bytes, or less if the message is
/// shorter. `None` while fewer than 5 bytes are known.
pub fn wanted_prefix(body_start: &[u8]) -> Option<usize> {
    let len = u32::from_be_bytes(body_start.get(1..5)?.try_into().ok()?) as usize;
    Some(5 + len.min(MESSAGE_PREFIX_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(field: u32, wire: u8) -> Vec<u8> {
        encode_varint(u64::from(field) << 3 | u64::from(wire))
    }

    fn encode_varint(mut v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(byte);
                return out;
            }
            out.push(byte | 0x80);
        }
    }

    fn string_field(field: u32, value: &[u8]) -> Vec<u8> {
        let mut out = key(field, 2);
        out.extend(encode_varint(value.len() as u64));
        out.extend_from_slice(value);
        out
    }

    #[test]
    fn finds_string_and_varint_fields_after_others() {
        let mut msg = Vec::new();
        msg.extend(key(1, 5));
        msg.extend([1, 2, 3, 4]);
        msg.extend(key(2, 1));
        msg.extend([0; 8]);
        msg.extend(key(3, 0));
        msg.extend(encode_varint(300));
        msg.extend(string_field(4, b"alice"));
        msg.extend(string_field(600, b"big number"));
        assert_eq!(find_field(&msg, 3), Some(FieldValue::Varint(300)));
        assert_eq!(find_field(&msg, 4), Some(FieldValue::Bytes(b"alice")));
        assert_eq!(
            find_field(&msg, 600),
            Some(FieldValue::Bytes(b"big number"))
        );
        assert_eq!(find_field(&msg, 1), None, "fixed32 is not readable");
        assert_eq!(find_field(&msg, 7), None);
    }

    #[test]
    fn a_value_cut_off_by_the_window_is_partial() {
        let msg = string_field(1, b"vip-0123456789");
        assert_eq!(
            find_field(&msg[..8], 1),
            Some(FieldValue::Partial {
                start: b"vip-01",
                len: 14
            })
        );
        assert_eq!(find_field(&msg[..8], 2), None);
    }

    #[test]
    fn first_occurrence_counts() {
        let mut msg = string_field(1, b"first");
        msg.extend(string_field(1, b"second"));
        assert_eq!(find_field(&msg, 1), Some(FieldValue::Bytes(b"first")));
    }

    #[test]
    fn cut_off_or_malformed_bytes_end_the_walk() {
        let msg = string_field(1, b"abcdef");
        for cut in 0..msg.len() {
            // Cut in the key or the length: nothing; cut in the value: its start.
            match find_field(&msg[..cut], 1) {
                None => assert!(cut < 2, "cut at {cut}"),
                Some(FieldValue::Partial { start, len: 6 }) => {
                    assert_eq!(start, &b"abcdef"[..cut - 2]);
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        // A length far past the end of another field, a group, an over-long varint.
        assert_eq!(
            find_field(&[0x12, 0xff, 0xff, 0xff, 0x0f, b'x', 0x0a, 0], 1),
            None
        );
        assert_eq!(find_field(&[0x0b, 0x0c], 1), None);
        let mut long_varint = vec![0x08];
        long_varint.extend([0x80; 10]);
        long_varint.push(0x01);
        assert_eq!(find_field(&long_varint, 1), None);
        assert_eq!(find_field(&[0x08; 2], 1), Some(FieldValue::Varint(8)));
        assert_eq!(find_field(&[0x80; 11], 1), None);
        assert_eq!(find_field(&[0x00, 0x01], 0), None, "field 0 is malformed");
    }

    #[test]
    fn the_first_message_is_bounded_and_compression_is_refused() {
        let mut body = vec![0, 0, 0, 0, 3, b'a', b'b', b'c', 0, 0];
        assert_eq!(first_message(&body), Some(&b"abc"[..]));
        assert_eq!(wanted_prefix(&body), Some(8));
        body[0] = 1;
        assert_eq!(first_message(&body), None);
        assert_eq!(first_message(&[0, 0, 0]), None);
        assert_eq!(wanted_prefix(&[0, 0, 0]), None);
        let big = [0, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(wanted_prefix(&big), Some(5 + MESSAGE_PREFIX_MAX));
        let mut long = big.to_vec();
        long.extend(vec![7u8; MESSAGE_PREFIX_MAX + 10]);
        assert_eq!(
            first_message(&long).map(<[u8]>::len),
            Some(MESSAGE_PREFIX_MAX)
        );
    }
}
