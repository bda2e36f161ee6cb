//! Moving a TCP connection's data path to shared memory, without ever putting a byte on the
//! wire that a peer without the library could see.
//!
//! 1. `listen()` in a process with the library binds an abstract Unix socket
//!    `@flatmesh-shm/l/<port>` (per network namespace, gone when the process is).
//! 2. `connect()` to a local address whose port has that advertisement: the connector binds its
//!    socket (to learn its port before the SYN leaves), creates the region file
//!    `/dev/shm/flatmesh-shm-<netns>-<dst ip>-<dst port>-<src port>` (mode 0600), then connects.
//!    The connection starts *pending*: the connector sends over TCP as usual.
//! 3. `accept()` looks the accepted 4-tuple's file up. If it is there, the acceptor maps it,
//!    removes the name and marks the region attached. From then on the acceptor writes to the
//!    ring; the connector, on seeing "attached", records how many bytes it had sent over TCP
//!    (the prefix the acceptor must still read from the kernel) and writes to the ring as well.
//!
//! If the acceptor does not run the library, or loses the race, or anything fails, nothing is
//! ever attached and the connection simply stays TCP.
//!
//! Between the PUs of a split namespace (different network namespaces), steps 1 to 3 go through
//! a directory the PUs share instead, and the PU agent gives the proof: see `group`. The
//! allow-list (`FLATMESH_SHM_PORTS`) is checked at each step: a port not on it is never
//! advertised, offered or attached.

use crate::conn::{self, Conn, Role};
use crate::group;
use crate::proof;
use crate::real;
use crate::region::{Region, ATTACHED, ATTACHING, PENDING};
use crate::settings;
use libc::c_int;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A listening fd's advertisements: the abstract socket for its own network namespace, and
/// the path socket for the other PUs of its split namespace (`group`).
struct Advert {
    local: c_int,
    /// The socket, its port, and the process that bound it (only that one removes the name:
    /// a forked child closing its copy of the listener leaves the parent's advertisement).
    group: Option<(c_int, u16, u32)>,
}

/// Listening fd -> its advertisements.
static ADVERTS: Mutex<BTreeMap<c_int, Advert>> = Mutex::new(BTreeMap::new());

/// A Unix socket address: `name` in the abstract namespace (per network namespace, gone with
/// its socket) or as a path. `None` if it does not fit.
pub fn unix_address(name: &[u8], abstract_name: bool) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is integers and a byte array, for which all-zero bytes are valid.
    let mut address: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    address.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // An abstract name starts with a NUL byte; a path ends with one.
    let skip = usize::from(abstract_name);
    if name.contains(&0) || skip + name.len() + 1 > address.sun_path.len() {
        return None;
    }
    for (slot, byte) in address.sun_path[skip..].iter_mut().zip(name) {
        *slot = *byte as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>()
        + skip
        + name.len()
        + usize::from(!abstract_name);
    Some((address, len as libc::socklen_t))
}

fn advert_address(port: u16) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    unix_address(format!("flatmesh-shm/l/{port}").as_bytes(), true)
}

/// A new datagram socket bound at `address`, or bind's errno.
pub fn bind_unix(address: &libc::sockaddr_un, len: libc::socklen_t) -> Result<c_int, c_int> {
    // SAFETY: socket takes no pointer; the new fd is ours.
    let socket = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if socket < 0 {
        return Err(real::errno());
    }
    // SAFETY: bind reads `len` bytes of `address`, a live sockaddr_un of at least that size
    // (`unix_address` made both).
    if unsafe { libc::bind(socket, (address as *const libc::sockaddr_un).cast(), len) } == 0 {
        return Ok(socket);
    }
    let code = real::errno();
    // SAFETY: `socket` is ours, handed to nobody, and closed once.
    unsafe { real::close(socket) };
    Err(code)
}

/// Whether a datagram socket is bound at `address` (a connect to it succeeds).
pub fn unix_bound(address: &libc::sockaddr_un, len: libc::socklen_t) -> bool {
    // SAFETY: socket takes no pointer; the new fd is ours.
    let probe = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if probe < 0 {
        return false;
    }
    // SAFETY: connect reads `len` bytes of `address`, a live sockaddr_un of at least that size.
    let rc = unsafe { real::connect(probe, (address as *const libc::sockaddr_un).cast(), len) };
    // SAFETY: `probe` is ours, handed to nobody, and closed once.
    unsafe { real::close(probe) };
    rc == 0
}

