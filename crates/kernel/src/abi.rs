//! `#[repr(C)]` twins of the structs in `bpf/common.h` and `bpf/dispatch.bpf.c`.
//! Field order and sizes must match the C side byte for byte; the layout tests below pin them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub(crate) const AF_INET: u8 = 2;
pub(crate) const AF_INET6: u8 = 10;

/// Indexes into `fm_stats`, one per program (enum fm_stat_id), then counters that are not
/// programs of their own.
pub(crate) const STAT_NAMES: [&str; 10] = [
    "fm_connect4",
    "fm_connect6",
    "fm_getsockopt",
    "fm_sockops_capture",
    "fm_sockops_redirect",
    "fm_sk_msg",
    "fm_parser",
    "fm_verdict",
    "fm_sockops_l7",
    "fm_sk_msg_direct",
];

/// Counters in `fm_stats` that belong to no pinned program: (name, the program that does
/// the work). `flatmesh kernel status` shows them under that program.
pub(crate) const DERIVED_STATS: [(&str, &str); 1] = [("fm_sk_msg_direct", "fm_sk_msg")];

/// First `fm_stats` slot of the verdict's per-reason counters (FM_ST_WHY in common.h): slot
/// `WHY_BASE + reason` counts, in `fallbacks`, what the verdict left to user space for that
/// reason (FM_WHY_* in dispatch.bpf.c).
pub(crate) const WHY_BASE: u32 = STAT_NAMES.len() as u32;

/// The FM_WHY_* reasons by number, as `flatmesh kernel status` names them. Up to
/// `unregistered` they count connections whose first request the kernel left to the user
/// tier (the sum is fm_verdict's `fallbacks`); `unregistered` and `peer_gone` count chunks
/// (and their bytes) passed up for a socket that was no longer the verdict's to decide.
pub(crate) const WHY_NAMES: [&str; 16] = [
    "other",
    "no_match",
    "huffman",
    "truncated",
    "malformed",
    "punt_rule",
    "dynamic_table",
    "too_long",
    "busy",
    "protocol",
    "unregistered",
    "peer_gone",
    "held",
    "pending_limit",
    "not_plain",
    "",
];

/// Slot of WHY_NAMES that is not a fallback: frames cut across chunks whose bytes the verdict
/// held in `fm_l7_hold` (`runs` = frames held, `bytes` = bytes copied).
pub(crate) const WHY_HELD: usize = 12;

/// struct fm_addr: IPv4 in ip[0] (network order), ports in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FmAddr {
    pub ip: [u32; 4],
    pub port: u16,
    pub family: u8,
    pub pad: u8,
}

// SAFETY: plain integers, no padding holes beyond the explicit `pad` byte.
unsafe impl aya::Pod for FmAddr {}

impl FmAddr {
    pub(crate) fn from_socket_addr(addr: SocketAddr) -> Self {
        match addr.ip() {
            IpAddr::V4(v4) => FmAddr {
                ip: [u32::from_ne_bytes(v4.octets()), 0, 0, 0],
                port: addr.port(),
                family: AF_INET,
                pad: 0,
            },
            IpAddr::V6(v6) => {
                let o = v6.octets();
                let mut ip = [0u32; 4];
                for (i, w) in ip.iter_mut().enumerate() {
                    *w = u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]);
                }
                FmAddr {
                    ip,
                    port: addr.port(),
                    family: AF_INET6,
                    pad: 0,
                }
            }
        }
    }

    /// As `from_socket_addr`, with a v4-mapped IPv6 address as the IPv4 address it is (what
    /// the programs do: `fm_addr_ip6` in bpf/common.h).
    pub(crate) fn from_socket_addr_normalized(addr: SocketAddr) -> Self {
        match addr.ip() {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => FmAddr::from_socket_addr(SocketAddr::new(IpAddr::V4(v4), addr.port())),
                None => FmAddr::from_socket_addr(addr),
            },
            IpAddr::V4(_) => FmAddr::from_socket_addr(addr),
        }
    }

    pub(crate) fn is_loopback(&self) -> bool {
        self.to_socket_addr().is_some_and(|a| a.ip().is_loopback())
    }

    pub(crate) fn to_socket_addr(self) -> Option<SocketAddr> {
        match self.family {
            AF_INET => Some(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(self.ip[0].to_ne_bytes())),
                self.port,
            )),
            AF_INET6 => {
                let mut o = [0u8; 16];
                for (i, w) in self.ip.iter().enumerate() {
                    o[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
                }
                Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(o)), self.port))
            }
            _ => None,
        }
    }
}

/// struct fm_tuple (common.h): a captured connection as the node sees it, (its peer, itself).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FmTuple {
    pub client: FmAddr,
    pub server: FmAddr,
}

// SAFETY: two FmAddr, no padding.
unsafe impl aya::Pod for FmTuple {}

/// struct fm_source (capture.bpf.c): who made a captured connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FmSource {
    pub cgroup_id: u64,
    pub uid: u32,
    pub pad: u32,
}

// SAFETY: plain integers, no padding holes beyond the explicit `pad`.
unsafe impl aya::Pod for FmSource {}

/// struct fm_sock_key (redirect.bpf.c): a socket's own (local, remote) ends, with the netns
/// cookie when the local end is loopback.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FmSockKey {
    pub local: FmAddr,
    pub remote: FmAddr,
    pub netns: u64,
}

// SAFETY: two FmAddr (20 bytes each, no holes) then a u64 at offset 40: no padding.
unsafe impl aya::Pod for FmSockKey {}

/// struct fm_shortcut (redirect.bpf.c)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FmShortcut {
    pub target: FmSockKey,
    pub armed_at: u64,
}

