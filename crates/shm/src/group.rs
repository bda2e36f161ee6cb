//! hetero-socket between the network namespaces of one split namespace (HeteroPod's PUs).
//!
//! Within one network namespace, negotiation needs nothing but the kernel: an abstract Unix
//! socket advertises a listening port, and the socket table proves an accepted connection
//! (`negotiate`, `proof`). Both are per network namespace, and the PUs of a split namespace are
//! network namespaces that share one mount namespace (and so `/dev/shm`). Between them:
//!
//! - **Advertisement**: a listener also binds a Unix datagram socket at `<group>/l/<port>`, a
//!   path in the directory the PUs share (`FLATMESH_SHM_GROUP`, set by `flatmesh pu run`). Ports
//!   are unique across the PUs of a split namespace (the global port table refuses a second
//!   owner at bind), so the port alone names the listener.
//! - **Rendezvous**: the region file is `/dev/shm/flatmesh-shm-g<group>-<server port>-<client
//!   port>`, the group being the directory's inode. Addresses are left out: a connection to
//!   `127.0.0.1:P` on one PU arrives on the owner PU with other addresses (the split
//!   namespace's NAT, docs/pu.md), but with the same ports.
//! - **Interception**: a call to a service address that the split namespace's rules redirect to a
//!   proxy port on another PU (`<group>/intercept`, written by the agents) is offered to that
//!   port's listener: the proxy accepts it on its own port, with the caller's port.
//! - **Proof**: the acceptor cannot see the connector's socket (it lives in another network
//!   namespace) nor follow the NAT (that needs `CAP_NET_ADMIN`). Its PU agent can: the acceptor
//!   hands the accepted socket itself to the agent's proof service
//!   (`<group>/proof-<netns inode>`, `SCM_RIGHTS`) with the cookie the region names, and the
//!   agent answers whether the connection's far end, followed through both PUs' connection
//!   tracking tables, is the socket with that cookie (`flatmesh_pu::shm_proof`). No agent, no
//!   answer in time, or no: the connection stays TCP.

use crate::intercept;
use crate::negotiate::{bind_unix, unix_address, unix_bound};
use crate::real;
use parking_lot::Mutex;
use std::os::unix::ffi::OsStrExt as _;
use crate::settings;
use libc::c_int;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

/// How long an acceptor waits for the agent's answer before it keeps the connection on TCP.
const PROOF_WAIT_MS: c_int = 250;

/// The shared directory, if this process has one.
pub fn dir() -> Option<&'static std::ffi::CStr> {
    settings::get().group.as_deref()
}

fn path_in_group(name: &str) -> Option<Vec<u8>> {
    let mut path = dir()?.to_bytes().to_vec();
    path.push(b'/');
    path.extend_from_slice(name.as_bytes());
    Some(path)
}

/// `<group>/l/<port>`: where a listener on `port` advertises itself to the other PUs.
pub fn advert_path(port: u16) -> Option<Vec<u8>> {
    path_in_group(&format!("l/{port}"))
}

/// `<group>/proof-<netns inode>`: the proof service of the agent of the PU with that network
/// namespace (the agent's side: `flatmesh_pu::shm_proof::socket_path`).
fn proof_path(netns: u64) -> Option<Vec<u8>> {
    path_in_group(&format!("proof-{netns}"))
}

/// The group's identity in region names: the shared directory's inode (0 when it cannot be
/// read, and then no region is made).
fn group_id() -> u64 {
    static CACHE: AtomicU64 = AtomicU64::new(0);
    let cached = CACHE.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    let Some(dir) = dir() else { return 0 };
    // SAFETY: stat is plain integers, for which all-zero bytes are valid.
    let mut status: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is NUL-terminated; stat writes one struct stat into `status`, a live local.
    if unsafe { libc::stat(dir.as_ptr(), &mut status) } != 0 {
        return 0;
    }
    CACHE.store(status.st_ino, Ordering::Relaxed);
    status.st_ino
}

/// The rendezvous file of a connection between PUs, by the ports both ends see alike.
pub fn region_path(server_port: u16, client_port: u16) -> Option<CString> {
    let group = group_id();
    if group == 0 {
        return None;
    }
    CString::new(format!(
        "/dev/shm/flatmesh-shm-g{group}-{server_port}-{client_port}"
    ))
    .ok()
}

/// Binds the advertisement of `port` for the other PUs; the socket, or `None`. A name left by a
/// listener that is gone (nothing bound behind it) is taken over.
pub fn advertise(port: u16) -> Option<c_int> {
    let path = advert_path(port)?;
    let (address, len) = unix_address(&path, false)?;
    for _ in 0..2 {
        match bind_unix(&address, len) {
            Ok(advert) => return Some(advert),
            // A stale name: its socket is closed. Remove it and bind again (once).
            Err(libc::EADDRINUSE) if !unix_bound(&address, len) => {
                if let Ok(name) = CString::new(path.clone()) {
                    // SAFETY: `name` is a CString, so NUL-terminated.
                    unsafe { libc::unlink(name.as_ptr()) };
                }
            }
            // A live listener of this port (a sibling worker of this PU), or no room.
            Err(_) => return None,
        }
    }
    None
}

