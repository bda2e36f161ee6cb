//! Proof that an accepted connection is the one a rendezvous region was made for.
//!
//! The region's file name is only a rendezvous hint: it carries the server address and the
//! client *port*, which a connection from another address (another user's, or a remote
//! client's that happened to pick the same port) can share. Attaching on the name alone handed
//! one connection's region to another, so the acceptor must prove the match before it attaches.
//!
//! The proof comes from the kernel, not from the peer's word. The connector stores the *socket
//! cookie* of its TCP socket in the region (`SO_COOKIE`: a 64-bit number the kernel gives each
//! socket once and never reuses until reboot). The acceptor asks the kernel, over
//! `NETLINK_SOCK_DIAG`, which socket holds the other end of the connection it accepted: the
//! socket whose local address is the accepted connection's peer and whose remote address is its
//! own. Only if that socket's cookie is the region's cookie is the region attached; otherwise the
//! connection stays plain TCP and the file stays where it is, for the connection it belongs to.
//!
//! This keeps negotiation free of in-band bytes (a peer without the library never sees one) and
//! binds a region to exactly one connection: two live connections never share a 4-tuple within a
//! network namespace, and a socket never shares a cookie. It needs both ends in one network
//! namespace, which the region name already requires (it carries the namespace's id).

use crate::real;
use libc::c_int;
use std::net::{IpAddr, SocketAddr};

/// `SO_COOKIE` from `<asm-generic/socket.h>` (not in every libc crate release).
const SO_COOKIE: c_int = 57;
/// `<linux/sock_diag.h>`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `INET_DIAG_NOCOOKIE`: look the socket up by its addresses alone.
const NO_COOKIE: u32 = !0;

