//! The QNP packet header, exactly Fig. 11 of the paper, in network byte order:
//!
//! | offset | width | field |
//! |---|---|---|
//! | 0 | u8 | app_id |
//! | 1 | u8 | req_type |
//! | 2 | u32 | req_id |
//! | 6 | u32 | req_acked_id |
//! | 10 | u32 | req_len_in_bytes |
//! | 14 | u8 | req_len_in_pkts |
//! | 15 | u8 | pkt_seq_num_in_req |
//! | 16 | u8 | pkt_flag |
//! | 17 | u8 | seg_cnt |
//! | 18 | 4 × u8 | paddings (PAD_SIZE = 4, zero) |
//!
//! 22 bytes: with Ethernet (14), IPv4 (20) and UDP (8) headers the headers end at byte 64, the
//! 512-bit alignment the paper chose for its datapath.

use crate::QnpError;

/// Bytes of padding at the end of the header (the paper's PAD_SIZE).
pub const PAD_SIZE: usize = 4;
/// Bytes of the QNP header on the wire.
pub const HEADER_LEN: usize = 18 + PAD_SIZE;
/// Bytes of the Ethernet, IPv4 and UDP headers in front of QNP.
pub const L2_L4_HEADERS: usize = 14 + 20 + 8;
/// The datapath segment width (AXI-S, 512 bits) that `seg_cnt` counts in.
pub const SEGMENT_BYTES: usize = 64;

/// `pkt_flag` bit: the packet carries request data.
pub const FLAG_DATA: u8 = 0x01;
/// `pkt_flag` bit: `req_acked_id` is valid. A response is DATA|ACK: the ACK rides on it (§4.1).
pub const FLAG_ACK: u8 = 0x02;

/// A decoded QNP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QnpHeader {
    pub app_id: u8,
    pub req_type: u8,
    pub req_id: u32,
    pub req_acked_id: u32,
    pub req_len_in_bytes: u32,
    pub req_len_in_pkts: u8,
    pub pkt_seq_num_in_req: u8,
    pub pkt_flag: u8,
    pub seg_cnt: u8,
}

impl QnpHeader {
    /// Writes the header (with zero padding) to the first [`HEADER_LEN`] bytes of `out`.
    pub fn write(&self, out: &mut [u8; HEADER_LEN]) {
        out[0] = self.app_id;
        out[1] = self.req_type;
        out[2..6].copy_from_slice(&self.req_id.to_be_bytes());
        out[6..10].copy_from_slice(&self.req_acked_id.to_be_bytes());
        out[10..14].copy_from_slice(&self.req_len_in_bytes.to_be_bytes());
        out[14] = self.req_len_in_pkts;
        out[15] = self.pkt_seq_num_in_req;
        out[16] = self.pkt_flag;
        out[17] = self.seg_cnt;
        out[18..].fill(0);
    }

    /// The header as bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0; HEADER_LEN];
        self.write(&mut b);
        b
    }

    /// Parses the header at the start of a packet; returns it and the payload.
    pub fn parse(pkt: &[u8]) -> Result<(QnpHeader, &[u8]), QnpError> {
        let Some((h, payload)) = pkt.split_first_chunk::<HEADER_LEN>() else {
            return Err(QnpError::Packet(format!(
                "{} bytes is shorter than the {HEADER_LEN}-byte header",
                pkt.len()
            )));
        };
        let be = |i: usize| u32::from_be_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let hdr = QnpHeader {
            app_id: h[0],
            req_type: h[1],
            req_id: be(2),
            req_acked_id: be(6),
            req_len_in_bytes: be(10),
            req_len_in_pkts: h[14],
            pkt_seq_num_in_req: h[15],
            pkt_flag: h[16],
            seg_cnt: h[17],
        };
        if hdr.pkt_flag & !(FLAG_DATA | FLAG_ACK) != 0 {
            return Err(QnpError::Packet(format!(
                "unknown pkt_flag bits {:#04x}",
                hdr.pkt_flag
            )));
        }
        Ok((hdr, payload))
    }

    /// `seg_cnt` for a packet whose first `dispatch_bytes` payload bytes hold dispatch fields: the
    /// number of 64-byte datapath segments, from the Ethernet header on, the Matcher must read.
    pub fn seg_cnt_for(dispatch_bytes: usize) -> u8 {
        let bytes = L2_L4_HEADERS + HEADER_LEN + dispatch_bytes;
        u8::try_from(bytes.div_ceil(SEGMENT_BYTES)).unwrap_or(u8::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_fig_11_and_aligns_to_64_bytes() {
        assert_eq!(HEADER_LEN, 22);
        assert_eq!((L2_L4_HEADERS + HEADER_LEN) % SEGMENT_BYTES, 0);
        let h = QnpHeader {
            app_id: 1,
            req_type: 2,
            req_id: 0x0304_0506,
            req_acked_id: 0x0708_090a,
            req_len_in_bytes: 0x0b0c_0d0e,
            req_len_in_pkts: 15,
            pkt_seq_num_in_req: 16,
            pkt_flag: FLAG_DATA | FLAG_ACK,
            seg_cnt: 18,
        };
        let b = h.to_bytes();
        assert_eq!(
            b,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3, 18, 0, 0, 0, 0]
        );
        let mut pkt = b.to_vec();
        pkt.extend_from_slice(b"xy");
        let (back, payload) = QnpHeader::parse(&pkt).unwrap();
        assert_eq!(back, h);
        assert_eq!(payload, b"xy");
    }

    #[test]
    fn rejects_short_and_unknown_flags() {
        assert!(QnpHeader::parse(&[0; HEADER_LEN - 1]).is_err());
        let mut b = [0; HEADER_LEN];
        b[16] = 0x80;
        assert!(QnpHeader::parse(&b).is_err());
    }

    #[test]
    fn seg_cnt_counts_segments_holding_dispatch_bytes() {
        assert_eq!(QnpHeader::seg_cnt_for(0), 1);
        assert_eq!(QnpHeader::seg_cnt_for(1), 2);
        assert_eq!(QnpHeader::seg_cnt_for(64), 2);
        assert_eq!(QnpHeader::seg_cnt_for(65), 3);
    }
}
