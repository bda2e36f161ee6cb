//! Two kernel lookups over netlink, used to prove that two sockets are the two ends of one TCP
//! connection (hetero-socket, docs/shm.md "The proof"):
//!
//! - [`sock_diag`]: the cookie of the socket with a given local and remote address
//!   (`NETLINK_SOCK_DIAG`), and a socket's own cookie (`SO_COOKIE`);
//! - [`conntrack`]: a connection's original addresses, found by the addresses its reply
//!   carries after NAT (`NETLINK_NETFILTER`, ctnetlink), which is how a connection is followed
//!   across the network namespaces of a split namespace.
//!
//! A netlink socket answers for the network namespace it was opened in. Every system call is made
//! with `libc::syscall`: the preload library that uses this crate replaces libc's socket
//! functions, and a lookup must not run through them. Every answer is read as hostile input: a
//! malformed one is no answer (`None`), never a panic.

pub mod conntrack;
mod message;
pub mod sock_diag;

use std::os::fd::RawFd;

/// An open netlink socket of one protocol, in the network namespace it was opened in.
pub struct Netlink {
    /// Ours alone; closed (with the raw system call, not libc's close) on drop.
    fd: RawFd,
}

impl Drop for Netlink {
    fn drop(&mut self) {
        // SAFETY: `fd` is the socket `open` made, owned by this value alone, closed once here.
        unsafe { libc::syscall(libc::SYS_close, self.fd) };
    }
}

impl Netlink {
    /// Opens a netlink socket of `protocol` (e.g. `NETLINK_SOCK_DIAG`) in the calling thread's
    /// network namespace.
    pub fn open(protocol: libc::c_int) -> std::io::Result<Netlink> {
        // SAFETY: the socket system call takes no pointer.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_socket,
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Netlink { fd: fd as RawFd })
    }

    /// Sends one request and reads the one answer into `answer`, returning its length. The kernel
    /// answers a lookup of one object with one datagram before `sendto` returns, so the read
    /// never waits (`MSG_DONTWAIT`: a missing answer is `None`, not a blocked caller) and nothing
    /// is ever left queued for the next request (an answer longer than `answer` is cut, and its
    /// rest discarded with it).
    fn ask<'a>(&self, request: &[u8], answer: &'a mut [u64; 512]) -> Option<&'a [u8]> {
        // SAFETY: sockaddr_nl is integers, for which all-zero bytes are valid (pid 0: the kernel).
        let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: sendto reads `request.len()` bytes of `request`, a live slice, and a
        // sockaddr_nl of the size given from `kernel`, a live local.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_sendto,
                self.fd,
                request.as_ptr(),
                request.len(),
                0,
                &kernel as *const libc::sockaddr_nl,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent != request.len() as libc::c_long {
            return None;
        }
        let received = self.receive(answer)?;
        // SAFETY: `answer` is a live array of 4096 initialised bytes (512 u64s); the slice takes
        // at most that many and u8 needs no alignment.
        Some(unsafe {
            std::slice::from_raw_parts(answer.as_ptr().cast::<u8>(), received.min(4096))
        })
    }

    fn receive(&self, answer: &mut [u64; 512]) -> Option<usize> {
        // SAFETY: recvfrom writes at most `size_of_val(answer)` bytes into `answer`, a live
        // array; the null address pointers ask for no source address.
        let received = unsafe {
            libc::syscall(
                libc::SYS_recvfrom,
                self.fd,
                answer.as_mut_ptr(),
                std::mem::size_of_val(answer),
                libc::MSG_DONTWAIT,
                std::ptr::null_mut::<libc::sockaddr>(),
                std::ptr::null_mut::<libc::socklen_t>(),
            )
        };
        usize::try_from(received).ok()
    }
}
