//! The destinations an `hbone` listener's tunnels may reach (`hbone.destinations`): an
//! address block (`10.0.0.0/8`), a bare IP (every port) or one `IP:PORT`. Parsed once when
//! the config is checked and loaded; each CONNECT stream's destination is matched against
//! them.

use std::net::{IpAddr, SocketAddr};

/// One entry of `hbone.destinations`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// Every port of every address in the block.
    Block { network: IpAddr, prefix: u8 },
    /// One address and port.
    Exact(SocketAddr),
}

impl Destination {
    /// Parses `10.0.0.0/8`, `fd00::/8`, `10.1.2.3`, `10.1.2.3:8080` or `[::1]:8080`.
    pub fn parse(text: &str) -> Result<Destination, String> {
        let text = text.trim();
        if let Some((ip, prefix)) = text.split_once('/') {
            let network: IpAddr = ip
                .parse()
                .map_err(|_| format!("`{ip}` is not an IP address"))?;
            let max = if network.is_ipv4() { 32 } else { 128 };
            let prefix: u8 = prefix
                .parse()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("`/{prefix}` is not a prefix length from 0 to {max}"))?;
            if mask(network, prefix) != network {
                return Err(format!(
                    "`{text}` has bits set past its prefix; the block is {}/{prefix}",
                    mask(network, prefix)
                ));
            }
            return Ok(Destination::block(network, prefix));
        }
        if let Ok(ip) = text.parse::<IpAddr>() {
            let prefix = if ip.is_ipv4() { 32 } else { 128 };
            return Ok(Destination::block(ip, prefix));
        }
        match text.parse::<SocketAddr>() {
            Ok(addr) if addr.port() != 0 => Ok(Destination::Exact(addr)),
            Ok(_) => Err("port 0 is never a destination".into()),
            Err(_) => Err(format!(
                "`{text}` is neither an address block (10.0.0.0/8), an IP (10.0.0.1) nor an IP:PORT (10.0.0.1:8080)"
            )),
        }
    }

    /// A block, an IPv4-mapped IPv6 one (`::ffff:10.0.0.0/104`) as the IPv4 block it is, since
    /// destinations are matched as IPv4 when they are mapped. (A mapped network's prefix is at
    /// least 96: its `ffff` bits are set.)
    fn block(network: IpAddr, prefix: u8) -> Destination {
        match canonical(network) {
            IpAddr::V4(v4) if network.is_ipv6() => Destination::Block {
                network: IpAddr::V4(v4),
                prefix: prefix.saturating_sub(96),
            },
            _ => Destination::Block { network, prefix },
        }
    }

    /// True if a stream to `addr` may go here.
    pub fn allows(&self, addr: SocketAddr) -> bool {
        let ip = canonical(addr.ip());
        match *self {
            Destination::Exact(exact) => canonical(exact.ip()) == ip && exact.port() == addr.port(),
            Destination::Block { network, prefix } => {
                network.is_ipv4() == ip.is_ipv4() && mask(ip, prefix) == network
            }
        }
    }
}

/// What a listener without `hbone.destinations` allows: loopback addresses only, so a node
/// that sets nothing relays to nothing but itself.
pub const DEFAULT_DESTINATIONS: [Destination; 2] = [
    Destination::Block {
        network: IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 0)),
        prefix: 8,
    },
    Destination::Block {
        network: IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        prefix: 128,
    },
];

/// An IPv4-mapped IPv6 address is matched as the IPv4 address it carries.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let keep = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((bits & keep).into())
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let keep = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((bits & keep).into())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn allows(dest: &str, addr: &str) -> bool {
        Destination::parse(dest)
            .unwrap()
            .allows(addr.parse().unwrap())
    }

    #[test]
    fn blocks_addresses_and_exact_destinations() {
        assert!(allows("10.0.0.0/8", "10.200.1.2:80"));
        assert!(!allows("10.0.0.0/8", "11.0.0.1:80"));
        assert!(allows("0.0.0.0/0", "8.8.8.8:53"));
        assert!(!allows("0.0.0.0/0", "[::1]:53"));
        assert!(allows("10.0.0.7", "10.0.0.7:1"));
        assert!(!allows("10.0.0.7", "10.0.0.8:1"));
        assert!(allows("10.0.0.7:8080", "10.0.0.7:8080"));
        assert!(!allows("10.0.0.7:8080", "10.0.0.7:8081"));
        assert!(allows("fd00::/8", "[fd12::1]:80"));
        assert!(allows("[::1]:9", "[::1]:9"));
        // A mapped IPv4 address is its IPv4 address.
        assert!(allows("127.0.0.0/8", "[::ffff:127.0.0.1]:80"));
        assert!(allows("::ffff:127.0.0.1", "127.0.0.1:80"));
        assert!(allows("::ffff:10.0.0.0/104", "10.9.9.9:80"));
        assert!(!allows("::ffff:10.0.0.0/104", "11.0.0.1:80"));
        assert!(DEFAULT_DESTINATIONS
            .iter()
            .any(|d| d.allows("127.0.0.1:5".parse().unwrap())));
        assert!(!DEFAULT_DESTINATIONS
            .iter()
            .any(|d| d.allows("10.0.0.1:5".parse().unwrap())));
    }

    #[test]
    fn bad_destinations_say_what_is_wrong() {
        for (text, says) in [
            ("10.0.0.0/33", "prefix length from 0 to 32"),
            (
                "10.0.0.1/8",
                "bits set past its prefix; the block is 10.0.0.0/8",
            ),
            ("example.org:80", "neither an address block"),
            ("10.0.0.1:0", "port 0"),
            ("x/8", "not an IP address"),
            ("", "neither"),
        ] {
            let err = Destination::parse(text).unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
