//! The QingNiao on-wire format (§3.1, Fig. 6): a request is a sequence of TLV fields.
//!
//! Each field is `type: u8` (the field index declared in the IDL), `length: u16` big-endian
//! (bytes of value), then the value. int32 is 4 bytes and int64 8 bytes, both big-endian two's
//! complement; string (UTF-8) and bytes are raw. Dispatch fields come first, in declaration order,
//! then the other fields in declaration order, so a dispatcher finds them in the first packet.
//! The layout is hand-written rather than protobuf because the kernel and hardware matchers walk it
//! byte by byte and need fixed-width type and length fields.

use crate::QnpError;

/// Bytes of a TLV header: one type byte and a two-byte length.
pub const TLV_HEADER_LEN: usize = 3;

/// A message that the IDL compiler generated code for.
pub trait QnpMessage: Sized {
    /// The application this message belongs to (QNP header `app_id`).
    const APP_ID: u8;
    /// The request type (QNP header `req_type`).
    const REQ_TYPE: u8;
    /// Appends the TLV encoding to `out`. Returns how many bytes, from where encoding started, hold
    /// the dispatch fields: the transport keeps them in the first packet.
    fn encode(&self, out: &mut Vec<u8>) -> Result<usize, QnpError>;
    /// Decodes a whole request payload. Unknown field indices are skipped so that old readers
    /// accept messages from newer writers.
    fn decode(buf: &[u8]) -> Result<Self, QnpError>;
}

/// One decoded TLV field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tlv<'a> {
    /// The field index.
    pub field: u8,
    /// The value bytes.
    pub value: &'a [u8],
    /// Where the TLV header started in the buffer (for error messages).
    pub offset: usize,
}

/// Appends a field with a raw value.
pub fn put_bytes(out: &mut Vec<u8>, field: u8, value: &[u8]) -> Result<(), QnpError> {
    let len = u16::try_from(value.len()).map_err(|_| QnpError::ValueTooLong {
        field,
        len: value.len(),
    })?;
    out.push(field);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(value);
    Ok(())
}

/// Appends a string field (UTF-8 bytes).
pub fn put_string(out: &mut Vec<u8>, field: u8, value: &str) -> Result<(), QnpError> {
    put_bytes(out, field, value.as_bytes())
}

/// Appends an int32 field.
pub fn put_i32(out: &mut Vec<u8>, field: u8, value: i32) {
    out.push(field);
    out.extend_from_slice(&4u16.to_be_bytes());
    out.extend_from_slice(&value.to_be_bytes());
}

/// Appends an int64 field.
pub fn put_i64(out: &mut Vec<u8>, field: u8, value: i64) {
    out.push(field);
    out.extend_from_slice(&8u16.to_be_bytes());
    out.extend_from_slice(&value.to_be_bytes());
}

/// Iterates over the TLV fields of a buffer. Stops after the first error.
#[derive(Debug, Clone)]
pub struct TlvReader<'a> {
    buf: &'a [u8],
    pos: usize,
    failed: bool,
}

impl<'a> TlvReader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        TlvReader {
            buf,
            pos: 0,
            failed: false,
        }
    }
}

impl<'a> Iterator for TlvReader<'a> {
    type Item = Result<Tlv<'a>, QnpError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.buf.len() {
            return None;
        }
        let offset = self.pos;
        let rest = &self.buf[offset..];
        let Some((&[field, hi, lo], tail)) = rest.split_first_chunk::<TLV_HEADER_LEN>() else {
            self.failed = true;
            return Some(Err(QnpError::Tlv {
                offset,
                msg: format!("{} trailing bytes are too few for a TLV header", rest.len()),
            }));
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        let Some(value) = tail.get(..len) else {
            self.failed = true;
            return Some(Err(QnpError::Tlv {
                offset,
                msg: format!(
                    "field {field} claims {len} value bytes but only {} remain",
                    tail.len()
                ),
            }));
        };
        self.pos = offset + TLV_HEADER_LEN + len;
        Some(Ok(Tlv {
            field,
            value,
            offset,
        }))
    }
}

/// The value of the first field with index `field`, or `None` if it is absent or the stream is
/// malformed before it. This is what a dispatcher does with the first packet.
pub fn find_field(buf: &[u8], field: u8) -> Option<&[u8]> {
    TlvReader::new(buf)
        .map_while(Result::ok)
        .find(|t| t.field == field)
        .map(|t| t.value)
}