/// Removes the advertisement's name (the socket itself is closed by the caller).
pub fn withdraw(port: u16) {
    if let Some(name) = advert_path(port).and_then(|p| CString::new(p).ok()) {
        // SAFETY: `name` is a CString, so NUL-terminated.
        unsafe { libc::unlink(name.as_ptr()) };
    }
}

/// Whether a listener in another PU of the group advertises `port`.
pub fn advertised(port: u16) -> bool {
    advert_path(port)
        .and_then(|path| unix_address(&path, false))
        .is_some_and(|(address, len)| unix_bound(&address, len))
}

/// Whether a connection to `ip` may lead to another PU of the group: the split namespace's
/// addresses are the loopback addresses (mapped to the owner PU by its rules) and the PUs'
/// link addresses (169.254.0.0/16). Anything else leaves the node, and gets no region.
pub fn reachable(ip: std::net::IpAddr) -> bool {
    match crate::proof::canonical(ip) {
        std::net::IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local(),
        std::net::IpAddr::V6(v6) => v6.is_loopback(),
    }
}

/// The proxy port on another PU that the split namespace's interception rules redirect a call
/// to `server` to (`<group>/intercept`, re-read when it changes), if any.
pub fn intercepted(server: std::net::SocketAddr) -> Option<u16> {
    static RULES: Mutex<Option<(std::time::SystemTime, Vec<intercept::Rule>)>> = Mutex::new(None);
    let path = path_in_group("intercept")?;
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(&path));
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok()?;
    let mut cached = RULES.lock();
    if cached.as_ref().is_none_or(|(seen, _)| *seen != modified) {
        let mut text = String::new();
        let file = std::fs::File::open(path).ok()?;
        std::io::Read::read_to_string(
            &mut std::io::Read::take(file, intercept::MAX_BYTES as u64),
            &mut text,
        )
        .ok()?;
        *cached = Some((modified, intercept::parse(&text)));
    }
    cached
        .as_ref()
        .and_then(|(_, rules)| intercept::proxy_port(rules, server))
}

/// Asks this PU's agent whether the accepted connection `fd`'s far end is the socket with
/// `cookie`. Any failure (no group, no agent, no answer within `PROOF_WAIT_MS`) is a no.
pub fn proven(fd: c_int, cookie: u64, netns: u64) -> bool {
    if cookie == 0 {
        return false;
    }
    let Some((address, len)) = proof_path(netns).and_then(|path| unix_address(&path, false))
    else {
        return false;
    };
    // SAFETY: socket takes no pointer; the new fd is ours, closed below on every path.
    let service = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if service < 0 {
        return false;
    }
    let answer = ask(service, &address, len, fd, cookie);
    // SAFETY: `service` was opened above, is ours and is closed once, here.
    unsafe { real::close(service) };
    answer
}

fn ask(
    service: c_int,
    address: &libc::sockaddr_un,
    len: libc::socklen_t,
    fd: c_int,
    cookie: u64,
) -> bool {
    // A full backlog fails at once (nonblocking): a busy agent means TCP, not a stalled accept.
    // SAFETY: connect reads `len` bytes of `address`, a live sockaddr_un of at least that size.
    if unsafe { real::connect(service, (address as *const libc::sockaddr_un).cast(), len) } != 0 {
        return false;
    }
    let mut body = cookie.to_ne_bytes();
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    // One SCM_RIGHTS message with one fd, in a buffer aligned for cmsghdr.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is integers and pointers, for which all-zero bytes are valid.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    message.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) } as _;
    // SAFETY: `message` has a control buffer of msg_controllen bytes (32 >= CMSG_SPACE(4) = 24),
    // so CMSG_FIRSTHDR is non-null and points into `control`, as is CMSG_DATA, with room for
    // one int; `control` is u64-aligned, enough for cmsghdr.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as _;
        libc::CMSG_DATA(header).cast::<c_int>().write_unaligned(fd);
    }
    // SAFETY: `message` points to live locals (`iov` over `body`, `control`) for the call.
    let sent = unsafe { real::sendmsg(service, &message, libc::MSG_NOSIGNAL) };
    if sent != body.len() as isize {
        return false;
    }
    let mut wait = libc::pollfd {
        fd: service,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes one pollfd, `wait`, a live local.
    if unsafe { real::poll(&mut wait, 1, PROOF_WAIT_MS) } != 1 {
        return false;
    }
    let mut reply = [0u8; 1];
    // SAFETY: recv writes at most one byte into `reply`, a live local.
    let got = unsafe { real::recv(service, reply.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) };
    got == 1 && reply[0] == b'y'
}