// SAFETY: a key struct without holes and a u64.
unsafe impl aya::Pod for FmShortcut {}

/// struct fm_direct (redirect.bpf.c)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FmDirect {
    pub bytes: u64,
    pub msgs: u64,
}

// SAFETY: two u64.
unsafe impl aya::Pod for FmDirect {}

/// struct fm_conn_limit (conn_limit.bpf.c)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FmConnLimit {
    pub tat: u64,
    pub interval: u64,
    pub tolerance: u64,
}

// SAFETY: three u64.
unsafe impl aya::Pod for FmConnLimit {}

/// Values of `fm_redirect_ports`.
pub(crate) const PORT_BOTH: u8 = 1;
pub(crate) const PORT_CLIENT: u8 = 2;

/// struct fm_settings (common.h)
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FmSettings {
    pub netns: u64,
}

// SAFETY: one u64.
unsafe impl aya::Pod for FmSettings {}

/// struct fm_stat
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FmStat {
    pub runs: u64,
    pub bytes: u64,
    pub hits: u64,
    pub fallbacks: u64,
}

// SAFETY: four u64, no padding.
unsafe impl aya::Pod for FmStat {}

/// Sizes of `struct fm_route` and `fm_routes`: the tier-K lowering in flatmesh-rules makes
/// entries that fit them (the layout test below pins them to the C side).
pub(crate) const PATH_MAX: usize = flatmesh_rules::lower::kernel::PATH_MAX;
pub(crate) const METHOD_MAX: usize = flatmesh_rules::lower::kernel::METHOD_MAX;
pub(crate) const ROUTES_MAX: usize = flatmesh_rules::lower::kernel::ENTRIES_MAX;

pub(crate) const MATCH_END: u32 = 0;
pub(crate) const MATCH_EXACT: u32 = 1;
pub(crate) const MATCH_PREFIX: u32 = 2;
pub(crate) const ACT_BACKEND: u32 = 1;
pub(crate) const ACT_PUNT: u32 = 2;

/// struct fm_route
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FmRoute {
    pub method: [u8; METHOD_MAX],
    pub path: [u8; PATH_MAX],
    pub path_len: u32,
    pub kind: u32,
    pub action: u32,
    pub backend: u32,
    pub route_id: u32,
    /// 1 << connection protocol (1 HTTP/1.x, 2 HTTP/2) the backend action applies to.
    pub protos: u32,
}

impl Default for FmRoute {
    fn default() -> Self {
        FmRoute {
            method: [0; METHOD_MAX],
            path: [0; PATH_MAX],
            path_len: 0,
            kind: MATCH_END,
            action: 0,
            backend: 0,
            route_id: 0,
            protos: 0,
        }
    }
}

// SAFETY: byte arrays and u32s, sizes chosen so there is no implicit padding.
unsafe impl aya::Pod for FmRoute {}

pub(crate) const L7_PENDING: u32 = 0;
pub(crate) const L7_DECIDED: u32 = 1;
pub(crate) const L7_FALLBACK: u32 = 2;

/// struct fm_l7_conn
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FmL7Conn {
    pub peer: u64,
    pub stream_pos: u64,
    pub next_frame: u64,
    pub spliced: u64,
    pub state: u32,
    pub proto: u32,
    pub backend: u32,
    pub route_id: u32,
    pub reason: u32,
    pub chunks: u32,
}

// SAFETY: integers only, no padding (4 u64 then 6 u32).
unsafe impl aya::Pod for FmL7Conn {}

pub(crate) const HOLD: usize = 1024;

/// struct fm_l7_hold (dispatch.bpf.c): part of a frame cut across chunks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FmL7Hold {
    pub buf: [u8; HOLD],
    pub at: u64,
    pub len: u32,
    pub pad: u32,
}

// SAFETY: a byte array (a multiple of 8 long), a u64 and two u32: no padding.
unsafe impl aya::Pod for FmL7Hold {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_side() {
        assert_eq!(std::mem::size_of::<FmAddr>(), 20);
        assert_eq!(std::mem::size_of::<FmStat>(), 32);
        assert_eq!(std::mem::size_of::<FmRoute>(), 8 + 64 + 6 * 4);
        assert_eq!(std::mem::size_of::<FmL7Conn>(), 4 * 8 + 6 * 4);
        assert_eq!(std::mem::size_of::<FmL7Hold>(), HOLD + 16);
        assert_eq!(WHY_NAMES[WHY_HELD], "held");
        assert_eq!(std::mem::size_of::<FmSockKey>(), 48);
        assert_eq!(std::mem::size_of::<FmTuple>(), 40);
        assert_eq!(std::mem::size_of::<FmSource>(), 16);
        assert_eq!(std::mem::size_of::<FmShortcut>(), 56);
        assert_eq!(std::mem::size_of::<FmDirect>(), 16);
    }

    #[test]
    fn addresses_round_trip() {
        for a in [
            "127.0.0.1:80",
            "10.1.2.3:65535",
            "[::1]:8080",
            "[2001:db8::7]:1",
        ] {
            let sa: SocketAddr = a.parse().unwrap_or_else(|e| panic!("{a}: {e}"));
            assert_eq!(FmAddr::from_socket_addr(sa).to_socket_addr(), Some(sa));
        }
        let v4 = FmAddr::from_socket_addr("127.0.0.1:80".parse().unwrap_or_else(|e| panic!("{e}")));
        // Network byte order in memory, as the kernel's user_ip4.
        assert_eq!(v4.ip[0].to_ne_bytes(), [127, 0, 0, 1]);
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:80"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(FmAddr::from_socket_addr_normalized(mapped), v4);
        assert!(v4.is_loopback());
    }
}