/// Decodes an int32 value.
pub fn get_i32(tlv: &Tlv<'_>) -> Result<i32, QnpError> {
    let bytes: [u8; 4] = tlv.value.try_into().map_err(|_| wrong_width(tlv, 4))?;
    Ok(i32::from_be_bytes(bytes))
}

/// Decodes an int64 value.
pub fn get_i64(tlv: &Tlv<'_>) -> Result<i64, QnpError> {
    let bytes: [u8; 8] = tlv.value.try_into().map_err(|_| wrong_width(tlv, 8))?;
    Ok(i64::from_be_bytes(bytes))
}

/// Decodes a string value.
pub fn get_string(tlv: &Tlv<'_>) -> Result<String, QnpError> {
    std::str::from_utf8(tlv.value)
        .map(str::to_owned)
        .map_err(|e| QnpError::Tlv {
            offset: tlv.offset,
            msg: format!("string field {} is not UTF-8 ({e})", tlv.field),
        })
}

/// Decodes a bytes value.
pub fn get_bytes(tlv: &Tlv<'_>) -> Vec<u8> {
    tlv.value.to_vec()
}

/// Rejects a second occurrence of a field: a duplicate would let a dispatcher (which reads the
/// first) and the application (which would read the last) see different values.
pub fn mark_seen(seen: &mut bool, tlv: &Tlv<'_>) -> Result<(), QnpError> {
    if std::mem::replace(seen, true) {
        return Err(QnpError::Tlv {
            offset: tlv.offset,
            msg: format!("field {} appears twice", tlv.field),
        });
    }
    Ok(())
}

fn wrong_width(tlv: &Tlv<'_>, want: usize) -> QnpError {
    QnpError::Tlv {
        offset: tlv.offset,
        msg: format!(
            "field {} has {} value bytes, its type needs {want}",
            tlv.field,
            tlv.value.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_type() {
        let mut buf = Vec::new();
        put_string(&mut buf, 0, "user:42").unwrap();
        put_i32(&mut buf, 1, -7);
        put_i64(&mut buf, 2, i64::MIN);
        put_bytes(&mut buf, 3, &[0, 255]).unwrap();
        assert_eq!(&buf[..3], &[0, 0, 7], "type byte then big-endian length");
        let fields: Vec<_> = TlvReader::new(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(fields.len(), 4);
        assert_eq!(get_string(&fields[0]).unwrap(), "user:42");
        assert_eq!(get_i32(&fields[1]).unwrap(), -7);
        assert_eq!(get_i64(&fields[2]).unwrap(), i64::MIN);
        assert_eq!(get_bytes(&fields[3]), vec![0, 255]);
        assert_eq!(find_field(&buf, 3), Some(&[0u8, 255][..]));
        assert_eq!(find_field(&buf, 9), None);
    }

    #[test]
    fn rejects_truncation_and_bad_widths() {
        let mut buf = Vec::new();
        put_i32(&mut buf, 1, 5);
        for cut in 1..buf.len() {
            let r: Result<Vec<_>, _> = TlvReader::new(&buf[..cut]).collect();
            assert!(r.is_err(), "cut at {cut} must fail");
        }
        let tlv = Tlv {
            field: 1,
            value: &[1, 2, 3],
            offset: 0,
        };
        assert!(get_i32(&tlv).is_err());
        assert!(get_i64(&tlv).is_err());
        let bad = Tlv {
            field: 1,
            value: &[0xff],
            offset: 0,
        };
        assert!(get_string(&bad).is_err());
    }

    #[test]
    fn refuses_values_longer_than_the_length_field() {
        let mut buf = Vec::new();
        let big = vec![0u8; 65_536];
        assert!(matches!(
            put_bytes(&mut buf, 4, &big),
            Err(QnpError::ValueTooLong { field: 4, .. })
        ));
        assert!(buf.is_empty(), "nothing is written on error");
        put_bytes(&mut buf, 4, &big[..65_535]).unwrap();
    }

    #[test]
    fn duplicate_fields_are_errors() {
        let tlv = Tlv {
            field: 2,
            value: &[],
            offset: 0,
        };
        let mut seen = false;
        mark_seen(&mut seen, &tlv).unwrap();
        assert!(mark_seen(&mut seen, &tlv).is_err());
    }
}
