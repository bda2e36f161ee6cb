//! Socket cookies: a socket's own (`SO_COOKIE`), and the cookie of the socket with given
//! addresses, as the kernel's socket table reports it (`NETLINK_SOCK_DIAG`).
//!
//! A cookie is a 64-bit number the kernel gives each socket once and never reuses until reboot,
//! so it names one socket for good; within one network namespace, two live TCP sockets never
//! share a local and remote address.

use crate::message::{first_message, Request};
use crate::Netlink;
use std::net::{IpAddr, SocketAddr};

/// `SO_COOKIE` from `<asm-generic/socket.h>` (not in every libc crate release).
const SO_COOKIE: libc::c_int = 57;
/// `<linux/sock_diag.h>`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `INET_DIAG_NOCOOKIE`: look the socket up by its addresses alone.
const NO_COOKIE: u32 = !0;
/// `struct inet_diag_sockid`: ports (2 + 2), addresses (16 + 16), interface (4), cookie (8).
const SOCK_ID_LEN: usize = 48;
/// `struct inet_diag_msg`: family, state, timer, retrans (4), the socket id, then five u32s.
const DIAG_MESSAGE_LEN: usize = 4 + SOCK_ID_LEN + 20;

/// The kernel's cookie of socket `fd`; 0 when it cannot be had (no proof can match 0).
pub fn socket_cookie(fd: libc::c_int) -> u64 {
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` (8) bytes into `cookie`, a live local u64, and the
    // length into `len`, a live local.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_getsockopt,
            fd,
            libc::SOL_SOCKET,
            SO_COOKIE,
            &mut cookie as *mut u64,
            &mut len as *mut libc::socklen_t,
        )
    };
    if rc == 0 && len as usize == std::mem::size_of::<u64>() {
        cookie
    } else {
        0
    }
}

/// IPv4-mapped IPv6 addresses name the same endpoint as the IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// An address as `inet_diag_sockid` holds it: IPv4 in the first four bytes.
fn address_bytes(ip: IpAddr) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => bytes[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => bytes = v6.octets(),
    }
    bytes
}

/// The request for the TCP socket whose local address is `local` and remote `remote`.
fn request(local: SocketAddr, remote: SocketAddr) -> Option<Vec<u8>> {
    let (local_ip, remote_ip) = (canonical(local.ip()), canonical(remote.ip()));
    let family = match (local_ip, remote_ip) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let mut request = Request::new(SOCK_DIAG_BY_FAMILY, libc::NLM_F_REQUEST as u16);
    // struct inet_diag_req_v2: family, protocol, extensions, pad, states, the socket id.
    request.put(&[family as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    request.put(&u32::MAX.to_ne_bytes());
    request.put(&local.port().to_be_bytes());
    request.put(&remote.port().to_be_bytes());
    request.put(&address_bytes(local_ip));
    request.put(&address_bytes(remote_ip));
    request.put(&0u32.to_ne_bytes()); // any interface
    request.put(&NO_COOKIE.to_ne_bytes());
    request.put(&NO_COOKIE.to_ne_bytes());
    Some(request.finish())
}

impl Netlink {
    /// Opens a `NETLINK_SOCK_DIAG` socket in the calling thread's network namespace.
    pub fn sock_diag() -> std::io::Result<Netlink> {
        Netlink::open(libc::NETLINK_SOCK_DIAG)
    }

    /// The cookie of the TCP socket in this netlink socket's namespace whose local address is
    /// `local` and remote address `remote`; `None` if there is none (or the kernel cannot be
    /// asked).
    pub fn cookie_of(&self, local: SocketAddr, remote: SocketAddr) -> Option<u64> {
        let request = request(local, remote)?;
        let mut answer = [0u64; 512];
        parse_answer(self.ask(&request, &mut answer)?)
    }
}

/// Reads the socket's cookie out of the kernel's answer. Anything but one well-formed
/// `inet_diag_msg` (an error message, a short read) is no answer.
pub fn parse_answer(bytes: &[u8]) -> Option<u64> {
    let (kind, body) = first_message(bytes)?;
    if kind != SOCK_DIAG_BY_FAMILY || body.len() < DIAG_MESSAGE_LEN {
        return None;
    }
    // The cookie: the last eight bytes of the socket id, two native-endian u32s, low first.
    let at = 4 + SOCK_ID_LEN - 8;
    let low = u32::from_ne_bytes(body[at..at + 4].try_into().ok()?);
    let high = u32::from_ne_bytes(body[at + 4..at + 8].try_into().ok()?);
    Some(u64::from(low) | (u64::from(high) << 32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    #[test]
    fn the_kernel_names_the_far_end_of_a_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        let cookie = socket_cookie(client.as_raw_fd());
        assert_ne!(cookie, 0, "SO_COOKIE gave nothing");
        let diag = Netlink::sock_diag().unwrap();
        // The client's socket: its local address is the accepted one's peer.
        assert_eq!(diag.cookie_of(peer, local), Some(cookie));
        assert_eq!(
            diag.cookie_of(local, peer),
            Some(socket_cookie(accepted.as_raw_fd()))
        );
        // No socket has these addresses.
        let elsewhere = SocketAddr::new("127.0.0.2".parse().unwrap(), peer.port());
        assert_eq!(diag.cookie_of(elsewhere, local), None);
    }

    #[test]
    fn malformed_answers_are_no_answer() {
        assert_eq!(parse_answer(&[]), None);
        assert_eq!(parse_answer(&[0u8; 200]), None);
        // An NLMSG_ERROR answer (what the kernel sends when no socket matches).
        let mut error = [0u8; 200];
        error[..4].copy_from_slice(&36u32.to_ne_bytes());
        error[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        assert_eq!(parse_answer(&error), None);
        // A length field past the bytes received.
        let mut long = [0u8; 200];
        long[..4].copy_from_slice(&5000u32.to_ne_bytes());
        long[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert_eq!(parse_answer(&long), None);
    }
}
