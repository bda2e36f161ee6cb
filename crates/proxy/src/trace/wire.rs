//! Protobuf wire format, written by hand for the few OTLP fields the node sends (`super::otlp`
//! has the same messages as prost structs, which the tests decode with). Spans are encoded
//! straight from the request's fields into the exporter's batch buffer: no message tree, no
//! owned string per attribute, no allocation past the buffer's growth.

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn key(buf: &mut Vec<u8>, field: u32, wire: u8) {
    varint(buf, u64::from(field << 3 | u32::from(wire)));
}

pub fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push(v as u8 | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// Bytes `v` takes as a varint.
pub fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// An `int32`/`int64`/enum field (negative values take ten bytes, as protobuf says).
pub fn int(buf: &mut Vec<u8>, field: u32, v: i64) {
    key(buf, field, VARINT);
    varint(buf, v as u64);
}

pub fn fixed64(buf: &mut Vec<u8>, field: u32, v: u64) {
    key(buf, field, FIXED64);
    buf.extend_from_slice(&v.to_le_bytes());
}

pub fn fixed32(buf: &mut Vec<u8>, field: u32, v: u32) {
    key(buf, field, FIXED32);
    buf.extend_from_slice(&v.to_le_bytes());
}

/// The key and length of a length-delimited field whose `len` bytes the caller writes next.
pub fn delimited_head(buf: &mut Vec<u8>, field: u32, len: usize) {
    key(buf, field, LEN);
    varint(buf, len as u64);
}

/// A `bytes` or `string` field.
pub fn bytes(buf: &mut Vec<u8>, field: u32, v: &[u8]) {
    delimited_head(buf, field, v.len());
    buf.extend_from_slice(v);
}

/// A length-delimited field (an embedded message, or a string written piecewise) whose
/// content `body` appends. Its length is known only afterwards: one byte is set aside, which
/// is enough below 128 bytes; a longer body is moved up to make room for the longer prefix.
pub fn delimited(buf: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    key(buf, field, LEN);
    let at = buf.len();
    buf.push(0);
    body(buf);
    let len = buf.len() - at - 1;
    if len < 0x80 {
        buf[at] = len as u8;
        return;
    }
    let mut prefix = Vec::with_capacity(10);
    varint(&mut prefix, len as u64);
    buf.splice(at..at + 1, prefix);
}

/// A string field holding `value` as `Display` writes it.
pub fn display(buf: &mut Vec<u8>, field: u32, value: impl std::fmt::Display) {
    // Writing into a Vec cannot fail.
    delimited(buf, field, |b| {
        let _ = write!(b, "{value}");
    });
}

/// An OTLP `KeyValue` (`common.proto`) with a string value, as field `field`.
pub fn attr_str(buf: &mut Vec<u8>, field: u32, key: &str, value: &[u8]) {
    delimited(buf, field, |b| {
        bytes(b, 1, key.as_bytes());
        delimited(b, 2, |b| bytes(b, 1, value)); // AnyValue.string_value
    });
}

/// An OTLP `KeyValue` with an `int64` value.
pub fn attr_int(buf: &mut Vec<u8>, field: u32, key: &str, value: i64) {
    delimited(buf, field, |b| {
        bytes(b, 1, key.as_bytes());
        delimited(b, 2, |b| int(b, 3, value)); // AnyValue.int_value
    });
}

/// An OTLP `KeyValue` with a string value that `text` appends.
pub fn attr_text(buf: &mut Vec<u8>, field: u32, key: &str, text: impl FnOnce(&mut Vec<u8>)) {
    delimited(buf, field, |b| {
        bytes(b, 1, key.as_bytes());
        delimited(b, 2, |b| delimited(b, 1, text));
    });
}

/// Appends `ip` as its `Display` does; IPv4 without `core::fmt`, which costs more than the
/// rest of a span's encoding.
pub fn push_ip(buf: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf.push(b'.');
                }
                push_decimal(buf, octet.into());
            }
        }
        IpAddr::V6(v6) => {
            let _ = write!(buf, "{v6}");
        }
    }
}

/// Appends `addr` as its `Display` does (IPv4 fast, as [`push_ip`]).
pub fn push_socket_addr(buf: &mut Vec<u8>, addr: SocketAddr) {
    match addr {
        SocketAddr::V4(v4) => {
            push_ip(buf, IpAddr::V4(*v4.ip()));
            buf.push(b':');
            push_decimal(buf, v4.port());
        }
        SocketAddr::V6(_) => {
            let _ = write!(buf, "{addr}");
        }
    }
}

fn push_decimal(buf: &mut Vec<u8>, mut n: u16) {
    let mut digits = [0u8; 5];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[at..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_match_prost() {
        for v in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u32::MAX as u64,
            u64::MAX,
        ] {
            let mut ours = Vec::new();
            varint(&mut ours, v);
            let mut theirs = Vec::new();
            prost::encoding::encode_varint(v, &mut theirs);
            assert_eq!(ours, theirs, "{v}");
            assert_eq!(varint_len(v), theirs.len(), "{v}");
        }
    }

    #[test]
    fn addresses_read_as_display_writes_them() {
        let addrs: [SocketAddr; 6] = [
            "0.0.0.0:0".parse().expect("addr"),
            "10.0.0.1:5000".parse().expect("addr"),
            "255.255.255.255:65535".parse().expect("addr"),
            "127.0.10.100:80".parse().expect("addr"),
            "[::1]:8080".parse().expect("addr"),
            "[fe80::1%7]:1".parse().expect("addr"),
        ];
        for addr in addrs {
            let mut ip = Vec::new();
            push_ip(&mut ip, addr.ip());
            assert_eq!(String::from_utf8(ip).expect("utf-8"), addr.ip().to_string());
            let mut whole = Vec::new();
            push_socket_addr(&mut whole, addr);
            assert_eq!(String::from_utf8(whole).expect("utf-8"), addr.to_string());
        }
    }

    #[test]
    fn a_long_delimited_body_gets_a_long_prefix() {
        for len in [0, 1, 127, 128, 200, 16_383, 16_384, 70_000] {
            let text = "x".repeat(len);
            let mut ours = vec![9];
            delimited(&mut ours, 5, |b| b.extend_from_slice(text.as_bytes()));
            let mut theirs = vec![9];
            prost::encoding::string::encode(5, &text, &mut theirs);
            assert_eq!(ours, theirs, "{len}");
        }
    }
}
