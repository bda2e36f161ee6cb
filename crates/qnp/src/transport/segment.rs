//! Cutting a request into QNP packets (§3.2.1, §4.1).

use crate::header::{QnpHeader, FLAG_ACK, FLAG_DATA, HEADER_LEN};
use crate::transport::QnpConfig;
use crate::QnpError;
use bytes::{BufMut, Bytes, BytesMut};

/// What to send: the QNP identity of the request and its TLV payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutReq {
    pub app_id: u8,
    pub req_type: u8,
    /// The TLV-encoded request.
    pub payload: Bytes,
    /// How many leading payload bytes hold dispatch fields; they must fit in the first packet.
    pub dispatch_len: usize,
}

impl OutReq {
    /// Encodes a generated message.
    pub fn from_message<M: crate::QnpMessage>(msg: &M) -> Result<OutReq, QnpError> {
        let mut buf = Vec::new();
        let dispatch_len = msg.encode(&mut buf)?;
        Ok(OutReq {
            app_id: M::APP_ID,
            req_type: M::REQ_TYPE,
            payload: Bytes::from(buf),
            dispatch_len,
        })
    }
}

/// Segments `req` into packets. `acked` is `Some(id)` for a response, which carries the ACK of
/// request `id` in every packet.
pub fn segment(
    req: &OutReq,
    req_id: u32,
    acked: Option<u32>,
    cfg: &QnpConfig,
) -> Result<Vec<Bytes>, QnpError> {
    let chunk = cfg.max_packet_bytes.saturating_sub(HEADER_LEN);
    if chunk == 0 {
        return Err(QnpError::TooLarge(format!(
            "max_packet_bytes {} leaves no room after the {HEADER_LEN}-byte header; raise it",
            cfg.max_packet_bytes
        )));
    }
    if req.dispatch_len > chunk {
        return Err(QnpError::TooLarge(format!(
            "the dispatch fields take {} bytes but the first packet holds {chunk}; dispatch on shorter fields or raise max_packet_bytes (§3.4: dispatch data is limited to one packet)",
            req.dispatch_len
        )));
    }
    let len = req.payload.len();
    let pkts = len.div_ceil(chunk).max(1);
    let max = usize::from(cfg.max_pkts_per_req);
    if pkts > max {
        return Err(QnpError::TooLarge(format!(
            "a {len}-byte request needs {pkts} packets but at most {max} are allowed; raise max_pkts_per_req (≤ 255) or send less"
        )));
    }
    let len_u32 = u32::try_from(len)
        .map_err(|_| QnpError::TooLarge(format!("a {len}-byte request exceeds 4 GiB")))?;
    let mut out = Vec::with_capacity(pkts);
    for seq in 0..pkts {
        let body = req.payload.slice(seq * chunk..((seq + 1) * chunk).min(len));
        let hdr = QnpHeader {
            app_id: req.app_id,
            req_type: req.req_type,
            req_id,
            req_acked_id: acked.unwrap_or(0),
            req_len_in_bytes: len_u32,
            // Both casts are bounded by max_pkts_per_req, a u8.
            req_len_in_pkts: pkts as u8,
            pkt_seq_num_in_req: seq as u8,
            pkt_flag: FLAG_DATA | if acked.is_some() { FLAG_ACK } else { 0 },
            seg_cnt: if seq == 0 {
                QnpHeader::seg_cnt_for(req.dispatch_len)
            } else {
                0
            },
        };
        let mut pkt = BytesMut::with_capacity(HEADER_LEN + body.len());
        pkt.put_slice(&hdr.to_bytes());
        pkt.put_slice(&body);
        out.push(pkt.freeze());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(len: usize, dispatch_len: usize) -> OutReq {
        OutReq {
            app_id: 3,
            req_type: 4,
            payload: Bytes::from((0..len).map(|i| i as u8).collect::<Vec<_>>()),
            dispatch_len,
        }
    }

    #[test]
    fn segments_into_at_most_max_packet_bytes() {
        let cfg = QnpConfig::default();
        let pkts = segment(&req(5000, 10), 9, None, &cfg).unwrap();
        assert_eq!(pkts.len(), 4);
        let mut joined = Vec::new();
        for (i, p) in pkts.iter().enumerate() {
            assert!(p.len() <= cfg.max_packet_bytes);
            let (h, body) = QnpHeader::parse(p).unwrap();
            assert_eq!(h.req_id, 9);
            assert_eq!(h.req_len_in_pkts, 4);
            assert_eq!(usize::from(h.pkt_seq_num_in_req), i);
            assert_eq!(h.req_len_in_bytes, 5000);
            assert_eq!(h.pkt_flag, FLAG_DATA);
            assert_eq!(h.seg_cnt, if i == 0 { 2 } else { 0 });
            joined.extend_from_slice(body);
        }
        assert_eq!(joined, req(5000, 10).payload);
    }

    #[test]
    fn empty_request_is_one_packet_and_responses_carry_the_ack() {
        let pkts = segment(&req(0, 0), 1, Some(77), &QnpConfig::default()).unwrap();
        assert_eq!(pkts.len(), 1);
        let (h, _) = QnpHeader::parse(&pkts[0]).unwrap();
        assert_eq!(h.pkt_flag, FLAG_DATA | FLAG_ACK);
        assert_eq!(h.req_acked_id, 77);
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let cfg = QnpConfig {
            max_pkts_per_req: 2,
            ..QnpConfig::default()
        };
        assert!(segment(&req(5000, 0), 1, None, &cfg).is_err());
        assert!(segment(&req(2000, 1451), 1, None, &cfg).is_err());
        assert!(segment(&req(2000, 1450), 1, None, &cfg).is_ok());
    }
}
