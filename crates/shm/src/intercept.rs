//! The split namespace's interception rules as the library reads them (`<group>/intercept`,
//! written by the PU agents: `flatmesh_pu::shm_proof::intercept_text`), so that a connector knows
//! that its call to a service address will be redirected to a proxy port on another PU, and can
//! offer a shared region to the proxy (docs/shm.md "Between PUs").
//!
//! The file sits in a world-writable directory: it is read as hostile input. Lines that do not
//! parse are skipped, and every list has a bound.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// Most rules, ports per rule and excluded prefixes per rule read.
const MAX_RULES: usize = 64;
const MAX_ITEMS: usize = 256;
/// Longest file read.
pub const MAX_BYTES: usize = 64 * 1024;
const HEADER: &str = "flatmesh-pu intercept v1";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub proxy_port: u16,
    /// Destination ports; empty: every port.
    pub ports: Vec<u16>,
    /// Excluded destination prefixes: (address, prefix length).
    pub exclude: Vec<(Ipv4Addr, u8)>,
}

fn prefix(text: &str) -> Option<(Ipv4Addr, u8)> {
    let (addr, len) = text.split_once('/').unwrap_or((text, "32"));
    let len: u8 = len.parse().ok()?;
    (len <= 32).then_some((addr.parse().ok()?, len))
}

fn in_prefix(ip: Ipv4Addr, (net, len): (Ipv4Addr, u8)) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
    u32::from(ip) & mask == u32::from(net) & mask
}

fn rule(line: &str) -> Option<Rule> {
    let mut fields = line.split_ascii_whitespace();
    let (proxy_port, ports, exclude) = (fields.next()?, fields.next()?, fields.next()?);
    if fields.next().is_some() {
        return None;
    }
    let proxy_port: u16 = proxy_port.parse().ok().filter(|p| *p != 0)?;
    let ports = match ports {
        "*" => Vec::new(),
        list => {
            let ports: Option<Vec<u16>> = list.split(',').map(|p| p.parse().ok()).collect();
            ports.filter(|p| p.len() <= MAX_ITEMS)?
        }
    };
    let exclude = match exclude {
        "-" => Vec::new(),
        list => {
            let prefixes: Option<Vec<_>> = list.split(',').map(prefix).collect();
            prefixes.filter(|p| p.len() <= MAX_ITEMS)?
        }
    };
    Some(Rule {
        proxy_port,
        ports,
        exclude,
    })
}

/// The rules of a file's text; nothing unless it starts with the header.
pub fn parse(text: &str) -> Vec<Rule> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Vec::new();
    }
    lines.filter_map(rule).take(MAX_RULES).collect()
}

/// The proxy port a TCP connection to `server` is redirected to, as the split namespace's rules
/// decide it (crates/pu/src/rules.rs `intercept_match`): IPv4, not loopback, not the PUs' links,
/// not excluded, a listed port. The first matching rule.
pub fn proxy_port(rules: &[Rule], server: SocketAddr) -> Option<u16> {
    let IpAddr::V4(ip) = crate::proof::canonical(server.ip()) else {
        return None;
    };
    if ip.is_loopback() || ip.is_link_local() {
        return None;
    }
    rules
        .iter()
        .find(|rule| {
            (rule.ports.is_empty() || rule.ports.contains(&server.port()))
                && !rule.exclude.iter().any(|p| in_prefix(ip, *p))
        })
        .map(|rule| rule.proxy_port)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rules_read_back_and_match_as_the_nftables_rules_do() {
        let rules = parse(
            "flatmesh-pu intercept v1\n15006 80,8080 10.0.0.0/8,192.168.1.1\n15001 * -\n",
        );
        assert_eq!(rules.len(), 2);
        let at = |s: &str| proxy_port(&rules, s.parse().unwrap());
        assert_eq!(at("10.96.0.10:80"), Some(15001), "excluded from the first rule");
        assert_eq!(at("172.16.0.1:80"), Some(15006));
        assert_eq!(at("172.16.0.1:8080"), Some(15006));
        assert_eq!(at("192.168.1.1:80"), Some(15001));
        assert_eq!(at("172.16.0.1:443"), Some(15001));
        assert_eq!(at("127.0.0.1:80"), None, "loopback is never intercepted");
        assert_eq!(at("169.254.213.2:80"), None, "nor the links");
        assert_eq!(at("[::ffff:172.16.0.1]:80"), Some(15006));
        assert_eq!(at("[fd00::1]:80"), None, "IPv6 is not intercepted");
    }

    #[test]
    fn hostile_files_give_no_rules_or_skip_bad_lines() {
        assert!(parse("").is_empty());
        assert!(parse("15006 80 -\n").is_empty(), "no header");
        let rules = parse(
            "flatmesh-pu intercept v1\n0 80 -\n70000 80 -\n15006 80,x -\n15006 80 10.0.0.0/40\n15006 80 - extra\n15007 443 -\n",
        );
        assert_eq!(
            rules,
            vec![Rule {
                proxy_port: 15007,
                ports: vec![443],
                exclude: vec![]
            }]
        );
        let many = format!(
            "flatmesh-pu intercept v1\n{}",
            "1 * -\n".repeat(MAX_RULES + 10)
        );
        assert_eq!(parse(&many).len(), MAX_RULES);
    }
}
