//! Without tier K, who owns a client's socket: the `uid` column of its line in
//! `/proc/self/net/tcp` or `tcp6` (the node's network namespace), found by its two ends.
//!
//! The kernel writes one line per socket, so reading is linear in the sockets of the
//! namespace: at most [`MAX_BYTES`] are read (about 400,000 sockets), past which the client
//! counts as no workload. Tier K's record is one map lookup instead.

use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The most of each file read per lookup.
pub const MAX_BYTES: u64 = 64 * 1024 * 1024;

/// The uid owning the TCP socket whose local end is `client` and remote end `server`: for a
/// connection the node accepted from `client` on `server`, the client process's socket.
pub fn socket_uid(client: SocketAddr, server: SocketAddr) -> Option<u32> {
    let (client, server) = (canonical(client), canonical(server));
    // An IPv4 client may also hold a dual-stack IPv6 socket, listed in tcp6 as v4-mapped.
    let files: &[&str] = if client.is_ipv4() {
        &["/proc/self/net/tcp", "/proc/self/net/tcp6"]
    } else {
        &["/proc/self/net/tcp6"]
    };
    files.iter().find_map(|path| {
        let file = std::fs::File::open(path).ok()?;
        find_uid(file.take(MAX_BYTES), client, server)
    })
}

/// The uid of the line in `table` (a `/proc/net/tcp{,6}` text) whose local address is
/// `client` and remote address `server`.
pub fn find_uid(table: impl Read, client: SocketAddr, server: SocketAddr) -> Option<u32> {
    BufReader::new(table)
        .lines()
        .skip(1)
        .map_while(Result::ok)
        .find_map(|line| {
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
            let mut fields = line.split_whitespace();
            let local = parse_address(fields.nth(1)?)?;
            let remote = parse_address(fields.next()?)?;
            if local != client || remote != server {
                return None;
            }
            fields.nth(4)?.parse().ok()
        })
}

/// `0100007F:1F90` (127.0.0.1:8080) or the 32-digit IPv6 form: each 32-bit word of the
/// address printed as the number it is in memory, the port as a number. Mapped addresses
/// come back as IPv4.
fn parse_address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(ip.get(8 * i..8 * i + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut octets = [0u8; 16];
            for i in 0..4 {
                octets[4 * i..4 * i + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

/// A v4-mapped IPv6 address (a dual-stack socket's view) as the IPv4 address it is.
pub(crate) fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), addr.port()),
            None => addr,
        },
        IpAddr::V4(_) => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:A0B2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1001        0 2 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:A0B2 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 30 10 -1
";

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:C001 0000000000000000FFFF00000100007F:1F90 01 00000000:00000000 00:00000000 00000000  1002        0 4 1 0000000000000000 20 4 30 10 -1
   1: 00000000000000000000000001000000:C002 00000000000000000000000001000000:1F90 01 00000000:00000000 00:00000000 00000000  1003        0 5 1 0000000000000000 20 4 30 10 -1
";

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn finds_the_client_socket_by_its_two_ends() {
        let server = a("127.0.0.1:8080");
        assert_eq!(
            find_uid(TCP.as_bytes(), a("127.0.0.1:41138"), server),
            Some(1001)
        );
        // The node's own accepted end is the reverse: not the client.
        assert_eq!(
            find_uid(TCP.as_bytes(), server, a("127.0.0.1:41138")),
            Some(0)
        );
        assert_eq!(find_uid(TCP.as_bytes(), a("127.0.0.1:41139"), server), None);
        // A dual-stack client socket to an IPv4 address, and an IPv6 one.
        assert_eq!(
            find_uid(TCP6.as_bytes(), a("127.0.0.1:49153"), server),
            Some(1002)
        );
        assert_eq!(
            find_uid(TCP6.as_bytes(), a("[::1]:49154"), a("[::1]:8080")),
            Some(1003)
        );
    }

    #[test]
    fn garbage_finds_nothing() {
        for text in [
            "",
            "header only\n",
            "h\n 0: zz:1 00:0 01 0 0 0 5\n",
            "h\n 0: 0100007F 0100007F:1F90\n",
        ] {
            assert_eq!(
                find_uid(text.as_bytes(), a("127.0.0.1:1"), a("127.0.0.1:8080")),
                None
            );
        }
    }
}
