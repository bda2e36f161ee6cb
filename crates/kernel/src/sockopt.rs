//! Socket options the proxy side uses to talk to tier K: the socket cookie that keys the
//! maps, and SO_ORIGINAL_DST as an unmodified proxy would ask for it.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};

/// SO_ORIGINAL_DST (linux/netfilter_ipv4.h) and IP6T_SO_ORIGINAL_DST share the value 80.
const SO_ORIGINAL_DST: libc::c_int = 80;

/// The kernel's socket cookie: a 64-bit id, unique for the socket's lifetime.
pub fn socket_cookie(sock: &impl AsFd) -> io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: the buffer and its length describe a valid u64.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// `getsockopt(SO_ORIGINAL_DST)` on an accepted socket, IPv4 or IPv6 by the socket's family.
/// Tier K answers it for captured connections; with netfilter REDIRECT, conntrack does.
pub fn original_dst_sockopt(sock: &impl AsFd, ipv6: bool) -> io::Result<SocketAddr> {
    let fd = sock.as_fd().as_raw_fd();
    if ipv6 {
        // SAFETY: sockaddr_in6 is plain data; zero is a valid bit pattern.
        let mut sa: libc::sockaddr_in6 = unsafe { zeroed() };
        let mut len = size_of::<libc::sockaddr_in6>() as libc::socklen_t;
        // SAFETY: buffer and length describe `sa`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IPV6,
                SO_ORIGINAL_DST,
                (&mut sa as *mut libc::sockaddr_in6).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddr::new(
            IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)),
            u16::from_be(sa.sin6_port),
        ))
    } else {
        // SAFETY: sockaddr_in is plain data; zero is a valid bit pattern.
        let mut sa: libc::sockaddr_in = unsafe { zeroed() };
        let mut len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: buffer and length describe `sa`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_IP,
                SO_ORIGINAL_DST,
                (&mut sa as *mut libc::sockaddr_in).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(sa.sin_addr.s_addr.to_ne_bytes())),
            u16::from_be(sa.sin_port),
        ))
    }
}

/// What crossed a TCP socket's stack, from TCP_INFO: payload bytes sent, acknowledged by
/// the peer and received, and bytes queued but not sent yet. Bytes the sockmap moved in the
/// kernel are in none of them (the SYN and FIN count one byte each in `acked`/`received`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpCounters {
    pub sent: u64,
    pub acked: u64,
    pub received: u64,
    pub unsent: u64,
}

/// Reads [`TcpCounters`] of a TCP socket.
pub fn tcp_counters(sock: &impl AsFd) -> io::Result<TcpCounters> {
    // SAFETY: tcp_info is plain data; zero is a valid bit pattern.
    let mut info: libc::tcp_info = unsafe { zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: buffer and length describe `info`; the kernel writes at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpCounters {
        sent: info.tcpi_bytes_sent,
        acked: info.tcpi_bytes_acked,
        received: info.tcpi_bytes_received,
        unsent: u64::from(info.tcpi_notsent_bytes),
    })
}