fn socket_address(fd: c_int, peer: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is integers and bytes, for which all-zero bytes are valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let pointer = (&mut storage as *mut libc::sockaddr_storage).cast();
    // SAFETY: the call writes at most `len` (the storage's size) bytes into `storage`, a live
    // local, and the address's length into `len`, a live local.
    let rc = unsafe {
        if peer {
            libc::getpeername(fd, pointer, &mut len)
        } else {
            libc::getsockname(fd, pointer, &mut len)
        }
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: `pointer` is `storage`, a live local, and `len` is the length of the address the
    // kernel wrote there; every socket address fits a sockaddr_storage, so `len` bytes are
    // readable.
    unsafe { parse_address(pointer, len) }
}

/// # Safety
/// `address` must point to `len` readable bytes (or be null). No alignment is assumed.
pub unsafe fn parse_address(
    address: *const libc::sockaddr,
    len: libc::socklen_t,
) -> Option<SocketAddr> {
    let len = len as usize;
    if address.is_null() || len < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: the family is the first field of every sockaddr, and `len` covers it (checked
    // above; the contract makes `len` bytes readable); read_unaligned needs no alignment.
    let family = unsafe { address.cast::<libc::sa_family_t>().read_unaligned() };
    match family as c_int {
        libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: `len` readable bytes (the contract) cover a whole sockaddr_in (checked
            // by the guard); read_unaligned copies it out whatever the caller's alignment.
            let v4 = unsafe { address.cast::<libc::sockaddr_in>().read_unaligned() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(v4.sin_port)))
        }
        libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for a whole sockaddr_in6.
            let v6 = unsafe { address.cast::<libc::sockaddr_in6>().read_unaligned() };
            let ip = std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr);
            Some(SocketAddr::new(IpAddr::V6(ip), u16::from_be(v6.sin6_port)))
        }
        _ => None,
    }
}

