//! A connection's original addresses from the connection tracking table (ctnetlink), looked up
//! by the addresses its replies carry.
//!
//! NAT rewrites a packet's addresses on the way; the tracking entry keeps both views: the
//! *original* tuple (the addresses the first packet had when the entry was made) and the
//! *reply* tuple (the addresses replies carry, which after NAT are the connection's addresses as
//! the local socket sees them). A socket's local and remote address are therefore the reply
//! tuple's destination and source, and the original tuple says where the connection came from
//! before it was rewritten: in a split namespace, the other PU's link address, from which the
//! connection can be followed into that PU's own table.

use crate::message::{attributes, find, first_message, Request};
use crate::Netlink;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET` (`<linux/netfilter/nfnetlink_conntrack.h>`).
const GET: u16 = (1 << 8) | 1;
/// The answer to a GET: `IPCTNL_MSG_CT_NEW`.
const NEW: u16 = 1 << 8;
/// `struct nfgenmsg`: family, version, resource id.
const NFGENMSG_LEN: usize = 4;
/// `enum ctattr_type`.
const TUPLE_ORIG: u16 = 1;
const TUPLE_REPLY: u16 = 2;
/// `enum ctattr_tuple`.
const TUPLE_IP: u16 = 1;
const TUPLE_PROTO: u16 = 2;
/// `enum ctattr_ip`.
const IP_V4_SRC: u16 = 1;
const IP_V4_DST: u16 = 2;
const IP_V6_SRC: u16 = 3;
const IP_V6_DST: u16 = 4;
/// `enum ctattr_l4proto`.
const PROTO_NUM: u16 = 1;
const PROTO_SRC_PORT: u16 = 2;
const PROTO_DST_PORT: u16 = 3;

/// One direction of a tracked TCP connection: where its packets come from and go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuple {
    pub source: SocketAddr,
    pub destination: SocketAddr,
}

fn request(reply: Tuple) -> Option<Vec<u8>> {
    let (source, destination) = (reply.source, reply.destination);
    let family = match (source.ip(), destination.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let mut request = Request::new(GET, libc::NLM_F_REQUEST as u16);
    request.put(&[family as u8, 0, 0, 0]);
    request.nest(TUPLE_REPLY, |tuple| {
        tuple.nest(TUPLE_IP, |ip| match (source.ip(), destination.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                ip.attribute(IP_V4_SRC, &s.octets());
                ip.attribute(IP_V4_DST, &d.octets());
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                ip.attribute(IP_V6_SRC, &s.octets());
                ip.attribute(IP_V6_DST, &d.octets());
            }
            _ => {}
        });
        tuple.nest(TUPLE_PROTO, |proto| {
            proto.attribute(PROTO_NUM, &[libc::IPPROTO_TCP as u8]);
            proto.attribute(PROTO_SRC_PORT, &source.port().to_be_bytes());
            proto.attribute(PROTO_DST_PORT, &destination.port().to_be_bytes());
        });
    });
    Some(request.finish())
}

impl Netlink {
    /// Opens a ctnetlink socket in the calling thread's network namespace (reading the table
    /// needs `CAP_NET_ADMIN` there).
    pub fn conntrack() -> std::io::Result<Netlink> {
        Netlink::open(libc::NETLINK_NETFILTER)
    }

    /// The original tuple of the tracked TCP connection whose replies carry `reply`; `None` if
    /// the table has no such entry (or cannot be read).
    pub fn original_of_reply(&self, reply: Tuple) -> Option<Tuple> {
        let request = request(reply)?;
        let mut answer = [0u64; 512];
        parse_answer(self.ask(&request, &mut answer)?)
    }
}

fn address(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(bytes).ok()?,
        ))),
        _ => None,
    }
}

fn port(bytes: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(bytes.try_into().ok()?))
}

/// Reads one tuple attribute's payload: addresses of one family, TCP ports.
fn tuple(bytes: &[u8]) -> Option<Tuple> {
    let ip = find(bytes, TUPLE_IP)?;
    let (source, destination) = match (find(ip, IP_V4_SRC), find(ip, IP_V4_DST)) {
        (Some(s), Some(d)) if s.len() == 4 && d.len() == 4 => (address(s)?, address(d)?),
        _ => {
            let (s, d) = (find(ip, IP_V6_SRC)?, find(ip, IP_V6_DST)?);
            if s.len() != 16 || d.len() != 16 {
                return None;
            }
            (address(s)?, address(d)?)
        }
    };
    let proto = find(bytes, TUPLE_PROTO)?;
    if find(proto, PROTO_NUM)? != [libc::IPPROTO_TCP as u8] {
        return None;
    }
    Some(Tuple {
        source: SocketAddr::new(source, port(find(proto, PROTO_SRC_PORT)?)?),
        destination: SocketAddr::new(destination, port(find(proto, PROTO_DST_PORT)?)?),
    })
}

/// The original tuple out of the kernel's answer. Anything but a well-formed conntrack entry
/// with a TCP original tuple (an error message, a short read, a malformed attribute) is no
/// answer.
pub fn parse_answer(bytes: &[u8]) -> Option<Tuple> {
    let (kind, body) = first_message(bytes)?;
    if kind != NEW {
        return None;
    }
    let entry = body.get(NFGENMSG_LEN..)?;
    attributes(entry)
        .find(|(kind, _)| *kind == TUPLE_ORIG)
        .and_then(|(_, payload)| tuple(payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(original: Tuple) -> Vec<u8> {
        // An answer as the kernel writes it: the GET request's layout, with the original tuple.
        let mut bytes = request(original).unwrap();
        bytes[4..6].copy_from_slice(&NEW.to_ne_bytes());
        let at = crate::message::HEADER_LEN + NFGENMSG_LEN + 2;
        bytes[at..at + 2].copy_from_slice(&(TUPLE_ORIG | crate::message::NESTED).to_ne_bytes());
        bytes
    }

    #[test]
    fn an_entry_reads_back_as_its_original_tuple() {
        for (s, d) in [
            ("169.254.213.1:41000", "169.254.213.2:8080"),
            ("[fd00::1]:41000", "[fd00::2]:8080"),
        ] {
            let original = Tuple {
                source: s.parse().unwrap(),
                destination: d.parse().unwrap(),
            };
            assert_eq!(parse_answer(&entry(original)), Some(original));
        }
    }

    #[test]
    fn malformed_answers_are_no_answer() {
        let original = Tuple {
            source: "10.0.0.1:1".parse().unwrap(),
            destination: "10.0.0.2:2".parse().unwrap(),
        };
        let whole = entry(original);
        // Every truncation: the message length then runs past the bytes, or attributes end.
        for cut in 0..whole.len() {
            assert_eq!(parse_answer(&whole[..cut]), None, "cut at {cut}");
        }
        // Not an entry: the request's own type.
        assert_eq!(parse_answer(&request(original).unwrap()), None);
    }

    #[test]
    fn a_table_without_the_connection_has_no_answer() {
        // The calling thread's namespace: no tracked connection has these addresses (or
        // conntrack is not loaded here): either way, no answer.
        let table = Netlink::conntrack().unwrap();
        let reply = Tuple {
            source: "127.0.0.1:9".parse().unwrap(),
            destination: "127.0.0.9:9".parse().unwrap(),
        };
        assert_eq!(table.original_of_reply(reply), None);
    }
}
