//! A minimal original-destination TCP relay: what a sidecar proxy does with an intercepted
//! connection. It asks the kernel where the connection was headed (`getsockopt(SO_ORIGINAL_DST)`),
//! connects there, and copies bytes both ways. The demo and the tests run it on the proxy's PU to
//! prove that the split interception rules leave the original destination readable there.
//! (flatmesh's node proxy relays a TCP listener to a fixed cluster and does not read
//! SO_ORIGINAL_DST yet; see docs/pu.md.)

use std::io;
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd as _;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

/// SO_ORIGINAL_DST from linux/netfilter_ipv4.h.
const SO_ORIGINAL_DST: libc::c_int = 80;

/// Where an intercepted IPv4 connection was originally headed, per this PU's conntrack.
pub fn original_dst(stream: &TcpStream) -> io::Result<SocketAddrV4> {
    // SAFETY: sockaddr_in is plain data; getsockopt writes at most `len` bytes into it.
    unsafe {
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let rc = libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut addr as *mut libc::sockaddr_in).cast(),
            &mut len,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
            u16::from_be(addr.sin_port),
        ))
    }
}

/// Asks another process's socket for its original destination, the way that process itself
/// would: finds, among the sockets of process `pid`, the TCP connection with local port
/// `local_port` whose peer uses port `peer_port`, takes a duplicate of it (`pidfd_getfd`, which
/// needs ptrace rights over the process: root), and calls `getsockopt(SO_ORIGINAL_DST)` on it.
/// The demo uses it to show what the unmodified flatmesh node proxy on the other PU would read.
/// `Ok(None)`: no such connection (yet).
pub fn original_dst_in_process(
    pid: u32,
    local_port: u16,
    peer_port: u16,
) -> io::Result<Option<SocketAddrV4>> {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a fresh descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as libc::c_int) };
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(entry) = entry else { continue };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        let Some(target_fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::c_int>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // SAFETY: pidfd_getfd takes a pidfd we own, a descriptor number of that process and
        // flags; it returns a new descriptor of ours or -1.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_pidfd_getfd,
                pidfd.as_raw_fd(),
                target_fd,
                0 as libc::c_uint,
            )
        };
        if fd < 0 {
            // The process closed it meanwhile, or it is not ours to take.
            continue;
        }
        // SAFETY: a fresh descriptor from pidfd_getfd; closing it leaves the process's own
        // descriptor (and the connection) untouched.
        let stream = TcpStream::from(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) });
        let (Ok(local), Ok(peer)) = (stream.local_addr(), stream.peer_addr()) else {
            continue;
        };
        if local.port() == local_port && peer.port() == peer_port {
            return original_dst(&stream).map(Some);
        }
    }
    Ok(None)
}

/// One relayed connection, as the relay saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayRecord {
    pub peer: SocketAddr,
    pub original_dst: Option<SocketAddrV4>,
    /// Why the upstream connection failed, if it did.
    pub upstream_error: Option<String>,
}

pub struct Relay {
    listener: TcpListener,
    accept: Option<JoinHandle<()>>,
    log: Arc<Mutex<Vec<RelayRecord>>>,
}

impl Relay {
    /// Serves `listener` (bound in the proxy's PU; the relay's threads inherit the calling
    /// thread's network namespace, so call this on a thread inside that PU).
    pub fn start(listener: TcpListener) -> io::Result<Relay> {
        let log = Arc::new(Mutex::new(Vec::new()));
        let accept_listener = listener.try_clone()?;
        let accept_log = Arc::clone(&log);
        let accept = std::thread::Builder::new()
            .name("pu-relay".into())
            .spawn(move || accept_loop(accept_listener, accept_log))?;
        Ok(Relay {
            listener,
            accept: Some(accept),
            log,
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn records(&self) -> Vec<RelayRecord> {
        self.log.lock().clone()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // shutdown() on a listening socket wakes the blocked accept() with an error.
        // SAFETY: the descriptor is owned by self.listener and still open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, log: Arc<Mutex<Vec<RelayRecord>>>) {
    while let Ok((client, peer)) = listener.accept() {
        let log = Arc::clone(&log);
        let _ = std::thread::Builder::new()
            .name("pu-relay-conn".into())
            .spawn(move || relay_one(client, peer, &log));
    }
}

fn relay_one(client: TcpStream, peer: SocketAddr, log: &Mutex<Vec<RelayRecord>>) {
    let original = original_dst(&client).ok();
    let upstream = match original {
        Some(dst) => TcpStream::connect_timeout(&SocketAddr::V4(dst), Duration::from_secs(2)),
        None => Err(io::Error::other(
            "no original destination (not intercepted)",
        )),
    };
    let upstream_error = upstream.as_ref().err().map(|e| e.to_string());
    log.lock().push(RelayRecord {
        peer,
        original_dst: original,
        upstream_error,
    });
    let Ok(upstream) = upstream else {
        return;
    };
    let (Ok(mut c2), Ok(mut u2)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut c2, &mut u2);
        let _ = u2.shutdown(Shutdown::Write);
    });
    let (mut client, mut upstream) = (client, upstream);
    let _ = io::copy(&mut upstream, &mut client);
    let _ = client.shutdown(Shutdown::Write);
    let _ = up.join();
}