/// `struct inet_diag_sockid` (`<linux/inet_diag.h>`): ports and addresses in network order.
#[repr(C)]
#[derive(Clone, Copy)]
struct SockId {
    sport: [u8; 2],
    dport: [u8; 2],
    src: [u8; 16],
    dst: [u8; 16],
    interface: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DiagRequest {
    family: u8,
    protocol: u8,
    extensions: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

/// `struct inet_diag_msg`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DiagMessage {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: SockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Request {
    header: libc::nlmsghdr,
    body: DiagRequest,
}

/// The kernel's cookie of socket `fd` (0 when it cannot be had: the connection then stays TCP,
/// since no acceptor can prove a match against 0).
pub fn socket_cookie(fd: c_int) -> u64 {
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` (8) bytes into `cookie`, a live local u64, and the
    // length into `len`, a live local.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
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

fn address_bytes(ip: IpAddr) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => bytes[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => bytes = v6.octets(),
    }
    bytes
}

/// The cookie of the socket at the far end of the connection `(local, peer)` that this process
/// accepted, as the kernel reports it. `None` if the kernel knows no such socket here (a remote
/// peer, a peer in another network namespace, a peer that already closed) or cannot be asked.
pub fn peer_cookie(local: SocketAddr, peer: SocketAddr) -> Option<u64> {
    let (local_ip, peer_ip) = (canonical(local.ip()), canonical(peer.ip()));
    let family = match (local_ip, peer_ip) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let request = Request {
        header: libc::nlmsghdr {
            nlmsg_len: std::mem::size_of::<Request>() as u32,
            nlmsg_type: SOCK_DIAG_BY_FAMILY,
            nlmsg_flags: libc::NLM_F_REQUEST as u16,
            nlmsg_seq: 1,
            nlmsg_pid: 0,
        },
        body: DiagRequest {
            family: family as u8,
            protocol: libc::IPPROTO_TCP as u8,
            extensions: 0,
            pad: 0,
            states: !0,
            // The far socket's own view: its local address is our peer, its remote is us.
            id: SockId {
                sport: peer.port().to_be_bytes(),
                dport: local.port().to_be_bytes(),
                src: address_bytes(peer_ip),
                dst: address_bytes(local_ip),
                interface: 0,
                cookie: [NO_COOKIE, NO_COOKIE],
            },
        },
    };
    // SAFETY: socket takes no pointer; the new fd is ours, closed below on every path.
    let socket = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if socket < 0 {
        return None;
    }
    let answer = ask(socket, &request);
    // SAFETY: `socket` was opened above, is ours and is closed once, here.
    unsafe { real::close(socket) };
    answer
}

/// Sends the request and reads the one answer. The kernel answers a lookup of one socket
/// before `send` returns, so the read never waits (`MSG_DONTWAIT`: a missing answer is a
/// failed proof, not a blocked accept).
fn ask(socket: c_int, request: &Request) -> Option<u64> {
    // SAFETY: sockaddr_nl is integers, for which all-zero bytes are valid (pid 0: the kernel).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: sendto reads `size_of::<Request>()` bytes of `*request`, a live plain-data struct
    // of exactly that size, and a sockaddr_nl of the size given from `kernel`, a live local.
    let sent = unsafe {
        real::sendto(
            socket,
            (request as *const Request).cast(),
            std::mem::size_of::<Request>(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent != std::mem::size_of::<Request>() as isize {
        return None;
    }
    // u64 alignment for the headers read in place below.
    let mut buffer = [0u64; 128];
    // SAFETY: recv writes at most `size_of_val(&buffer)` bytes into `buffer`, a live local.
    let received = unsafe {
        real::recv(
            socket,
            buffer.as_mut_ptr().cast(),
            std::mem::size_of_val(&buffer),
            libc::MSG_DONTWAIT,
        )
    };
    let received = usize::try_from(received).ok()?;
    // SAFETY: `buffer` is a live local of 1024 initialised bytes (128 zeroed u64s) and the
    // slice takes at most 1024 of them; u8 needs no alignment.
    let bytes =
        unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<u8>(), received.min(1024)) };
    parse_answer(bytes)
}

/// Reads the far socket's cookie out of the kernel's answer. Anything but one well-formed
/// `inet_diag_msg` (an error message, a short read) is no proof.
pub fn parse_answer(bytes: &[u8]) -> Option<u64> {
    let header_len = std::mem::size_of::<libc::nlmsghdr>();
    if bytes.len() < header_len + std::mem::size_of::<DiagMessage>() {
        return None;
    }
    // SAFETY: `bytes` holds at least a nlmsghdr (checked above); read_unaligned copies it
    // whatever its alignment, and any bytes are a valid nlmsghdr (plain integers).
    let header: libc::nlmsghdr = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    let message_len = header.nlmsg_len as usize;
    if header.nlmsg_type != SOCK_DIAG_BY_FAMILY
        || message_len < header_len + std::mem::size_of::<DiagMessage>()
        || message_len > bytes.len()
    {
        return None;
    }
    // SAFETY: as above: `bytes[header_len..]` holds at least a DiagMessage (checked above),
    // plain integers, copied with read_unaligned.
    let message: DiagMessage =
        unsafe { std::ptr::read_unaligned(bytes[header_len..].as_ptr().cast()) };
    Some(u64::from(message.id.cookie[0]) | (u64::from(message.id.cookie[1]) << 32))
}

/// Whether the connection `(local, peer)` this process accepted is the one whose connector's
/// socket has `cookie`.
pub fn proven(local: SocketAddr, peer: SocketAddr, cookie: u64) -> bool {
    cookie != 0 && peer_cookie(local, peer) == Some(cookie)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    #[test]
    fn the_kernel_names_the_connectors_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        let cookie = socket_cookie(client.as_raw_fd());
        assert_ne!(cookie, 0, "SO_COOKIE gave nothing");
        assert_eq!(peer_cookie(local, peer), Some(cookie));
        assert!(proven(local, peer, cookie));
        // Another socket's cookie is no proof, and neither is 0.
        let other = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!proven(local, peer, socket_cookie(other.as_raw_fd())));
        assert!(!proven(local, peer, 0));
    }

    #[test]
    fn a_peer_address_no_local_socket_has_is_no_proof() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let local = accepted.local_addr().unwrap();
        let elsewhere = SocketAddr::new("127.0.0.2".parse().unwrap(), peer.port());
        let cookie = socket_cookie(client.as_raw_fd());
        assert!(!proven(local, elsewhere, cookie));
    }

    #[test]
    fn malformed_answers_are_no_proof() {
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
