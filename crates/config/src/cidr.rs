//! An IP prefix in CIDR notation (`10.0.0.0/8`, `fd00::/8`, or a bare address for one host),
//! for allow-lists such as an `original_dst` cluster's `allow:`.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An address prefix: `addr` with the bits past `len` cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Cidr {
    /// Every IPv4 address (`0.0.0.0/0`).
    pub const ANY_V4: Cidr = Cidr {
        addr: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        len: 0,
    };
    /// Every IPv6 address (`::/0`).
    pub const ANY_V6: Cidr = Cidr {
        addr: IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        len: 0,
    };

    /// `addr/len`; `None` when `len` is longer than the address.
    pub fn new(addr: IpAddr, len: u8) -> Option<Cidr> {
        let bits = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        (len <= bits).then(|| Cidr {
            addr: mask(addr, len),
            len,
        })
    }

    /// Whether every address of the prefix is a loopback one (inside `127.0.0.0/8`, or `::1`).
    pub fn is_loopback(&self) -> bool {
        match self.addr {
            IpAddr::V4(v4) => self.len >= 8 && v4.is_loopback(),
            IpAddr::V6(v6) => self.len == 128 && v6.is_loopback(),
        }
    }

    /// Whether `ip` is inside the prefix. An IPv4-mapped IPv6 address (`::ffff:10.0.0.1`,
    /// what a dual-stack socket reports) is compared as the IPv4 address it is.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                mask(ip, self.len) == self.addr
            }
            _ => false,
        }
    }
}

/// `addr` with every bit past the first `len` cleared.
fn mask(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => {
            let m = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            IpAddr::V4((u32::from(v4) & m).into())
        }
        IpAddr::V6(v6) => {
            let m = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & m).into())
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Cidr, String> {
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (s, None),
        };
        let addr: IpAddr = ip.trim().parse().map_err(|_| {
            format!("`{s}` is not an address prefix: write one such as 10.0.0.0/8 or fd00::/8")
        })?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => bits,
            Some(len) => len
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= bits)
                .ok_or_else(|| {
                    format!("`{s}`: the prefix length must be a number from 0 to {bits}")
                })?,
        };
        Cidr::new(addr, len).ok_or_else(|| format!("`{s}`: prefix too long"))
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;
    fn try_from(s: String) -> Result<Cidr, String> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_prefix_holds_exactly_its_addresses() {
        let c: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(c.contains(ip("10.1.255.3")));
        assert!(!c.contains(ip("10.2.0.1")));
        assert!(!c.contains(ip("fd00::1")));
        // A dual-stack socket's view of an IPv4 address is that address.
        assert!(c.contains(ip("::ffff:10.1.0.9")));
        let host: Cidr = "127.0.0.1".parse().unwrap();
        assert_eq!(host.to_string(), "127.0.0.1/32");
        assert!(host.contains(ip("127.0.0.1")) && !host.contains(ip("127.0.0.2")));
        assert!(host.is_loopback() && "127.0.0.0/8".parse::<Cidr>().unwrap().is_loopback());
        assert!(!"0.0.0.0/1".parse::<Cidr>().unwrap().is_loopback() && !c.is_loopback());
        assert!(Cidr::ANY_V4.contains(ip("192.0.2.1")) && !Cidr::ANY_V4.contains(ip("::1")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fdab::1")) && !v6.contains(ip("fe80::1")));
    }

    #[test]
    fn host_bits_are_cleared_and_bad_prefixes_named() {
        assert_eq!(
            "10.9.8.7/8".parse::<Cidr>().unwrap().to_string(),
            "10.0.0.0/8"
        );
        let e = "10.0.0.0/33".parse::<Cidr>().unwrap_err();
        assert!(e.contains("0 to 32"), "{e}");
        let e = "ten/8".parse::<Cidr>().unwrap_err();
        assert!(e.contains("not an address prefix"), "{e}");
    }
}