fn is_tcp_stream(fd: c_int) -> bool {
    let option = |name: c_int| {
        let mut value: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` (the size of an int) bytes into `value`, a
        // live local int, and the actual length into `len`, a live local.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&mut value as *mut c_int).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(value)
    };
    option(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && option(libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP)
}

/// After a successful listen(): advertise the port (once per listening fd), in this network
/// namespace and, with a group, to the other PUs.
pub fn advertise(listen_fd: c_int) {
    let settings = settings::get();
    if !settings.enabled || !is_tcp_stream(listen_fd) {
        return;
    }
    let Some(local) = socket_address(listen_fd, false) else {
        return;
    };
    if !settings.port_allowed(local.port()) {
        return;
    }
    let mut adverts = ADVERTS.lock();
    if adverts.contains_key(&listen_fd) {
        return;
    }
    // EADDRINUSE: another library process (or a sibling worker) already advertises the port.
    let Some(Ok(advert)) = advert_address(local.port()).map(|(address, len)| bind_unix(&address, len))
    else {
        return;
    };
    let group = group::advertise(local.port())
        .map(|socket| (socket, local.port(), crate::process::pid()));
    adverts.insert(
        listen_fd,
        Advert {
            local: advert,
            group,
        },
    );
}

/// When a listening fd closes, its advertisements go too.
/// Also called for every other closing fd: if the application closes one of our advertisement
/// fds (daemons close all fds), forget it rather than later closing someone else's fd.
pub fn forget_listener(fd: c_int) {
    let mut adverts = ADVERTS.lock();
    if adverts.is_empty() {
        return;
    }
    if let Some(advert) = adverts.remove(&fd) {
        // SAFETY: the sockets `advertise` opened. The entry was still in ADVERTS, so they are
        // still ours (an application close of either fd number would have removed it: `retain`
        // below), and removing the entry here makes this the one close.
        unsafe { real::close(advert.local) };
        if let Some((socket, port, owner)) = advert.group {
            if owner == crate::process::pid() {
                group::withdraw(port);
            }
            // SAFETY: as above.
            unsafe { real::close(socket) };
        }
    }
    adverts.retain(|_, advert| {
        advert.local != fd && advert.group.is_none_or(|(socket, _, _)| socket != fd)
    });
}

fn port_advertised(port: u16) -> bool {
    advert_address(port).is_some_and(|(address, len)| unix_bound(&address, len))
}

fn is_local(ip: IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    // A local address is one we can bind to.
    let bound = SocketAddr::new(ip, 0);
    let (storage, len) = to_sockaddr(bound);
    let family = if ip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket takes no pointer; bind reads `len` bytes of `storage`, a live local that
    // `to_sockaddr` filled with a sockaddr of that length; `probe` is ours and closed once.
    unsafe {
        let probe = libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if probe < 0 {
            return false;
        }
        let rc = libc::bind(
            probe,
            (&storage as *const libc::sockaddr_storage).cast(),
            len,
        );
        real::close(probe);
        rc == 0
    }
}

fn to_sockaddr(address: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is integers and bytes, for which all-zero bytes are valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match address {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is made to hold any address: larger than a sockaddr_in
            // and at least as aligned; `storage` is a live local, borrowed only here.
            let sin = unsafe {
                &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above, for a sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

pub fn netns_id() -> u64 {
    static CACHE: AtomicU64 = AtomicU64::new(0);
    crate::process::namespace_id("net", &CACHE)
}

/// The rendezvous file for a connection, keyed by what the connector knows of its 4-tuple
/// before its SYN leaves: the server address and its own port (its source address is picked
/// at connect time). The name is only a hint; `proof` decides whether an accepted connection
/// is the one the file was made for.
pub fn handoff_path(server: SocketAddr, client_port: u16) -> Option<CString> {
    let name = format!(
        "/dev/shm/flatmesh-shm-{}-{}-{}-{}",
        netns_id(),
        proof::canonical(server.ip()),
        server.port(),
        client_port
    );
    CString::new(name).ok()
}

/// Wake-up bytes must leave at once: with Nagle's algorithm a one-byte segment waits for the
/// peer's delayed ACK (40 ms). The only visible effect: getsockopt(TCP_NODELAY) reports 1.
fn set_nodelay(fd: c_int) {
    let one: c_int = 1;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from `one`, a live local int.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const c_int).cast(),
            std::mem::size_of::<c_int>() as libc::socklen_t,
        )
    };
}

fn fd_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no pointer (its argument is ignored).
    let flags = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

/// The connect() interposer's work: prepare a region before the real connect if the
/// destination is a local listener that runs the library, then connect.
///
/// # Safety
/// Arguments as for connect(2).
pub unsafe fn connect(fd: c_int, address: *const libc::sockaddr, len: libc::socklen_t) -> c_int {
    // SAFETY: the caller's arguments, passed on unchanged under connect(2)'s contract (this
    // function's `# Safety`).
    let plain = || unsafe { real::connect(fd, address, len) };
    if !settings::get().enabled || conn::lookup(fd).is_some() || fd as usize >= conn::MAX_FD {
        return plain();
    }
    // SAFETY: connect(2)'s contract: `address` points to `len` readable bytes.
    let Some(server) = (unsafe { parse_address(address, len) }) else {
        return plain();
    };
    if server.port() == 0 || !settings::get().port_allowed(server.port()) || !is_tcp_stream(fd)
    {
        return plain();
    }
    // A listener in this network namespace; or in another PU of the group, dialled there
    // (`Some(its port)`) or reached through the split namespace's interception rules (`Some(the
    // proxy's port)`: the proxy accepts the call on that port).
    let across_pus = if port_advertised(server.port()) && is_local(server.ip()) {
        None
    } else if group::reachable(server.ip()) && group::advertised(server.port()) {
        Some(server.port())
    } else if let Some(proxy) = group::intercepted(server)
        .filter(|proxy| !port_advertised(*proxy) && group::advertised(*proxy))
    {
        Some(proxy)
    } else {
        return plain();
    };
    // Bind now so the source port (half of the rendezvous name) is known before the SYN leaves.
    let Some(mut local) = socket_address(fd, false) else {
        return plain();
    };
    if local.port() == 0 {
        let wildcard = SocketAddr::new(
            if local.is_ipv4() {
                IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
            } else {
                IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
            },
            0,
        );
        let (storage, storage_len) = to_sockaddr(wildcard);
        // SAFETY: bind reads `storage_len` bytes of `storage`, a live local that `to_sockaddr`
        // filled with a sockaddr of that length.
        if unsafe {
            libc::bind(
                fd,
                (&storage as *const libc::sockaddr_storage).cast(),
                storage_len,
            )
        } != 0
        {
            return plain();
        }
        match socket_address(fd, false) {
            Some(bound) => local = bound,
            None => return plain(),
        }
    }
    let path = match across_pus {
        Some(listener_port) => group::region_path(listener_port, local.port()),
        None => handoff_path(server, local.port()),
    };
    let Some(path) = path else {
        return plain();
    };
    // The acceptor attaches only if the kernel says its connection ends in this very socket.
    let cookie = proof::socket_cookie(fd);
    if cookie == 0 {
        return plain();
    }
    let Some(region) = Region::create(&path, settings::get().local_bytes, cookie) else {
        return plain();
    };
    let rc = plain();
    let code = real::errno();
    if rc == 0 || code == libc::EINPROGRESS {
        set_nodelay(fd);
        let conn = Conn::new(region, Role::Connector, Some(path), fd_nonblocking(fd));
        conn::insert(fd, Arc::new(conn));
    } else {
        // SAFETY: `path` is a CString, so NUL-terminated.
        unsafe { libc::unlink(path.as_ptr()) };
        drop(region);
    }
    real::set_errno(code);
    rc
}

/// After accept(): take over the connector's region if there is one and it was made for this
/// very connection. A region whose connector socket is not this connection's peer (another
/// client that shares the server address and the client port, from another address) is left
/// alone, for the connection it belongs to, and this one stays TCP.
pub fn accepted(fd: c_int, nonblocking: bool) {
    if !settings::get().enabled || fd as usize >= conn::MAX_FD {
        return;
    }
    let (Some(local), Some(peer)) = (socket_address(fd, false), socket_address(fd, true)) else {
        return;
    };
    if !settings::get().port_allowed(local.port()) {
        return;
    }
    let open = |path: &CString| {
        // SAFETY: `path` is a CString, so NUL-terminated.
        let file = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            )
        };
        (file >= 0).then_some(file)
    };
    // A connector in this network namespace, or in another PU of the group.
    let same_netns = handoff_path(local, peer.port()).and_then(|path| Some((open(&path)?, path)));
    let (file, path, across_pus) = match same_netns {
        Some((file, path)) => (file, path, false),
        None => {
            let Some(path) = group::dir().and(group::region_path(local.port(), peer.port())) else {
                return;
            };
            let Some(file) = open(&path) else { return };
            (file, path, true)
        }
    };
    let region = Region::attach(file);
    // SAFETY: `file` was opened above and is ours, closed once; the mapping outlives it.
    unsafe { real::close(file) };
    let Some(region) = region else { return };
    let control = region.control();
    let proven = if across_pus {
        group::proven(fd, control.connector_cookie, netns_id())
    } else {
        proof::proven(local, peer, control.connector_cookie)
    };
    if !proven {
        crate::stats::bump(&crate::stats::get().unproven);
        return;
    }
    // SAFETY: `path` is a CString, so NUL-terminated. (Only the proven acceptor removes the
    // name.)
    unsafe { libc::unlink(path.as_ptr()) };
    // Only one acceptor may flip the region (two processes of one user could both have opened
    // the file before either unlinked it; only one of them holds the proven connection, but a
    // region is attached once, whatever happens).
    if control
        .state
        .compare_exchange(PENDING, ATTACHING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    set_nodelay(fd);
    control.pid_namespace[1].store(crate::process::pid_namespace(), Ordering::Relaxed);
    control.holders[1].store(1, Ordering::Release);
    region.add_pid(1);
    control.state.store(ATTACHED, Ordering::Release);
    crate::stats::bump(&crate::stats::get().accelerated);
    conn::insert(
        fd,
        Arc::new(Conn::new(region, Role::Acceptor, None, nonblocking)),
    );
}
